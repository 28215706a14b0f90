"""/v1/models with autoscaling at zero: the card comes from what the ingress knows, and no replica is started."""
import json

import pytest

from affinity_serve.app.config import AppConfig
from affinity_serve.engine import EngineConfig, EngineLimits
from tests.unit.app.conftest import LocalHandle

AT_ZERO = {"enabled": True, "min_replicas": 0, "initial_replicas": 0}


class CardReplica:
    """A model replica stand-in that reports `limits` (each call is recorded by the LocalHandle)."""

    def __init__(self, limits: EngineLimits):
        self._limits = limits

    async def limits(self):
        return self._limits

    async def debug_state(self):
        return {}


def _ingress(path, engine, autoscaling=AT_ZERO, replica_limits=None):
    from affinity_serve.app.ingress import Ingress
    cfg = AppConfig.model_validate({"engine": {"model": path, **engine}, "autoscaling": autoscaling,
                                    "serve": {"first_token_timeout_s": 0.5}})
    handle = LocalHandle(CardReplica(replica_limits or EngineLimits(77, 10**6, 77)))
    return Ingress(handle, cfg), handle


def _get(path: str):
    from starlette.requests import Request

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}
    return Request({"type": "http", "method": "GET", "path": path, "query_string": b"", "headers": []}, receive)


# the engine's own rule on a tiny checkpoint: the model's positions (512), engine.max_model_len, YaRN, and the cap
# at the KV pool's capacity (num_blocks, a memory budget in float32 and in bfloat16), as a replica reports them
CASES = [
    ("llama", {"device": "cpu"}),
    ("llama", {"device": "cpu", "max_model_len": 100}),
    ("llama", {"device": "cpu", "cache": {"num_blocks": 8, "block_size": 4}}),
    ("llama", {"device": "cpu", "cache": {"memory_budget_bytes": 40960}}),
    ("llama", {"device": "auto", "dtype": "bfloat16", "cache": {"memory_budget_bytes": 40960}}),
    ("llama", {"device": "cpu", "cache": {"num_blocks": 40, "block_size": 4},
               "scheduler": {"max_num_batched_tokens": 32, "enable_chunked_prefill": True}}),
    ("qwen2_yarn", {"device": "cpu"}),
    ("mistral", {"device": "cpu", "cache": {"num_blocks": 12, "block_size": 4}}),
]


@pytest.mark.parametrize("name,engine", CASES)
async def test_models_at_zero_starts_no_replica_and_reports_the_engines_max_model_len(checkpoints, name, engine):
    """Autoscaling at zero and no replica ever answered: /v1/models asked a replica for the engine's limits,
    which started one (and waited for its cold start). Now the card's max_model_len is derived from the config
    and checkpoint, the same value a replica of that config reports, and no replica is called."""
    from affinity_serve.engine import LLMEngine
    engine = {"cpu_kernels": False, **engine}
    ing, handle = _ingress(checkpoints[name], engine)
    r = await ing.http_models(_get("/v1/models"))
    assert r.status_code == 200
    card = json.loads(r.body)["data"][0]
    one = await ing.model(ing.model_name)
    assert handle.calls == []                                   # nothing asked: nothing started
    replica = LLMEngine.from_config(EngineConfig.model_validate({"model": checkpoints[name], **engine}))
    assert card["max_model_len"] == one["max_model_len"] == replica.limits.max_model_len


async def test_models_keep_a_replicas_answer_and_ask_only_what_the_config_cannot_tell(checkpoints):
    # a CUDA pool is sized from the device's free memory: only a replica knows (asked once, then kept)
    ing, handle = _ingress(checkpoints["llama"], {"device": "auto"})
    assert (await ing.models())["data"][0]["max_model_len"] == 77
    assert (await ing.models())["data"][0]["max_model_len"] == 77
    assert [name for name, _ in handle.calls] == ["limits"]
    # not at zero (min_replicas 1): a replica runs, and its answer is the card's
    ing, handle = _ingress(checkpoints["llama"], {"device": "cpu"}, autoscaling={"enabled": False})
    assert (await ing.models())["data"][0]["max_model_len"] == 77
    assert [name for name, _ in handle.calls] == ["limits"]


def test_the_derivation_and_the_build_share_the_cpu_kv_budget():
    """One constant: the derivation (engine.derive_max_model_len) and engine/build.py's pool sizing."""
    from affinity_serve.engine import build
    from affinity_serve.engine.models import checkpoint
    assert build.DEFAULT_CPU_KV_BYTES is checkpoint.DEFAULT_CPU_KV_BYTES


async def test_models_at_zero_with_pd_report_the_decode_pools_engine(checkpoints):
    """With P/D the ingress's replicas are the decode pool's: its engine settings over the engine section."""
    from affinity_serve.app.ingress import Ingress
    cfg = AppConfig.model_validate({
        "engine": {"model": checkpoints["llama"], "device": "cpu", "cache": {"block_size": 4}},
        "autoscaling": AT_ZERO, "serve": {"first_token_timeout_s": 0.5},
        "disaggregation": {"enabled": True, "decode": {"engine": {"cache": {"num_blocks": 8}}}}})
    handle = LocalHandle(CardReplica(EngineLimits(77, 10**6, 77)))
    ing = Ingress(handle, cfg)
    assert (await ing.models())["data"][0]["max_model_len"] == 28 and handle.calls == []   # 7 blocks x 4 tokens
    # the decode pool's own autoscaling decides whether it may be at zero
    cfg = AppConfig.model_validate({
        "engine": {"model": checkpoints["llama"], "device": "cpu", "cache": {"block_size": 4}},
        "autoscaling": {"enabled": True, "min_replicas": 1}, "serve": {"first_token_timeout_s": 0.5},
        "disaggregation": {"enabled": True, "decode": {"autoscaling": {"min_replicas": 0, "initial_replicas": 0}}}})
    handle = LocalHandle(CardReplica(EngineLimits(77, 10**6, 77)))
    assert (await Ingress(handle, cfg).models())["data"][0]["max_model_len"] == 512 and handle.calls == []


async def test_health_with_pd_follows_the_decode_pools_autoscaling(checkpoints, monkeypatch):
    """With P/D only the decode pool may be at zero (its own autoscaling over a section that may not): /health
    said 503 `starting` and woke it, and once it was at zero again 503 `no_replica_running`, reading the
    section's min_replicas 1 (acceptance finding)."""
    from affinity_serve.app.ingress import Ingress
    cfg = AppConfig.model_validate({
        "engine": {"model": checkpoints["llama"], "device": "cpu", "cache": {"block_size": 4}},
        "autoscaling": {"enabled": True, "min_replicas": 1, "max_replicas": 1},
        "serve": {"first_token_timeout_s": 0.5},
        "disaggregation": {"enabled": True, "decode": {"autoscaling": {"min_replicas": 0, "initial_replicas": 0}}}})
    handle = LocalHandle(CardReplica(EngineLimits(77, 10**6, 77)))
    ing = Ingress(handle, cfg)
    monkeypatch.setattr(ing.serving, "_num_replicas", lambda: 0)
    r = await ing.http_health()
    assert r.status_code == 200 and json.loads(r.body)["status"] == "scaled_to_zero" and handle.calls == []
    await ing.serving.limits()                     # a replica ran once, then the pool went back to zero
    r = await ing.http_health()
    assert r.status_code == 200 and json.loads(r.body)["status"] == "scaled_to_zero"
