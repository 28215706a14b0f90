"""SharedConnectorScheduler: the scheduler side of the node-shared store (torch-free).

Every block the pool computes is written to the node's `SharedKVStore` (on the step after it was
computed, before that step's forward pass), and any replica on the node can load a prefix another one
computed. Lookups read the store directly (one stat per block); the runner side does the copies.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from engine.hashing import BlockHash
from engine.kv_connector.base import (KVConnectorMetadata, KVConnectorOutput, KVConnectorScheduler,
                                      KVConnectorUpdate, KVLayout, KVTransfer, PoolChanges)
from engine.kv_connector.shared_store import SharedKVStore
from engine.types import BlockRemoved, BlockStored, KVEvent

if TYPE_CHECKING:
    from engine.request import Request
    from engine.types import SchedulerOutput

#: hashes this replica wrote recently: not offered to the store again (it would skip them anyway)
_RECENT_WRITES = 100_000


class SharedConnectorScheduler(KVConnectorScheduler):
    medium = "shared"

    def __init__(self, layout: KVLayout, store: SharedKVStore, *, load_timeout_s: float = 30.0,
                 enable_events: bool = False):
        super().__init__()
        self.layout = layout
        self.block_size = layout.block_size
        self.store = store
        self.load_timeout_s = load_timeout_s
        self.wants_cached = True
        self.wants_evicted = False
        self._enable_events = enable_events
        self._recent: OrderedDict[BlockHash, None] = OrderedDict()
        self._pending_loads: list[KVTransfer] = []
        self._loading: dict[str, int] = {}          # req_id -> blocks
        self._num_storing = 0
        self._events: list[KVEvent] = []

    def get_num_new_matched_tokens(self, request: "Request", num_local_tokens: int) -> tuple[int | None, bool]:
        return self._match_after_local(request, num_local_tokens, self.store.contains)

    def update_state_after_alloc(self, request: "Request", block_ids: list[int], num_external_tokens: int) -> None:
        start = request.num_computed_tokens // self.block_size
        hashes = request.block_hashes[start:start + len(block_ids)]
        self._loading[request.req_id] = len(block_ids)
        self._pending_loads.append(KVTransfer(request.req_id, list(block_ids), list(hashes)))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput", changes: PoolChanges) -> KVConnectorMetadata:
        ids: list[int] = []
        hashes: list[BlockHash] = []
        recent = self._recent
        for block_id, h in changes.cached:
            if h in recent:
                continue
            recent[h] = None
            ids.append(block_id)
            hashes.append(h)
        while len(recent) > _RECENT_WRITES:
            recent.popitem(last=False)
        meta = KVConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        if ids:
            meta.stores.append(KVTransfer(None, ids, hashes))
            self._num_storing += 1
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> KVConnectorUpdate:
        for hashes, ok in output.finished_stores:
            self._num_storing = max(0, self._num_storing - 1)
            if ok:
                self.stats.stored_blocks += len(hashes)
                if self._enable_events and hashes:
                    self._events.append(BlockStored(list(hashes), None, [], self.block_size, medium=self.medium))
            else:
                self.stats.stores_failed += len(hashes)
                for h in hashes:
                    self._recent.pop(h, None)
        if output.tier_evicted:
            self.stats.evicted_blocks += len(output.tier_evicted)
            for h in output.tier_evicted:
                self._recent.pop(h, None)
            if self._enable_events:
                self._events.append(BlockRemoved(list(output.tier_evicted), medium=self.medium))
        for req_id, ok in output.finished_loads.items():
            n = self._loading.pop(req_id, 0)
            if ok:
                self.stats.loads_ok += 1
                self.stats.loaded_blocks += n
            else:
                self.stats.loads_failed += 1
        return KVConnectorUpdate(dict(output.finished_loads))

    def has_pending_work(self) -> bool:
        return bool(self._pending_loads or self._loading or self._num_storing)

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def block_hashes(self) -> list[BlockHash]:
        return self.store.block_hashes()

    def close(self) -> None:
        self.store.close()
