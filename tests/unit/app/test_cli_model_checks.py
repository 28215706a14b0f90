"""The start-up check (before Ray) catches what would otherwise fail in every replica after the deploy: weights
config.json asks for that the file lacks, an unreadable weight file, a broken tokenizer, float16 where the
replicas run on CPU. Each is one line, exit 2, and Ray never starts."""
import json
import re
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from affinity_serve.app.cli import main
from tests.unit.app.ray_guard import RayStarted, no_ray  # noqa: F401 (the fixture)


pytestmark = pytest.mark.usefixtures("no_ray")


def _serve(tmp_path, capsys, engine: dict) -> tuple[int, str]:
    p = tmp_path / "c.yaml"
    p.write_text(json.dumps({"engine": engine}))
    rc = main(["serve", "--config", str(p)])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


def _one_line_exit_2(tmp_path, capsys, engine: dict, pattern: str) -> None:
    rc, err = _serve(tmp_path, capsys, engine)
    assert rc == 2
    assert len(err.strip().splitlines()) == 1, err
    assert re.search(pattern, err), err


def _copy(checkpoints, tmp_path) -> Path:
    return Path(shutil.copytree(checkpoints["llama"], tmp_path / "m"))


@pytest.mark.parametrize("change, pattern", [
    (dict(num_hidden_layers=3), r"engine\.model: checkpoint is missing weights config\.json asks for"),
    (dict(attention_bias=True), r"missing weights .*self_attn\.qkv_proj\.bias"),
    (dict(mlp_bias=True), r"missing weights .*mlp\.gate_up_proj\.bias"),
])
def test_weights_the_file_lacks(checkpoints, tmp_path, capsys, change, pattern):
    d = _copy(checkpoints, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **change}))
    _one_line_exit_2(tmp_path, capsys, {"model": str(d)}, pattern)


def test_untied_without_lm_head(checkpoints, tmp_path, capsys):
    d = _copy(checkpoints, tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    _one_line_exit_2(tmp_path, capsys, {"model": str(d)}, "no lm_head.weight and tie_word_embeddings is false")


def test_a_truncated_weight_file(checkpoints, tmp_path, capsys):
    d = _copy(checkpoints, tmp_path)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:len(data) // 2])
    _one_line_exit_2(tmp_path, capsys, {"model": str(d)}, r"cannot read weight file 'model\.safetensors'")


def test_a_broken_tokenizer_json(checkpoints, tmp_path, capsys):
    d = _copy(checkpoints, tmp_path)
    (d / "tokenizer.json").write_text('{"version": "1.0", "truncated')
    _one_line_exit_2(tmp_path, capsys, {"model": str(d)}, r"engine\.model: could not load a tokenizer from")
    with pytest.raises(RayStarted):                    # token-ids-only mode loads no tokenizer: it passes
        _serve(tmp_path, capsys, {"model": str(d), "skip_tokenizer_init": True})


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_float16_where_the_replicas_run_on_cpu(checkpoints, tmp_path, capsys, monkeypatch, device):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    d = str(_copy(checkpoints, tmp_path))
    _one_line_exit_2(tmp_path, capsys, {"model": d, "dtype": "float16", "device": device},
                     r"engine\.dtype: 'float16' is not supported on CPU.*use float32 or bfloat16")
    with pytest.raises(RayStarted):
        _serve(tmp_path, capsys, {"model": d, "dtype": "bfloat16", "device": device})
    monkeypatch.setenv("RAY_ADDRESS", "local")                 # a new Ray here: still this machine's replicas
    _one_line_exit_2(tmp_path, capsys, {"model": d, "dtype": "float16", "device": device},
                     r"engine\.dtype: 'float16' is not supported on CPU")
    # joining a cluster: the replicas run on its nodes (GPU workers behind a CPU-only head), not here
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    with pytest.raises(RayStarted):
        _serve(tmp_path, capsys, {"model": d, "dtype": "float16", "device": device})


def test_a_kv_tier_every_replica_would_fail_on(checkpoints, tmp_path, capsys):
    """An offload tier larger than this machine's memory (replicas failed with a bare MemoryError, over and over,
    after Ray started): one line naming the key, exit 2, before Ray."""
    d = str(_copy(checkpoints, tmp_path))
    _one_line_exit_2(tmp_path, capsys, {"model": d, "kv_connector": {"type": "offload", "capacity_bytes": 10**15}},
                     r"engine\.kv_connector\.capacity_bytes: ")
