"""PrefixIndex: which replica holds which block hash, fed by the engines' KV events plus speculative inserts.

Exact where the events are: each replica's view follows its event stream (per-replica sequence numbers and
cache epoch); a gap or a changed epoch drops that replica's entries and waits for a snapshot. Between a
routing decision and the chosen engine's BlockStored, the prompt's blocks count as held speculatively (TTL).

Layout, chosen so a lookup costs O(matched blocks) whatever the number of replicas: one entry per block
hash holding two bit masks (bit i = replica slot i), `confirmed` (from events) and `spec` (speculative).
Matching ANDs the masks of the prompt's hashes in order, so each block costs one dict lookup and one int
AND; a replica's match length is recorded when its bit drops out. Each replica also keeps the set of hashes
it holds, so dropping it costs O(its blocks) and never a scan of the index.

Memory bound: at most `max_blocks` hashes (LRU: a lookup or an event touches a hash). Measured with
tracemalloc (tests/unit/routing/test_prefix_index.py::test_memory_per_entry, 20k and 100k hashes): 190-260
bytes per hash held by one replica, counting the 65-byte hash object itself, plus 40-120 bytes per further
replica holding it (its hash-set slot; sets grow in powers of two). So the default 500,000 hashes cost at
most about 130 MB with one holder each, 130 MB + 60 MB per extra copy on average; size
`max_index_entries` to about (replicas x KV blocks per replica) / (replicas per hash).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable

from engine.types import AllBlocksCleared, BlockRemoved, BlockStored

from app.routing.api import BlockHash, KVEventBatch, KVSnapshot


class _Entry:
    __slots__ = ("confirmed", "spec", "spec_expiry")

    def __init__(self) -> None:
        self.confirmed = 0                               # bit mask of replica slots (from events)
        self.spec = 0                                    # bit mask of slots holding it speculatively
        self.spec_expiry: dict[int, float] | None = None  # slot -> expiry time, for the bits in `spec`


class _ReplicaState:
    __slots__ = ("slot", "epoch", "next_seq", "needs_snapshot", "held")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.epoch: str | None = None
        self.next_seq = 0
        self.needs_snapshot = True          # nothing known until a snapshot or the stream's seq 0
        self.held: set[BlockHash] = set()   # hashes whose entry has this replica's bit (either mask)


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
        self._entries: OrderedDict[BlockHash, _Entry] = OrderedDict()
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
            self._apply(st, event)
        st.next_seq = max(st.next_seq, batch.first_seq + len(events))
        return True

    def replicas_needing_snapshot(self) -> list[str]:
        return [rid for rid, st in self._replicas.items() if st.needs_snapshot]

    def apply_snapshot(self, snapshot: KVSnapshot) -> None:
        st = self._replicas.get(snapshot.replica_id)
        if st is None:
            return
        self._drop(st)
        bit = 1 << st.slot
        for h in snapshot.block_hashes:
            self._entry(h).confirmed |= bit
            st.held.add(h)
        st.epoch, st.next_seq, st.needs_snapshot = snapshot.epoch, snapshot.next_seq, False
        self._enforce_bound()

    def _lose(self, st: _ReplicaState) -> bool:
        self._drop(st)
        st.epoch, st.needs_snapshot = None, True
        self.num_resyncs += 1
        return False

    def _apply(self, st: _ReplicaState, event: object) -> None:
        bit = 1 << st.slot
        if isinstance(event, BlockStored):
            for h in event.block_hashes:
                e = self._entry(h)
                e.confirmed |= bit
                if e.spec & bit:
                    self._clear_spec(e, st.slot)
                st.held.add(h)
            self._enforce_bound()
        elif isinstance(event, BlockRemoved):
            # A speculative bit set after the block was stored stays: it predicts a newer store.
            for h in event.block_hashes:
                e = self._entries.get(h)
                if e is not None and e.confirmed & bit:
                    e.confirmed &= ~bit
                    if not e.spec & bit:
                        st.held.discard(h)
                    if not (e.confirmed or e.spec):
                        del self._entries[h]
        elif isinstance(event, AllBlocksCleared):
            self._drop(st)

    def _drop(self, st: _ReplicaState) -> None:
        """Forget every hash the replica holds: O(its blocks)."""
        slot, keep = st.slot, ~(1 << st.slot)
        for h in st.held:
            e = self._entries.get(h)
            if e is None:
                continue
            e.confirmed &= keep
            if e.spec & ~keep:
                self._clear_spec(e, slot)
            if not (e.confirmed or e.spec):
                del self._entries[h]
        st.held = set()

    # ------------------------------------------------------------ speculative inserts
    def insert_speculative(self, replica_id: str, block_hashes: list[BlockHash], now: float) -> None:
        """The replica will hold these blocks once it prefills the request: count them until the TTL ends."""
        st = self._replicas.get(replica_id)
        if st is None or not block_hashes:
            return
        slot, bit, expiry = st.slot, 1 << st.slot, now + self.speculative_ttl_s
        fresh = []
        for h in block_hashes:
            e = self._entry(h)
            if e.confirmed & bit:
                continue
            e.spec |= bit
            if e.spec_expiry is None:
                e.spec_expiry = {}
            e.spec_expiry[slot] = expiry
            st.held.add(h)
            fresh.append(h)
        if fresh:
            self._spec_records.append((expiry, slot, fresh))
        self._enforce_bound()

    def expire(self, now: float) -> None:
        """Drop speculative bits whose TTL ended unconfirmed (amortized O(1) per inserted hash)."""
        records = self._spec_records
        while records and records[0][0] <= now:
            expiry, slot, hashes = records.popleft()
            owner = self._slot_owner[slot] if slot < len(self._slot_owner) else None
            st = self._replicas.get(owner) if owner is not None else None
            for h in hashes:
                e = self._entries.get(h)
                if e is None or e.spec_expiry is None or e.spec_expiry.get(slot) != expiry:
                    continue                     # confirmed, dropped or re-inserted later since
                self._clear_spec(e, slot)
                if not e.confirmed >> slot & 1 and st is not None:
                    st.held.discard(h)
                if not (e.confirmed or e.spec):
                    del self._entries[h]

    @staticmethod
    def _clear_spec(e: _Entry, slot: int) -> None:
        e.spec &= ~(1 << slot)
        if e.spec_expiry is not None:
            e.spec_expiry.pop(slot, None)
            if not e.spec_expiry:
                e.spec_expiry = None

    # ------------------------------------------------------------ lookup
    def match(self, block_hashes: list[BlockHash], replica_ids: list[str]) -> dict[str, int]:
        """Leading blocks of `block_hashes` each replica holds (confirmed or speculative); replicas with 0
        are absent. Cost: one dict lookup and one int AND per matched block, plus one step per drop-out."""
        slots = {}
        active = 0
        for rid in replica_ids:
            st = self._replicas.get(rid)
            if st is not None:
                slots[st.slot] = rid
                active |= 1 << st.slot
        out: dict[str, int] = {}
        entries = self._entries
        n = 0
        for h in block_hashes:
            if not active:
                break
            e = entries.get(h)
            if e is None:
                break
            held = active & (e.confirmed | e.spec)
            if held != active:
                for slot in _bits(active & ~held):
                    if n:
                        out[slots[slot]] = n
                active = held
                if not active:
                    break
            entries.move_to_end(h)
            n += 1
        if n:
            for slot in _bits(active):
                out[slots[slot]] = n
        return out

    def holds_any(self, block_hash: BlockHash) -> bool:
        """Whether any replica (candidate or not) holds the hash."""
        e = self._entries.get(block_hash)
        return e is not None and bool(e.confirmed | e.spec)

    def num_held(self, replica_id: str) -> int:
        st = self._replicas.get(replica_id)
        return len(st.held) if st is not None else 0

    @property
    def num_entries(self) -> int:
        """Block hashes held by at least one replica (the bounded quantity)."""
        return len(self._entries)

    # ------------------------------------------------------------ bound
    def _entry(self, h: BlockHash) -> _Entry:
        e = self._entries.get(h)
        if e is None:
            e = self._entries[h] = _Entry()
        else:
            self._entries.move_to_end(h)
        return e

    def _enforce_bound(self) -> None:
        entries = self._entries
        while len(entries) > self.max_blocks:
            h, e = entries.popitem(last=False)
            for slot in _bits(e.confirmed | e.spec):
                owner = self._slot_owner[slot]
                if owner is not None:
                    self._replicas[owner].held.discard(h)
            self.num_evictions += 1
