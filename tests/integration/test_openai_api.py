"""The official openai client (strict response validation) against the real Serve app over HTTP."""
import asyncio

import httpx
import openai
import pytest

from tests.integration.waiting import wait_until

pytestmark = pytest.mark.slow
MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def client(app_url):
    return openai.OpenAI(base_url=f"{app_url}/v1", api_key="unused", max_retries=0, timeout=60,
                         _strict_response_validation=True)


@pytest.fixture(scope="module")
def lenient_client(app_url):
    """For streamed legacy completions only: openai's `CompletionChoice.finish_reason` is a non-optional
    Literal, so the `null` that OpenAI (and we) send on intermediate chunks fails strict validation."""
    return openai.OpenAI(base_url=f"{app_url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_and_stream_agree(client, lenient_client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    assert full.object == "text_completion" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12 and full.usage.total_tokens == full.usage.prompt_tokens + 12
    assert full.system_fingerprint.startswith("replica:")
    chunks = list(lenient_client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    assert len(chunks) > 3                          # streamed, not one blob
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_and_stream_agree_with_n(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=8,
              temperature=0.9, seed=7, n=2, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    assert sorted(c.index for c in full.choices) == [0, 1]
    assert all(c.message.role == "assistant" and c.finish_reason == "length" for c in full.choices)
    assert full.usage.completion_tokens == 16
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    by_index = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            by_index[ch.index] += ch.delta.content or ""
    assert by_index == {c.index: c.message.content for c in full.choices}
    streamed, whole = chunks[-1].usage.model_dump(), full.usage.model_dump()
    # the second request finds the first one's prompt cached: only its cached tokens may be larger
    cached = [u["prompt_tokens_details"].pop("cached_tokens") for u in (streamed, whole)]
    assert streamed == whole and cached[0] >= cached[1]


def test_stop_strings_are_excluded(client):
    base = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(base) > 6
    stop = base[3:6]
    cut = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=24, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == base[:base.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].model_extra["stop_reason"] == stop           # vLLM's field: which stop string
    assert client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].model_extra["stop_reason"] is None


def test_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="Knowledge is", max_tokens=4, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.token_logprobs) == 4 and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(t) == 2 for t in lp.top_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(max(top.values()) == pytest.approx(v) for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=3,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 3 for c in content)


def test_return_token_ids(client, lenient_client, checkpoints, hf_reference):
    """vLLM's extension through the openai client (`extra_body`, read back from the extra fields)."""
    prompt = [1, 415, 293, 606, 285]
    kw = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = client.completions.create(**kw).choices[0]
    assert choice.model_extra["token_ids"] == hf_reference(checkpoints["llama"], prompt, 6)
    assert choice.model_extra["prompt_token_ids"] == prompt
    chunks = [c.choices[0].to_dict() for c in lenient_client.completions.create(stream=True, **kw)]
    assert [t for c in chunks for t in c["token_ids"]] == choice.model_extra["token_ids"]
    assert chunks[0]["prompt_token_ids"] == prompt
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          extra_body={"return_token_ids": True}).to_dict()
    assert chat["prompt_token_ids"] and len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]


def test_echo_logprobs_score_the_prompt(lenient_client, checkpoints, hf_reference):
    """What lm-eval's local-completions sends (echo, logprobs=1, max_tokens=1): the prompt tokens' logprobs
    come back, the first null (as from OpenAI: the client's types say float, so the lenient client)."""
    import torch
    from transformers import AutoTokenizer

    path = checkpoints["llama"]
    ids = AutoTokenizer.from_pretrained(path).encode("Knowledge is power. All that glitters is not gold.")
    ref = torch.log_softmax(hf_reference.logits(path, ids), dim=-1)
    text = None
    for prompt in (ids, [ids]):                  # token ids, and a batch of one
        out = lenient_client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=1,
                                                temperature=0)
        lp = out.choices[0].logprobs
        assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:len(ids)] == pytest.approx([float(ref[p - 1, ids[p]]) for p in range(1, len(ids))],
                                                              abs=1e-4)
        assert all(lp.token_logprobs[p] in top.values() for p, top in enumerate(lp.top_logprobs) if p)
        text = text or out.choices[0].text
        assert out.choices[0].text == text and text.startswith("Knowledge is power.")
        assert out.usage.completion_tokens == 1 and out.usage.prompt_tokens_details.cached_tokens == 0
    scored = lenient_client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1,
                                               extra_body={"prompt_logprobs": 0})
    assert scored.choices[0].text == "Knowledge is power. All that glitters is not gold."
    assert scored.choices[0].logprobs.token_logprobs[0] is None and scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:-1], abs=1e-5)
    plp = scored.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None
    assert [e[str(t)]["logprob"] for e, t in zip(plp[1:], ids[1:])] == scored.choices[0].logprobs.token_logprobs[1:]


def test_cached_tokens_reported_on_repeat(client):
    prompt = "All that glitters is not gold. " * 4
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    cached = 0
    for _ in range(6):        # the second replica may get the first repeat; a few tries reach a warm one
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        cached = max(cached, out.usage.prompt_tokens_details.cached_tokens)
    assert cached >= 4


BAD = [
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens", "invalid_value"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature", "invalid_value"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p", "invalid_value"),
    ({"max_tokens": 3}, 400, "prompt", "invalid_value"),
    ({"prompt": "x", "model": "gpt-7"}, 404, "model", "model_not_found"),
    ({"prompt": "x", "max_tokens": 100000}, 400, "max_tokens", "context_length_exceeded"),
    ({"prompt": [100000, 5]}, 400, "prompt", "invalid_value"),
    ({"prompt": "x", "logprobs": 99}, 400, "logprobs", "invalid_value"),
    ({"prompt": ""}, 400, "prompt", "invalid_value"),
]


@pytest.mark.parametrize("body,status,param,code", BAD)
def test_bad_input_http(app_url, body, status, param, code):
    r = httpx.post(f"{app_url}/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["code"] == code and err["message"]
    assert "Traceback" not in r.text


def test_malformed_json_and_unknown_route(app_url):
    r = httpx.post(f"{app_url}/v1/completions", content=b"{not json", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(f"{app_url}/v1/chat/completions", json={"messages": []}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.get(f"{app_url}/v1/nope", timeout=10)
    assert r.status_code == 404 and "error" in r.json()


def test_request_id_roundtrip(app_url):
    r = httpx.post(f"{app_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                   headers={"x-request-id": "my-req-123"}, timeout=30)
    assert r.status_code == 200 and r.json()["id"] == "my-req-123"
    assert r.headers["x-request-id"] == "my-req-123"


def test_a_reused_request_id_is_only_a_label(app_url):
    """8 concurrent requests carrying one x-request-id (clients and proxies reuse ids): with 2 replicas
    several share one, and none may collide with another in the engine."""
    async def go():
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(*[c.post(f"{app_url}/v1/completions", headers={"x-request-id": "same-id"},
                                                 json={"prompt": f"concurrent {i}", "max_tokens": 16,
                                                       "ignore_eos": True}) for i in range(8)])
    rs = asyncio.run(go())
    assert [r.status_code for r in rs] == [200] * 8, [r.text for r in rs if r.status_code != 200]
    assert all(r.headers["x-request-id"] == "same-id" and r.json()["id"] == "same-id" for r in rs)
    assert all(r.json()["usage"]["completion_tokens"] == 16 for r in rs)


def test_non_json_content_type_is_415(app_url):
    r = httpx.post(f"{app_url}/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}', timeout=30,
                   headers={"content-type": "text/plain"})
    assert r.status_code == 415, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "unsupported_media_type"
    r = httpx.post(f"{app_url}/v1/chat/completions", data={"messages": "x"}, timeout=30)     # form-encoded
    assert r.status_code == 415
    r = httpx.post(f"{app_url}/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}', timeout=30)
    assert r.status_code == 200                                 # no Content-Type at all: read as JSON


def test_best_of(client):
    for kw in (dict(n=2, best_of=1), dict(best_of=2, stream=True)):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2, **kw)
        assert e.value.param == "best_of" and e.value.status_code == 400
    out = client.completions.create(model=MODEL, prompt="Once", max_tokens=5, best_of=3, n=2, temperature=1.0,
                                    seed=3, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1] and all(c.logprobs is None for c in out.choices)
    assert out.usage.completion_tokens == 15                    # every generated sequence is billed


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=100000)
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")


def test_health_and_metrics(app_url):
    r = httpx.get(f"{app_url}/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    r = httpx.post(f"{app_url}/v1/completions", json={"prompt": "metrics please", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{app_url}/v1/completions", json={"prompt": "", "max_tokens": 3}, timeout=30)
    assert r.status_code == 400, r.text           # counted too (the test needs no earlier test's 400s)
    names = ("affinity_time_to_first_token", "affinity_time_per_output_token", "affinity_e2e_request_latency",
             "affinity_prompt_tokens_total", "affinity_generation_tokens_total",
             "affinity_cached_prompt_tokens_total", "affinity_http_requests_total",
             "affinity_replica_running_requests", "affinity_replica_kv_cache_usage",
             "affinity_replica_prefix_cache_hit_rate", "affinity_replica_recent_prefix_cache_hit_rate",
             "affinity_replica_waiting_requests")
    # the replica gauges reach /metrics on the replicas' own pushes (app/metrics_hub.py), not with the
    # request: wait for a scrape that has every series (each is asserted below)
    def scraped() -> str | None:
        text = httpx.get(f"{app_url}/metrics", timeout=10).text
        return text if all(name in text for name in (*names, 'status="200"', 'status="400"')) else None
    text = wait_until(scraped, 30, "every series on /metrics")
    for name in names:
        assert name in text, name
    assert 'status="200"' in text and 'status="400"' in text
    assert "_bucket{" in text and 'replica="' in text
