"""The `disaggregation` section of AppConfig: a prefill pool and a decode pool (app/disagg.py)."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat

from affinity_serve.engine.config import EngineConfig


class PoolSection(BaseModel):
    """One pool's size and its engine settings over the `engine` section."""

    model_config = ConfigDict(extra="forbid")

    num_replicas: int = Field(1, ge=1, description="replicas of this pool (fixed: per-pool autoscaling is not "
                              "implemented yet)")
    engine: dict[str, Any] = Field(
        {}, description="engine settings for this pool laid over the engine section (nested keys merge), e.g. "
        "{scheduler: {max_num_batched_tokens: 8192}} for prefill or {scheduler: {max_num_seqs: 256}} for decode")
    replica_resources: dict[str, PositiveFloat] | None = Field(
        None, description="custom Ray resources each replica of this pool requests (null: serve.replica_resources), "
        "e.g. a slot only the prefill pool's node type declares")


class DisaggregationSection(BaseModel):
    """Prefill/decode disaggregation (docs/disaggregation.md): the ingress sends requests to the decode pool,
    whose replicas have the prefill pool prefill prompts and read the KV back through Ray's object store."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="serve with a prefill pool and a decode pool instead of one pool")
    prefill: PoolSection = Field(PoolSection(), description="the prefill pool")
    decode: PoolSection = Field(PoolSection(), description="the decode pool (it takes the ingress's requests)")
    min_remote_prefill_tokens: int = Field(
        256, ge=0, description="a decode replica prefills a request itself when fewer prompt tokens than this are "
        "missing from its own prefix cache (a short prompt, or a later turn of a conversation it holds)")
    transfer_timeout_s: float = Field(
        30.0, gt=0, description="a prefill replica frees a request's held KV blocks if they were not copied out "
        "by then (the caller left)")


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` laid over `base`: nested mappings merge, anything else replaces."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def pool_engine_config(engine: EngineConfig, pool: PoolSection, section: DisaggregationSection) -> EngineConfig:
    """A pool's engine config: the engine section, the pool's settings, and the P/D connector."""
    cfg = merge(engine.model_dump(), pool.engine)
    kv = {**cfg["kv_connector"], "type": "pd", "transfer_timeout_s": section.transfer_timeout_s}
    return EngineConfig.model_validate({**cfg, "kv_connector": kv})
