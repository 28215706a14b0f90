"""ReplicaStats: what a replica reports for routing and observability (typed, small, JSON-able)."""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

from affinity_serve.observability.metrics import ReplicaLoadSample

if TYPE_CHECKING:
    from affinity_serve.engine import EngineLoad


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    """One replica's load and prefix-cache state.

    Serve's controller polls `record_routing_stats()` and rebroadcasts every replica's stats to every
    router whenever one changes, so this stays a handful of numbers (KV usage rounded to 4 digits).
    Serve carries it as a dict (`to_dict`); routers rebuild it with `from_dict`, which also accepts the
    `{}` Serve reports before the first poll.
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_queued_prefill_tokens: int = 0
    prefix_cache_queries: int = 0           # prompt tokens looked up since the engine started
    prefix_cache_hits: int = 0
    recent_prefix_cache_queries: int = 0    # over the engine's sliding window of recent admissions
    recent_prefix_cache_hits: int = 0
    cache_epoch: str = ""                   # "<boot id>:<reset count>": changes when the cache was emptied
    #                                         (the epoch of the replica's KV events too)
    num_blocks: int = 0                     # KV pool size in blocks (fixed; lets routers weigh cache room)
    taken_at: float = 0.0                   # wall clock (time.time()) when the engine's load was read: a
    #                                         router counts requests it sent after this on top

    @classmethod
    def from_load(cls, load: EngineLoad) -> ReplicaStats:
        return cls(num_running=load.num_running_reqs, num_waiting=load.num_waiting_reqs,
                   kv_cache_usage=round(load.kv_cache_usage, 4),
                   num_queued_prefill_tokens=load.num_queued_prefill_tokens,
                   prefix_cache_queries=load.prefix_cache_queries_total,
                   prefix_cache_hits=load.prefix_cache_hits_total,
                   recent_prefix_cache_queries=load.recent_prefix_cache_queries,
                   recent_prefix_cache_hits=load.recent_prefix_cache_hits,
                   cache_epoch=load.cache_epoch, num_blocks=load.num_blocks,
                   taken_at=round(time.time() - max(0.0, time.monotonic() - load.timestamp), 4))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ReplicaStats:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def prefix_hit_rate(self) -> float:
        """Lifetime hit rate (0-1)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def recent_prefix_hit_rate(self) -> float:
        """Hit rate over the recent window (0-1): what routers and operators should look at."""
        q = self.recent_prefix_cache_queries
        return self.recent_prefix_cache_hits / q if q else 0.0


def load_sample(load: EngineLoad) -> ReplicaLoadSample:
    """A replica's gauges and load counters (observability.metrics.ReplicaMetrics) from the engine's load."""
    st = ReplicaStats.from_load(load)
    return ReplicaLoadSample(num_running=load.num_running_reqs, num_waiting=load.num_waiting_reqs,
                             kv_cache_usage=load.kv_cache_usage, prefix_hit_rate=st.prefix_hit_rate,
                             recent_prefix_hit_rate=st.recent_prefix_hit_rate,
                             prefix_cache_queries_total=load.prefix_cache_queries_total,
                             prefix_cache_hits_total=load.prefix_cache_hits_total,
                             num_preemptions_total=load.num_preemptions_total)
