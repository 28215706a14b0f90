"""Admission control under a backlog bound by KV room, on real Ray Serve (issue 25, under overload).

Many concurrent long-output requests against a pool that holds about one of them: before the wait model
saw KV room, every request was admitted (the prefill queue is short) and those behind ended with 503
`replica_unavailable` at `serve.first_token_timeout_s`. Now the requests the pool cannot start within
`serve.max_queue_wait_s` get 429 `queue_full` with Retry-After at once, the admitted ones complete, and
the pool ends empty.
"""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.integration.conftest import app_config, wait_running
from tests.integration.waiting import wait_until

pytestmark = pytest.mark.slow

KV_APP = "affinity-kv-admission"
BLOCK = 4
POOL = 40                      # blocks, the null block included: 156 tokens of room
PROMPT, OUT = 40, 100          # one request needs 35 blocks: the pool runs one at a time
CONCURRENT = 64               # served one after another: longer than the first-token timeout in all (~13 s)
#: serve.max_queue_wait_s: above the KV-pressure penalty the model charged such a backlog before (bounded,
#: under 1 s here), so without a wait for KV room the prefill queue alone admitted the whole burst
BOUND_S = 2.0
FIRST_TOKEN_TIMEOUT_S = 8.0    # what a request admitted behind the backlog waited for, then 503
WARM_UP = 4                    # sequential requests first: the router has seen how long a sequence lives


@pytest.fixture(scope="module")
def kv_url(ray_serve, checkpoints):
    from ray import serve

    from affinity_serve.app.builder import build_app

    cfg = app_config(checkpoints["llama"], num_replicas=1, max_ongoing_requests=CONCURRENT,
                     max_queued_requests=CONCURRENT, max_queue_wait_s=BOUND_S,
                     first_token_timeout_s=FIRST_TOKEN_TIMEOUT_S)
    cfg["engine"]["cache"] = {"num_blocks": POOL, "block_size": BLOCK}
    serve.run(build_app(cfg), name=KV_APP, route_prefix="/kv-admission")
    wait_running(KV_APP, "LLMReplica", 1)
    yield ray_serve + "/kv-admission"
    serve.delete(KV_APP, _blocking=True)


def _pool_state():
    from ray import serve
    return serve.get_deployment_handle("LLMReplica", app_name=KV_APP).debug_state.remote().result(timeout_s=30)


def test_a_kv_bound_backlog_gets_429_queue_full_early_and_no_503(kv_url):
    url = f"{kv_url}/v1/completions"

    async def one(c: httpx.AsyncClient, i: int):
        t0 = time.monotonic()
        r = await c.post(url, json={"prompt": [(7 * i + k) % 700 + 5 for k in range(PROMPT)], "max_tokens": OUT,
                                    "ignore_eos": True, "temperature": 0})
        return r, time.monotonic() - t0

    async def burst():
        async with httpx.AsyncClient(timeout=2 * FIRST_TOKEN_TIMEOUT_S + 30) as c:
            # the ingress builds its router on its first request; a few alone, as earlier traffic would
            for i in range(WARM_UP):
                r, _ = await one(c, 10_000 + i)
                assert r.status_code == 200, r.text
            return await asyncio.gather(*[one(c, i) for i in range(CONCURRENT)])

    results = asyncio.run(burst())
    codes = sorted(r.status_code for r, _ in results)
    assert set(codes) <= {200, 429}, codes                      # no 503 replica_unavailable
    assert 200 in codes and 429 in codes, codes
    for r, took in results:
        if r.status_code == 429:
            body = r.json()["error"]
            assert body["code"] == "queue_full", body
            assert int(r.headers["retry-after"]) >= 1
            assert took < FIRST_TOKEN_TIMEOUT_S / 2, took     # told early, not after the first-token timeout
        else:
            assert r.json()["usage"]["completion_tokens"] == OUT
    # the replica freed every block: nothing left running or queued
    wait_until(lambda: (lambda s: s["num_requests"] == 0 and s["num_free_blocks"] == s["num_blocks"] - 1)(
        _pool_state()), 30, "the KV pool to end empty")
