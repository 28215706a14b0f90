"""PrefixIndex: which replica holds which block hash, fed by the engines' KV events plus speculative inserts.

Exact where the events are: each replica's view follows its event stream (per-replica sequence numbers and
cache epoch); a gap or a changed epoch drops that replica's entries and waits for a snapshot. Between a
routing decision and the chosen engine's BlockStored, the prompt's blocks count as held speculatively (TTL).

Layout, chosen so a lookup costs O(matched blocks) whatever the number of replicas, and so the garbage
collector never walks the index: only plain dicts of bytes -> int/float/None, which CPython untracks (an
OrderedDict or a set of 500k hashes would cost a full collection tens of milliseconds):
  `_held`  block hash -> bit mask of the replica slots holding it (bit i = slot i), in LRU order (a touch
           re-inserts the key at the end; eviction takes keys from the front).
  `_spec`  block hash -> the subset of those bits that are speculative (only hashes with any).
  `_spec_expiry[slot]`  block hash -> when that slot's speculative hold ends.
A slot's bit is confirmed or speculative for a hash, never both (a BlockStored turns one into the other).
Matching ANDs the masks of the prompt's hashes in order, one dict lookup and one int AND per block; a
replica's match length is recorded when its bit drops out. Each replica also keeps the hashes it holds
(a dict used as a set), so dropping it costs O(its blocks), never a scan of the index.

Tiers (engine/kv_connector; events with `medium` "offload" or "shared"): a block outside the paged pool is
a load away, not free, so it is kept apart from `_held`:
  `_offload`  block hash -> bit mask of the replica slots whose offload tier holds it;
  `_shared`   block hash -> bit mask of the *node* slots whose node-shared store holds it. A shared-medium
              BlockStored/BlockRemoved from any replica of node N changes N's store, which every replica
              of N can load from (a replica of unknown node counts as a node of its own).
`match_tiers` continues each candidate's pool match through its offload tier and its node's store.
Across replicas of one node, events about the same store arrive on different streams pulled at different
times; within one pull period a hash stored by one replica and evicted by another may be applied out of
order and mispredicted until the next event about it or a snapshot (which carries the whole store). The
engine's own lookup decides what is loaded, so a wrong prediction costs a routing choice, never a token.
A pool reset (AllBlocksCleared) leaves the tiers; a lost stream (gap, epoch change) drops the replica's
offload entries until its snapshot; the node's store entries stay until a snapshot replaces them.

Memory bound: at most `max_blocks` hashes, least recently touched evicted first (down to 99% of the
bound, in one pass); a lookup or store touches a chain's tail first so its head, which every longer prompt
needs, is evicted last. Measured with tracemalloc (tests/unit/routing/test_prefix_index.py::
test_memory_per_entry, in a fresh interpreter; 20k-300k hashes): 125-170 bytes per hash held by one replica, counting the 65-byte
hash object itself, plus 40-70 bytes per further replica holding it (its entry in that replica's dict).
The default 500,000 hashes thus cost at most about 90 MB with one holder each, plus up to 35 MB per extra
copy; size `max_index_entries` to about (replicas x KV blocks per replica) / (replicas per hash).
The tier dicts have their own bound, `max_tier_blocks` hashes over both (LRU, the same layout and cost per
entry: at most about 90 MB at the default 500,000, plus 40-70 bytes per further holder).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from engine.types import MEDIUM_OFFLOAD, MEDIUM_POOL, MEDIUM_SHARED, AllBlocksCleared, BlockRemoved, BlockStored

from app.routing.api import BlockHash, KVEventBatch, KVSnapshot


class _NodeState:
    __slots__ = ("slot", "held", "members")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.held: dict[BlockHash, None] = {}   # hashes in this node's shared store (as far as we know)
        self.members: set[str] = set()


class _ReplicaState:
    __slots__ = ("slot", "epoch", "next_seq", "needs_snapshot", "held", "offload", "node")

    def __init__(self, slot: int, node: _NodeState) -> None:
        self.slot = slot
        self.epoch: str | None = None
        self.next_seq = 0
        self.needs_snapshot = True          # nothing known until a snapshot or the stream's seq 0
        self.held: dict[BlockHash, None] = {}   # hashes with this replica's bit (confirmed or speculative)
        self.offload: dict[BlockHash, None] = {}   # hashes in this replica's offload tier
        self.node = node


def _bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class PrefixIndex:
    """Block hash -> replicas holding it. Not thread-safe; `now` comes from the caller's clock.

    Event contract (see api.KVEventBatch): events of a replica are numbered consecutively within an epoch.
    A replica's state is known once it has a snapshot, or a batch starting at seq 0 or with AllBlocksCleared
    (the cache is empty there). Overlapping batches are fine (already-applied events are skipped).
    """

    def __init__(self, max_blocks: int, speculative_ttl_s: float, max_tier_blocks: int = 500_000) -> None:
        self.max_blocks = max_blocks
        self.max_tier_blocks = max_tier_blocks
        self.speculative_ttl_s = speculative_ttl_s
        self._offload: dict[BlockHash, int] = {}
        self._shared: dict[BlockHash, int] = {}
        self._nodes: dict[str, _NodeState] = {}
        self._node_owner: list[_NodeState | None] = []
        self.num_tier_evictions = 0
        self._held: dict[BlockHash, int] = {}
        self._spec: dict[BlockHash, int] = {}
        self._spec_expiry: list[dict[BlockHash, float]] = []
        self._replicas: dict[str, _ReplicaState] = {}
        self._slot_owner: list[str | None] = []
        self._spec_records: deque[tuple[float, int, list[BlockHash]]] = deque()   # FIFO: one TTL for all
        self.num_evictions = 0
        self.num_resyncs = 0

    # ------------------------------------------------------------ membership
    @property
    def replica_ids(self) -> list[str]:
        return list(self._replicas)

    def add_replica(self, replica_id: str, node_id: str | None = None) -> None:
        """Track a replica (no-op if tracked, except that a changed `node_id` moves it to that node)."""
        key = node_id if node_id is not None else f"replica:{replica_id}"
        st = self._replicas.get(replica_id)
        if st is not None:
            if key not in st.node.members:
                self._leave_node(replica_id, st.node)
                st.node = self._join_node(replica_id, key)
            return
        try:
            slot = self._slot_owner.index(None)
            self._slot_owner[slot] = replica_id
        except ValueError:
            slot = len(self._slot_owner)
            self._slot_owner.append(replica_id)
            self._spec_expiry.append({})
        self._replicas[replica_id] = _ReplicaState(slot, self._join_node(replica_id, key))

    def remove_replica(self, replica_id: str) -> None:
        st = self._replicas.pop(replica_id, None)
        if st is not None:
            self._drop(st)
            self._drop_offload(st)
            self._leave_node(replica_id, st.node)
            self._slot_owner[st.slot] = None

    def _join_node(self, replica_id: str, key: str) -> _NodeState:
        node = self._nodes.get(key)
        if node is None:
            try:
                slot = self._node_owner.index(None)
            except ValueError:
                slot = len(self._node_owner)
                self._node_owner.append(None)
            node = self._nodes[key] = _NodeState(slot)
            self._node_owner[slot] = node
        node.members.add(replica_id)
        return node

    def _leave_node(self, replica_id: str, node: _NodeState) -> None:
        """A node nobody tracked is on any more is forgotten (its store is out of sight)."""
        node.members.discard(replica_id)
        if node.members:
            return
        self._drop_shared(node)
        self._node_owner[node.slot] = None
        for key in [k for k, n in self._nodes.items() if n is node]:
            del self._nodes[key]

    # ------------------------------------------------------------ events and snapshots
    def apply_events(self, batch: KVEventBatch) -> bool:
        """Apply one replica's batch; False when that replica needs a snapshot (see the class contract)."""
        st = self._replicas.get(batch.replica_id)
        if st is None:
            return True                                       # not a member (yet): nothing to track
        events = batch.events
        if st.epoch != batch.epoch or st.needs_snapshot:
            if batch.first_seq != 0 and not (events and isinstance(events[0], AllBlocksCleared)):
                return self._lose(st)
            self._drop(st)                                    # known empty at this point
            if st.epoch is not None and st.epoch != batch.epoch:
                self._drop_offload(st)                        # a restarted replica's tier is gone
            st.epoch, st.next_seq, st.needs_snapshot = batch.epoch, batch.first_seq, False
        if batch.first_seq > st.next_seq:
            return self._lose(st)
        for event in events[st.next_seq - batch.first_seq:]:
            if isinstance(event, BlockStored):
                medium = event.medium
                if medium == MEDIUM_POOL:
                    self._store(st, event.block_hashes)
                elif medium == MEDIUM_SHARED:
                    self._tier_store(self._shared, st.node.held, st.node.slot, event.block_hashes)
                elif medium == MEDIUM_OFFLOAD:
                    self._tier_store(self._offload, st.offload, st.slot, event.block_hashes)
            elif isinstance(event, BlockRemoved):
                medium = event.medium
                if medium == MEDIUM_POOL:
                    self._remove(st, event.block_hashes)
                elif medium == MEDIUM_SHARED:
                    self._tier_remove(self._shared, st.node.held, st.node.slot, event.block_hashes)
                elif medium == MEDIUM_OFFLOAD:
                    self._tier_remove(self._offload, st.offload, st.slot, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self._drop(st)                                # the pool only: tiers outlive a reset
        st.next_seq = max(st.next_seq, batch.first_seq + len(events))
        return True

    def replicas_needing_snapshot(self) -> list[str]:
        return [rid for rid, st in self._replicas.items() if st.needs_snapshot]

    def apply_snapshot(self, snapshot: KVSnapshot) -> None:
        st = self._replicas.get(snapshot.replica_id)
        if st is None:
            return
        self._drop(st)
        self._store(st, snapshot.block_hashes)
        self._drop_offload(st)
        tiers = snapshot.tier_block_hashes
        if MEDIUM_OFFLOAD in tiers:
            self._tier_store(self._offload, st.offload, st.slot, tiers[MEDIUM_OFFLOAD])
        if MEDIUM_SHARED in tiers:                            # the whole store of the replica's node
            self._drop_shared(st.node)
            self._tier_store(self._shared, st.node.held, st.node.slot, tiers[MEDIUM_SHARED])
        st.epoch, st.next_seq, st.needs_snapshot = snapshot.epoch, snapshot.next_seq, False

    def _lose(self, st: _ReplicaState) -> bool:
        self._drop(st)
        self._drop_offload(st)
        st.epoch, st.needs_snapshot = None, True
        self.num_resyncs += 1
        return False

    def _store(self, st: _ReplicaState, hashes: list[BlockHash]) -> None:
        bit, held, spec = 1 << st.slot, self._held, self._spec
        for h in reversed(hashes):                           # tail first: the chain's head ends up newest
            mask = held.pop(h, 0)
            held[h] = mask | bit                             # (re)inserted last: most recently used
            if mask and spec.get(h, 0) & bit:
                self._clear_spec(h, st.slot)
            st.held[h] = None
        self._enforce_bound()

    def _remove(self, st: _ReplicaState, hashes: list[BlockHash]) -> None:
        # A speculative bit is kept: set after the block was stored, it predicts a newer store.
        bit, held, spec = 1 << st.slot, self._held, self._spec
        for h in hashes:
            mask = held.get(h)
            if mask is None or not mask & bit or spec.get(h, 0) & bit:
                continue
            st.held.pop(h, None)
            if mask == bit:
                del held[h]
            else:
                held[h] = mask & ~bit

    def _drop(self, st: _ReplicaState) -> None:
        """Forget every hash the replica holds: O(its blocks)."""
        bit, held, spec = 1 << st.slot, self._held, self._spec
        for h in st.held:
            mask = held.get(h)
            if mask is None:
                continue
            if spec.get(h, 0) & bit:
                self._clear_spec(h, st.slot)
            if mask == bit:
                del held[h]
            else:
                held[h] = mask & ~bit
        st.held = {}

    # ------------------------------------------------------------ tiers
    def _tier_store(self, tier: dict[BlockHash, int], owned: dict[BlockHash, None], slot: int,
                    hashes: list[BlockHash]) -> None:
        bit = 1 << slot
        for h in reversed(hashes):                           # tail first, as the pool
            tier[h] = tier.pop(h, 0) | bit
            owned[h] = None
        self._enforce_tier_bound()

    @staticmethod
    def _tier_remove(tier: dict[BlockHash, int], owned: dict[BlockHash, None], slot: int,
                     hashes: list[BlockHash]) -> None:
        bit = 1 << slot
        for h in hashes:
            mask = tier.get(h)
            if mask is None or not mask & bit:
                continue
            owned.pop(h, None)
            if mask == bit:
                del tier[h]
            else:
                tier[h] = mask & ~bit

    def _drop_offload(self, st: _ReplicaState) -> None:
        self._tier_remove(self._offload, st.offload, st.slot, list(st.offload))

    def _drop_shared(self, node: _NodeState) -> None:
        self._tier_remove(self._shared, node.held, node.slot, list(node.held))

    def _enforce_tier_bound(self) -> None:
        """Evict least recently used tier entries down to 99% of `max_tier_blocks`, from the larger dict."""
        excess = len(self._offload) + len(self._shared) - self.max_tier_blocks
        if excess <= 0:
            return
        excess += self.max_tier_blocks // 100
        while excess > 0:
            shared = len(self._shared) >= len(self._offload)
            tier = self._shared if shared else self._offload
            n = min(excess, len(tier))
            for h in [h for h, _ in zip(tier, range(n))]:
                mask = tier.pop(h)
                for slot in _bits(mask):
                    if shared:
                        node = self._node_owner[slot]
                        if node is not None:
                            node.held.pop(h, None)
                    else:
                        owner = self._slot_owner[slot]
                        if owner is not None:
                            self._replicas[owner].offload.pop(h, None)
                self.num_tier_evictions += 1
            excess -= n

    def match_tiers(self, block_hashes: list[BlockHash], replica_ids: list[str],
                    pool_matched: dict[str, int]) -> dict[str, int]:
        """Blocks each replica can load right after its pool match (`pool_matched`, absent = 0): the run of
        following hashes in its offload tier or its node's shared store. Replicas with 0 are absent.
        Cost: two dict lookups per block position visited (each position once, whatever the number of
        replicas), plus one mask test per replica per block of its run."""
        if not self._offload and not self._shared:
            return {}
        replicas = self._replicas
        n = len(block_hashes)
        off: list[int | None] = [None] * n          # masks per position, looked up on first visit
        sh: list[int] = [0] * n
        off_get, sh_get = self._offload.get, self._shared.get
        out: dict[str, int] = {}
        lo, hi = n, 0
        for rid in replica_ids:
            st = replicas.get(rid)
            if st is None:
                continue
            rbit, nbit = 1 << st.slot, 1 << st.node.slot
            j = start = pool_matched.get(rid, 0)
            while j < n:
                o = off[j]
                if o is None:
                    h = block_hashes[j]
                    o = off[j] = off_get(h, 0)
                    sh[j] = sh_get(h, 0)
                if not (o & rbit or sh[j] & nbit):
                    break
                j += 1
            if j > start:
                out[rid] = j - start
                lo, hi = min(lo, start), max(hi, j)
        for i in range(hi - 1, lo - 1, -1):                 # LRU: tail first, so the head is newest
            h = block_hashes[i]
            if off[i]:
                self._offload[h] = self._offload.pop(h)
            if sh[i]:
                self._shared[h] = self._shared.pop(h)
        return out

    def num_tier_held(self, replica_id: str) -> tuple[int, int]:
        """(offload-tier hashes, node-store hashes) the replica can load, as indexed."""
        st = self._replicas.get(replica_id)
        return (len(st.offload), len(st.node.held)) if st is not None else (0, 0)

    @property
    def num_tier_entries(self) -> int:
        """Tier hashes indexed (offload + shared; the quantity `max_tier_blocks` bounds)."""
        return len(self._offload) + len(self._shared)

    # ------------------------------------------------------------ speculative inserts
    def insert_speculative(self, replica_id: str, block_hashes: list[BlockHash], now: float) -> None:
        """The replica will hold these blocks once it prefills the request: count them until the TTL ends."""
        st = self._replicas.get(replica_id)
        if st is None or not block_hashes:
            return
        slot, bit, expiry = st.slot, 1 << st.slot, now + self.speculative_ttl_s
        held, spec, expiries = self._held, self._spec, self._spec_expiry[st.slot]
        fresh = []
        for h in reversed(block_hashes):
            mask = held.pop(h, 0)
            held[h] = mask | bit
            if mask & bit and not spec.get(h, 0) & bit:
                continue                                      # confirmed already
            spec[h] = spec.get(h, 0) | bit
            expiries[h] = expiry
            st.held[h] = None
            fresh.append(h)
        if fresh:
            self._spec_records.append((expiry, slot, fresh))
        self._enforce_bound()

    def expire(self, now: float) -> None:
        """Drop speculative bits whose TTL ended unconfirmed (amortized O(1) per inserted hash)."""
        records, held = self._spec_records, self._held
        while records and records[0][0] <= now:
            expiry, slot, hashes = records.popleft()
            owner = self._slot_owner[slot]
            st = self._replicas[owner] if owner is not None else None
            expiries, bit = self._spec_expiry[slot], 1 << slot
            for h in hashes:
                if expiries.get(h) != expiry:
                    continue                     # confirmed, dropped or re-inserted later since
                self._clear_spec(h, slot)
                mask = held.get(h)
                if mask is not None:
                    if mask == bit:
                        del held[h]
                    else:
                        held[h] = mask & ~bit
                if st is not None:
                    st.held.pop(h, None)

    def _clear_spec(self, h: BlockHash, slot: int) -> None:
        """Clear the slot's speculative bit (not its bit in `_held`)."""
        mask = self._spec.get(h, 0) & ~(1 << slot)
        if mask:
            self._spec[h] = mask
        else:
            self._spec.pop(h, None)
        self._spec_expiry[slot].pop(h, None)

    # ------------------------------------------------------------ lookup
    def match(self, block_hashes: list[BlockHash], replica_ids: list[str]) -> dict[str, int]:
        """Leading blocks of `block_hashes` each replica holds (confirmed or speculative); replicas with 0
        are absent. Cost: one dict lookup and one int AND per matched block, plus one step per drop-out."""
        slots = {}
        active = 0
        replicas = self._replicas
        for rid in replica_ids:
            st = replicas.get(rid)
            if st is not None:
                slots[st.slot] = rid
                active |= 1 << st.slot
        out: dict[str, int] = {}
        get = self._held.get
        n = 0
        for h in block_hashes:
            mask = get(h)
            if mask is None:
                break
            both = active & mask
            if both != active:
                for slot in _bits(active ^ both):
                    if n:
                        out[slots[slot]] = n
                active = both
                if not active:
                    break
            n += 1
        if n:
            for slot in _bits(active):
                out[slots[slot]] = n
            held, pop = self._held, self._held.pop
            for i in range(n - 1, -1, -1):                   # LRU: tail first, so the head is newest
                h = block_hashes[i]
                held[h] = pop(h)
        return out

    def holds_any(self, block_hash: BlockHash) -> bool:
        """Whether any replica (candidate or not) holds the hash."""
        return block_hash in self._held

    def num_held(self, replica_id: str) -> int:
        st = self._replicas.get(replica_id)
        return len(st.held) if st is not None else 0

    @property
    def num_entries(self) -> int:
        """Block hashes held by at least one replica (the bounded quantity)."""
        return len(self._held)

    # ------------------------------------------------------------ bound
    def _enforce_bound(self) -> None:
        """Evict least recently used hashes down to 99% of the bound, in one pass from the dict's front."""
        held = self._held
        if len(held) <= self.max_blocks:
            return
        num_evict = len(held) - self.max_blocks * 99 // 100
        for h in [h for h, _ in zip(held, range(num_evict))]:
            mask = held.pop(h)
            spec = self._spec.pop(h, 0)
            for slot in _bits(mask):
                if spec >> slot & 1:
                    self._spec_expiry[slot].pop(h, None)
                owner = self._slot_owner[slot]
                if owner is not None:
                    self._replicas[owner].held.pop(h, None)
            self.num_evictions += 1
