"""LLMReplica: one AsyncLLMEngine per Serve replica; streaming generate, published limits, stats for
routing/autoscaling, the KV event feed routers pull, health (dead or wedged step loop). Serve options are
set by builder.py, not here.

Reads the engine only through its thread-safe surface: `limits`, `load()`, `health()`, `kv_events_since()`,
`kv_snapshot()`, `kv_connector_stats()`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from affinity_serve.app.config import AutoscalingSection, ObservabilitySection, ServeSection
from affinity_serve.app.errors import APIError, drop_serve_duplicate_logs, log_failure, to_api_error
from affinity_serve.app.metrics_hub import MetricsExporter, serve_app_and_replica
from affinity_serve.app.protocol import GenerateRequest, ReplicaChunk
from affinity_serve.app.routing.serve_compat import drop_kv_feed_access_logs
from affinity_serve.app.stats import load_sample, routing_stats
from affinity_serve.autoscale.signals import SignalRecorder, refilled_tokens
from affinity_serve.engine import (AsyncLLMEngine, EngineConfig, EngineLimits, EngineLoad, SamplingParams,
                                  tune_gc_for_serving)
from affinity_serve.engine.errors import EngineDeadError, InvalidRequestError
from affinity_serve.engine.types import EngineRequest, KVCacheSnapshot, KVEventsReply
from affinity_serve.observability import names
from affinity_serve.observability.metrics import ReplicaLoadSample, ReplicaMetrics

logger = logging.getLogger("affinity.replica")


def _replica_id() -> str:
    try:
        from ray import serve
        return serve.get_replica_context().replica_id.unique_id
    except Exception:   # outside Serve (unit tests)
        return f"local-{uuid.uuid4().hex[:6]}"


def serving_engine_config(engine: EngineConfig) -> EngineConfig:
    """The engine config a serving replica runs: the given one with KV cache events on, which the
    prefix-affinity router needs (they cost a list append per completed block; unread ones are bounded)."""
    return engine.model_copy(update={"cache": engine.cache.model_copy(update={"enable_kv_cache_events": True})})


class LLMReplica:
    """Takes its engine as configuration; can be built synchronously in tests without Serve.

    `engine`, `serve`, `observability`, `autoscaling`: the app config's validated sections (a P/D pool's own
    autoscaling section), as builder.build_app binds them
    (Serve pickles them; nothing is validated again here). A section left out is that section's defaults:
    the replica has no defaults of its own."""

    def __init__(self, engine: EngineConfig, serve: ServeSection | None = None,
                 observability: ObservabilitySection | None = None, *,
                 autoscaling: AutoscalingSection | None = None):
        from affinity_serve.observability.logs import configure_json_logging
        from affinity_serve.observability.setup import setup_telemetry

        if not isinstance(engine, EngineConfig):
            raise TypeError(f"LLMReplica takes an EngineConfig (EngineConfig.model_validate(...)), not "
                            f"{type(engine).__name__}")
        serve = serve or ServeSection()
        obs = observability or ObservabilitySection()
        configure_json_logging(obs.log_level)
        drop_serve_duplicate_logs()
        drop_kv_feed_access_logs()
        config = serving_engine_config(engine)
        self.kv_tier = config.kv_connector.type          # "none", "offload" or "shared"
        self.engine = AsyncLLMEngine.from_config(config)
        # The start-up heap (model, tokenizer, block pool) is built: keep the collector out of the step
        # loop's tail latency. Process-wide, so it belongs to the serving process, not to every engine.
        tune_gc_for_serving()
        telemetry = setup_telemetry(obs.service_name, obs.traces, obs.otlp_endpoint, obs.max_spans_kept)
        self.tracer = telemetry.tracer
        self.replica_id = _replica_id()
        # Gauges read the engine's load at every collection: the exporter's timer pushes them to the app's
        # metrics hub while requests run (app/metrics_hub.py)
        self.metrics = ReplicaMetrics(telemetry.meter, self.replica_id, self._load_sample, self.kv_tier,
                                      self.kv_tier_stats)
        serve_ctx = serve_app_and_replica()
        self.metrics_exporter = MetricsExporter(telemetry.snapshot_reader, serve_ctx and serve_ctx[0],
                                                f"replica:{self.replica_id}", obs.metrics_push_interval_s)
        self.wedge_timeout_s = serve.wedge_timeout_s
        # recent TTFT / TPOT / prefill rate for the autoscaler, over the autoscaling section's window
        self.signals = SignalRecorder(window_s=(autoscaling or AutoscalingSection()).signal_window_s)
        self._last_step_recorded = 0             # the engine's last step the signal recorder was given
        self._max_num_seqs = config.scheduler.max_num_seqs   # the batch cap bounds the learned decode capacity
        limits = self.engine.limits
        logger.info("replica %s ready (max_model_len %d, KV capacity %d tokens)", self.replica_id,
                    limits.max_model_len, limits.max_kv_tokens)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[ReplicaChunk]:
        """Stream chunks; the last chunk of each sequence carries finish_reason and timings.

        `req` is the engine's request as the ingress built it (P/D disaggregation, app/disagg.py: with the
        RemotePrefill of each sequence in `kv_transfer`, continued here)."""
        from affinity_serve.observability.tracing import context_from_carrier, trace_id_hex

        ids = {"request_id": req.request_id or req.req_id, "req_id": req.req_id}
        arrival = time.monotonic()
        first_token: float | None = None
        num_output_tokens: dict[int, int] = {}   # per sequence index, for the autoscaler's TPOT
        num_finished = 0
        ended_as: str | None = "abort"           # how unfinished sequences count if the stream stops early
        # The ingress's W3C trace context arrives in the request; the engine span continues that trace.
        span = self.tracer.start_span(names.SPAN_ENGINE, context=context_from_carrier(req.trace_context),
                                      attributes={"replica": self.replica_id, **ids})
        try:
            async for d in self.engine.generate(req):
                now = time.monotonic()
                self._record_steps()
                if first_token is None and d.token_ids:
                    first_token = now
                    self.signals.on_first_token(now, now - arrival, d.num_prompt_tokens - d.num_cached_tokens,
                                                refilled_tokens(d.num_prompt_tokens, d.num_cached_tokens,
                                                                req.cached_on, self.replica_id),
                                                d.num_prompt_tokens)
                num_output_tokens[d.index] = num_output_tokens.get(d.index, 0) + len(d.token_ids)
                chunk = ReplicaChunk.of(d, self.replica_id)
                if d.finished:
                    if d.finish_reason == "error":     # the engine logged the failed step's traceback
                        raise APIError("generation failed inside the engine", 500, "server_error", None,
                                       "engine_error")
                    sched = d.first_scheduled_time or arrival
                    ft = first_token or now
                    chunk.timings = {"queue_s": max(0.0, sched - arrival), "prefill_s": max(0.0, ft - sched),
                                     "decode_s": max(0.0, now - ft)}
                    num_finished += 1
                    self.metrics.record_sequence(finish_reason=d.finish_reason or "stop", **chunk.timings)
                    self.signals.on_finished(now, chunk.timings["decode_s"], num_output_tokens.get(d.index, 0),
                                             num_prompt_tokens=d.num_prompt_tokens)
                    chunk.trace_id = trace_id_hex(span)
                    logger.info("sequence finished", extra={
                        **ids, "index": d.index, "finish_reason": d.finish_reason,
                        "cached_tokens": d.num_cached_tokens, **{k: round(v, 4) for k, v in chunk.timings.items()}})
                    span.set_attribute("cached_tokens", d.num_cached_tokens)
                yield chunk
        except Exception as e:
            api = to_api_error(e)
            ended_as = "error" if api.status_code >= 500 else None     # a rejected request never ran
            log_failure(logger, e, api, "sequence failed", **ids)
            if isinstance(e, APIError):
                raise
            raise api from e
        finally:
            span.end()
            if ended_as is not None:             # cancelled (the client left) or failed: count what did not end
                for _ in range(max(0, req.sampling_params.n - num_finished)):
                    self.metrics.record_sequence(finish_reason=ended_as)

    async def warm(self, prompts: list[list[int]]) -> dict[str, Any]:
        """Prefill these prompts (one generated token each, discarded) so their full blocks are cached:
        a router warms a replica that joined with its hottest prefixes. Prompts the engine would refuse
        (too long) are skipped; runs concurrently with real requests, which it does not hold up beyond its
        share of the steps."""
        async def one(ids: list[int]) -> int:
            try:
                warm = EngineRequest(f"warmup-{uuid.uuid4().hex}", ids, SamplingParams(max_tokens=1, temperature=0.0),
                                     background=True)
                async for _ in self.engine.generate(warm):
                    pass
                return len(ids)
            except InvalidRequestError:
                return 0
        start = time.monotonic()
        done = await asyncio.gather(*(one(list(p)) for p in prompts))
        return {"num_prompts": sum(1 for n in done if n), "num_tokens": sum(done),
                "elapsed_s": round(time.monotonic() - start, 4)}

    async def limits(self) -> EngineLimits:
        """The engine's request limits (the ingress checks requests against these before routing)."""
        return self.engine.limits

    def stats(self) -> EngineLoad:
        """The engine's latest load (taken after its last step)."""
        return self.engine.load()

    def _load_sample(self) -> ReplicaLoadSample:
        """What the replica's gauges read (observability.metrics.ReplicaMetrics), at each collection."""
        return load_sample(self.engine.load())

    # ------------------------------------------------------------------ KV event feed (pulled by routers)
    async def kv_events_since(self, next_seq: int, epoch: str | None = None) -> KVEventsReply:
        """The engine's KV events numbered `next_seq` on (at most 10,000); see `KVEventsReply`.

        Routers pull this on a timer, off the request path, never through `record_routing_stats` (a change
        there rebroadcasts every replica's stats to every handle).
        """
        return self.engine.kv_events_since(next_seq, epoch)

    async def kv_snapshot(self) -> KVCacheSnapshot:
        """Every cached block hash, with the event number to follow on from (taken between steps)."""
        return await self.engine.kv_snapshot()

    # ------------------------------------------------------------------ Serve hooks
    def record_routing_stats(self) -> dict[str, Any]:
        """The engine's load as the dict Serve carries (`RunningReplica.routing_stats`): app.stats.routing_stats."""
        return routing_stats(self.engine.load())

    def record_autoscaling_stats(self) -> dict[str, float]:
        """The autoscaler's signals (autoscale.signals.METRIC_KEYS), numbers only: the engine's load, the
        preemption rate and the recent TTFT / TPOT p90 and prefill rate of this replica's streams.

        A warm-up's prompts (`warm`) are left out of the queued prefill tokens and the request counts: a
        one-off the router asked for when this replica joined, not load that lasts (counted, a joining
        replica's warm-up backlog alone read as most of a replica and scaled the fleet out again). The
        engine counts them apart (background requests). The routing stats keep them: they do delay this
        replica's requests."""
        load = self._record_steps()
        return self.signals.snapshot(
            time.monotonic(), num_running=load.num_running_reqs - load.num_background_running,
            num_waiting=load.num_waiting_reqs - load.num_background_waiting,
            num_in_flight=self.engine.num_in_flight - self.engine.num_background_in_flight,
            kv_cache_usage=load.kv_cache_usage,
            num_queued_prefill_tokens=load.num_queued_prefill_tokens - load.num_background_queued_prefill_tokens,
            num_preemptions_total=load.num_preemptions_total, max_num_seqs=self._max_num_seqs).to_metrics()

    def _record_steps(self) -> EngineLoad:
        """Give the signal recorder the engine's steps since the last call (their costs train the replica's
        capacity model); the streams call it with each delta and the autoscaler's poll with each read, so
        no more than the engine keeps (RECENT_STEPS) pass between two calls while requests run."""
        load = self.engine.load()
        if load.num_steps_total > self._last_step_recorded:
            for s in load.recent_steps:
                if s.step > self._last_step_recorded:
                    self.signals.on_step(s.time, s.step_time_s, s.num_prefill_tokens, s.num_decode_seqs,
                                         s.num_decode_context_tokens)
            self._last_step_recorded = load.num_steps_total
        return load

    async def check_health(self) -> None:
        """Unhealthy when the engine is dead, or wedged: requests to run and no step for too long (the
        loop steps whenever it holds requests, so only a stuck step or loop gets here)."""
        h = self.engine.health()
        if h.dead_reason is not None:
            raise EngineDeadError(h.dead_reason)
        idle_for = time.monotonic() - h.last_progress_time
        if h.num_unfinished_reqs and idle_for > self.wedge_timeout_s:
            raise EngineDeadError(f"engine wedged: {h.num_unfinished_reqs} unfinished requests and no step for "
                                  f"{idle_for:.0f}s")

    # ------------------------------------------------------------------ introspection
    def kv_tier_stats(self) -> dict[str, int] | None:
        """The KV connector's cumulative counters (lookups, hits, loads, load failures by cause, stores,
        evictions, bytes), exported by `ReplicaMetrics` labelled with `self.kv_tier`; None without
        a connector."""
        conn = self.engine.kv_connector_stats()
        return dataclasses.asdict(conn) if conn is not None else None

    async def debug_state(self) -> dict[str, Any]:
        load = self.engine.load()
        return {"replica_id": self.replica_id, "num_free_blocks": load.num_free_blocks,
                "num_blocks": load.num_blocks, "num_requests": load.num_requests,
                "num_in_flight": self.engine.num_in_flight, "stats": self.record_routing_stats(),
                "autoscaling": self.record_autoscaling_stats(), "signal_totals": dict(self.signals.totals),
                # the KV connector's cumulative counters (lookups, hit/loaded/stored blocks, failures)
                "kv_tier": self.kv_tier, "kv_connector": self.kv_tier_stats()}

    async def reset_prefix_cache(self) -> bool:
        return await self.engine.reset_prefix_cache()

    def __del__(self) -> None:
        logger.info("replica %s stopping", getattr(self, "replica_id", "?"))
