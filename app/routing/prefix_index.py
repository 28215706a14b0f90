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

Memory bound: at most `max_blocks` hashes, least recently touched evicted first (down to 99% of the
bound, in one pass); a lookup or store touches a chain's tail first so its head, which every longer prompt
needs, is evicted last. Measured with tracemalloc (tests/unit/routing/test_prefix_index.py::
test_memory_per_entry, in a fresh interpreter; 20k-300k hashes): 125-170 bytes per hash held by one replica, counting the 65-byte
hash object itself, plus 40-70 bytes per further replica holding it (its entry in that replica's dict).
The default 500,000 hashes thus cost at most about 90 MB with one holder each, plus up to 35 MB per extra
copy; size `max_index_entries` to about (replicas x KV blocks per replica) / (replicas per hash).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from engine.types import AllBlocksCleared, BlockRemoved, BlockStored

from app.routing.api import BlockHash, KVEventBatch, KVSnapshot


class _ReplicaState:
    __slots__ = ("slot", "epoch", "next_seq", "needs_snapshot", "held")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.epoch: str | None = None
        self.next_seq = 0
        self.needs_snapshot = True          # nothing known until a snapshot or the stream's seq 0
        self.held: dict[BlockHash, None] = {}   # hashes with this replica's bit (confirmed or speculative)


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

    def __init__(self, max_blocks: int, speculative_ttl_s: float) -> None:
        self.max_blocks = max_blocks
        self.speculative_ttl_s = speculative_ttl_s
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

    def add_replica(self, replica_id: str) -> None:
        if replica_id in self._replicas:
            return
        try:
            slot = self._slot_owner.index(None)
            self._slot_owner[slot] = replica_id
        except ValueError:
            slot = len(self._slot_owner)
            self._slot_owner.append(replica_id)
            self._spec_expiry.append({})
        self._replicas[replica_id] = _ReplicaState(slot)

    def remove_replica(self, replica_id: str) -> None:
        st = self._replicas.pop(replica_id, None)
        if st is not None:
            self._drop(st)
            self._slot_owner[st.slot] = None

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
            st.epoch, st.next_seq, st.needs_snapshot = batch.epoch, batch.first_seq, False
        if batch.first_seq > st.next_seq:
            return self._lose(st)
        for event in events[st.next_seq - batch.first_seq:]:
            if isinstance(event, BlockStored):
                self._store(st, event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self._remove(st, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self._drop(st)
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
        st.epoch, st.next_seq, st.needs_snapshot = snapshot.epoch, snapshot.next_seq, False

    def _lose(self, st: _ReplicaState) -> bool:
        self._drop(st)
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
