"""`--model org/name[@revision]` through huggingface_hub, against a hub-layout cache built here (offline)."""
import shutil

import pytest

from affinity_serve.engine import LLM, SamplingParams
from affinity_serve.engine.errors import ModelLoadError
from affinity_serve.engine.models.checkpoint import validate_checkpoint
from affinity_serve.engine.models.hub import hub_cache_dir, is_hub_id, resolve_model_path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(checkpoints, tmp_path, monkeypatch):
    """HF_HUB_CACHE with `tiny-org/tiny-llama` at COMMIT (refs/main and refs/v1 point at it), offline."""
    cache = tmp_path / "hub"
    repo = cache / "models--tiny-org--tiny-llama"
    shutil.copytree(checkpoints["llama"], repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    for ref in ("main", "v1"):
        (repo / "refs" / ref).write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hub_ids_and_cache_dir(tmp_path, monkeypatch):
    assert is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("org/name@v1.0") and not is_hub_id("/abs/path")
    assert not is_hub_id("no-slash") and not is_hub_id(str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hub_cache_dir() == tmp_path / "hf" / "hub"
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)          # a local directory as it is


@pytest.mark.parametrize("model", ["tiny-org/tiny-llama", "tiny-org/tiny-llama@v1", f"tiny-org/tiny-llama@{COMMIT}"])
def test_hub_id_loads_from_the_cache_offline(checkpoints, hub_cache, model):
    path = resolve_model_path(model)
    assert path.endswith(COMMIT)
    assert validate_checkpoint(model).architecture == "LlamaForCausalLM"      # the CLI's pre-flight path
    assert (hub_cache / ".locks" / "affinity-serve" / "tiny-org--tiny-llama.lock").exists()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    hub = LLM(model, cache={"num_blocks": 16, "block_size": 8}).generate([[5, 6, 7]], params, use_tqdm=False)
    local = LLM(checkpoints["llama"], cache={"num_blocks": 16, "block_size": 8}).generate([[5, 6, 7]], params,
                                                                                          use_tqdm=False)
    assert hub[0].outputs[0].token_ids == local[0].outputs[0].token_ids


@pytest.mark.parametrize("model", ["tiny-org/missing", "tiny-org/tiny-llama@no-such-ref"])
def test_missing_model_is_one_line_naming_the_id_and_the_cache(hub_cache, model, capsys):
    with pytest.raises(ModelLoadError) as e:
        validate_checkpoint(model)
    msg = str(e.value)
    assert repr(model) in msg and str(hub_cache) in msg and "HF_HUB_OFFLINE" in msg and "\n" not in msg
    from affinity_serve.app.cli import main
    assert main(["serve", "--model", model]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and repr(model) in err


def test_tokenizer_alone_resolves_a_hub_id_without_the_weights(hub_cache, checkpoints, monkeypatch):
    """The ingress loads only the tokenizer: a snapshot with no safetensors is enough."""
    from affinity_serve.engine.tokenizer import load_tokenizer
    for f in (hub_cache / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT).glob("*.safetensors"):
        f.unlink()
    tok = load_tokenizer("tiny-org/tiny-llama")
    assert tok.encode("hello") == load_tokenizer(checkpoints["llama"]).encode("hello")
