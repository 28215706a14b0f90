"""SharedConnectorScheduler: the scheduler side of the node-shared store (torch-free).

Every block the pool computes is written to the node's `SharedKVStore` (on the step after it was
computed, before that step's forward pass), and any replica on the node can load a prefix another one
computed. Lookups read the store directly (one stat per block); the runner side does the copies.

Hybrid models (sliding-window KV-cache groups): one store namespace per group (`GroupedSharedStore`),
each holding its group's blocks; a sliding group's blocks are written as they are computed, as a full
group's are (any position may end a later prompt's hit), and a load reads only its window's.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from affinity_serve.engine.block_pool import CacheKey
from affinity_serve.engine.hashing import BlockHash
from affinity_serve.engine.kv_connector.base import (KVConnectorMetadata, KVConnectorOutput, KVConnectorScheduler,
                                      KVConnectorUpdate, KVLayout, KVTransfer, PoolChanges)
from affinity_serve.engine.kv_connector.shared_store import GroupedSharedStore, SharedKVStore
from affinity_serve.engine.types import BlockRemoved, BlockStored, KVEvent

if TYPE_CHECKING:
    from affinity_serve.engine.request import Request
    from affinity_serve.engine.types import SchedulerOutput

#: hashes this replica wrote recently: not offered to the store again (it would skip them anyway)
_RECENT_WRITES = 100_000


class SharedConnectorScheduler(KVConnectorScheduler):
    medium = "shared"
    supports_kv_groups = True

    def __init__(self, layout: KVLayout, store: SharedKVStore | GroupedSharedStore, *, load_timeout_s: float = 30.0,
                 enable_events: bool = False, share_salted: bool = True):
        super().__init__()
        self.layout = layout
        self.block_size = layout.block_size
        self.store = store
        self.load_timeout_s = load_timeout_s
        self.wants_cached = True
        self.wants_evicted = False
        self._enable_events = enable_events
        self._recent: OrderedDict[CacheKey, None] = OrderedDict()
        self._store_generation = store.generation     # the store reopened its directory: _recent is stale
        self._pending_loads: list[KVTransfer] = []
        self._loading: dict[str, list[CacheKey]] = {}           # req_id -> hashes being loaded
        self._num_storing = 0
        self._events: list[KVEvent] = []
        self.share_salted = share_salted
        # share_salted=False: unsalted requests seen at admission (req_id -> (request, hashes taken)) and
        # the hashes of their blocks, the only ones stored
        self._public_requests: dict[str, tuple["Request", int]] = {}
        self._public: OrderedDict[BlockHash, None] = OrderedDict()

    def get_num_new_matched_tokens(self, request: "Request", num_local_tokens: int) -> tuple[int | None, bool]:
        if not self.share_salted:
            if request.cache_salt:
                return 0, False
            self._public_requests.setdefault(request.req_id, (request, 0))
        return self._match_after_local(request, num_local_tokens, self.store.contains)

    def update_state_after_alloc(self, request: "Request", block_ids: list[int], num_external_tokens: int) -> None:
        start = request.num_computed_tokens // self.block_size
        self._plan_load(request, block_ids, request.block_hashes[start:start + len(block_ids)])

    def update_state_after_alloc_keyed(self, request: "Request", blocks: list[tuple[int, CacheKey]],
                                       num_external_tokens: int) -> None:
        self._plan_load(request, [b for b, _ in blocks], [k for _, k in blocks])

    def _plan_load(self, request: "Request", block_ids: list[int], keys: list[CacheKey]) -> None:
        self._loading[request.req_id] = list(keys)
        self._load_started(request)
        self._pending_loads.append(KVTransfer(request.req_id, list(block_ids), list(keys)))

    def request_finished_keyed(self, request: "Request", blocks: list[tuple[int, CacheKey]]) -> bool:
        return self.request_finished(request, [])

    def request_finished(self, request: "Request", block_ids: list[int]) -> bool:
        if request.req_id in self._public_requests:
            self._take_public_hashes()
            del self._public_requests[request.req_id]
        return False

    def _take_public_hashes(self) -> None:
        for req_id, (req, taken) in self._public_requests.items():
            for h in req.block_hashes[taken:]:
                self._public[h] = None
            self._public_requests[req_id] = (req, len(req.block_hashes))
        while len(self._public) > _RECENT_WRITES:
            self._public.popitem(last=False)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput", changes: PoolChanges) -> KVConnectorMetadata:
        self._note_abandoned_loads()
        if not self.share_salted:
            self._take_public_hashes()
        ids: list[int] = []
        hashes: list[BlockHash] = []
        if changes.cached:
            self.store.check_dir()        # deleted while serving: reopen before trusting what we wrote there
        if self.store.generation != self._store_generation:
            self._store_generation = self.store.generation
            self._recent.clear()          # what this replica wrote went with the old directory
        recent = self._recent
        for block_id, h in changes.cached:
            if h in recent or (not self.share_salted and (h if type(h) is bytes else h[1]) not in self._public):
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
        written = None if output.tier_written is None else set(output.tier_written)
        for hashes, ok in output.finished_stores:
            self._num_storing = max(0, self._num_storing - 1)
            if ok:      # count what was written: the store skips blocks it holds already
                n = len(hashes) if written is None else sum(h in written for h in hashes)
                self.stats.stored_blocks += n
                self.stats.stored_bytes += n * self.layout.block_bytes
                own = [h for h in hashes if type(h) is bytes]      # group 0's keys only, as the pool's events
                if self._enable_events and own:
                    self._events.append(BlockStored(own, None, [], self.block_size, medium=self.medium))
            else:       # a store that failed part way (a full filesystem) wrote some blocks
                done = [h for h in hashes if h in written] if written else []
                self.stats.stored_blocks += len(done)
                self.stats.stored_bytes += len(done) * self.layout.block_bytes
                self.stats.stores_failed += len(hashes) - len(done)
                done_set = set(done)
                for h in hashes:
                    if h not in done_set:
                        self._recent.pop(h, None)
                own = [h for h in done if type(h) is bytes]
                if self._enable_events and own:
                    self._events.append(BlockStored(own, None, [], self.block_size, medium=self.medium))
        if output.tier_evicted:
            self.stats.evicted_blocks += len(output.tier_evicted)
            for h in output.tier_evicted:
                self._recent.pop(h, None)
            own = [h for h in output.tier_evicted if type(h) is bytes]
            if self._enable_events and own:
                self._events.append(BlockRemoved(own, medium=self.medium))
        for req_id, ok in output.finished_loads.items():
            hashes = self._loading.pop(req_id, [])
            if not ok:       # the request recomputes these blocks: store them again (damaged files are gone)
                for h in hashes:
                    self._recent.pop(h, None)
            self._load_finished(req_id, ok, len(hashes), output.load_failure_causes.get(req_id),
                                self.layout.block_bytes)
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
