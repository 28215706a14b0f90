"""Routing core API: the typed values the pure routing core is fed and returns, and the `RouterCore` protocol.

Nothing here (or anywhere in app/routing/ except serve_router.py) imports Ray, so an offline simulator can
drive a core with its own clock. The feed, in the order a caller usually produces it:

    membership   core.set_replicas([ReplicaInfo, ...])
    load         core.on_stats(replica_id, ReplicaLoadView)             (each stats poll)
    cache state  core.on_kv_events(KVEventBatch) -> bool                (False: fetch a snapshot)
                 core.replicas_needing_snapshot() / core.on_snapshot(KVSnapshot)
    a request    core.route(RouteRequest, candidate_ids) -> Decision    (never raises)
    lifecycle    core.on_routed / on_first_token / on_actual_cached / on_finished
    inspection   core.recent_decisions(n), core.counters()
    scale-out    core.hot_prefixes(n) -> token ids to warm a joining replica (prefix_affinity only; optional)

Block hashes are the engine's own (`engine.hashing.hash_block_chain` over the prompt's token ids with the
request's cache salt, full blocks only), computed once at the ingress and passed in `RouteRequest`.
"""
from __future__ import annotations

import enum
import heapq
import math
import time
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from affinity_serve.engine.types import KVEvent

BlockHash = bytes


# ---------------------------------------------------------------- inputs
@dataclass(slots=True, frozen=True)
class ReplicaInfo:
    """One member of the replica set. `node_id` (None if unknown) drives the same-node tie-break."""

    replica_id: str
    node_id: str | None = None


@dataclass(slots=True, frozen=True)
class ReplicaLoadView:
    """The part of a replica's `EngineLoad` the core reads (`from_stats`; the core's own short names).

    `num_queued_prefill_tokens`: uncached prompt tokens admitted but not yet computed (waiting + chunked).
    `num_blocks` (KV pool size in blocks) is optional: with it, new-group placement weighs how much of the
    pool the index sees filled, and the index is sized from the fleet's pools; without it, `kv_cache_usage`
    alone. `age_s`: how long before delivery the snapshot was taken (from the replica's `taken_at` wall
    time): requests routed since then are not in it.
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_queued_prefill_tokens: int = 0
    cache_epoch: str = ""
    num_blocks: int | None = None
    age_s: float = 0.0
    step_time_s: float | None = None          # mean recent step that decoded (s), if the replica reports it
    kv_wait_s: float = 0.0                    # the engine's expected wait for KV blocks for a new request (s)

    @classmethod
    def from_stats(cls, stats: Any, now_wall: float | None = None) -> ReplicaLoadView:
        """From the routing stats Serve carries (app.stats.routing_stats: EngineLoad's field names) or an
        EngineLoad itself; `taken_at` (wall clock, seconds), when present, gives `age_s` against `now_wall`
        (default: time.time())."""
        get = stats.get if isinstance(stats, Mapping) else (lambda k, d=None: getattr(stats, k, d))
        taken_at = float(get("taken_at", 0.0) or 0.0)
        age = 0.0
        if taken_at > 0.0:
            age = min(60.0, max(0.0, (time.time() if now_wall is None else now_wall) - taken_at))
        return cls(num_running=int(get("num_running_reqs", 0) or 0),
                   num_waiting=int(get("num_waiting_reqs", 0) or 0),
                   kv_cache_usage=float(get("kv_cache_usage", 0.0) or 0.0),
                   num_queued_prefill_tokens=int(get("num_queued_prefill_tokens", 0) or 0),
                   cache_epoch=str(get("cache_epoch", "") or ""), num_blocks=get("num_blocks", None),
                   age_s=age, step_time_s=_positive_or_none(get("step_time_s", None)),
                   kv_wait_s=_positive_or_none(get("kv_wait_s", None)) or 0.0)


def _positive_or_none(value: Any) -> float | None:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if v > 0 and math.isfinite(v) else None


@dataclass(slots=True)
class KVEventBatch:
    """Consecutive KV events of one replica: event i has sequence number `first_seq + i`.

    Sequence numbers are per replica and per `epoch`; the epoch changes when the replica restarts or its
    prefix cache is reset, and numbering may start again from 0.
    """

    replica_id: str
    epoch: str
    first_seq: int
    events: list[KVEvent]


@dataclass(slots=True)
class KVSnapshot:
    """A replica's whole cached-block set at one point: `next_seq` is the seq of the first event after it.

    `tier_block_hashes` (engine KVCacheSnapshot's): what its KV connector's tier can load, by medium
    ("offload": the replica's own tier; "shared": its node's whole store); a medium absent is unknown.
    """

    replica_id: str
    epoch: str
    next_seq: int
    block_hashes: list[BlockHash]
    tier_block_hashes: dict[str, list[BlockHash]] = field(default_factory=dict)


@dataclass(slots=True)
class RouteRequest:
    """A request to place. `block_hashes`: the engine's chained hashes of the prompt's full blocks."""

    req_id: str
    block_hashes: list[BlockHash]
    num_prompt_tokens: int
    max_tokens: int = 0
    caller_node_id: str | None = None


# ---------------------------------------------------------------- outputs
class Reason(enum.Enum):
    AFFINITY = "affinity"          # kept on the replica predicted to hold most of the prompt
    RELEASED = "released"          # the affinity replica was too slow: best predicted TTFT instead
    NEW_GROUP = "new_group"        # no replica holds any of the prompt: placed by cache room and load
    SPILL = "spill"                # the replicas holding the prefix are not candidates (full, excluded)
    HOT_REPLICA = "hot_replica"    # a hot prefix group spread over k replicas, placed among them by load
    LOAD = "load"                  # a load-only policy (round_robin, power_of_two)
    FALLBACK = "fallback"          # internal error: load-only ranking


@dataclass(slots=True)
class CandidateScore:
    """What the policy predicted for one candidate (the decision record's evidence).

    `predicted_cached_tokens` counts every token the engine would not recompute (what it reports as
    cached): `predicted_tier_cached_tokens` of them are loaded from a KV tier (offload or the node's
    shared store), the rest (`predicted_pool_cached_tokens`) are hits in its paged pool.
    """

    replica_id: str
    predicted_cached_tokens: int
    predicted_ttft_s: float
    queued_prefill_tokens: int     # stats + this router's in-flight uncached tokens, before this request
    decode_load: int               # running requests (stats + this router's in-flight)
    kv_usage: float
    predicted_tier_cached_tokens: int = 0

    @property
    def predicted_pool_cached_tokens(self) -> int:
        return self.predicted_cached_tokens - self.predicted_tier_cached_tokens


#: recent candidate-id tuples, each kept once and shared by the decisions over that candidate set (several
#: routers in a process, such as P/D's decode and prefill routers, alternate sets); a race between threads only
#: loses the sharing (dict reads and writes are atomic)
_recent_ids: dict[tuple[str, ...], tuple[str, ...]] = {}
_MAX_RECENT_IDS = 16


def _column(values: Sequence[int]) -> array:
    """An integer column as a signed 64-bit array (a float in it, which no caller passes today, keeps the
    column as doubles rather than failing a decision)."""
    try:
        return array("q", values)
    except TypeError:
        return array("d", values)


class RankedIds(Sequence):
    """Replica ids best first, as positions into a candidate tuple (a read-only sequence of str; equal to a
    list or tuple of the same ids). What a decision keeps instead of a list of 128 strings, for the same
    reason as `CandidateScores`' columns."""

    __slots__ = ("_ids", "_order")

    def __init__(self, ids: Sequence[str], order: Sequence[int]) -> None:
        self._ids = ids
        self._order = array("I", order)

    def __len__(self) -> int:
        return len(self._order)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._ids[k] for k in self._order[i]]
        return self._ids[self._order[i]]

    def __iter__(self):
        ids = self._ids
        return (ids[k] for k in self._order)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (RankedIds, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None   # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(list(self))


@dataclass(slots=True)
class CandidateScores:
    """Every candidate's scores as columns (index i = `replica_ids[i]`, in the order route() got them).

    Columns rather than one object per candidate: a decision at 128 replicas would otherwise carry 128
    objects, and the recent-decisions ring keeping hundreds of decisions would make every full garbage
    collection walk tens of thousands of them. `Decision.candidates` builds the per-candidate view.
    The numeric columns are stored as `array.array` and `replica_ids` as a tuple shared by the recent decisions
    over the same candidates: the collector walks a young list element by element, and at 128 replicas the
    decisions kept since the last young collection held ~150k list slots, a 2-3 ms pause inside a decision
    (arrays hold no object references, so the collector never walks them). Columns read as sequences.
    """

    replica_ids: Sequence[str]
    predicted_cached_tokens: Sequence[int]
    predicted_ttft_s: Sequence[float]
    queued_prefill_tokens: Sequence[int]
    decode_load: Sequence[int]
    kv_usage: Sequence[float]
    #: of predicted_cached_tokens, those loaded from a KV tier (empty: none anywhere)
    predicted_tier_cached_tokens: Sequence[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        ids = tuple(self.replica_ids)
        shared = _recent_ids.get(ids)
        if shared is None:
            if len(_recent_ids) >= _MAX_RECENT_IDS:
                _recent_ids.clear()
            _recent_ids[ids] = shared = ids
        self.replica_ids = shared
        self.predicted_cached_tokens = _column(self.predicted_cached_tokens)
        self.predicted_ttft_s = array("d", self.predicted_ttft_s)
        self.queued_prefill_tokens = _column(self.queued_prefill_tokens)
        self.decode_load = _column(self.decode_load)
        self.kv_usage = array("d", self.kv_usage)
        self.predicted_tier_cached_tokens = _column(self.predicted_tier_cached_tokens)

    @classmethod
    def empty(cls) -> CandidateScores:
        return cls([], [], [], [], [], [])

    def tier_cached(self, i: int) -> int:
        return self.predicted_tier_cached_tokens[i] if self.predicted_tier_cached_tokens else 0

    def __len__(self) -> int:
        return len(self.replica_ids)

    def __getitem__(self, i: int) -> CandidateScore:
        return CandidateScore(self.replica_ids[i], self.predicted_cached_tokens[i], self.predicted_ttft_s[i],
                              self.queued_prefill_tokens[i], self.decode_load[i], self.kv_usage[i],
                              self.tier_cached(i))


@dataclass(slots=True)
class Decision:
    """One routing decision: candidates ranked best first, the choice, why, and the scores behind it."""

    req_id: str
    ranked: Sequence[str]             # a list, or a RankedIds
    chosen: str
    reason: Reason
    scores: CandidateScores
    decision_time_s: float
    affinity_replica_id: str | None = None   # the replica holding most of the prompt, if any
    num_hot_replicas: int = 1                # k for a hot prefix group (1 otherwise)

    @property
    def candidates(self) -> list[CandidateScore]:
        """One CandidateScore per candidate (built on each access)."""
        return [self.scores[i] for i in range(len(self.scores))]

    def most_cached(self, k: int = 2) -> list[tuple[str, int]]:
        """The `k` candidates predicted to hold most of the prompt, as (replica id, cached tokens), best
        first, none that holds nothing. With two, a replica can tell what *another* replica holds: a request
        that recomputes a prefix held elsewhere refills it (a one-off cost of moving it, which the autoscaler
        does not count as lasting load); one that recomputes what the index thought it held itself lost it
        (an eviction, which is load)."""
        sc = self.scores
        best = heapq.nlargest(k, zip(sc.predicted_cached_tokens, range(len(sc))), key=lambda t: t[0])
        return [(sc.replica_ids[i], n) for n, i in best if n > 0]

    def score_of(self, replica_id: str) -> CandidateScore | None:
        try:
            return self.scores[self.scores.replica_ids.index(replica_id)]
        except ValueError:
            return None


@dataclass(slots=True)
class RouterCounters:
    """Cumulative counters since the core was built (a copy; safe to keep)."""

    num_decisions: int = 0
    num_by_reason: dict[Reason, int] = field(default_factory=dict)
    num_errors: int = 0                      # route() calls that fell back after an internal error
    num_rerouted: int = 0                    # on_routed() with a replica other than the decision's
    predicted_cached_tokens: int = 0         # over requests that also reported actual cached tokens
    actual_cached_tokens: int = 0
    num_accuracy_samples: int = 0
    num_resyncs: int = 0                     # replicas dropped for a gap, epoch change or clear
    num_index_entries: int = 0               # block hashes indexed now (<= max_index_entries)
    num_index_evictions: int = 0             # entries dropped by the memory bound
    prefill_tokens_per_s: float = 0.0        # the calibrated prefill rate now
    decode_step_s: float = 0.0               # the calibrated per-running-request cost now
    tier_load_tokens_per_s: float = 0.0      # the calibrated KV-tier load rate now
    num_tier_entries: int = 0                # tier block hashes indexed now (<= max_tier_index_entries)

    @property
    def index_accuracy(self) -> float:
        """actual / predicted cached tokens (1.0 exact, > 1 under-predicted); 1.0 before any sample."""
        if not self.predicted_cached_tokens:
            return 1.0 if not self.actual_cached_tokens else float("inf")
        return self.actual_cached_tokens / self.predicted_cached_tokens


# ---------------------------------------------------------------- the core
class RouterCore(Protocol):
    """What every routing policy implements (prefix_affinity, power_of_two, round_robin).

    Not thread-safe: one caller (a router loop or a simulator) drives it. Methods about unknown replicas or
    requests are no-ops, never errors.
    """

    def set_replicas(self, replicas: list[ReplicaInfo]) -> None:
        """The replica set now. Replicas no longer present lose their index entries, stats and in-flight."""

    def on_stats(self, replica_id: str, load: ReplicaLoadView) -> None:
        """A fresh stats snapshot. In-flight requests routed before it are assumed counted in it."""

    def on_kv_events(self, batch: KVEventBatch) -> bool:
        """Apply a batch. False: a gap, an unknown or changed epoch, or AllBlocksCleared — the replica's
        entries were dropped and the caller must fetch a snapshot (see replicas_needing_snapshot)."""

    def replicas_needing_snapshot(self) -> list[str]:
        """Replicas whose index entries are not trustworthy until on_snapshot() (new, gapped, reset)."""

    def on_snapshot(self, snapshot: KVSnapshot) -> None:
        """Rebuild the replica's entries; events from `snapshot.next_seq` on apply after it."""

    def forget_kv_state(self) -> None:
        """Drop every replica's KV entries; each then needs a snapshot (the feed paused: see KVEventFeed)."""

    def route(self, request: RouteRequest, candidate_ids: list[str]) -> Decision:
        """Rank `candidate_ids` (non-empty) for the request. Never raises: on an internal error returns a
        load-only FALLBACK decision and logs. Records the decision (in-flight load, speculative index
        entries on the chosen replica) as if the request was sent to `chosen`."""

    def on_routed(self, req_id: str, replica_id: str) -> None:
        """The request actually went to `replica_id` (call only if it differs from the decision)."""

    def on_first_token(self, req_id: str, num_cached_tokens: int | None = None,
                       kv_wait_s: float | None = None) -> None:
        """The request's first token arrived: its prefill left the replica's queue. `num_cached_tokens`
        (what the engine found cached) feeds index-accuracy counters, as on_actual_cached; `kv_wait_s` (the
        engine's measure of how long it waited for KV blocks) is not prefill time, and the TTFT model's fit
        leaves it out."""

    def on_actual_cached(self, req_id: str, num_cached_tokens: int) -> None:
        """The engine's cached-token count for the request (predicted vs actual counters)."""

    def on_finished(self, req_id: str, num_output_tokens: int | None = None) -> None:
        """The request ended (success, error or cancel): it stops counting as load anywhere.
        `num_output_tokens` (if known) feeds the observed output lengths that a group's demand uses."""

    def recent_decisions(self, n: int) -> list[Decision]:
        """The last `n` decisions, newest last."""

    def counters(self) -> RouterCounters:
        """A copy of the cumulative counters."""
