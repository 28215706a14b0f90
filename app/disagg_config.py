"""The `disaggregation` section of AppConfig: a prefill pool and a decode pool (app/disagg.py)."""
from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat

from affinity_serve.engine.config import EngineConfig


class PoolSection(BaseModel):
    """One pool's size and its engine settings over the `engine` section."""

    model_config = ConfigDict(extra="forbid")

    num_replicas: int = Field(1, ge=1, description="replicas of this pool; with autoscaling, the pool's initial "
                              "replicas unless its autoscaling sets initial_replicas")
    autoscaling: dict[str, Any] = Field(
        {}, description="this pool's autoscaling settings laid over the autoscaling section (any of its keys), e.g. "
        "{max_replicas: 4, ttft_slo_s: 1.0} for prefill or {tpot_slo_s: 0.05} for decode; {enabled: false} keeps "
        "this pool at num_replicas. Each pool scales on its own signals: prefill on prefill backlog against the "
        "TTFT SLO, decode on running sequences, KV usage and TPOT (autoscale/pools.py)")
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
    same_node_slack_s: float = Field(
        0.05, ge=0, description="the ingress chooses a request's prefill replica first (prefix affinity on the "
        "prefill pool), then prefers a decode replica on that replica's node (the KV copy stays in the node's "
        "object store) over a better one elsewhere when the node's best is predicted at most this many seconds "
        "slower and to hold as much of the prompt (a decode replica holding earlier turns keeps its request); "
        "with routing.policy prefix_affinity or llm_d_precise (the policies that predict TTFT)")
    same_node_slack_requests: int = Field(
        2, ge=0, description="the same preference under the load-only routing policies (power_of_two, "
        "round_robin), which predict no TTFT: the decode replica on the prefill replica's node with the fewest "
        "ongoing requests (running at its last stats plus this ingress's sends since) goes first when, with the "
        "request counted there, it has at most this many more than the policy's own choice has with it")
    transfer_timeout_s: float = Field(
        30.0, gt=0, description="a prefill replica frees a request's held KV blocks if they were not copied out "
        "by then (the caller left)")
    prefill_timeout_s: float | None = Field(
        None, gt=0, description="a decode replica stops waiting for the prefill pool's answer after this many "
        "seconds and prefills the request itself (a prefill replica that hangs without dying, or a pool too "
        "backlogged to answer in time); null: half of serve.first_token_timeout_s, so the recompute still has "
        "time before the ingress gives up. Must be below serve.first_token_timeout_s")

    def prefill_timeout(self, first_token_timeout_s: float) -> float:
        """The decode replica's deadline on one prefill call (prefill_timeout_s, or its default)."""
        return self.prefill_timeout_s if self.prefill_timeout_s is not None else first_token_timeout_s / 2


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` laid over `base`: nested mappings merge, anything else replaces."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


_Autoscaling = TypeVar("_Autoscaling", bound=BaseModel)


def pool_autoscaling(autoscaling: _Autoscaling, pool: PoolSection, name: str = "pool") -> _Autoscaling:
    """A pool's autoscaling section: the app's `autoscaling` section with the pool's settings laid over it,
    its initial replicas the pool's num_replicas unless either sets initial_replicas (kept within its
    bounds). Raises pydantic's ValidationError for a bad setting, ValueError for a num_replicas set outside
    the bounds (`name`: the pool's, for the message)."""
    data = merge(autoscaling.model_dump(exclude_unset=True), pool.autoscaling)
    if data.get("initial_replicas") is None:
        fields = type(autoscaling).model_fields
        lo, hi = (data.get(k, fields[k].default) for k in ("min_replicas", "max_replicas"))
        enabled = data.get("enabled", fields["enabled"].default)
        if enabled and "num_replicas" in pool.model_fields_set and not lo <= pool.num_replicas <= hi:
            raise ValueError(f"disaggregation.{name}.num_replicas: {pool.num_replicas} is outside this pool's "
                             f"autoscaling bounds [{lo}, {hi}] (it is the pool's initial size; change it or the "
                             "bounds)")
        data["initial_replicas"] = max(lo, min(pool.num_replicas, hi))
    return type(autoscaling).model_validate(data)


def pool_engine_config(engine: EngineConfig, pool: PoolSection, section: DisaggregationSection) -> EngineConfig:
    """A pool's engine config: the engine section, the pool's settings, and the P/D connector."""
    cfg = merge(engine.model_dump(), pool.engine)
    kv = {**cfg["kv_connector"], "type": "pd", "transfer_timeout_s": section.transfer_timeout_s}
    return EngineConfig.model_validate({**cfg, "kv_connector": kv})
