"""LLMReplica: one AsyncLLMEngine per Serve replica; streaming generate, stats for routing/autoscaling,
health (dead or wedged step loop). Serve options are set by builder.py, not here."""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from app.errors import APIError, to_api_error
from app.protocol import GenerateRequest, ReplicaChunk
from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.errors import EngineDeadError

logger = logging.getLogger("affinity.replica")


def _replica_id() -> str:
    try:
        from ray import serve
        return serve.get_replica_context().replica_id.unique_id
    except Exception:   # outside Serve (unit tests)
        return f"local-{uuid.uuid4().hex[:6]}"


class LLMReplica:
    """Takes its engine as configuration; can be built synchronously in tests without Serve."""

    def __init__(self, engine_config: dict[str, Any], wedge_timeout_s: float = 30.0,
                 observability: dict[str, Any] | None = None):
        self.engine = AsyncLLMEngine.from_config(EngineConfig.model_validate(engine_config))
        from observability.logs import configure_json_logging
        from observability.setup import setup_telemetry

        obs = observability or {}
        configure_json_logging(obs.get("log_level", "INFO"))
        self.tracer = setup_telemetry(obs.get("service_name", "affinity-serve"), obs.get("traces", "none"),
                                      obs.get("otlp_endpoint"), obs.get("max_spans_kept", 2000),
                                      prometheus=False).tracer
        self.replica_id = _replica_id()
        self.boot_id = uuid.uuid4().hex[:8]        # changes when the replica (and its cache) restarts
        self.wedge_timeout_s = wedge_timeout_s
        logger.info("replica %s ready (KV capacity %d tokens)", self.replica_id, self.engine.engine.kv_capacity_tokens)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[ReplicaChunk]:
        """Stream chunks; the last chunk of each sequence carries finish_reason and timings."""
        from observability.tracing import context_from_carrier, trace_id_hex

        arrival = time.monotonic()
        first_token: float | None = None
        # The ingress's W3C trace context arrives in the request; the engine span continues that trace.
        span = self.tracer.start_span("llm.engine", context=context_from_carrier(req.trace_context),
                                      attributes={"replica": self.replica_id, "request_id": req.request_id})
        try:
            gen = self.engine.generate(req.prompt_token_ids, req.params, req.request_id, priority=req.priority,
                                       cache_salt=req.cache_salt, trace_context=req.trace_context or None)
            async for d in gen:
                now = time.monotonic()
                if first_token is None and d.token_ids:
                    first_token = now
                chunk = ReplicaChunk(d.index, d.text, d.token_ids, d.finish_reason, d.stop_reason, d.logprobs,
                                     d.num_prompt_tokens, d.num_cached_tokens, self.replica_id)
                if d.finished:
                    if d.finish_reason == "error":
                        raise APIError("generation failed inside the engine", 500, "server_error", None,
                                       "engine_error")
                    sched = d.first_scheduled_time or arrival
                    ft = first_token or now
                    chunk.timings = {"queue_s": max(0.0, sched - arrival), "prefill_s": max(0.0, ft - sched),
                                     "decode_s": max(0.0, now - ft)}
                    chunk.replica_stats = self.record_routing_stats()
                    chunk.replica_stats["trace_id"] = trace_id_hex(span)
                    logger.info("sequence finished", extra={
                        "request_id": req.request_id, "index": d.index, "finish_reason": d.finish_reason,
                        "cached_tokens": d.num_cached_tokens, **{k: round(v, 4) for k, v in chunk.timings.items()}})
                    span.set_attribute("cached_tokens", d.num_cached_tokens)
                yield chunk
        except APIError:
            raise
        except Exception as e:
            raise to_api_error(e) from None
        finally:
            span.end()

    # ------------------------------------------------------------------ Serve hooks
    def record_routing_stats(self) -> dict[str, Any]:
        """Small on purpose: the controller rebroadcasts the whole replica set when this changes."""
        st = self.engine.stats
        return {
            "num_running": st.num_running_reqs,
            "num_waiting": st.num_waiting_reqs,
            "kv_cache_usage": round(st.kv_cache_usage, 4),
            "num_queued_prefill_tokens": st.num_queued_prefill_tokens,
            "prefix_cache_queries": st.prefix_cache_queries_total,
            "prefix_cache_hits": st.prefix_cache_hits_total,
            "cache_epoch": f"{self.boot_id}:{self.engine.engine.kv_cache_manager.cache_epoch}",
        }

    def record_autoscaling_stats(self) -> dict[str, float]:
        st = self.engine.stats
        return {
            "num_running": float(st.num_running_reqs),
            "num_waiting": float(st.num_waiting_reqs),
            "kv_cache_usage": float(st.kv_cache_usage),
            "num_queued_prefill_tokens": float(st.num_queued_prefill_tokens),
        }

    async def check_health(self) -> None:
        self.engine.check_health()
        sched = self.engine.engine.scheduler
        idle_for = time.monotonic() - self.engine.last_progress_time
        if sched.running and idle_for > self.wedge_timeout_s:
            raise EngineDeadError(f"engine wedged: {len(sched.running)} running requests and no step for "
                                  f"{idle_for:.0f}s")

    # ------------------------------------------------------------------ introspection
    async def debug_state(self) -> dict[str, Any]:
        kv = self.engine.engine.kv_cache_manager
        return {"replica_id": self.replica_id, "num_free_blocks": kv.pool.num_free_blocks,
                "num_blocks": kv.pool.num_blocks, "num_requests": len(self.engine.engine.scheduler.requests),
                "num_in_flight": self.engine.num_in_flight, "stats": self.record_routing_stats()}

    async def reset_prefix_cache(self) -> bool:
        return self.engine.engine.reset_prefix_cache()

    def __del__(self) -> None:
        logger.info("replica %s stopping", getattr(self, "replica_id", "?"))
