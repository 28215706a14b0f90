"""Typed hand-offs between engine parts: caller -> engine, scheduler -> runner -> scheduler -> caller.

Small slotted dataclasses built every step; plain lists, never tensors.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from affinity_serve.engine.hashing import BlockHash
from affinity_serve.engine.limits import EngineLimits
from affinity_serve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from affinity_serve.engine.structured_output.grammar import GrammarBitmask


# ---------------------------------------------------------------- caller -> engine
@dataclass(slots=True)
class EngineRequest:
    """One request as the engine takes it (`LLMEngine.add_request`, `AsyncLLMEngine.generate`).

    Built once by its caller (the ingress for a served request, `make_request` for text prompts) and read,
    not re-shaped, down to the scheduler's `Request`. The engine keeps `prompt_token_ids` by reference:
    the caller must not change the list once it handed the request over.
    """

    req_id: str                                  # the engine's key, unique among requests in flight
    prompt_token_ids: list[int]
    sampling_params: SamplingParams              # params.n sequences; structured_output: their grammar
    priority: int = 0                            # lower runs first under the priority policy
    cache_salt: str | None = None                # isolates this tenant's prefix-cache blocks
    #: the caller's W3C trace context; the engine's span continues that trace
    trace_context: dict[str, str] | None = None
    #: time.monotonic() in the engine's process when the request arrived; None: when it is added
    arrival_time: float | None = None
    #: the prompt's full-block hashes (`hash_block_chain`, the engine's block size and `cache_salt`), computed
    #: once by the caller for routing; used instead of hashing the prompt again when they check out
    block_hashes: list[BlockHash] | None = None
    #: P/D disaggregation (kv_connector.type pd): `RemoteDecode()` (prefill here, hold the KV for a decode
    #: engine) or one `RemotePrefill` per sequence (continue those prefills here)
    kv_transfer: RemoteDecode | list[RemotePrefill] | None = None
    #: the limits the caller already checked this request against (`EngineLimits.check`; the ingress, with
    #: the limits a replica published): an engine whose own limits are these does not check them again
    checked_limits: EngineLimits | None = None
    #: work the caller does for the engine's own sake (a cache warm-up): runs like any other request and is
    #: counted apart in `AsyncLLMEngine.load()` (num_background_*)
    background: bool = False


# ---------------------------------------------------------------- what a request carries for P/D
@dataclass(slots=True, frozen=True)
class RemoteDecode:
    """Marks a request for a prefill engine: prefill, sample the first token, hold the KV for a decode engine.
    (vLLM: kv_transfer_params with do_remote_decode.) Give the request max_tokens=1."""


@dataclass(slots=True, frozen=True)
class RemotePrefill:
    """One sequence's prefilled KV, held by a prefill engine: what a decode engine needs to read it.
    (vLLM: kv_transfer_params with do_remote_prefill, remote_engine_id, remote_block_ids, remote_host.)"""

    engine_id: str           # the prefill engine holding the blocks
    transfer_id: str         # the sequence's id there
    layout_key: str          # KVLayout.namespace(model identity): a reader with another one cannot use them
    num_tokens: int          # prompt tokens whose KV was computed
    num_blocks: int          # full blocks held (num_tokens // block_size): the prompt's last partial one is not
    first_token_id: int      # the token the prefill sampled: the decode engine continues after it
    #: transport-specific address of the prefill engine (the Ray transport: its replica's actor handle)
    address: Any = None
    #: which of its request's n sequences this is (set by the prefill engine): a seeded sequence continues
    #: drawing from seed + seq_index, as it would on one engine, wherever it stands in the decode request
    seq_index: int = 0
    #: the prompt tokens the prefill engine found in its own prefix cache: of the KV read, only these count as
    #: cached on the decode side (the rest was computed for this request)
    num_cached_tokens: int = 0


# ---------------------------------------------------------------- scheduler -> runner
@dataclass(slots=True)
class NewRequestData:
    """A request the runner has no state for: first scheduled, or resumed after preemption."""

    req_id: str
    token_ids: list[int]            # prompt + output so far (a copy)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]            # the whole block table
    num_computed_tokens: int        # KV already present (prefix-cache hit) before this step


@dataclass(slots=True)
class CachedRequestData:
    """Requests the runner already holds, as parallel lists (one entry per request)."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)   # blocks appended this step (maybe [])
    num_computed_tokens: list[int] = field(default_factory=list)   # before this step


@dataclass(slots=True)
class KVTransfer:
    """Whole-block copies between pool blocks and a tier, one entry per block (parallel lists).

    `tier_slots` address the offload tier's host buffer; a keyed tier (the shared store) uses
    `block_hashes` instead and leaves `tier_slots` empty.
    """

    req_id: str | None                 # the loading request (None for stores)
    block_ids: list[int]               # paged-pool blocks
    block_hashes: list[BlockHash]
    tier_slots: list[int] = field(default_factory=list)


@dataclass(slots=True)
class KVConnectorMetadata:
    """One step's copies. The runner does every store, then every load, then the forward pass: a pool
    block evicted in this step's schedule() is saved before anything overwrites it."""

    stores: list[KVTransfer] = field(default_factory=list)     # pool -> tier
    loads: list[KVTransfer] = field(default_factory=list)      # tier -> pool (one per request)

    @property
    def is_empty(self) -> bool:
        return not self.stores and not self.loads


@dataclass(slots=True)
class SchedulerOutput:
    """The plan for one step: which requests compute how many tokens, and where their KV lives."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    #: requests finished or aborted since the previous schedule(): the runner drops their state.
    finished_req_ids: set[str]
    #: requests preempted during this schedule(): the runner drops their state too.
    preempted_req_ids: set[str]
    #: the KV connector's copies for this step (None without a connector)
    kv_connector_metadata: KVConnectorMetadata | None = None
    #: requests wait that the next schedule() may admit (a running slot and a KV block are free): the next
    #: step will likely differ from this one (the runner launches no decode step ahead then)
    admits_waiting: bool = False
    #: the allowed tokens of this step's constrained rows that sample (set by the engine after schedule())
    grammar_bitmask: GrammarBitmask | None = None
    #: models with sliding-window KV-cache groups: each scheduled request's every group table, whole (dropped
    #: entries are the null block 0); the runner reads these instead of block_ids / new_block_ids
    kv_group_block_ids: dict[str, list[list[int]]] | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


# ---------------------------------------------------------------- runner -> scheduler
@dataclass(slots=True)
class Logprobs:
    """Log-probabilities for one sampled position: the chosen token plus the top-k alternatives."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class KVConnectorOutput:
    """Transfers that completed in the runner: loads by request id, stores by their position."""

    finished_loads: dict[str, bool] = field(default_factory=dict)       # req_id -> ok
    #: stores that completed, as (block hashes, ok) per KVTransfer in the order they were issued
    finished_stores: list[tuple[list[BlockHash], bool]] = field(default_factory=list)
    #: hashes the tier dropped while making room (a keyed tier whose eviction happens in the runner)
    tier_evicted: list[BlockHash] = field(default_factory=list)
    #: hashes the stores actually wrote, for a tier that skips blocks it already holds (the shared store);
    #: None: every block of an ok store was written
    tier_written: list[BlockHash] | None = None
    #: why a load in `finished_loads` failed, by req_id: "missing" (a block was gone), "damaged" (a block
    #: failed verification); a failed load without an entry failed with an error
    load_failure_causes: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class ModelRunnerOutput:
    """Sampled tokens for the requests that reached the end of their known tokens this step."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]               # parallel to req_ids; [] for partial prefill chunks
    logprobs: dict[str, list[Logprobs]] | None = None
    #: whole-prompt logprobs of requests that asked for them, in the step that completed their prompt
    #: (the step that samples their first token): entry p for prompt position p, entry 0 None.
    prompt_logprobs: dict[str, list[Logprobs | None]] | None = None
    #: the KV connector's transfers that finished (None without a connector)
    kv_connector_output: KVConnectorOutput | None = None


# ---------------------------------------------------------------- scheduler -> front end
@dataclass(slots=True)
class RequestDelta:
    """What one step produced for one sequence: the one output type from the scheduler to the caller.

    The scheduler builds it keyed by the sequence's own id (`req_id`, `index` 0, no text); `LLMEngine` fills
    the same object in for its caller: `req_id` becomes the request's, `index` the sequence's (< n), `text`
    the new detokenized text, and a stop string or grammar may end it. The app's `ReplicaChunk` is this plus
    replica metadata. `prompt_logprobs` (with `SamplingParams.prompt_logprobs`) is set once per request: on
    index 0's delta that carries its first output token, one entry per prompt token, the first None.
    """

    req_id: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None           # "stop" | "length" | "abort" | "error"; None while it runs
    stop_reason: int | str | None = None       # the stop token id or stop string that ended it
    logprobs: list[Logprobs] | None = None
    prompt_logprobs: list[Logprobs | None] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None  # time.monotonic() of first admission
    #: P/D: a prefill sequence's RemotePrefill (engine.kv_connector.pd), on its finishing delta
    kv_transfer: Any = None
    #: seconds the sequence waited in the queue for KV blocks before it ran (Request.kv_wait_s), on its deltas
    #: once it ran: a router leaves it out of the TTFT it learns prefill rates from
    kv_wait_s: float = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class SchedulerStats:
    """Replica load signals; counters (`*_total`) are cumulative since the engine started."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_queued_prefill_tokens: int = 0        # uncached prompt tokens not yet computed (waiting + chunked)
    num_scheduled_tokens: int = 0             # this step
    prefix_cache_queries_total: int = 0       # prompt tokens looked up at admission
    prefix_cache_hits_total: int = 0          # of which found in the cache
    #: the same two over the last N admissions (cache.prefix_cache_recent_requests); 0 after a cache reset
    recent_prefix_cache_queries: int = 0
    recent_prefix_cache_hits: int = 0
    num_preemptions_total: int = 0
    #: the wait for KV blocks a request joining the queue now can expect: while the queue is blocked for want
    #: of blocks, the larger of the recent admissions' waits (a decayed mean) and the current blocked stretch;
    #: 0 while it is not blocked
    kv_wait_s: float = 0.0
    step_time_s: float = 0.0
    #: this step's work, the regressors of its cost (engine/pacing.py's model; an autoscaler learns a
    #: replica's capacity from them): prompt tokens computed, sequences decoding one token, their context
    num_prefill_tokens: int = 0
    num_decode_seqs: int = 0
    num_decode_context_tokens: int = 0


@dataclass(frozen=True, slots=True)
class StepCost:
    """One engine step that ran the model: how long it took and the work it did (SchedulerStats' fields)."""

    step: int                                 # the engine's step number (LLMEngine.num_steps), from 1
    time: float                               # time.monotonic() when it ended
    step_time_s: float
    num_prefill_tokens: int
    num_decode_seqs: int
    num_decode_context_tokens: int


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """An engine's load, taken between steps (`LLMEngine.load`; `AsyncLLMEngine.load` hands out the latest).

    The one load record: a replica reports it (app.stats.routing_stats: its fields Serve carries, by their
    names), the router reads that (app.routing.ReplicaLoadView.from_stats) and the autoscaler's signals start from it.
    """

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    num_queued_prefill_tokens: int
    num_free_blocks: int
    num_blocks: int
    num_requests: int                     # sequences the scheduler holds (running, waiting, preempted)
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    recent_prefix_cache_queries: int      # over the scheduler's sliding window of recent admissions
    recent_prefix_cache_hits: int
    num_preemptions_total: int            # since the engine started
    cache_epoch: str                      # "<boot id>:<resets>": changes on restart and on every cache reset
    timestamp: float                      # time.monotonic() when the snapshot was taken
    #: of the totals above, the requests generated with `background=True` (a cache warm-up): a caller that
    #: sizes the fleet on this load can leave them out
    num_background_running: int = 0
    #: SchedulerStats.kv_wait_s: the wait for KV blocks a request joining the queue can expect (0: none)
    kv_wait_s: float = 0.0
    num_background_waiting: int = 0
    num_background_queued_prefill_tokens: int = 0
    #: the last RECENT_STEPS steps that ran the model, oldest first (numbered: a reader keeps the last number
    #: it consumed), and how many steps the loop has run: what a replica's capacity model learns from
    recent_steps: tuple[StepCost, ...] = ()
    num_steps_total: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        """Lifetime prefix-cache hit rate (0-1)."""
        q = self.prefix_cache_queries_total
        return self.prefix_cache_hits_total / q if q else 0.0

    @property
    def recent_prefix_hit_rate(self) -> float:
        """Hit rate over the recent admissions (0-1): what routers and operators should look at."""
        q = self.recent_prefix_cache_queries
        return self.recent_prefix_cache_hits / q if q else 0.0


@dataclass(slots=True)
class StepOutput:
    """One engine step's result: per-request deltas, requests finished since the last step, stats."""

    outputs: list[RequestDelta]
    finished_req_ids: set[str]
    stats: SchedulerStats
    timestamp: float = field(default_factory=time.monotonic)


# ---------------------------------------------------------------- KV events
#: where a block lives: the replica's paged pool (free to hit), its offload tier, or the node-shared store
#: (both a load away). Events without a medium are about the pool.
MEDIUM_POOL = "pool"
MEDIUM_OFFLOAD = "offload"
MEDIUM_SHARED = "shared"


@dataclass(slots=True, frozen=True)
class BlockStored:
    """Hashes entered `medium`. For the pool: one chain, with its parent hash and token ids; a tier's
    events carry only the hashes (parent None, token_ids [])."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    medium: str = MEDIUM_POOL


@dataclass(slots=True, frozen=True)
class BlockRemoved:
    block_hashes: list[BlockHash]
    medium: str = MEDIUM_POOL


@dataclass(slots=True, frozen=True)
class AllBlocksCleared:
    """Every cached block hash was dropped (prefix cache reset)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True, frozen=True)
class KVEventsReply:
    """An engine's KV events from `first_seq` on (`AsyncLLMEngine.kv_events_since`).

    Event `events[i]` has sequence number `first_seq + i`; `next_seq` is the one to ask for next. Numbers
    are consecutive for the engine's life and `epoch` names the cache they describe: it changes when the
    engine restarts or its prefix cache is reset. With `snapshot_required` (the asked number fell out of
    the buffer or lies ahead of `next_seq`, or the asker's epoch is not `epoch`) `events` is empty: take a
    `kv_snapshot()` and follow on from its `next_seq`.
    """

    epoch: str
    first_seq: int
    events: list[KVEvent]
    next_seq: int
    snapshot_required: bool


@dataclass(slots=True, frozen=True)
class KVCacheSnapshot:
    """Every block hash an engine's prefix cache holds, taken between steps (`AsyncLLMEngine.kv_snapshot`).

    Applying the events numbered `next_seq` onwards (same `epoch`) to `block_hashes` keeps it exact.
    """

    epoch: str
    next_seq: int
    block_hashes: list[BlockHash]
    #: with a KV connector: what its tier can load, by medium ("offload" or "shared"); events of that
    #: medium numbered `next_seq` onwards keep it current
    tier_block_hashes: dict[str, list[BlockHash]] = field(default_factory=dict)
