"""`org/name[@revision]` -> a local snapshot directory through huggingface_hub; local directories as they are.

Only what the engine reads is fetched: config, generation config and tokenizer files, and of the weights the
index's shards (else model.safetensors), top-level only (`weight_patterns`). HF_HOME /
HF_HUB_CACHE, HF_TOKEN and HF_HUB_OFFLINE are read when a model is resolved (huggingface_hub reads its own
copies at import, before a test or a launcher may have set them). A file lock in the cache serialises
replicas on one node, so the first downloads and the others find the files in place.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from affinity_serve.engine.errors import ModelLoadError

#: the files a snapshot needs besides the weights: everything validate_checkpoint and load_tokenizer read.
#: Plain names match top-level files only (huggingface_hub matches allow_patterns with fnmatch on the path)
_NO_WEIGHTS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "tokenizer.model", "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt",
               "merges.txt", "*.tiktoken", "chat_template.jinja", "chat_template.json"]
WEIGHT_INDEX = "model.safetensors.index.json"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
_TRUE = ("1", "true", "yes", "on")


def is_hub_id(model: str) -> bool:
    """`org/name` or `org/name@revision` that is not an existing local path."""
    return bool(_REPO_ID.match(model)) and not Path(model).exists()


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps snapshots: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface"
    return Path(home).expanduser() / "hub"


def resolve_model_path(model: str, *, weights: bool = True) -> str:
    """A local checkpoint directory for `model`: the path itself, or the hub snapshot of `org/name[@rev]`
    (downloaded unless HF_HUB_OFFLINE is set). ModelLoadError, in one line naming the id and the cache,
    when it cannot be had. `weights=False` fetches all but the safetensors (the ingress needs only the
    tokenizer)."""
    if not is_hub_id(model):
        return model
    repo_id, _, revision = model.partition("@")
    cache = hub_cache_dir()
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE
    from filelock import FileLock
    from huggingface_hub import snapshot_download
    lock_dir = cache / ".locks" / "affinity-serve"
    lock_dir.mkdir(parents=True, exist_ok=True)
    kw = dict(cache_dir=str(cache), local_files_only=offline, token=os.environ.get("HF_TOKEN") or None)
    with FileLock(str(lock_dir / f"{repo_id.replace('/', '--')}.lock")):
        try:
            if not weights:
                return snapshot_download(repo_id, revision=revision or None, allow_patterns=_NO_WEIGHTS, **kw)
            # the index first: it names the shards, so only the weights the loader reads are fetched (not
            # Mistral's consolidated.safetensors, nor original/ and other subfolders)
            snap = snapshot_download(repo_id, revision=revision or None,
                                     allow_patterns=[*_NO_WEIGHTS, WEIGHT_INDEX], **kw)
            return snapshot_download(repo_id, revision=Path(snap).name, allow_patterns=weight_patterns(Path(snap)),
                                     **kw)
        except Exception as e:     # huggingface_hub raises a dozen types: not found, gated, offline, HTTP...
            raise ModelLoadError(_unavailable(model, repo_id, revision, cache, offline, e)) from None


def weight_patterns(snapshot: Path) -> list[str]:
    """The weight files the loader reads (checkpoint.safetensors_files), as exact paths: the shards
    `snapshot`'s model.safetensors.index.json names, else model.safetensors."""
    try:
        weight_map = json.loads((snapshot / WEIGHT_INDEX).read_text()).get("weight_map") or {}
        return sorted({str(f) for f in weight_map.values()}) or ["model.safetensors"]
    except (OSError, ValueError, AttributeError):     # no index (or a broken one, which the check names)
        return ["model.safetensors"]


def _unavailable(model: str, repo_id: str, revision: str, cache: Path, offline: bool, e: Exception) -> str:
    """One line: why `model` could not be had, and the ways out that apply (huggingface_hub's command is `hf`;
    2.x ships no `huggingface-cli`)."""
    fetch = f"hf download {repo_id}{f' --revision {revision}' if revision else ''} --cache-dir {cache}"
    head = (f"model {model!r} is not a local directory and could not be loaded from the Hugging Face cache "
            f"{str(cache)!r}")
    if offline:
        return (f"{head} (HF_HUB_OFFLINE is set, so nothing was downloaded); download it there ({fetch}), "
                f"unset HF_HUB_OFFLINE, or pass a local path")
    why = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return (f"{head} ({type(e).__name__}: {why}); check the id and revision (and HF_TOKEN for a gated model), "
            f"download it there ({fetch}), or pass a local path")
