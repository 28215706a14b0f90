"""Issue 33 on the real Serve app over HTTP: batched prompts, fuzzed fields, deep JSON, health under load,
disconnects, the HTTP-layer limits and the API key's routes. Loopback only."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow
MODEL = "tiny-llama"


def _post(url: str, body, timeout: float = 60, **kw) -> httpx.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(url, content=data, headers={"content-type": "application/json", **kw.pop("headers", {})},
                      timeout=timeout, **kw)


# ---------------------------------------------------------------- finding 1
@pytest.mark.parametrize("num_prompts", [8, 50])
def test_a_batch_of_token_prompts_is_answered_like_concurrent_requests(app_url, num_prompts):
    """8 (or 50) token-id prompts in one completion: every prompt answered, promptly, and a single request
    sent meanwhile is not held up (before the fix: 503 after the 60 s first-token timeout, fleet stalled)."""
    client = openai.OpenAI(base_url=f"{app_url}/v1", api_key="unused", max_retries=0, timeout=30)
    prompts = [[5 + i % 7, 9, 11 + i] for i in range(num_prompts)]

    async def both():
        loop = asyncio.get_running_loop()
        batch = loop.run_in_executor(None, lambda: client.completions.create(
            model=MODEL, prompt=prompts, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}))
        await asyncio.sleep(0.2)
        t = time.monotonic()
        single = await loop.run_in_executor(None, lambda: client.completions.create(
            model=MODEL, prompt="hello", max_tokens=2))
        return await batch, single, time.monotonic() - t

    t0 = time.monotonic()
    batch, single, single_s = asyncio.run(both())
    assert len(batch.choices) == num_prompts and all(c.finish_reason == "length" for c in batch.choices)
    assert batch.usage.completion_tokens == 4 * num_prompts
    assert single.choices[0].text is not None and single_s < 10
    assert time.monotonic() - t0 < 25


def test_too_many_prompts_is_a_400(app_url):
    r = _post(f"{app_url}/v1/completions", {"model": MODEL, "prompt": [[1, 2]] * 65, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_prompts"


# ---------------------------------------------------------------- finding 6
def test_health_stays_fast_and_ready_during_a_burst(app_url):
    """Before: /health made a model replica call, queued behind the burst (503s, a 6.9 s probe)."""
    async def run():
        async with httpx.AsyncClient(timeout=60) as c:
            assert (await c.get(f"{app_url}/health")).status_code in (200, 503)     # starts the state
            t0 = time.monotonic()
            burst = [asyncio.create_task(c.post(f"{app_url}/v1/completions", json={
                "model": MODEL, "prompt": f"burst {i}", "max_tokens": 24, "user": None})) for i in range(120)]
            await asyncio.sleep(0.5)
            probes = []
            for _ in range(10):
                t = time.monotonic()
                r = await c.get(f"{app_url}/health")
                probes.append((r.status_code, time.monotonic() - t))
                await asyncio.sleep(0.2)
            statuses = [r.status_code for r in await asyncio.gather(*burst)]
            return probes, statuses, time.monotonic() - t0

    probes, statuses, burst_s = asyncio.run(run())
    assert all(code == 200 for code, _ in probes), probes
    # all answered from state (every probe 200: before, 503s). A probe still waits for the burst's own intake
    # in the proxy and the ingress (3.8 s once in a full suite; 6.5 s on a machine at load 12), but not for the
    # burst to be served, as the queued /health did (6.9 s on a quiet machine, most of the burst): the bound
    # scales with how long the burst took on this machine
    assert max(s for _, s in probes) < max(5.0, 0.5 * burst_s), (probes, burst_s)
    assert set(statuses) <= {200, 429}


# ---------------------------------------------------------------- findings 2 and 12
@pytest.mark.parametrize("path,raw,status", [
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "request_id": "\\ud800"}', 400),
    ("/v1/chat/completions", '{"model": "\\ud800", "messages": [{"role": "user", "content": "x"}]}', 400),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "top_k": 18446744073709551616}', 400),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "temperature": NaN}', 400),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "logit_bias": {"18446744073709551616": 5}}', 400),
    # a 32-bit id outside the vocabulary: refused by the replica's engine, a 400 all the same
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "logit_bias": {"2147483647": 5}}', 400),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "top_k": 2147483647, "seed": 9223372036854775807, '
                        '"stop_token_ids": [2147483647], "priority": -2147483648, "min_tokens": 1}', 200),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "max_tokens": 4.0}', 200),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "max_tokens": 4.0, '
                             '"stream": true}', 200),
    ("/v1/chat/completions", '{"messages": ' + "[" * 2000 + "]" * 2000 + "}", 400),
    ("/v1/completions", '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", 400),
])
def test_hostile_bodies_over_http_are_4xx_or_answered(app_url, path, raw, status):
    r = _post(f"{app_url}{path}", raw, timeout=30)
    assert r.status_code == status, r.text[:300]
    if status == 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    elif '"stream": true' in raw:
        assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_schema_fuzz_against_the_real_engine(app_url, path):
    """The unit fuzz's bodies (fewer, seeded) against real replicas: the engine's own ranges hold too."""
    from hypothesis import HealthCheck, given, seed, settings

    from affinity_serve.app.prompts import RequestKind
    from tests.unit.app.test_hostile_inputs import _bodies
    kind = RequestKind.COMPLETION if path == "/v1/completions" else RequestKind.CHAT

    @seed(33)
    @settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(_bodies(kind))
    def check(body):
        if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
            body["max_tokens"] = 8                      # keep the run short; ranges are fuzzed in unit tests
        r = _post(f"{app_url}{path}", json.dumps(body, allow_nan=True), timeout=60)
        assert r.status_code < 500, (body, r.text[:300])
        assert '"server_error"' not in r.text, (body, r.text[:300])

    check()
