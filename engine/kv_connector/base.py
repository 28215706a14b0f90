"""The KV connector interface: a scheduler side (torch-free) and a runner side, after vLLM v1's split.

A connector moves whole KV blocks between the replica's paged pool and a tier outside it (a host-memory
offload tier, a node-shared store). Its scheduler side answers "how many more prompt tokens can you
supply beyond the local prefix hit?", is told which pool blocks to fill, plans each step's copies as a
`KVConnectorMetadata` (handed to the runner inside `SchedulerOutput`), and learns from the runner's
`KVConnectorOutput` which copies completed. Its runner side (`KVConnectorWorker`) does the copies.

The Scheduler calls the scheduler side at these points (vLLM v1 names):
- `get_num_new_matched_tokens(request, num_local_tokens)` at admission, after the local prefix lookup;
- `update_state_after_alloc(request, block_ids, num_external_tokens)` once blocks for the load exist;
- `build_connector_meta(scheduler_output, changes)` at the end of every `schedule()`;
- `update_connector_output(output)` at the start of every `update_from_output()`;
- `request_finished(request, block_ids)` when a request ends or is preempted (True: keep the blocks
  until the connector reports the request's saves done);
- `take_events()` whenever the engine collects KV events.
Loads are asynchronous: the request waits in `RequestStatus.WAITING_FOR_KV` (not running, no token
budget) until its load is reported; a failed or timed-out load falls back to recomputing.
"""
from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from affinity_serve.engine.block_pool import CacheKey, cache_key
from affinity_serve.engine.hashing import BlockHash
from affinity_serve.engine.kv_groups import window_start_block
from affinity_serve.engine.request import RequestStatus
from affinity_serve.engine.types import KVConnectorMetadata, KVConnectorOutput, KVEvent
from affinity_serve.engine.types import KVTransfer as KVTransfer  # re-exported: connectors name it from here

if TYPE_CHECKING:
    from affinity_serve.engine.request import Request
    from affinity_serve.engine.types import SchedulerOutput


# ---------------------------------------------------------------- what a block is
@dataclass(slots=True, frozen=True)
class KVLayout:
    """What one block's KV holds, independent of the attention backend's tensor layout.

    A tier stores a block as one contiguous `[num_layers, 2 (k, v), num_kv_heads, block_size, head_dim]`
    array of `dtype`, so replicas with different backends (torch on CPU, flash on GPU) can share it.

    A hybrid model (sliding-window KV-cache groups, engine/kv_groups.py) has one block id per group and
    position, each a page in every shared KV tensor: `num_layers` is then the number of KV tensors, a tier
    entry is one group's block (keyed by the pool's `cache_key(hash, group)`), and `kv_groups` lists each
    group's window (None: full attention; empty: one full-attention group, the plain model).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str                    # torch dtype name without the prefix: "float32", "bfloat16", ...
    element_size: int
    kv_groups: tuple[int | None, ...] = ()

    @property
    def block_bytes(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim * self.element_size

    def namespace(self, model_identity: str) -> str:
        """The key space a tier's blocks live in: block hashes only match within one namespace.

        The cache salt needs no place here: it is part of the block hash chain (engine.hashing).
        """
        text = (f"affinity-kv/v1|model={model_identity}|dtype={self.dtype}|layers={self.num_layers}|"
                f"kv_heads={self.num_kv_heads}|head_dim={self.head_dim}|block_size={self.block_size}|"
                "layout=L2HBD" + (f"|groups={list(self.kv_groups)}" if self.kv_groups else ""))
        return hashlib.sha256(text.encode()).hexdigest()[:32]


def tier_hit_end(hashes: "list[BlockHash]", start: int, end: int, windows: "tuple[int | None, ...]", holds,
                 block_size: int) -> int:
    """The last block (exclusive, in [start, end]) a tier extends a hit to: group g's block i is
    `holds(cache_key(hashes[i], g))`; full-attention groups need every block from `start`, sliding ones the
    blocks their window reads from the end (blocks before `start` are the local hit's)."""
    n = start
    full = [g for g, w in enumerate(windows) if w is None]
    while n < end and all(holds(cache_key(hashes[n], g)) for g in full):
        n += 1
    sliding = [(g, w) for g, w in enumerate(windows) if w is not None]
    while n > start and sliding:     # lower n below the last window block any sliding group lacks, re-check
        missing = -1
        for g, w in sliding:
            for i in range(n - 1, max(start, window_start_block(n * block_size, w, block_size)) - 1, -1):
                if not holds(cache_key(hashes[i], g)):
                    missing = max(missing, i)
                    break
        if missing < 0:
            break
        n = missing
    return n


# ---------------------------------------------------------------- scheduler -> runner
@dataclass(slots=True)
class PoolChanges:
    """What the paged pool did since the previous schedule(), as (block id, hash) pairs."""

    cached: list[tuple[int, BlockHash]]     # blocks whose KV was computed and registered under a new hash
    evicted: list[tuple[int, BlockHash]]    # cached blocks reallocated in this schedule(): saved or lost


# ---------------------------------------------------------------- runner -> scheduler
@dataclass(slots=True)
class KVConnectorUpdate:
    """What the scheduler needs from a runner report: loads done, and requests whose saves are done."""

    finished_loads: dict[str, bool] = field(default_factory=dict)
    finished_saving_req_ids: set[str] = field(default_factory=set)


@dataclass(slots=True)
class KVConnectorStats:
    """Cumulative counters (blocks, the tokens and bytes they hold). A failed load counts in `loads_failed`
    and in exactly one `load_failures_*` cause."""

    lookups: int = 0
    hit_blocks: int = 0
    hit_tokens: int = 0
    loads_ok: int = 0
    loads_failed: int = 0
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    stored_blocks: int = 0
    stored_bytes: int = 0
    stores_failed: int = 0
    evicted_blocks: int = 0
    load_failures_missing: int = 0       # a block was gone by the time it was read (evicted)
    load_failures_damaged: int = 0       # a block failed verification (shared store)
    load_failures_timed_out: int = 0     # not reported within load_timeout_s: the request recomputed
    load_failures_error: int = 0         # the copy raised (logged with its traceback)


LOAD_FAILURE_CAUSES = ("missing", "damaged", "timed_out", "error")


# ---------------------------------------------------------------- the two sides
class KVConnectorScheduler(ABC):
    """Scheduler side: torch-free bookkeeping of what a tier holds and which copies are in flight.

    Subclasses implement the abstract methods; the defaults of the others suit a tier whose stores need
    no blocks held after their request ends (ours: stores run before the next forward pass).
    `wants_cached` / `wants_evicted` say which `PoolChanges` the pool must record for it.
    """

    block_size: int                      # set by the subclass from its KVLayout
    wants_cached: bool = False
    wants_evicted: bool = False

    #: a load not reported within this many seconds fails (the request recomputes instead)
    load_timeout_s: float = 30.0
    #: the `medium` of this connector's KV events ("offload", "shared")
    medium: str = "tier"
    #: some queued requests' loads start before admission (see `loads_early`)
    early_loads: bool = False

    def __init__(self) -> None:
        self.stats = KVConnectorStats()
        self._load_requests: dict[str, "Request"] = {}      # loads in flight, for timeout accounting
        self._abandoned_loads: set[str] = set()             # timed out or aborted: their late report is not counted
        # the latest lookup of each request still waiting (req_id -> (request, hit blocks)): the scheduler
        # re-asks the head of the queue every step while it has no room for it; one admission counts once
        self._asked: dict[str, tuple["Request", int]] = {}

    def loads_early(self, request: "Request") -> bool:
        """True if `request`'s load should start as soon as it is queued, not when it reaches the head of the
        queue (P/D: KV another engine computed for it; a tier's cached blocks wait their turn). The Scheduler
        then asks `get_num_new_matched_tokens` early, and again at admission if the load did not fit."""
        return False

    #: whether the connector handles hybrid models (several KV-cache groups): the Scheduler then calls the
    #: `*_keyed` methods with every group's blocks; one that does not is refused for such models
    supports_kv_groups: bool = False

    def _match_after_local(self, request: "Request", num_local_tokens: int, holds) -> tuple[int, bool]:
        """The tier's share of a lookup: full blocks right after the local hit for which `holds(key)` is
        true, never the last prompt token's block (it is always computed). With KV-cache groups
        (`layout.kv_groups`), vLLM's hybrid rule: every full-attention group's blocks up to the hit's end, and
        of each sliding group only the blocks its window reads from there.

        Counted in the stats once per admission, with the answer the request was admitted on: a request
        asked again while it waits for room replaces its earlier answer (see `_count_lookups`)."""
        bs, hashes = self.block_size, request.block_hashes
        end = min((request.num_tokens - 1) // bs, len(hashes))
        start = num_local_tokens // bs
        layout: KVLayout | None = getattr(self, "layout", None)      # the tiers set it; a test's fake may not
        windows = (layout.kv_groups if layout is not None else ()) or (None,)
        n = tier_hit_end(hashes, start, end, windows, holds, bs) - start if end > start else 0
        self._asked[request.req_id] = (request, n)
        return n * bs, n > 0

    def _count_lookups(self, loading: "Request | None" = None) -> None:
        """Count the lookups of requests admitted since the last call (`loading`: one whose load starts
        now): a request that left the waiting queue counts its last answer; a finished one (aborted while
        waiting) counts nothing; one still waiting keeps its entry for the next call."""
        if loading is not None:
            self._commit_lookup(loading.req_id)
        for req_id, (req, _) in list(self._asked.items()):
            status = req.status
            if status.is_finished:
                del self._asked[req_id]
            elif status is not RequestStatus.WAITING and status is not RequestStatus.PREEMPTED:
                self._commit_lookup(req_id)

    def _commit_lookup(self, req_id: str) -> None:
        entry = self._asked.pop(req_id, None)
        if entry is not None:
            self.stats.lookups += 1
            self.stats.hit_blocks += entry[1]
            self.stats.hit_tokens += entry[1] * self.block_size

    def update_state_after_alloc_keyed(self, request: "Request", blocks: list[tuple[int, "CacheKey"]],
                                       num_external_tokens: int) -> None:
        """A hybrid model's `update_state_after_alloc`: `blocks` are (pool block, cache key) of every group's
        blocks to fill (a sliding group's only from its window at the load's end)."""
        raise NotImplementedError(f"{type(self).__name__} does not handle KV-cache groups")

    def request_finished_keyed(self, request: "Request", blocks: list[tuple[int, "CacheKey"]]) -> bool:
        """A hybrid model's `request_finished`: (pool block, cache key) of every group's computed blocks it
        still holds (a sliding group's window)."""
        raise NotImplementedError(f"{type(self).__name__} does not handle KV-cache groups")

    # Load accounting shared by the tiers: a subclass calls `_load_started` from update_state_after_alloc,
    # `_note_abandoned_loads` from build_connector_meta (the Scheduler has just expired overdue loads in the
    # same schedule()) and `_load_finished` for every reported load.
    def _load_started(self, request: "Request") -> None:
        self._load_requests[request.req_id] = request
        self._count_lookups(request)

    def _note_abandoned_loads(self) -> None:
        """Loads the Scheduler gave up on: it moves a request out of WAITING_FOR_KV only when its load is
        reported, times out (counted here) or the request is aborted (not a load failure). Also counts the
        lookups of the requests this schedule() admitted."""
        self._count_lookups()
        for req_id, req in list(self._load_requests.items()):
            if req.status is RequestStatus.WAITING_FOR_KV:
                continue
            del self._load_requests[req_id]
            self._abandoned_loads.add(req_id)
            if not req.status.is_finished:
                self.stats.loads_failed += 1
                self.stats.load_failures_timed_out += 1

    def _load_finished(self, req_id: str, ok: bool, num_blocks: int, cause: str | None, block_bytes: int) -> None:
        self._load_requests.pop(req_id, None)
        if req_id in self._abandoned_loads:
            self._abandoned_loads.discard(req_id)
            return
        if ok:
            self.stats.loads_ok += 1
            self.stats.loaded_blocks += num_blocks
            self.stats.loaded_bytes += num_blocks * block_bytes
            return
        self.stats.loads_failed += 1
        cause = cause if cause in LOAD_FAILURE_CAUSES else "error"
        name = f"load_failures_{cause}"
        setattr(self.stats, name, getattr(self.stats, name) + 1)

    @abstractmethod
    def get_num_new_matched_tokens(self, request: "Request", num_local_tokens: int) -> tuple[int | None, bool]:
        """Tokens the tier holds right after the first `num_local_tokens` (block aligned, never the last
        prompt token's block), and whether loading them is asynchronous. None: ask again next step."""
        raise NotImplementedError

    @abstractmethod
    def update_state_after_alloc(self, request: "Request", block_ids: list[int], num_external_tokens: int) -> None:
        """`block_ids` (pool blocks, in order) are to receive the request's next `num_external_tokens`."""
        raise NotImplementedError

    @abstractmethod
    def build_connector_meta(self, scheduler_output: "SchedulerOutput", changes: PoolChanges) -> KVConnectorMetadata:
        """This step's copies; called once per schedule()."""
        raise NotImplementedError

    @abstractmethod
    def update_connector_output(self, output: KVConnectorOutput) -> KVConnectorUpdate:
        """Account for transfers the runner reports as finished."""
        raise NotImplementedError

    def request_finished(self, request: "Request", block_ids: list[int]) -> bool:
        """The request ended (or was preempted); True if its blocks must stay held until its saves finish."""
        return False

    def has_pending_work(self) -> bool:
        """Copies planned or in flight: the engine keeps stepping until there are none."""
        return False

    #: whether blocks held after `request_finished` need steps until they are freed (a save in flight does: the
    #: runner reports its end); False: nothing to do until `has_pending_work` says one is done (P/D's holds for a
    #: reader), so an engine with only such holds is idle, woken by the reader or by `next_wakeup_s`
    held_blocks_need_steps: bool = True

    def next_wakeup_s(self) -> float | None:
        """Seconds until an idle engine must step for this connector's sake (a hold's timeout), None: never."""
        return None

    def take_events(self) -> list[KVEvent]:
        return []

    def block_hashes(self) -> list[BlockHash]:
        """Every hash the tier can load now (for snapshots and accounting checks)."""
        return []

    def close(self) -> None:
        """Release what the connector holds outside this process's memory (files, shared segments)."""


class KVConnectorWorker(Protocol):
    """Runner side: copies whole blocks; owns the tier's bytes (or its handle to them)."""

    def register_kv_caches(self, kv_caches: list, block_dim: int) -> None:
        """The paged KV tensors, one per layer; `block_dim` is the block axis of each."""

    def execute(self, metadata: KVConnectorMetadata) -> KVConnectorOutput:
        """Start (on CPU: do) this step's stores then loads; report every transfer that finished."""
