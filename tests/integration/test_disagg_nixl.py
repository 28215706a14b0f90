"""P/D on a real Ray Serve with `disaggregation.transport: nixl`: 1 prefill + 1 decode replica, each with its own
NIXL agent (UCX between the two replica processes, over host memory here). The decode replica's engine reads the
prefill replica's held blocks out of its KV cache; nothing goes through Ray's object store. Token-exact greedy
output against transformers, whole and streamed, n > 1; each hold freed by the reader's notification (none by the
timeout); both pools end with every KV block free."""
from __future__ import annotations

import json
import random

import httpx
import pytest

from affinity_serve.app.disagg_config import nixl_installed
from tests.integration.conftest import app_config, wait_running
from tests.integration.waiting import wait_until

pytestmark = [pytest.mark.slow,        # deploys its own 1P+1D app
              pytest.mark.skipif(not nixl_installed(), reason="NIXL's Python package is not installed")]
APP = "affinity-disagg-nixl"


@pytest.fixture(scope="module")
def nixl_url(ray_serve, checkpoints):
    from ray import serve

    from affinity_serve.app.builder import build_app

    cfg = app_config(checkpoints["llama"])
    cfg["disaggregation"] = {"enabled": True, "transport": "nixl", "nixl_staging_mib": 4,
                             "min_remote_prefill_tokens": 12, "transfer_timeout_s": 20.0,
                             "prefill": {"num_replicas": 1, "engine": {"scheduler": {"max_num_batched_tokens": 64}}},
                             "decode": {"num_replicas": 1}}
    serve.run(build_app(cfg), name=APP, route_prefix="/disagg-nixl")
    try:
        wait_running(APP, "LLMReplica", 1)
        wait_running(APP, "PrefillReplica", 1)
        yield ray_serve + "/disagg-nixl"
    finally:
        serve.delete(APP)


def _state(deployment: str) -> dict:
    from ray import serve
    return serve.get_deployment_handle(deployment, app_name=APP).debug_state.remote().result(timeout_s=30)


def _ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(10, 700) for _ in range(n)]


def _pools_empty():
    for dep in ("LLMReplica", "PrefillReplica"):
        st = _state(dep)
        if st["num_free_blocks"] != st["num_blocks"] - 1 or st["num_requests"]:
            return False
    return not _state("PrefillReplica")["pd"]["holds"] - sum(
        _state("PrefillReplica")["pd"][k] for k in ("holds_read", "holds_released", "holds_expired"))


def test_pd_over_nixl_is_token_exact_whole_streamed_and_n2(nixl_url, checkpoints, hf_reference):
    path = checkpoints["llama"]
    with httpx.Client(timeout=60) as c:
        for n_prompt in (13, 31, 57, 90):
            prompt = _ids(n_prompt, 500 + n_prompt)
            ref = hf_reference(path, prompt, 10)
            r = c.post(f"{nixl_url}/v1/completions", json={"prompt": prompt, "max_tokens": 10, "temperature": 0,
                                                           "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == ref
            streamed = []
            with c.stream("POST", f"{nixl_url}/v1/completions", json={
                    "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "stream": True,
                    "return_token_ids": True}) as s:
                assert s.status_code == 200
                for line in s.iter_lines():
                    if line.startswith("data: {"):
                        ch = json.loads(line[6:])["choices"]
                        if ch:
                            streamed.extend(ch[0].get("token_ids") or [])
            assert streamed == ref
        prompt = _ids(44, 777)
        r = c.post(f"{nixl_url}/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0, "n": 2,
                                                       "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        ref = hf_reference(path, prompt, 6)
        assert [ch["token_ids"] for ch in r.json()["choices"]] == [ref, ref]
    wait_until(_pools_empty, timeout_s=60, what="both pools to free every block and hold")
    decode, prefill = _state("LLMReplica"), _state("PrefillReplica")
    assert decode["pd_transport"] == prefill["pd_transport"] == "nixl"
    conn = decode["kv_connector"]
    assert conn["loads_ok"] >= 5 and conn["loads_failed"] == 0
    assert decode["nixl"]["reads_posted"] == conn["loads_ok"]
    # the streamed repeat of each prompt finds its blocks in the decode replica's cache: released, not read
    pd = prefill["pd"]
    assert pd["holds_read"] == conn["loads_ok"] and pd["holds_expired"] == 0
    assert prefill["nixl"]["notifications"] >= pd["holds_read"]
    assert decode["nixl"]["staging_bytes_free"] == 4 << 20
