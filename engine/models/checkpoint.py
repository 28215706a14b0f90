"""What a checkpoint directory must hold (config.json, safetensors weights of the right shapes, tokenizer
files), checked without reading weights (the shape check alone imports torch). The engine's loader and the CLI's
pre-flight check call the same functions, so a user
sees the same message whether a problem is caught before Ray starts or inside a replica."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from affinity_serve.engine.errors import ModelLoadError
from affinity_serve.engine.models.config import ModelArgs

#: files transformers' AutoTokenizer can build a tokenizer from (one is enough; tokenizer_config.json alone is not)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "*.tiktoken")


def validate_checkpoint(path: str | Path, *, need_tokenizer: bool = True) -> ModelArgs:
    """Check a checkpoint directory without loading weights; raise ModelLoadError naming what is wrong.
    `path` may be a hub id, `org/name[@revision]`: its snapshot is fetched first (engine/models/hub.py).

    Checks, in order: the directory, config.json and its architecture (and every field that changes the
    math), the safetensors weights (single file, or an index whose shards all exist) and each tensor's shape
    against the model's (headers only; this one check imports torch), and (when `need_tokenizer`) the
    tokenizer files.
    """
    from affinity_serve.engine.models.hub import resolve_model_path
    path = resolve_model_path(str(path))
    args = ModelArgs.from_dir(path)
    safetensors_files(Path(path))
    from affinity_serve.engine.models.loader import check_weight_shapes
    check_weight_shapes(path, args)
    if need_tokenizer:
        check_tokenizer_files(path)
    return args


def check_engine_support(args: ModelArgs | str | Path, kv_connector_type: str) -> None:
    """Engine parts this model's features rule out, before any is built: ValueError, one line naming the key.
    (The Scheduler refuses the same combination with the same reason.) `args`: the model's, or its checkpoint
    directory (its config.json is read)."""
    if not isinstance(args, ModelArgs):
        args = ModelArgs.from_dir(args)
    if kv_connector_type == "pd" and any(w is not None for w in args.layer_windows):
        raise ValueError("engine.kv_connector.type: 'pd' moves one block table per request and this model has "
                         "sliding-window layers (a table per KV-cache group); use offload, shared or none")


def resolve_context_length(args: ModelArgs, max_model_len: int | None) -> int:
    """The context length an engine serves: the model's positions (sliding-window layers included: the KV
    manager keeps their windows), or `max_model_len` when set; ValueError if that asks for more than the
    model has. An engine may cap the result further at the KV pool's capacity once the pool is sized."""
    limit, source = model_positions(args)
    if max_model_len is None:
        return limit
    if max_model_len > limit:
        raise ValueError(f"max_model_len {max_model_len} exceeds this model's limit of {limit} tokens "
                         f"({source}); lower it or leave it unset")
    return max_model_len


def model_positions(args: ModelArgs) -> tuple[int, str]:
    """The positions a model serves and where that comes from: `max_position_embeddings`, or with YaRN RoPE
    scaling original_max_position_embeddings × factor when that is more, as vLLM derives it (Qwen2.5 ships
    32,768 with YaRN factor 4 for 131,072). Linear scaling is left as `max_position_embeddings` says: Gemma 3
    ships the scaled length there already (131,072 with factor 8)."""
    limit = args.max_position_embeddings
    rope = args.rope
    factor = rope.params.get("factor")
    if rope.rope_type == "yarn" and factor and factor > 1:
        orig = rope.params.get("original_max_position_embeddings") or limit
        scaled = int(orig * factor)
        if scaled > limit:
            return scaled, f"rope_scaling: YaRN, original_max_position_embeddings {orig} x factor {factor:g}"
    return limit, "max_position_embeddings"


def safetensors_files(path: Path) -> list[Path]:
    """The weight files: every shard named by model.safetensors.index.json, else model.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except (json.JSONDecodeError, AttributeError) as e:
            raise ModelLoadError(f"{index.name} in {str(path)!r} is not a valid safetensors index: {e}") from e
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index.name} lists shards that are missing: {missing}")
        if not files:
            raise ModelLoadError(f"{index.name} in {str(path)!r} lists no weight files")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelLoadError(f"no model.safetensors or model.safetensors.index.json in {str(path)!r} "
                         f"(found: {_listing(path)}); only safetensors checkpoints are supported")


def check_tokenizer_files(path: str | Path) -> None:
    """Raise ModelLoadError when the directory holds none of TOKENIZER_FILES (saying what was looked for)."""
    path = Path(path)
    if any(next(path.glob(name), None) is not None for name in TOKENIZER_FILES):
        return
    raise ModelLoadError(
        f"no tokenizer in {str(path)!r}: looked for {', '.join(TOKENIZER_FILES)} (found: {_listing(path)}). "
        "Copy the model's tokenizer files into the directory, or, if every prompt is token ids, set "
        "skip_tokenizer_init: true (engine.skip_tokenizer_init in the app config)")


def _listing(path: Path, limit: int = 20) -> list[str]:
    return sorted(p.name for p in path.iterdir())[:limit]


#: the KV pool's memory on CPU when cache.memory_budget_bytes and cache.num_blocks are unset (engine/build.py)
DEFAULT_CPU_KV_BYTES = 512 * 1024 * 1024
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def derive_max_model_len(config: Any) -> int | None:
    """The max_model_len an engine built from `config` (an EngineConfig) will report, derived without building
    it, as engine/build.py does: the checkpoint's positions or config.max_model_len, capped at what the KV pool
    holds for one request. None when only the serving machine can tell: a checkpoint not on this machine (a hub
    id), a config the engine refuses (it says why), or a pool sized from a CUDA device's free memory or from a
    budget whose dtype follows `device: auto`. Torch-free (an ingress that never runs the model uses it)."""
    import os

    from affinity_serve.engine.kv_groups import kv_cache_groups, num_kv_tensors, tokens_capacity
    if not os.path.isfile(os.path.join(config.model, "config.json")):
        return None
    try:
        args = ModelArgs.from_dir(config.model)
        length = resolve_context_length(args, config.max_model_len)
    except (ModelLoadError, ValueError):
        return None
    groups = kv_cache_groups(args.layer_windows)
    c = config.cache
    num_blocks = c.num_blocks
    if num_blocks is None:
        dtype = config.dtype if config.dtype != "auto" else {"cpu": "float32", "cuda": "bfloat16"}.get(config.device)
        budget = c.memory_budget_bytes
        if budget is None and config.device == "cpu":
            budget = DEFAULT_CPU_KV_BYTES
        if dtype not in _DTYPE_BYTES or budget is None:
            return None
        per_block = 2 * num_kv_tensors(groups) * c.block_size * args.num_kv_heads * args.head_dim * _DTYPE_BYTES[dtype]
        num_blocks = budget // per_block
        if num_blocks < 2:
            return None
    capacity = tokens_capacity(groups, num_blocks - 1, c.block_size, config.scheduler.max_num_batched_tokens)
    return min(length, capacity)
