"""What a hub id fetches: the top-level files the engine reads, and of the weights only those the loader reads
(the index's shards, else model.safetensors); never Mistral's consolidated.safetensors or the safetensors in
subfolders (original/). huggingface_hub's own filter (filter_repo_objects) decides, with no network."""
import json

import pytest
from huggingface_hub.utils import filter_repo_objects

from affinity_serve.engine.models import hub

COMMIT = "0123456789abcdef0123456789abcdef01234567"
SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
#: files a mistralai-style repo holds besides what the engine reads
NOT_READ = ["consolidated.safetensors", "original/model.safetensors", "original/consolidated.00.pth",
            "original/tokenizer.model", "params.json", "tekken.json", "README.md", "pytorch_model.bin",
            "subdir/model-00001-of-00002.safetensors"]
META = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "special_tokens_map.json", "chat_template.jinja"]


def _repo(sharded: bool) -> dict[str, str]:
    files = {name: "{}" for name in META + NOT_READ}
    if sharded:
        files["model.safetensors.index.json"] = json.dumps(
            {"metadata": {}, "weight_map": {"model.embed_tokens.weight": SHARDS[0], "lm_head.weight": SHARDS[1]}})
        files.update({s: "" for s in SHARDS})
    else:
        files["model.safetensors"] = ""
    return files


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """snapshot_download over an in-memory repo: writes what huggingface_hub's filter lets through."""
    state = {"repo": {}, "fetched": set()}

    def snapshot_download(repo_id, *, revision=None, cache_dir=None, allow_patterns=None, local_files_only=False,
                          token=None):
        assert revision in (None, COMMIT)
        snap = tmp_path / "snapshots" / COMMIT
        for name in filter_repo_objects(list(state["repo"]), allow_patterns=allow_patterns):
            (snap / name).parent.mkdir(parents=True, exist_ok=True)
            (snap / name).write_text(state["repo"][name])
            state["fetched"].add(name)
        snap.mkdir(parents=True, exist_ok=True)
        return str(snap)

    import huggingface_hub
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return state


@pytest.mark.parametrize("sharded", [True, False])
def test_only_the_weights_the_loader_reads_are_fetched(fake_hub, sharded):
    fake_hub["repo"] = _repo(sharded)
    path = hub.resolve_model_path("mistralai/Some-Model")
    assert path.endswith(COMMIT)
    weights = (["model.safetensors.index.json"] + SHARDS) if sharded else ["model.safetensors"]
    assert fake_hub["fetched"] == set(META + weights)


def test_the_tokenizer_alone_fetches_no_weights(fake_hub):
    fake_hub["repo"] = _repo(sharded=True)
    hub.resolve_model_path("mistralai/Some-Model", weights=False)
    assert fake_hub["fetched"] == set(META)


def test_weight_patterns_name_top_level_files_only(tmp_path):
    assert hub.weight_patterns(tmp_path) == ["model.safetensors"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": SHARDS[1],
                                                                                      "b": SHARDS[0]}}))
    assert hub.weight_patterns(tmp_path) == SHARDS
    listing = SHARDS + NOT_READ + ["model.safetensors"]
    assert sorted(filter_repo_objects(listing, allow_patterns=hub.weight_patterns(tmp_path))) == SHARDS


def test_the_error_suggests_the_hf_command_and_mentions_offline_mode_only_when_it_is_set(fake_hub, tmp_path,
                                                                                         monkeypatch):
    from affinity_serve.engine.errors import ModelLoadError
    cache = tmp_path / "cache"
    import huggingface_hub

    def gone(*a, **kw):
        raise OSError("404 Client Error: Repository Not Found for url\nmore detail")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", gone)
    with pytest.raises(ModelLoadError) as online:
        hub.resolve_model_path("org/missing@v2")
    msg = str(online.value)
    assert "\n" not in msg and "HF_HUB_OFFLINE" not in msg and "huggingface-cli" not in msg
    assert "(OSError: 404 Client Error: Repository Not Found for url)" in msg
    assert f"hf download org/missing --revision v2 --cache-dir {cache}" in msg

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as offline:
        hub.resolve_model_path("org/missing")
    msg = str(offline.value)
    assert "HF_HUB_OFFLINE is set, so nothing was downloaded" in msg and "unset HF_HUB_OFFLINE" in msg
    assert f"hf download org/missing --cache-dir {cache}" in msg and "huggingface-cli" not in msg
