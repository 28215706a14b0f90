"""Ingress and replica logic built synchronously, with local handles instead of Ray."""
import asyncio
import json
import logging

import pytest

from affinity_serve.app.config import AppConfig
from affinity_serve.app.errors import APIError, to_api_error
from affinity_serve.app.prompts import RequestKind
from affinity_serve.app.protocol import CompletionRequest, GenerateRequest, ReplicaChunk
from affinity_serve.engine import EngineLimits, SamplingParams
from affinity_serve.engine.types import Logprobs
from affinity_serve.engine import EngineConfig
from affinity_serve.app.config import ServeSection
from tests.unit.app.conftest import LocalHandle

LIMITS = EngineLimits(max_model_len=64, vocab_size=10**6, max_kv_tokens=64)


class FakeReplica:
    """Streams what `behaviour(req)` yields; publishes LIMITS."""

    def __init__(self, behaviour, limits=LIMITS):
        self.behaviour = behaviour
        self._limits = limits

    async def generate(self, req):
        async for c in self.behaviour(req):
            yield c

    async def limits(self):
        return self._limits

    async def debug_state(self):
        return {}


def _ingress(checkpoints, behaviour, engine=None, **serve):
    from affinity_serve.app.ingress import Ingress
    cfg = AppConfig.model_validate({"engine": {"model": checkpoints["llama"], **(engine or {})},
                                    "serve": {"first_token_timeout_s": 0.3, **serve}})
    handle = LocalHandle(FakeReplica(behaviour))
    return Ingress(handle, cfg), handle


def _tokens(req, n_tokens=2, text="ab"):
    """A well-behaved replica stream: every sequence yields n_tokens tokens, then finishes."""
    async def gen():
        for i in range(req.sampling_params.n):
            for t in range(n_tokens):
                yield ReplicaChunk("", i, text[t % len(text)], [10 + t], "length" if t == n_tokens - 1 else None,
                                   num_prompt_tokens=len(req.prompt_token_ids), replica_id="r1")
    return gen()


async def test_no_replica_output_is_503_within_bound(checkpoints):
    async def silent(req):
        await asyncio.sleep(3600)
        yield None

    ing, _ = _ingress(checkpoints, silent)
    t = asyncio.get_running_loop().time()
    with pytest.raises(APIError) as e:
        await ing.completions(CompletionRequest(prompt="hi", max_tokens=2))
    assert e.value.status_code == 503 and e.value.retry_after_s == 1
    assert asyncio.get_running_loop().time() - t < 20     # bounded: the replica never answers


async def test_no_replica_answering_for_limits_is_a_503_not_a_hang(checkpoints):
    """/v1/models and a first completion ask a replica for the engine's limits: none up -> a bounded 503."""
    from affinity_serve.app.ingress import Ingress

    class NoLimits(FakeReplica):
        async def limits(self):
            await asyncio.sleep(3600)

    cfg = AppConfig.model_validate({"engine": {"model": checkpoints["llama"]},
                                    "serve": {"first_token_timeout_s": 0.2, "retry_after_s": 7}})
    ing = Ingress(LocalHandle(NoLimits(_tokens)), cfg)
    t = asyncio.get_running_loop().time()
    for r in [await ing.http_models(_http_request(b"", None)),
              await ing._http(RequestKind.COMPLETION, _http_request(b'{"prompt": "hi"}', None))]:
        assert r.status_code == 503 and r.headers["retry-after"] == "7"
        assert json.loads(r.body)["error"]["code"] == "replica_unavailable"
    with pytest.raises(APIError) as e:
        await ing.chat({"messages": [{"role": "user", "content": "x"}]})
    assert (e.value.status_code, e.value.retry_after_s) == (503, 7)
    assert asyncio.get_running_loop().time() - t < 20     # bounded: the replica never answers


async def test_retry_after_is_the_configured_serve_retry_after_s(checkpoints):
    from ray.serve.exceptions import BackPressureError

    from affinity_serve.app.http import error_response

    async def silent(req):
        await asyncio.sleep(3600)
        yield None

    ing, _ = _ingress(checkpoints, silent, retry_after_s=5)
    overload = error_response(ing._fail(BackPressureError(num_queued_requests=3, max_queued_requests=2), "/x"))
    assert overload.status_code == 429 and overload.headers["retry-after"] == "5"
    r = await ing._http(RequestKind.COMPLETION, _http_request(b'{"prompt": "hi", "max_tokens": 2}', None))
    assert r.status_code == 503 and r.headers["retry-after"] == "5"          # no output within the timeout
    with pytest.raises(APIError) as e:
        await ing.completions({"prompt": "hi", "max_tokens": 2})
    assert e.value.retry_after_s == 5
    bad = error_response(ing._fail(APIError("bad", 400), "/x"))
    assert bad.status_code == 400 and "retry-after" not in bad.headers


async def test_failure_after_stream_started_is_an_sse_error_then_done(checkpoints):
    from affinity_serve.app.http import sse

    async def dies(req):
        yield ReplicaChunk("", 0, "Hel", [5], replica_id="r1")
        raise APIError("generation failed inside the engine", 500, "server_error", None, "engine_error")

    ing, _ = _ingress(checkpoints, dies)
    gen = ing.serving.stream(RequestKind.COMPLETION, CompletionRequest(prompt="hi", max_tokens=5, stream=True),
                             "req-1", {})
    first = await gen.__anext__()
    events = [e async for e in sse(first, gen, lambda e: ing._fail(e, "/v1/completions", count=False))]
    assert json.loads(events[0][6:])["choices"][0]["text"] == "Hel"
    err = json.loads(events[1][6:])
    assert err == {"error": {"message": "generation failed inside the engine", "type": "server_error",
                             "param": None, "code": "engine_error"}}
    assert events[-1] == "data: [DONE]\n\n" and len(events) == 3


async def test_limit_and_model_checks_use_the_replicas_limits_before_any_generate(checkpoints):
    ing, handle = _ingress(checkpoints, _tokens)
    with pytest.raises(APIError) as e:
        await ing.completions({"prompt": "hi", "max_tokens": 10**6})
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"
    with pytest.raises(APIError) as e:
        await ing.completions({"prompt": [1] * 64})
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    with pytest.raises(APIError) as e:
        await ing.chat({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})
    assert e.value.param == "top_logprobs"
    with pytest.raises(APIError) as e:
        await ing.completions({"prompt": "hi", "model": "gpt-7"})
    assert e.value.status_code == 404
    assert [name for name, _ in handle.calls] == ["limits"]          # asked once, cached; nothing generated
    assert (await ing.models())["data"][0]["max_model_len"] == 64


async def test_vocabulary_check_comes_from_the_published_limits(checkpoints):
    from affinity_serve.app.ingress import Ingress
    cfg = AppConfig.model_validate({"engine": {"model": checkpoints["llama"]}})
    ing = Ingress(LocalHandle(FakeReplica(_tokens, EngineLimits(64, 100, 64))), cfg)
    with pytest.raises(APIError) as e:
        await ing.completions({"prompt": [5, 100]})
    assert (e.value.status_code, e.value.param, e.value.code) == (400, "prompt", "invalid_value")
    assert (await ing.completions({"prompt": [5, 99], "max_tokens": 2}))["usage"]["prompt_tokens"] == 2


async def test_reused_client_request_id_never_becomes_the_engine_key(checkpoints):
    seen: list[GenerateRequest] = []

    def record(req):
        seen.append(req)
        return _tokens(req)

    ing, _ = _ingress(checkpoints, record)
    outs = await asyncio.gather(*[ing.completions({"prompt": "hi", "max_tokens": 2}, request_id="same")
                                  for _ in range(4)])
    multi = await ing.completions({"prompt": ["a", "b"], "max_tokens": 2, "request_id": "body-id"})
    assert all(o["id"] == "same" for o in outs) and multi["id"] == "body-id"
    assert [r.request_id for r in seen] == ["same"] * 4 + ["body-id"] * 2
    assert len({r.req_id for r in seen}) == 6 and not {r.req_id for r in seen} & {"same", "body-id"}


async def test_same_client_id_concurrently_on_one_real_replica(checkpoints):
    """The defect end to end: one replica, 8 concurrent requests carrying one id -> all succeed."""
    from affinity_serve.app.ingress import Ingress
    from affinity_serve.app.replica import LLMReplica
    rep = LLMReplica(EngineConfig(model=checkpoints["llama"], cache={"num_blocks": 64, "block_size": 4}))
    cfg = AppConfig.model_validate({"engine": {"model": checkpoints["llama"]}})
    ing = Ingress(LocalHandle(rep), cfg)
    outs = await asyncio.gather(*[ing.completions({"prompt": f"hello {i}", "max_tokens": 6, "ignore_eos": True},
                                                  request_id="dup") for i in range(8)])
    assert all(o["id"] == "dup" and o["usage"]["completion_tokens"] == 6 for o in outs)
    await rep.engine.shutdown()


def test_error_mapping_table():
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    from affinity_serve.engine.errors import ContextLengthExceededError, EngineDeadError, InvalidRequestError
    cases = [
        (BackPressureError(num_queued_requests=3, max_queued_requests=2), 429, "rate_limit_error"),
        (DeploymentUnavailableError.__new__(DeploymentUnavailableError), 503, "service_unavailable"),
        (EngineDeadError("x"), 503, "service_unavailable"),
        (ContextLengthExceededError("too long"), 400, "invalid_request_error"),
        (InvalidRequestError("bad", param="top_p"), 400, "invalid_request_error"),
        (RuntimeError("secret internals\nTraceback"), 500, "server_error"),
    ]
    for exc, status, typ in cases:
        err = to_api_error(exc)
        assert (err.status_code, err.type) == (status, typ), exc
    assert to_api_error(RuntimeError("secret internals")).message == "internal server error"
    assert to_api_error(BackPressureError(num_queued_requests=3, max_queued_requests=2)).retry_after_s == 1


def test_app_config_yaml_and_strictness(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("engine:\n  model: /models/x\n  cache: {block_size: 32}\nserve:\n  num_replicas: 3\n")
    cfg = AppConfig.from_yaml(p)
    assert cfg.engine.cache.block_size == 32 and cfg.serve.num_replicas == 3 and cfg.serve.host == "127.0.0.1"
    p.write_text("serve:\n  num_replicaz: 3\n")
    with pytest.raises(Exception, match="num_replicaz"):
        AppConfig.from_yaml(p)


# ---------------------------------------------------------------- best_of (OpenAI conformance)
@pytest.mark.parametrize("body", [{"n": 3, "best_of": 2}, {"best_of": 2, "stream": True}])
async def test_best_of_smaller_than_n_or_streamed_is_a_400_naming_best_of(checkpoints, body):
    ing, handle = _ingress(checkpoints, _tokens)
    with pytest.raises(APIError) as e:
        if body.get("stream"):
            [c async for c in ing.completions_stream({"prompt": "hi", "max_tokens": 2, **body})]
        else:
            await ing.completions({"prompt": "hi", "max_tokens": 2, **body})
    assert (e.value.status_code, e.value.param) == (400, "best_of")
    assert [name for name, _ in handle.calls] == ["limits"]


async def test_best_of_returns_the_n_most_likely_of_best_of_and_bills_them_all(checkpoints):
    seen = []
    scores = [-3.0, -0.5, -2.0, -1.0]        # sequence i: two tokens, each with logprob scores[i] / 2

    async def scored(req):
        seen.append(req)
        for i in range(req.sampling_params.n):
            lp = Logprobs(7, scores[i] / 2, 1, [], [])
            yield ReplicaChunk("", i, f"s{i}", [7], None, logprobs=[lp], replica_id="r1")
            yield ReplicaChunk("", i, "!", [7], "length", logprobs=[lp], replica_id="r1")

    ing, _ = _ingress(checkpoints, scored)
    out = await ing.completions({"prompt": "hi", "max_tokens": 2, "n": 2, "best_of": 4})
    # ranking needs each token's logprob
    assert seen[0].sampling_params.n == 4 and seen[0].sampling_params.logprobs == 0
    assert [c["text"] for c in out["choices"]] == ["s1!", "s3!"] and [c["index"] for c in out["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in out["choices"])           # not asked for
    assert out["usage"]["completion_tokens"] == 8                       # all best_of sequences
    out = await ing.completions({"prompt": "hi", "max_tokens": 2, "best_of": 4, "logprobs": 1})
    assert [c["text"] for c in out["choices"]] == ["s1!"]
    assert out["choices"][0]["logprobs"]["token_logprobs"] == [-0.25, -0.25]


async def test_stream_holds_a_siblings_chunks_until_its_prompts_logprobs_arrive(checkpoints):
    """The engine scores a prompt once, on sequence 0 with its first token: sequence 1 may come first."""
    async def sibling_first(req):
        prompt_lps = [None] + [Logprobs(t, -1.0, 1, [], []) for t in req.prompt_token_ids[1:]]
        yield ReplicaChunk("", 1, "x", [7], None, logprobs=[Logprobs(7, -0.5, 1, [], [])], replica_id="r1")
        yield ReplicaChunk("", 0, "y", [8], None, logprobs=[Logprobs(8, -0.5, 1, [], [])], prompt_logprobs=prompt_lps,
                           replica_id="r1")
        yield ReplicaChunk("", 1, "z", [9], "length", logprobs=[Logprobs(9, -0.5, 1, [], [])], replica_id="r1")
        yield ReplicaChunk("", 0, "w", [9], "length", logprobs=[Logprobs(9, -0.5, 1, [], [])], replica_id="r1")

    ing, _ = _ingress(checkpoints, sibling_first)
    body = {"prompt": [5, 6], "n": 2, "max_tokens": 2, "echo": True, "logprobs": 0, "stream": True}
    chunks = [c["choices"][0] async for c in ing.completions_stream(body)]
    assert [(c["index"], c["logprobs"]["token_logprobs"]) for c in chunks] == [
        (0, [None, -1.0, -0.5]), (1, [None, -1.0, -0.5]), (1, [-0.5]), (0, [-0.5])]
    assert all(chunks[i]["text"].endswith(("y", "x")[i]) for i in (0, 1))


async def test_missing_prompt_logprobs_are_a_server_error_not_zeros(checkpoints):
    ing, _ = _ingress(checkpoints, _tokens)          # a replica that never sends them
    for body in ({"prompt": "hi", "echo": True, "logprobs": 1}, {"prompt": "hi", "prompt_logprobs": 1}):
        with pytest.raises(APIError) as e:
            await ing.completions(body)
        assert e.value.status_code == 500
    with pytest.raises(APIError) as e:
        [c async for c in ing.completions_stream({"prompt": "hi", "echo": True, "logprobs": 1, "stream": True})]
    assert e.value.status_code == 500


# ---------------------------------------------------------------- token-ids-only mode
async def test_token_ids_only_mode_loads_no_tokenizer_and_refuses_text(checkpoints, monkeypatch):
    import affinity_serve.app.ingress  # noqa: F401
    from affinity_serve import app
    def no_tokenizer(path):
        raise AssertionError("no tokenizer may be loaded in token-ids-only mode")

    monkeypatch.setattr(app.ingress, "load_tokenizer", no_tokenizer)

    async def with_logprobs(req):
        lp = Logprobs(11, -0.1, 1, [11, 12], [-0.1, -2.0])
        assert req.sampling_params.prompt_logprobs == 1        # echo + logprobs: the prompt is scored too
        prompt_lps = [None] + [Logprobs(t, -1.0, 2, [12], [-0.5]) for t in req.prompt_token_ids[1:]]
        yield ReplicaChunk("", 0, "", [11], "length", logprobs=[lp], prompt_logprobs=prompt_lps, replica_id="r1")

    ing, _ = _ingress(checkpoints, with_logprobs, engine={"skip_tokenizer_init": True})
    for call, body, param in [(ing.completions, {"prompt": "text"}, "prompt"),
                              (ing.completions, {"prompt": ["a", "b"]}, "prompt"),
                              (ing.chat, {"messages": [{"role": "user", "content": "x"}]}, "messages"),
                              (ing.completions, {"prompt": [1, 2], "stop": ["x"]}, "stop")]:
        with pytest.raises(APIError) as e:
            await call(body)
        assert (e.value.status_code, e.value.param) == (400, param)
        assert "token ids" in e.value.message
    out = await ing.completions({"prompt": [1, 2, 3], "max_tokens": 1, "logprobs": 1, "echo": True})
    choice = out["choices"][0]          # the echo of a token-id prompt without a tokenizer is "", as in vLLM
    assert choice["text"] == "" and choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in (1, 2, 3, 11)]
    assert choice["logprobs"]["top_logprobs"] == [None, {"token_id:2": -1.0, "token_id:12": -0.5},
                                                  {"token_id:3": -1.0, "token_id:12": -0.5},
                                                  {"token_id:11": -0.1}]     # logprobs 1: the top one


# ---------------------------------------------------------------- HTTP body: 415 and friends
def _http_request(body: bytes, content_type: str | None):
    from starlette.requests import Request
    headers = [(b"content-length", str(len(body)).encode())]
    if content_type is not None:
        headers.append((b"content-type", content_type.encode()))
    sent = False

    async def receive():
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers, "query_string": b""}
    return Request(scope, receive)


@pytest.mark.parametrize("content_type,status", [
    ("text/plain", 415), ("application/x-www-form-urlencoded", 415), ("multipart/form-data; boundary=x", 415),
    ("application/json", 200), ("application/json; charset=utf-8", 200), ("application/vnd.api+json", 200),
    (None, 200),
])
async def test_non_json_content_type_is_a_415_in_the_openai_envelope(checkpoints, content_type, status):
    ing, _ = _ingress(checkpoints, _tokens)
    r = await ing._http(RequestKind.COMPLETION, _http_request(b'{"prompt": "hi", "max_tokens": 2}', content_type))
    assert r.status_code == status, r.body
    if status == 415:
        err = json.loads(r.body)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "unsupported_media_type"
        assert "application/json" in err["message"]


# ---------------------------------------------------------------- errors are logged once, by kind
async def test_unexpected_ingress_error_logs_its_traceback_once_and_4xx_without(checkpoints, app_logs):
    async def broken(req):
        raise KeyError("a bug")
        yield

    ing, _ = _ingress(checkpoints, broken)
    r = await ing._http(RequestKind.COMPLETION, _http_request(b'{"prompt": "hi", "max_tokens": 2}', None))
    assert r.status_code == 500 and b"Traceback" not in r.body and b"a bug" not in r.body
    failed = [rec for rec in app_logs.records if rec.levelno >= logging.ERROR]
    assert len(failed) == 1 and failed[0].exc_info and "a bug" in app_logs.text
    app_logs.clear()
    r = await ing._http(RequestKind.COMPLETION, _http_request(b'{"prompt": "hi", "max_tokens": 0}', None))
    assert r.status_code == 400
    rejected = [rec for rec in app_logs.records if getattr(rec, "status", None) == 400]
    assert len(rejected) == 1 and rejected[0].levelno == logging.INFO and not rejected[0].exc_info


async def test_engine_step_failure_traceback_logged_once_by_the_engine_with_ids(checkpoints, app_logs,
                                                                               monkeypatch):
    from affinity_serve.app.replica import LLMReplica
    rep = LLMReplica(EngineConfig(model=checkpoints["llama"], cache={"num_blocks": 32, "block_size": 4}))

    def boom(so):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(rep.engine.engine.runner, "execute_model", boom)
    req = GenerateRequest("engine-key-1", [5, 6, 7], SamplingParams(max_tokens=3), request_id="client-1")
    with pytest.raises(APIError) as e:
        async for _ in rep.generate(req):
            pass
    assert e.value.status_code == 500 and "kernel exploded" not in e.value.message
    with_trace = [rec for rec in app_logs.records if rec.exc_info]
    assert len(with_trace) == 1 and "engine-key-1" in with_trace[0].getMessage()
    failed = next(rec for rec in app_logs.records if rec.getMessage() == "sequence failed")
    assert failed.levelno == logging.ERROR and not failed.exc_info
    assert (failed.request_id, failed.req_id) == ("client-1", "engine-key-1")
    await rep.engine.shutdown()


# ---------------------------------------------------------------- replica surface
async def test_replica_reports_typed_small_stats_and_publishes_limits(checkpoints):
    from affinity_serve.app.replica import LLMReplica
    from affinity_serve.app.routing import ReplicaLoadView
    from affinity_serve.app.stats import ROUTING_STATS_FIELDS
    rep = LLMReplica(EngineConfig(model=checkpoints["llama"], cache={"num_blocks": 32, "block_size": 4}),
                     serve=ServeSection(wedge_timeout_s=0.05))
    chunks = [c async for c in rep.generate(GenerateRequest("a", [5, 6, 7], SamplingParams(max_tokens=3,
                                                                                         temperature=0)))]
    last = chunks[-1]
    assert last.finish_reason == "length" and last.timings
    assert last.trace_id is not None
    stats = rep.record_routing_stats()
    assert isinstance(stats, dict) and len(json.dumps(stats)) < 350      # EngineLoad's names: ~310
    load = rep.stats()
    assert set(stats) == {*ROUTING_STATS_FIELDS, "taken_at", "step_time_s"}
    assert all(stats[f] == getattr(load, f) for f in ROUTING_STATS_FIELDS if f != "kv_cache_usage")
    assert stats["prefix_cache_queries_total"] == 3 and stats["num_running_reqs"] == 0
    # the mean of the recent steps that decoded (the two after the prefill step), as the router reads it
    decoding = [s.step_time_s for s in load.recent_steps if s.num_decode_seqs > 0]
    assert len(decoding) == 2 and stats["step_time_s"] == pytest.approx(sum(decoding) / 2, abs=6e-5)
    view = ReplicaLoadView.from_stats(stats)
    assert (view.num_running, view.num_blocks, view.cache_epoch) == (0, 32, load.cache_epoch)
    assert view.step_time_s == stats["step_time_s"]
    prompt = list(range(20, 30))
    for rid in ("b", "c"):
        [c async for c in rep.generate(GenerateRequest(rid, prompt, SamplingParams(max_tokens=1)))]
    recent = rep.stats()
    assert (recent.recent_prefix_cache_queries, recent.recent_prefix_cache_hits) == (23, 8)
    assert recent.recent_prefix_hit_rate == 8 / 23
    stats = rep.record_routing_stats()
    assert all(isinstance(v, float) for v in rep.record_autoscaling_stats().values())
    assert await rep.limits() == EngineLimits(max_model_len=124, vocab_size=rep.engine.limits.vocab_size,
                                              max_kv_tokens=124, block_size=4)
    await rep.check_health()
    epoch = stats["cache_epoch"]
    assert await rep.reset_prefix_cache() and rep.record_routing_stats()["cache_epoch"] != epoch
    state = await rep.debug_state()
    assert state["num_free_blocks"] == state["num_blocks"] - 1 and state["num_requests"] == 0
    await rep.engine.shutdown()


async def test_replica_detects_a_wedged_step(checkpoints, monkeypatch):
    import threading

    from affinity_serve.app.replica import LLMReplica
    from affinity_serve.engine.errors import EngineDeadError
    rep = LLMReplica(EngineConfig(model=checkpoints["llama"], cache={"num_blocks": 32, "block_size": 4}),
                     serve=ServeSection(wedge_timeout_s=0.1))
    release = threading.Event()
    real_step = rep.engine.engine.step

    def stuck_step():
        release.wait(10)
        return real_step()

    monkeypatch.setattr(rep.engine.engine, "step", stuck_step)

    async def consume():
        return [c async for c in rep.generate(GenerateRequest("w", [5, 6], SamplingParams(max_tokens=2)))]

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.3)
    with pytest.raises(EngineDeadError, match="wedged"):
        await rep.check_health()
    release.set()
    assert (await asyncio.wait_for(task, 10))[-1].finish_reason is not None
    await rep.check_health()
    await rep.engine.shutdown()


def test_serve_does_not_log_our_api_errors_a_second_time(app_logs):
    from ray.serve.exceptions import BackPressureError

    from affinity_serve.app.errors import _AlreadyLogged, drop_serve_duplicate_logs
    drop_serve_duplicate_logs()
    drop_serve_duplicate_logs()
    serve_logger = logging.getLogger("ray.serve")
    serve_logger.addHandler(app_logs.handler)
    try:
        for exc in (APIError("bad", 400), RuntimeError("a bug")):
            try:
                raise exc
            except Exception:
                serve_logger.exception("Request failed.")
        # Serve's router, once per request refused at max_queued_requests (the ingress logs its 429s)
        for _ in range(3):
            serve_logger.warning(BackPressureError(num_queued_requests=1, max_queued_requests=1).message)
        serve_logger.warning("Replica %s is slow", "r1")         # anything else of Serve's is kept
    finally:
        serve_logger.removeHandler(app_logs.handler)
    kept = [r for r in app_logs.records if r.name == "ray.serve"]
    assert len(kept) == 2 and isinstance(kept[0].exc_info[1], RuntimeError), [r.getMessage() for r in kept]
    assert kept[1].getMessage() == "Replica r1 is slow"
    assert sum(isinstance(f, _AlreadyLogged) for f in serve_logger.filters) == 1      # idempotent


async def test_handle_calls_are_counted_by_method_and_status(checkpoints):
    """DeploymentHandle callers' requests were in no metric (affinity_http_requests counts HTTP only): each
    inference method's calls count by status, a stream when it ends, a failure after its first chunk as that
    failure; HTTP's counter is left alone."""
    async def dies_after_one(req):
        yield ReplicaChunk("", 0, "Hel", [5], replica_id="r1")
        raise APIError("generation failed inside the engine", 500, "server_error", None, "engine_error")

    ing, handle = _ingress(checkpoints, lambda req: _tokens(req))
    seen, http = [], []
    ing.metrics.record_handle = lambda method, status: seen.append((method, status))
    ing.metrics.record_http = lambda route, status: http.append((route, status))
    await ing.completions({"prompt": "hi", "max_tokens": 2})
    await ing.chat({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert [c async for c in ing.completions_stream({"prompt": "hi", "max_tokens": 2})]
    with pytest.raises(APIError):
        await ing.completions({"prompt": "hi", "max_tokens": -1})
    with pytest.raises(APIError):
        [c async for c in ing.chat_stream({"messages": "not a list"})]
    handle._target.behaviour = dies_after_one
    with pytest.raises(APIError):
        [c async for c in ing.completions_stream({"prompt": "hi", "max_tokens": 5})]
    assert seen == [("completions", 200), ("chat", 200), ("completions_stream", 200), ("completions", 400),
                    ("chat_stream", 400), ("completions_stream", 500)]
    assert http == []
