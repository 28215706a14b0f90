"""The `disaggregation` section of AppConfig: a prefill pool and a decode pool (app/disagg.py)."""
from __future__ import annotations

from typing import Any, Literal, TypeVar

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
        "{scheduler: {max_num_batched_tokens: 8192}} for prefill or {scheduler: {max_num_seqs: 256}} for decode. "
        "Not the keys both pools must share (model, dtype, cache.block_size, max_model_len, skip_tokenizer_init, "
        "generation_config: set them in the engine section) nor kv_connector (P/D's own)")
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
    local_prefill_slack_s: float | None = Field(
        None, ge=0, description="conditional disaggregation: the ingress has the decode replica it chose prefill "
        "a request itself when the prefill pool's best replica is predicted to give its first token more than "
        "this many seconds later than that decode replica would (a prefill pool backlogged or scaling out: TTFT "
        "bought with the decode replica's TPOT, whose running streams share those prefill steps); with "
        "routing.policy prefix_affinity or llm_d_precise (the policies that predict TTFT); null: never")
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
    transport: Literal["ray", "nixl"] = Field(
        "ray", description="how KV moves from a prefill replica to a decode replica: `ray` copies the held blocks "
        "into Ray's object store (zero-copy on one node, Ray's object manager across nodes); `nixl` lets the "
        "decode replica read them straight out of the prefill replica's KV cache with NIXL's one-sided reads "
        "(GPU memory on CUDA: RDMA, NVLink or CUDA IPC through UCX; needs NIXL's Python package: pip install "
        "'affinity-serve[nixl]')")
    nixl_staging_mib: int = Field(
        256, ge=1, le=1 << 20, description="transport nixl: each decode replica's staging area for reads in "
        "flight, MiB on its device (outside the KV cache's memory budget); a read that does not fit waits for room, "
        "one larger than the whole area gets a buffer of its own (one such read at a time)")
    transfer_timeout_s: float = Field(
        30.0, gt=0, description="a prefill replica frees a request's held KV blocks if they were not copied out "
        "(transport ray) or read (transport nixl) by then (the caller left)")
    prefill_timeout_s: float | None = Field(
        None, gt=0, description="a decode replica stops waiting for the prefill pool's answer after this many "
        "seconds and prefills the request itself (a prefill replica that hangs without dying, or a pool too "
        "backlogged to answer in time); null: half of serve.first_token_timeout_s, so the recompute still has "
        "time before the ingress gives up. Must be below serve.first_token_timeout_s")
    prefill_backoff_s: float = Field(
        10.0, gt=0, description="a prefill replica that missed prefill_timeout_s gets no prefill call from that "
        "decode replica for this many seconds (its calls go to the other prefill replicas; with none, the decode "
        "replica prefills them itself at once instead of waiting the timeout again); then one request at a time "
        "tries it again: an answer clears it, another timeout starts a new back-off")

    def prefill_timeout(self, first_token_timeout_s: float) -> float:
        """The decode replica's deadline on one prefill call (prefill_timeout_s, or its default)."""
        return self.prefill_timeout_s if self.prefill_timeout_s is not None else first_token_timeout_s / 2


#: transport nixl: a decode replica starts no read within this many seconds of the hold's expiry
#: (NixlTransport.expiry_margin_s)
NIXL_EXPIRY_MARGIN_S = 1.0


def nixl_installed() -> bool:
    """Whether NIXL's Python package is importable here (engine/kv_connector/nixl.py tries the same modules),
    without importing it."""
    import importlib.util
    return any(importlib.util.find_spec(m) is not None for m in ("nixl", "nixl_cu13", "nixl_cu12"))


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
    bounds). Raises pydantic's ValidationError for a bad setting, ValueError for bounds the wrong way round
    (saying where each one came from) or a num_replicas set outside them (`name`: the pool's, for the
    message)."""
    set_here = autoscaling.model_dump(exclude_unset=True)
    data = merge(set_here, pool.autoscaling)
    fields = type(autoscaling).model_fields
    lo, hi = (data.get(k, fields[k].default) for k in ("min_replicas", "max_replicas"))
    enabled = data.get("enabled", fields["enabled"].default)
    if not (isinstance(lo, int) and isinstance(hi, int)) or isinstance(lo, bool) or isinstance(hi, bool):
        # a bound of another type: pydantic's line names it (null, "many"), or coerces it as at the top level ("3")
        checked = type(autoscaling).model_validate({k: v for k, v in data.items() if k != "initial_replicas"})
        lo, hi = checked.min_replicas, checked.max_replicas
    if isinstance(lo, int) and isinstance(hi, int) and lo > hi:     # (a value of the wrong type: pydantic's line)
        def where(key: str) -> str:
            if key in pool.autoscaling:
                return "set in this pool"
            return f"inherited from autoscaling.{key}" + ("" if key in set_here else ", its default")
        note = ("" if enabled else "; this pool is not autoscaled (autoscaling.enabled is false: it runs "
                "num_replicas), but its bounds must still hold for when it is")
        fix = ("raise max_replicas or lower min_replicas" if "max_replicas" in pool.autoscaling
               else "set this pool's max_replicas too, or a lower min_replicas")
        raise ValueError(f"disaggregation.{name}.autoscaling: min_replicas ({lo}, {where('min_replicas')}) is above "
                         f"max_replicas ({hi}, {where('max_replicas')}): {fix}{note}")
    if data.get("initial_replicas") is None:
        # set, and not the default: the CLI re-validates a dumped config (every field reads as set), and a
        # default 1 under min_replicas 2 of a config that does not use the pool must not be an error
        explicit = "num_replicas" in pool.model_fields_set and pool.num_replicas != PoolSection().num_replicas
        if enabled and explicit and not lo <= pool.num_replicas <= hi:
            raise ValueError(f"disaggregation.{name}.num_replicas: {pool.num_replicas} is outside this pool's "
                             f"autoscaling bounds [{lo}, {hi}] (it is the pool's initial size; change it or the "
                             "bounds)")
        data["initial_replicas"] = max(lo, min(pool.num_replicas, hi))
    return type(autoscaling).model_validate(data)


def pool_initial_replicas(autoscaling: _Autoscaling, pool: PoolSection, name: str = "pool") -> int:
    """How many replicas a pool starts with: its autoscaling's initial replicas, or num_replicas when the
    pool is not autoscaled."""
    scaling = pool_autoscaling(autoscaling, pool, name)
    return scaling.initial_replicas if scaling.enabled else pool.num_replicas


#: engine keys the two pools must share (a pool's `engine` may not set them), and why
SHARED_ENGINE_KEYS: dict[str, str] = {
    "model": "both pools run one model, the decode pool continuing from the prefill pool's KV and first token",
    "dtype": "KV blocks move between the pools as they are: with another dtype every transfer is refused and "
             "the decode pool recomputes the prompt",
    "cache.block_size": "KV moves in whole blocks: with another block size every transfer is refused and the "
                        "decode pool recomputes the prompt",
    "max_model_len": "a prompt one pool takes and the other refuses fails its remote prefill and is recomputed",
    "skip_tokenizer_init": "the prefill pool's first token is the decode pool's first output: both return text "
                           "or neither does",
    "generation_config": "the prefill pool samples the first token and the decode pool the rest: both must "
                         "apply the checkpoint's sampling defaults alike",
}


def _lookup(data: Any, path: str) -> tuple[bool, Any]:
    for part in path.split("."):
        if not isinstance(data, dict) or part not in data:
            return False, None
        data = data[part]
    return True, data


def pool_engine_problems(name: str, overrides: dict[str, Any], engine: dict[str, Any],
                         other: dict[str, Any], *, devices: bool = True) -> list[str]:
    """What a pool's `engine` overrides may not set, one line each naming its key: a key both pools must
    share (SHARED_ENGINE_KEYS), the KV connector (P/D sets it), and, with dtype auto, a device other than the
    other pool's (the KV dtype follows the device). `engine`: the engine section as a dict; `other`: the
    other pool's overrides; `devices` False leaves out the device check (`engine` is not the app's)."""
    out = []
    for key, why in SHARED_ENGINE_KEYS.items():
        if _lookup(overrides, key)[0]:
            out.append(f"disaggregation.{name}.engine.{key}: must be the same in both pools ({why}); set "
                       f"engine.{key} in the top-level engine section instead")
    if "kv_connector" in overrides:
        out.append(f"disaggregation.{name}.engine.kv_connector: not a per-pool setting: disaggregation gives both "
                   "pools the pd connector; set how long a prefill replica holds KV with "
                   "disaggregation.transfer_timeout_s, and engine.kv_connector.load_timeout_s or model_identity "
                   "(both pools) in the top-level engine section")
    if devices and "device" in overrides and "dtype" not in overrides and engine.get("dtype", "auto") == "auto":
        theirs = other.get("device", engine.get("device", "auto"))
        # auto on either side may well be the same device (cuda on a GPU node): only two named ones differ
        if overrides["device"] != theirs and "auto" not in (overrides["device"], theirs):
            out.append(f"disaggregation.{name}.engine.device: {overrides['device']!r} while the other pool's is "
                       f"{theirs!r}: with engine.dtype auto the KV dtype follows the device (float32 on CPU, "
                       "bfloat16 on CUDA) and the pools must share it; set engine.dtype explicitly")
    return out


def without_shared_keys(overrides: dict[str, Any]) -> dict[str, Any]:
    """A pool's overrides less what pool_engine_problems refuses (so a refused key is reported once)."""
    out = {k: v for k, v in overrides.items() if k not in ("kv_connector", *SHARED_ENGINE_KEYS)}
    if isinstance(overrides.get("cache"), dict):
        out["cache"] = {k: v for k, v in overrides["cache"].items() if k != "block_size"}
    return out


def pool_engine_config(engine: EngineConfig, pool: PoolSection, section: DisaggregationSection) -> EngineConfig:
    """A pool's engine config: the engine section, the pool's settings, and the P/D connector."""
    cfg = merge(engine.model_dump(), pool.engine)
    kv = {**cfg["kv_connector"], "type": "pd", "transfer_timeout_s": section.transfer_timeout_s}
    return EngineConfig.model_validate({**cfg, "kv_connector": kv})
