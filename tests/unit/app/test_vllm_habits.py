"""Issue 32.7: vLLM's habits. `vllm serve`'s flags, /tokenize, /detokenize, /v1/models/{id}, and Serve's own
autoscaling field names (accepted, or refused naming what to write)."""
from __future__ import annotations

import json

import pytest
import ray

from affinity_serve.app.cli import main
from affinity_serve.app.config import AppConfig, ConfigError
from affinity_serve.engine import load_tokenizer
from tests.unit.app.test_hostile_inputs import http_request, ingress


# ---------------------------------------------------------------- the command line as vLLM spells it
class _Stop(Exception):
    pass


def test_vllm_flags_override_the_config(checkpoints, tmp_path, monkeypatch):
    seen: list = []

    def stop(cfg, **kw):
        seen.append(cfg)
        raise _Stop
    monkeypatch.setattr("affinity_serve.app.cli.check_model", stop)
    monkeypatch.setattr(ray, "init", lambda *a, **k: (_ for _ in ()).throw(AssertionError("Ray started")))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({"engine": {"max_model_len": 64}, "serve": {"model_name": "from-file"}}))
    with pytest.raises(_Stop):
        main(["serve", checkpoints["llama"], "--config", str(cfg), "--served-model-name", "my-model",
              "--max-model-len", "32", "--host", "127.0.0.2", "--port", "8123", "--dtype", "float32",
              "--max-num-seqs", "7", "--block-size", "8"])
    (c,) = seen
    assert (c.engine.model, c.serve.model_name, c.engine.max_model_len) == (checkpoints["llama"], "my-model", 32)
    assert (c.serve.host, c.serve.port, c.engine.dtype) == ("127.0.0.2", 8123, "float32")
    assert (c.engine.scheduler.max_num_seqs, c.engine.cache.block_size) == (7, 8)


def test_version_and_a_conflicting_model(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("affinity-serve ")
    assert main(["serve", "/a", "--model", "/b"]) == 2
    assert "MODEL '/a' and --model '/b' differ" in capsys.readouterr().err


# ---------------------------------------------------------------- /tokenize, /detokenize, /v1/models/{id}
async def _call(route, body: dict | None = None, *args):
    r = await route(*args, http_request(json.dumps(body or {}).encode(), method="POST" if body else "GET"))
    return r.status_code, json.loads(r.body)


async def test_tokenize_is_what_the_completions_and_chat_apis_run(checkpoints):
    ing, _ = ingress(checkpoints)
    tok = load_tokenizer(checkpoints["llama"])
    status, out = await _call(ing.http_tokenize, {"prompt": "Once upon a time"})
    ids = tok.encode("Once upon a time")
    assert status == 200 and out == {"count": len(ids), "max_model_len": 64, "tokens": ids, "token_strs": None}
    status, out = await _call(ing.http_tokenize, {"prompt": "Once", "add_special_tokens": False,
                                                  "return_token_strs": True})
    assert out["tokens"] == tok.encode("Once", add_special_tokens=False)
    assert "".join(out["token_strs"]).strip() == "Once"
    messages = [{"role": "user", "content": "hi there"}]
    status, out = await _call(ing.http_tokenize, {"messages": messages})
    p = await ing.serving.prepare(_chat_kind(), _chat(messages), "r1")
    assert status == 200 and out["tokens"] == p.prompts[0]
    _, bare = await _call(ing.http_tokenize, {"messages": messages, "add_generation_prompt": False})
    assert bare["tokens"] == out["tokens"][:len(bare["tokens"])] and bare["count"] < out["count"]


def _chat_kind():
    from affinity_serve.app.prompts import RequestKind
    return RequestKind.CHAT


def _chat(messages):
    from affinity_serve.app.protocol import ChatCompletionRequest
    return ChatCompletionRequest(messages=messages)


async def test_detokenize_round_trips_and_bad_bodies_are_400(checkpoints):
    ing, _ = ingress(checkpoints)
    tok = load_tokenizer(checkpoints["llama"])
    ids = tok.encode("hello world", add_special_tokens=False)
    status, out = await _call(ing.http_detokenize, {"tokens": ids})
    assert status == 200 and out == {"prompt": tok.decode(ids)}
    for body, param in [({"tokens": [len(tok)]}, "tokens"), ({"tokens": [-1]}, "tokens"),
                        ({}, None), ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None),
                        ({"prompt": "a", "junk": 1}, "junk")]:
        route = ing.http_detokenize if "tokens" in body else ing.http_tokenize
        status, out = await _call(route, body or {"model": None})
        assert status == 400 and out["error"]["type"] == "invalid_request_error", (body, out)
        if param:
            assert param in (out["error"]["param"] or ""), out
    status, out = await _call(ing.http_tokenize, {"model": "other", "prompt": "a"})
    assert status == 404 and out["error"]["code"] == "model_not_found"


async def test_retrieve_model_by_id(checkpoints):
    ing, _ = ingress(checkpoints, model_name="org/tiny")
    status, out = await _call(ing.http_model, None, "org/tiny")
    assert status == 200 and out["id"] == "org/tiny" and out["object"] == "model" and out["max_model_len"] == 64
    status, out = await _call(ing.http_model, None, "gpt-4")
    assert status == 404 and out["error"]["code"] == "model_not_found"
    ing, _ = ingress(checkpoints, model_name="k", api_key="sk-secret-key-123456")
    status, _ = await _call(ing.http_model, None, "k")
    assert status == 401


# ---------------------------------------------------------------- autoscaling: Serve's field names
def test_serve_autoscaling_names_are_accepted_or_refused_with_the_right_name():
    from affinity_serve.app.builder import autoscaling_config
    cfg = AppConfig.from_dict({"autoscaling": {"enabled": True, "policy": "requests", "min_replicas": 1,
                                               "max_replicas": 4, "initial_replicas": 3, "upscaling_factor": 1.5,
                                               "downscaling_factor": 0.5}})
    out = autoscaling_config(cfg)
    assert (out["initial_replicas"], out["upscaling_factor"], out["downscaling_factor"]) == (3, 1.5, 0.5)
    for key, hint in [("target_num_ongoing_requests_per_replica", "target_ongoing_requests"),
                      ("smoothing_factor", "upscaling_factor and downscaling_factor"),
                      ("max_ongoing_requests", "serve.max_ongoing_requests")]:
        with pytest.raises(ConfigError) as e:
            AppConfig.from_dict({"autoscaling": {key: 1}})
        assert e.value.problems == [f"autoscaling.{key}: unknown key (a Ray Serve autoscaling_config name; here "
                                    f"use {hint}" + e.value.problems[0].split(hint, 1)[1]], e.value.problems
    with pytest.raises(ConfigError) as e:
        AppConfig.from_dict({"autoscaling": {"policy": "engine", "upscaling_factor": 2}})
    assert "max_upscale_factor" in str(e.value)
    with pytest.raises(ConfigError) as e:
        AppConfig.from_dict({"autoscaling": {"min_replicas": 2, "max_replicas": 3, "initial_replicas": 5}})
    assert "initial_replicas (5) must be within" in str(e.value)
