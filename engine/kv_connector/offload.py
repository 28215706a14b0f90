"""OffloadConnectorScheduler: a per-replica host-memory tier below the paged pool (torch-free bookkeeping).

The tier is `capacity_blocks` slots of one block each; the runner side (`worker.OffloadWorker`) owns the
bytes, this side owns which hash lives in which slot, an LRU over them, and the copies in flight.

Stores: `store_on="evict"` (default) saves a cached pool block when the pool reallocates it, so the tier
holds what the pool just lost (an exclusive level below it, no copy of blocks the pool still has);
`store_on="finish"` saves a request's computed blocks when it ends (copies that the pool often still
holds; benchmarks/kv_connector.py measures both). A slot read by an in-flight load is pinned.

Hybrid models (sliding-window KV-cache groups): a slot holds one group's block, keyed by the pool's
`cache_key`. With `evict`, a sliding group's blocks reach the tier when the pool reuses them (their window
passed long before); with `finish`, only the blocks a request still holds (a sliding group's last window).
A load fills every full-attention group's blocks and only the blocks each sliding window reads.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Literal

from affinity_serve.engine.block_pool import CacheKey
from affinity_serve.engine.hashing import BlockHash
from affinity_serve.engine.kv_connector.base import (KVConnectorMetadata, KVConnectorOutput, KVConnectorScheduler,
                                      KVConnectorUpdate, KVLayout, KVTransfer, PoolChanges)
from affinity_serve.engine.types import BlockRemoved, BlockStored, KVEvent

if TYPE_CHECKING:
    from affinity_serve.engine.request import Request
    from affinity_serve.engine.types import SchedulerOutput


class OffloadConnectorScheduler(KVConnectorScheduler):
    medium = "offload"
    supports_kv_groups = True

    def __init__(self, layout: KVLayout, capacity_blocks: int, *, store_on: Literal["evict", "finish"] = "evict",
                 load_timeout_s: float = 30.0, enable_events: bool = False):
        super().__init__()
        if capacity_blocks < 1:
            raise ValueError(f"the offload tier needs >= 1 block, got {capacity_blocks}")
        if store_on not in ("evict", "finish"):
            raise ValueError(f"store_on must be 'evict' or 'finish', got {store_on!r}")
        self.layout = layout
        self.block_size = layout.block_size
        self.capacity_blocks = capacity_blocks
        self.store_on = store_on
        self.load_timeout_s = load_timeout_s
        self.wants_cached = False
        self.wants_evicted = store_on == "evict"
        self._enable_events = enable_events
        self._index: OrderedDict[CacheKey, int] = OrderedDict()     # loadable; first = least recently used
        self._free_slots = list(range(capacity_blocks - 1, -1, -1))
        self._storing: dict[CacheKey, int] = {}                       # slot reserved, copy not yet reported
        self._pins: dict[int, int] = {}                                # slot -> loads reading it
        self._loading: dict[str, list[int]] = {}                       # req_id -> pinned slots
        self._pending_loads: list[KVTransfer] = []
        self._finish_candidates: list[tuple[int, BlockHash]] = []
        self._events: list[KVEvent] = []

    # ------------------------------------------------------------------ lookup and loads
    def get_num_new_matched_tokens(self, request: "Request", num_local_tokens: int) -> tuple[int | None, bool]:
        return self._match_after_local(request, num_local_tokens, self._index.__contains__)

    def update_state_after_alloc(self, request: "Request", block_ids: list[int], num_external_tokens: int) -> None:
        start = request.num_computed_tokens // self.block_size
        self._plan_load(request, block_ids, request.block_hashes[start:start + len(block_ids)])

    def update_state_after_alloc_keyed(self, request: "Request", blocks: list[tuple[int, CacheKey]],
                                       num_external_tokens: int) -> None:
        self._plan_load(request, [b for b, _ in blocks], [k for _, k in blocks])

    def _plan_load(self, request: "Request", block_ids: list[int], hashes: list[CacheKey]) -> None:
        slots = []
        for h in hashes:
            slot = self._index[h]        # nothing evicts between the lookup and this call
            self._index.move_to_end(h)
            self._pins[slot] = self._pins.get(slot, 0) + 1
            slots.append(slot)
        self._loading[request.req_id] = slots
        self._load_started(request)
        self._pending_loads.append(KVTransfer(request.req_id, list(block_ids), list(hashes), slots))

    # ------------------------------------------------------------------ stores
    def request_finished(self, request: "Request", block_ids: list[int]) -> bool:
        if self.store_on == "finish" and block_ids:
            self._finish_candidates.extend(zip(block_ids, request.block_hashes))
        return False        # stores run before the next forward pass: the blocks may be reused right away

    def request_finished_keyed(self, request: "Request", blocks: list[tuple[int, CacheKey]]) -> bool:
        if self.store_on == "finish":
            self._finish_candidates.extend(blocks)
        return False

    def build_connector_meta(self, scheduler_output: "SchedulerOutput", changes: PoolChanges) -> KVConnectorMetadata:
        self._note_abandoned_loads()
        candidates = changes.evicted if self.store_on == "evict" else self._finish_candidates
        ids: list[int] = []
        hashes: list[BlockHash] = []
        slots: list[int] = []
        for block_id, h in candidates:
            if h in self._index:
                self._index.move_to_end(h)
                continue
            if h in self._storing:
                continue
            slot = self._alloc_slot()
            if slot is None:
                break                   # every slot is pinned or being written: these blocks are lost
            self._storing[h] = slot
            ids.append(block_id)
            hashes.append(h)
            slots.append(slot)
        self._finish_candidates = []
        meta = KVConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        if ids:
            meta.stores.append(KVTransfer(None, ids, hashes, slots))
        return meta

    def _alloc_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        pins = self._pins
        for h, slot in self._index.items():       # least recently used first
            if slot not in pins:
                del self._index[h]
                self.stats.evicted_blocks += 1
                if self._enable_events and type(h) is bytes:      # group 0's keys only, as the pool's events
                    self._events.append(BlockRemoved([h], medium=self.medium))
                return slot
        return None

    # ------------------------------------------------------------------ reports
    def update_connector_output(self, output: KVConnectorOutput) -> KVConnectorUpdate:
        for hashes, ok in output.finished_stores:
            stored = []
            for h in hashes:
                slot = self._storing.pop(h, None)
                if slot is None:
                    continue        # reported already (a failed step's transfers count as failed at once)
                if ok:
                    self._index[h] = slot
                    stored.append(h)
                else:
                    self._free_slots.append(slot)
            if ok:
                self.stats.stored_blocks += len(stored)
                self.stats.stored_bytes += len(stored) * self.layout.block_bytes
            else:
                self.stats.stores_failed += len(hashes)
            stored = [h for h in stored if type(h) is bytes]
            if stored and self._enable_events:
                self._events.append(BlockStored(stored, None, [], self.block_size, medium=self.medium))
        for req_id, ok in output.finished_loads.items():
            slots = self._loading.pop(req_id, ())
            for slot in slots:
                n = self._pins[slot] - 1
                if n:
                    self._pins[slot] = n
                else:
                    del self._pins[slot]
            self._load_finished(req_id, ok, len(slots), output.load_failure_causes.get(req_id),
                                self.layout.block_bytes)
        return KVConnectorUpdate(dict(output.finished_loads))

    def has_pending_work(self) -> bool:
        return bool(self._pending_loads or self._loading or self._storing or self._finish_candidates)

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def block_hashes(self) -> list[BlockHash]:
        return [h for h in self._index if type(h) is bytes]     # group 0's (a hybrid model's other groups: tuples)

    def check_accounting(self) -> None:
        """Every slot is exactly one of: free, holding an indexed block, being written (tests call this)."""
        used = list(self._index.values()) + list(self._storing.values())
        slots = used + self._free_slots
        assert len(slots) == len(set(slots)) == self.capacity_blocks, "a tier slot is lost or double-booked"
        assert all(slot in used for slot in self._pins), "a pinned slot holds no block"
