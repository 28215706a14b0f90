"""PrefixIndex: which replica holds which block hash, fed by the engines' KV events plus speculative inserts.

Exact where the events are: each replica's view follows its event stream (per-replica sequence numbers and
cache epoch); a gap or a changed epoch drops that replica's entries and waits for a snapshot. Between a
routing decision and the chosen engine's BlockStored, the prompt's blocks count as held speculatively (TTL).

Layout, chosen so a decision costs O(replicas + EXACT_BLOCKS + prompt blocks / SPEC_STRIDE + drop-outs x
log(prompt blocks)), whatever the prompt length, and so the garbage collector never walks the index: only plain dicts
of bytes -> int/float/None,
which CPython untracks (an OrderedDict or a set of millions of hashes would cost a full collection tens of
milliseconds):
  `_held`  block hash -> bit mask of the replica slots whose paged pool holds it (confirmed by events or a
           snapshot), in insertion order (a re-store moves the key to the end; the bound evicts from the front).
  `_spec`  checkpoint hash -> bit mask of the slots that were sent a request whose prompt has this hash at
           one of its checkpoint depths (see below; a chained hash fixes its depth).
  `_spec_expiry[slot]`  checkpoint hash -> when that slot's speculative hold ends.
Speculative holds are sparse. Block hashes are chained (a hash names its whole prefix), so a request that
shares a checkpoint hash at depth d with a routed one shares its first d blocks. A routed prompt of n blocks
whose first m are already held records only the depths in (m, n] that are powers of two below SPEC_STRIDE,
multiples of SPEC_STRIDE, or n itself: O(log + n / SPEC_STRIDE) dict writes, not O(n). A lookup probes the
same depths of its own prompt; a speculative match may thus round down by less than SPEC_STRIDE blocks.
Matching ANDs the confirmed masks of the prompt's first EXACT_BLOCKS hashes in order (one dict lookup and
one int AND per block; a replica's length is recorded when its bit drops out), bisects on the depth for the
replicas still holding past them (pools are prefix-closed: see `_deepest`), then raises each replica's
length to its deepest speculative checkpoint. Lookups never write: recency is the order of the engines' own
stores.

Bound, sized from the fleet: the engines' events keep `_held` to the hashes the pools hold, at most the
sum of their pool sizes. `set_capacity` (the core calls it from the replicas' reported `num_blocks`, times a
margin, on every membership or size change) sets the bound; `max_blocks` is only an upper limit. Past the
bound the oldest-stored hashes go, exactly as many as were added (amortized O(1) per stored hash, on the
event path, never in a decision). The speculative checkpoints have their own bound (a quarter of the pool
bound, oldest record first), and expire by TTL in FIFO order.

Memory, measured with tracemalloc (tests/unit/routing/test_prefix_index.py::test_memory_per_entry, in a
fresh interpreter): 125-175 bytes per hash held by one replica, counting the 65-byte hash object itself,
plus 40-75 bytes per further replica holding it (its entry in that replica's dict). A 128-replica fleet
of 8B models on 80 GB GPUs (~25k blocks of 16 tokens each, 3.2M blocks) thus costs about 400-560 MB of
router memory when every hash has one holder.

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
The tier dicts have their own bound, `max_tier_blocks` hashes over both (oldest stored first, amortized
O(1) per stored hash, the same cost per entry).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from affinity_serve.engine.types import (MEDIUM_OFFLOAD, MEDIUM_POOL, MEDIUM_SHARED, AllBlocksCleared, BlockRemoved,
                                         BlockStored)

from affinity_serve.app.routing.api import BlockHash, KVEventBatch, KVSnapshot


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
        self.max_blocks = max_blocks                  # upper limit; `bound` is what is enforced
        self.bound = max_blocks
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
        self._num_spec_entries = 0                    # (slot, hash) holds in the live records, at most
        self.num_evictions = 0
        self.num_spec_evictions = 0
        self.num_resyncs = 0

    def set_capacity(self, num_blocks: int) -> None:
        """Bound `_held` to `num_blocks` hashes (at most `max_blocks`): what the fleet's pools can hold,
        times a margin. Shrinking evicts the excess now (a membership change, not a decision)."""
        self.bound = max(1, min(self.max_blocks, int(num_blocks)))
        self._enforce_bound()

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
            self._drop_spec(st.slot)
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

    def forget_all(self) -> None:
        """Drop every entry (pool, tiers, speculative) of every replica, which then needs a snapshot: a feed
        that stops pulling cannot keep the index current, so it must not keep the index either. The tables
        are replaced, not emptied (a dict never shrinks as keys are deleted: emptied, a 300k-entry index kept
        its 10 MB); membership, slots and counters stay."""
        self._held, self._spec, self._offload, self._shared = {}, {}, {}, {}
        self._spec_expiry = [{} for _ in self._spec_expiry]
        self._spec_records = deque()
        self._num_spec_entries = 0
        for node in self._nodes.values():
            node.held = {}
        for st in self._replicas.values():
            st.held, st.offload = {}, {}
            st.epoch, st.needs_snapshot = None, True

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
        bit, held, owned = 1 << st.slot, self._held, st.held
        for h in reversed(hashes):                           # tail first: the chain's head ends up newest
            held[h] = held.pop(h, 0) | bit                   # (re)inserted last: evicted last
            owned[h] = None
        self._enforce_bound()

    def _remove(self, st: _ReplicaState, hashes: list[BlockHash]) -> None:
        bit, held = 1 << st.slot, self._held
        for h in hashes:
            mask = held.get(h)
            if mask is None or not mask & bit:
                continue
            st.held.pop(h, None)
            if mask == bit:
                del held[h]
            else:
                held[h] = mask & ~bit

    def _drop(self, st: _ReplicaState) -> None:
        """Forget every hash the replica holds in its pool: O(its blocks). Speculative holds stay (they
        predict stores still to come)."""
        bit, held = 1 << st.slot, self._held
        for h in st.held:
            mask = held.get(h)
            if mask is None:
                continue
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
        """Evict the oldest-stored tier entries, as many as exceed `max_tier_blocks`, from the larger dict
        (amortized O(1) per stored hash)."""
        excess = len(self._offload) + len(self._shared) - self.max_tier_blocks
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
    def insert_speculative(self, replica_id: str, block_hashes: list[BlockHash], now: float,
                           start: int = 0) -> None:
        """The replica will hold `block_hashes` (a whole prompt's) once it prefills the request; its first
        `start` blocks are held already. Counted until the TTL ends, whatever the events say meanwhile.
        Writes O(log SPEC_STRIDE + (n - start) / SPEC_STRIDE) checkpoints, never one per block."""
        st = self._replicas.get(replica_id)
        n = len(block_hashes)
        if st is None or n <= start:
            return
        slot, bit, expiry = st.slot, 1 << st.slot, now + self.speculative_ttl_s
        spec, expiries = self._spec, self._spec_expiry[st.slot]
        fresh = []
        for d in _checkpoints(start, n):
            h = block_hashes[d - 1]
            mask = spec.get(h, 0)
            if not mask & bit:
                spec[h] = mask | bit
                self._num_spec_entries += 1
            expiries[h] = expiry
            fresh.append(h)
        self._spec_records.append((expiry, slot, fresh))
        limit = max(1, self.bound // 4)
        while self._num_spec_entries > limit and len(self._spec_records) > 1:     # never the newest
            self._expire_record(*self._spec_records.popleft())
            self.num_spec_evictions += 1

    def expire(self, now: float) -> None:
        """Drop speculative holds whose TTL ended (amortized O(1) per inserted checkpoint)."""
        records = self._spec_records
        while records and records[0][0] <= now:
            self._expire_record(*records.popleft())

    def _expire_record(self, expiry: float, slot: int, hashes: list[BlockHash]) -> None:
        expiries = self._spec_expiry[slot]
        for h in hashes:
            if expiries.get(h) == expiry:        # else re-inserted later (or dropped) since
                self._clear_spec(h, slot)

    def _clear_spec(self, h: BlockHash, slot: int) -> None:
        mask = self._spec.get(h, 0)
        bit = 1 << slot
        if mask & bit:
            self._num_spec_entries -= 1
            mask &= ~bit
            if mask:
                self._spec[h] = mask
            else:
                del self._spec[h]
        self._spec_expiry[slot].pop(h, None)

    def _drop_spec(self, slot: int) -> None:
        for h in list(self._spec_expiry[slot]):
            self._clear_spec(h, slot)

    @property
    def num_spec_entries(self) -> int:
        return self._num_spec_entries

    # ------------------------------------------------------------ lookup
    def match(self, block_hashes: list[BlockHash], replica_ids: list[str]) -> dict[str, int]:
        """Leading blocks of `block_hashes` each replica holds (confirmed, or speculative to the deepest
        checkpoint); replicas with 0 are absent. Cost: one dict lookup and one int AND per matched block,
        one step per drop-out, one lookup per checkpoint depth of the prompt. Writes nothing."""
        slots = {}
        active = 0
        replicas = self._replicas
        for rid in replica_ids:
            st = replicas.get(rid)
            if st is not None:
                slots[st.slot] = rid
                active |= 1 << st.slot
        out: dict[str, int] = {}
        if not active:
            return out
        candidates = active
        get = self._held.get
        n = 0
        limit = min(len(block_hashes), EXACT_BLOCKS)
        while n < limit:
            mask = get(block_hashes[n])
            if mask is None:
                if n:
                    for slot in _bits(active):
                        out[slots[slot]] = n
                active = 0
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
        if active:
            if n < len(block_hashes):
                for slot, depth in _deepest(block_hashes, n, active, get):
                    out[slots[slot]] = depth
            else:
                for slot in _bits(active):
                    out[slots[slot]] = n
        spec = self._spec
        if spec:
            spec_get = spec.get
            for d in _checkpoints(0, len(block_hashes)):
                mask = spec_get(block_hashes[d - 1])
                if mask and mask & candidates:
                    for slot in _bits(mask & candidates):
                        rid = slots[slot]
                        if out.get(rid, 0) < d:
                            out[rid] = d
        return out

    def holds_any(self, block_hash: BlockHash) -> bool:
        """Whether any replica (candidate or not) holds the hash or was sent a prompt starting with it."""
        return block_hash in self._held or block_hash in self._spec

    def num_held(self, replica_id: str) -> int:
        """Hashes the replica's pool holds (confirmed)."""
        st = self._replicas.get(replica_id)
        return len(st.held) if st is not None else 0

    @property
    def num_entries(self) -> int:
        """Block hashes held by at least one replica (the bounded quantity)."""
        return len(self._held)

    # ------------------------------------------------------------ bound
    def _enforce_bound(self) -> None:
        """Evict the oldest-stored hashes, exactly as many as exceed the bound (amortized O(1) per store)."""
        held = self._held
        num_evict = len(held) - self.bound
        if num_evict <= 0:
            return
        for h in [h for h, _ in zip(held, range(num_evict))]:
            mask = held.pop(h)
            for slot in _bits(mask):
                owner = self._slot_owner[slot]
                if owner is not None:
                    self._replicas[owner].held.pop(h, None)
            self.num_evictions += 1


SPEC_STRIDE = 16
#: a match walks the first EXACT_BLOCKS blocks one by one; past them it bisects on the depth (see _deepest)
EXACT_BLOCKS = 64


def _deepest(hashes: list[BlockHash], lo: int, bits: int, get) -> list[tuple[int, int]]:
    """(slot, depth) for each slot in `bits`, all of which hold hashes[:lo]: its deepest held block, by
    bisection (O(log n) lookups per distinct depth, not O(n)). Exact when every pool's chains are
    prefix-closed, which the engines' LRU guarantees: a request that uses block i uses blocks 0..i-1 too,
    and freeing puts a chain's tail ahead of its head in the eviction order, so a pool never holds a block
    without its prefix; the events mirror that. (A block stored out of that order only shifts the
    predicted depth of a routing choice, never a token.)"""
    out = []
    stack = [(lo, len(hashes), bits)]                  # every slot in bits has its depth in [lo, hi]
    while stack:
        lo, hi, bits = stack.pop()
        if lo == hi:
            out.extend((slot, lo) for slot in _bits(bits))
            continue
        mid = (lo + hi + 1) // 2                       # lo < mid <= hi
        deeper = (get(hashes[mid - 1]) or 0) & bits
        if deeper:
            stack.append((mid, hi, deeper))
        if bits ^ deeper:
            stack.append((lo, mid - 1, bits ^ deeper))
    return out


def _checkpoints(start: int, n: int) -> list[int]:
    """Depths d in (start, n] a speculative hold records: powers of two below SPEC_STRIDE, multiples of
    SPEC_STRIDE, and n. A lookup probes the same depths of its prompt (with start = 0)."""
    out = []
    d = 1
    while d < SPEC_STRIDE and d <= n:
        if d > start:
            out.append(d)
        d <<= 1
    d = max(SPEC_STRIDE, (start // SPEC_STRIDE + 1) * SPEC_STRIDE)
    while d <= n:
        out.append(d)
        d += SPEC_STRIDE
    if n > start and (not out or out[-1] != n):
        out.append(n)
    return out
