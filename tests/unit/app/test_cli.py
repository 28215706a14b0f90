"""Start-up errors: a bad config or checkpoint prints one message and exits 2, before Ray starts."""
import json
import shutil

import pytest
import ray

from affinity_serve.app.cli import main
from affinity_serve.engine.config import EngineConfig
from affinity_serve.engine.errors import ModelLoadError


class _RayStarted(Exception):
    pass


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    """Starting Ray raises _RayStarted: a test that expects exit 2 fails if the CLI got that far. (Ray may
    already be up in this process for the integration tests, so `ray.is_initialized()` proves nothing.)"""
    def refuse(*a, **kw):
        raise _RayStarted
    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)     # serve_cmd sets it; keep it out of other tests


def _serve(tmp_path, capsys, engine: dict, cmd: str = "serve") -> tuple[int, str]:
    p = tmp_path / "c.yaml"
    p.write_text(json.dumps({"engine": engine}))           # JSON is YAML
    rc = main([cmd, "--config", str(p)])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


def _copy(checkpoints, tmp_path) -> str:
    return str(shutil.copytree(checkpoints["llama"], tmp_path / "m"))


def _engine_message(model: str, **kw) -> str:
    from affinity_serve.engine.llm_engine import LLMEngine
    with pytest.raises(ModelLoadError) as ei:
        LLMEngine.from_config(EngineConfig(model=model, **kw))
    return str(ei.value)


def test_bad_key_and_bad_value_name_the_dotted_key(tmp_path, capsys):
    for cmd in ("serve", "config"):
        rc, err = _serve(tmp_path, capsys, {"model": "/m", "linear_backen": "torch", "cache": {"block_size": 0}}, cmd)
        assert rc == 2
        assert sorted(err.splitlines()[1:]) == [
            "  engine.cache.block_size: Input should be greater than or equal to 1 (got 0)",
            "  engine.linear_backen: unknown key (did you mean 'linear_backend'?)"]
    assert main(["serve", "--model", "/m", "--port", "70000"]) == 2
    assert "serve.port: Input should be less than or equal to 65535 (got 70000)" in capsys.readouterr().err


def test_config_command_accepts_the_engine_keys_the_readme_documents(tmp_path, capsys):
    rc = main(["config", "--config", str(_write(tmp_path, "engine: {linear_backend: torch, cpu_kernels: false}"))])
    out = capsys.readouterr().out
    assert rc == 0 and "linear_backend: torch" in out and "cpu_kernels: false" in out


def _write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_missing_model_dir(tmp_path, capsys):
    missing = str(tmp_path / "nonexistent")
    rc, err = _serve(tmp_path, capsys, {"model": missing})
    assert rc == 2 and "is not a directory" in err
    assert err.strip() == f"affinity-serve: error: engine.model: {_engine_message(missing)}"


def test_model_dir_without_weights(checkpoints, tmp_path, capsys):
    d = _copy(checkpoints, tmp_path)
    (tmp_path / "m" / "model.safetensors").unlink()
    rc, err = _serve(tmp_path, capsys, {"model": d})
    assert rc == 2 and "no model.safetensors or model.safetensors.index.json" in err
    assert _engine_message(d) in err


def test_unsupported_architecture(checkpoints, tmp_path, capsys):
    d = _copy(checkpoints, tmp_path)
    cfg_file = tmp_path / "m" / "config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "architectures": ["GPT2LMHeadModel"]}))
    rc, err = _serve(tmp_path, capsys, {"model": d})
    assert rc == 2 and "unsupported architecture ['GPT2LMHeadModel']" in err
    assert _engine_message(d) in err


def test_missing_tokenizer_names_files_and_token_ids_only_mode_passes_the_check(checkpoints, tmp_path, capsys):
    d = _copy(checkpoints, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "m" / name).unlink()
    rc, err = _serve(tmp_path, capsys, {"model": d})
    assert rc == 2 and "looked for tokenizer.json, tokenizer.model" in err and "skip_tokenizer_init: true" in err
    assert _engine_message(d) in err
    with pytest.raises(_RayStarted):                    # the checks pass: the next step is starting Ray
        _serve(tmp_path, capsys, {"model": d, "skip_tokenizer_init": True})


def test_max_model_len_beyond_the_model_is_caught_before_ray(checkpoints, tmp_path, capsys):
    d = _copy(checkpoints, tmp_path)
    positions = json.loads((tmp_path / "m" / "config.json").read_text())["max_position_embeddings"]
    rc, err = _serve(tmp_path, capsys, {"model": d, "max_model_len": positions + 1})
    assert rc == 2
    assert err.startswith("affinity-serve: error: invalid configuration")
    assert f"engine.max_model_len: max_model_len {positions + 1} exceeds this model's limit of {positions}" in err


def test_cuda_without_a_gpu_is_caught_before_ray(checkpoints, tmp_path, capsys, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc, err = _serve(tmp_path, capsys, {"model": _copy(checkpoints, tmp_path), "device": "cuda"})
    assert rc == 2 and "engine.device: 'cuda' but this machine has no usable CUDA GPU" in err


def test_an_unsafe_shared_store_root_is_caught_before_ray(checkpoints, tmp_path, capsys):
    """Issue 26: a shared store root others may write is refused once, naming it, before Ray starts."""
    import os
    root = tmp_path / "store"
    root.mkdir()
    os.chmod(root, 0o777)
    rc, err = _serve(tmp_path, capsys, {"model": _copy(checkpoints, tmp_path),
                                        "kv_connector": {"type": "shared", "shared_dir": str(root)}})
    assert rc == 2 and "engine.kv_connector.shared_dir" in err and str(root) in err


@pytest.mark.parametrize("cmd", ["serve", "config"])
def test_pd_with_a_sliding_window_model_is_refused_before_ray(tmp_path, capsys, cmd):
    """Issue 31: a connector that cannot move a hybrid model's per-group tables is one line, exit 2, before Ray
    starts (serve checks the checkpoint, config a local one too); offload and shared pass."""
    from tests.unit.engine.tiny_hf import write_tiny_hf
    d = str(write_tiny_hf(tmp_path / "mistral", "MistralConfig", sliding_window=16))
    capsys.readouterr()                                 # transformers' progress bar while writing it
    rc, err = _serve(tmp_path, capsys, {"model": d, "kv_connector": {"type": "pd"}}, cmd=cmd)
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "engine.kv_connector.type: 'pd'" in err and "sliding-window layers" in err
    if cmd == "serve":
        with pytest.raises(_RayStarted):
            _serve(tmp_path, capsys, {"model": d, "kv_connector": {"type": "offload"}})
    else:
        assert _serve(tmp_path, capsys, {"model": d, "kv_connector": {"type": "shared"}}, cmd=cmd)[0] == 0


def test_config_checks_a_local_checkpoint_as_serve_does_and_says_what_it_left(checkpoints, tmp_path, capsys):
    """`config` runs serve's checkpoint checks on a checkpoint directory here (it used to check only the engine
    support), says what it checked, and says so when the model is not here to check."""
    d = _copy(checkpoints, tmp_path)
    rc, err = _serve(tmp_path, capsys, {"model": d}, cmd="config")
    assert rc == 0 and "checked the checkpoint at" in err and "device, dtype and KV tier" in err
    (tmp_path / "m" / "tokenizer.json").write_text("{not json")
    rc, err = _serve(tmp_path, capsys, {"model": d}, cmd="config")
    assert rc == 2 and err.startswith("affinity-serve: error: engine.model:") and "tokenizer" in err
    (tmp_path / "m" / "model.safetensors").unlink()
    rc, err = _serve(tmp_path, capsys, {"model": d}, cmd="config")
    assert rc == 2 and "no model.safetensors or model.safetensors.index.json" in err
    rc, err = _serve(tmp_path, capsys, {"model": "Qwen/Qwen3-0.6B"}, cmd="config")
    assert rc == 0 and "is not a checkpoint directory on this machine" in err
