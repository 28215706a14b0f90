"""P/D on a real Ray Serve with `disaggregation.transport: nixl`: 1 prefill + 1 decode replica, each with its own
NIXL agent (UCX between the two replica processes, over host memory here). The decode replica's engine reads the
prefill replica's held blocks out of its KV cache; nothing goes through Ray's object store. Token-exact greedy
output against transformers, whole and streamed, n > 1; each hold freed by the reader's notification (none by the
timeout); both pools end with every KV block free."""
from __future__ import annotations

import json

import httpx
import pytest

from affinity_serve.app.disagg_config import nixl_installed
from tests.integration.test_disagg import _ids, deployed_pd, pd_pools_empty, pd_state
from tests.integration.waiting import wait_until

pytestmark = [pytest.mark.slow,        # deploys its own 1P+1D app
              pytest.mark.skipif(not nixl_installed(), reason="NIXL's Python package is not installed")]
APP = "affinity-disagg-nixl"


@pytest.fixture(scope="module")
def nixl_url(ray_serve, checkpoints):
    with deployed_pd(ray_serve, checkpoints["llama"], APP, "/disagg-nixl", {
            "transport": "nixl", "nixl_staging_mib": 4, "min_remote_prefill_tokens": 12,
            "transfer_timeout_s": 20.0}) as url:
        yield url


def _state(deployment: str) -> dict:
    return pd_state(APP, deployment)


def _pools_empty():
    if not pd_pools_empty(APP):
        return False
    pd = _state("PrefillReplica")["pd"]
    return pd["holds"] == pd["holds_read"] + pd["holds_released"] + pd["holds_expired"]


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
