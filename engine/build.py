"""Engine construction: device, dtype, checkpoint, attention and linear backends with their self-tests, KV
sizing, the KV connector, CUDA graphs. `build_engine_parts(config)` returns the configured collaborators an
`LLMEngine` runs (`LLMEngine.from_config` calls it); nothing here runs per step.

The order matters on a GPU: the KV pool is sized from the memory free after the weights load, the fused
ops are switched on before the CUDA graphs are captured (a graph records the kernels the model calls), and
the graphs are captured over the runner's KV caches once the runner has allocated them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from affinity_serve.engine.attention import AttentionBackend, select_backend
from affinity_serve.engine.config import EngineConfig
from affinity_serve.engine.cuda_graphs import DecodeGraphs, graph_sizes
from affinity_serve.engine.kv_cache_manager import KVCacheManager
from affinity_serve.engine.kv_connector import (KVConnectorScheduler, build_kv_connector, model_identity,
                                                model_kv_layout)
from affinity_serve.engine.kv_groups import KVCacheGroupSpec, kv_cache_groups, tokens_capacity
from affinity_serve.engine.model_runner import ModelRunner, kv_bytes_per_block
from affinity_serve.engine.models import fused as fused_ops
from affinity_serve.engine.models.checkpoint import (DEFAULT_CPU_KV_BYTES, resolve_context_length,
                                                     validate_checkpoint)
from affinity_serve.engine.models.config import ModelArgs
from affinity_serve.engine.models.generation_config import GenerationConfig, all_eos_token_ids
from affinity_serve.engine.models.hub import resolve_model_path
from affinity_serve.engine.models.linear import HYBRID_PLAIN_ROWS, prepack_supported
from affinity_serve.engine.models.loader import load_model
from affinity_serve.engine.pacing import PacedRunner
from affinity_serve.engine.scheduler import Scheduler
from affinity_serve.engine.structured_output.manager import StructuredOutputManager
from affinity_serve.engine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

#: linear_backend auto keeps the plain weights beside the packed ones (hybrid) while that copy costs at most
#: this much; larger models get onednn alone
_HYBRID_AUTO_MAX_EXTRA_BYTES = 1 << 30
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class EngineParts:
    """What an LLMEngine runs, built and configured: the engine only wires requests through them."""

    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    #: the checkpoint directory: config.model, or the hub snapshot of an `org/name[@revision]` id
    model_path: str
    model_args: ModelArgs
    max_model_len: int                      # after the KV cap: every admitted request can finish
    tokenizer: Any                          # None with skip_tokenizer_init
    generation_config: GenerationConfig
    #: every EOS id, the primary (the Request's eos_token_id) first; the others stop as stop token ids
    eos_token_ids: list[int]
    linear_backend: str
    num_blocks: int
    kv_cache_manager: KVCacheManager
    scheduler: Scheduler
    #: the ModelRunner, or a PacedRunner around it (engine.pace)
    runner: ModelRunner | PacedRunner
    kv_connector: KVConnectorScheduler | None
    kv_connector_worker: Any                # the connector's runner side (None without a connector)
    structured_output: StructuredOutputManager


def build_engine_parts(config: EngineConfig) -> EngineParts:
    """Load the checkpoint and build every part, in the order the GPU path needs (see the module docstring)."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = pick_device(config.device)
    dtype = pick_dtype(config.dtype, device)
    # the same checks (and messages) as the CLI's pre-flight, before anything heavy loads
    model_path = resolve_model_path(config.model)
    model_args = validate_checkpoint(model_path, need_tokenizer=not config.skip_tokenizer_init)
    max_model_len = resolve_context_length(model_args, config.max_model_len)
    tokenizer = None if config.skip_tokenizer_init else load_tokenizer(model_path)
    generation_config = GenerationConfig.from_dir(model_path)
    eos_token_ids = all_eos_token_ids(tokenizer.eos_token_id if tokenizer is not None else None,
                                      model_args.eos_token_ids, generation_config)
    torch.manual_seed(config.seed)
    linear_backend = pick_linear_backend(config.linear_backend, device, dtype, plain_copy_bytes(model_args, dtype))
    model, _ = load_model(model_path, dtype, device, max_model_len,
                          prepack=linear_backend in ("onednn", "hybrid"),
                          plain_rows=HYBRID_PLAIN_ROWS if linear_backend == "hybrid" else 0)
    block_size = config.cache.block_size
    num_blocks = num_kv_blocks(config, model_args, dtype, device)      # from the memory the weights left
    kv_groups = kv_cache_groups(model_args.layer_windows)
    max_model_len = _cap_to_kv(max_model_len, kv_groups, num_blocks, config)
    backend = select_backend(config.attention_backend, device.type, block_size,
                             cpu_kernels=config.cpu_kernels, cascade_min_tokens=config.cascade_min_tokens,
                             sliding_window=any(g.window is not None for g in kv_groups),
                             softcap=model_args.attn_logit_softcapping is not None)
    _use_fused_ops(model, backend, device, dtype, config.cpu_kernels)
    kv_cache_manager = KVCacheManager(
        num_blocks, block_size, max_model_len,
        enable_caching=config.cache.enable_prefix_caching,
        enable_kv_cache_events=config.cache.enable_kv_cache_events,
        recent_requests=config.cache.prefix_cache_recent_requests, groups=kv_groups,
        max_chunk_tokens=config.scheduler.max_num_batched_tokens)
    kv_connector, kv_connector_worker = _build_kv_connector(config, model_path, model_args, device, dtype)
    scheduler = Scheduler(config.scheduler, kv_cache_manager, max_model_len, kv_connector=kv_connector)
    runner = ModelRunner(model, model_args, backend, num_blocks, block_size, device=device, dtype=dtype,
                         seed=config.seed, kv_connector=kv_connector_worker)
    if device.type == "cuda" and not config.enforce_eager:
        _capture_decode_graphs(config, model, backend, runner, scheduler, max_model_len,
                               overlap=config.overlap_decode and kv_connector is None)
    # grammars for structured output, compiled on its own thread (xgrammar, imported on first use). The
    # step's bitmask fill overlaps the forward: on CUDA the runner reads it once the forward is launched
    # (the host fills while the device computes); on CPU a worker thread fills it during the forward
    # (benchmarks/structured.py: cheaper than filling after it, once the forward is a few ms)
    cuda = device.type == "cuda"
    structured_output = StructuredOutputManager(tokenizer, model_args.vocab_size, eos_token_ids,
                                                fill_on_thread=not cuda, pin_memory=cuda)
    logger.info("engine ready: %s %s on %s, attention=%s, linear=%s, max_model_len=%d, KV cache %d blocks "
                "x %d tokens = %d tokens (%.1f MiB)", model_args.architecture, dtype, device, backend.name,
                linear_backend, max_model_len, num_blocks, block_size, (num_blocks - 1) * block_size,
                num_blocks * kv_bytes_per_block(model_args, block_size, dtype) / 2**20)
    pace = config.pace
    return EngineParts(
        config, device, dtype, model_path, model_args, max_model_len, tokenizer, generation_config,
        eos_token_ids, linear_backend, num_blocks, kv_cache_manager, scheduler,
        PacedRunner(runner, scheduler.requests, pace) if pace.enabled else runner,
        kv_connector, kv_connector_worker, structured_output)


# ------------------------------------------------------------------ device, dtype, linear backend
def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available; use device: cpu or auto")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = _DTYPES[name]
    if device.type == "cpu" and dtype == torch.float16:
        raise ValueError("float16 is not supported on CPU; use float32 or bfloat16")
    return dtype


def plain_copy_bytes(args: ModelArgs, dtype: torch.dtype) -> int:
    """What linear_backend hybrid costs on top of onednn: one plain copy of every Linear weight, the lm_head's
    included."""
    q, kv, h = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim, args.hidden_size
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * args.intermediate_size
    return (args.num_layers * per_layer + args.vocab_size * h) * torch.empty((), dtype=dtype).element_size()


def pick_linear_backend(name: str, device: torch.device, dtype: torch.dtype, plain_bytes: int = 0) -> str:
    """`plain_bytes`: what hybrid's plain copies would cost (plain_copy_bytes); auto picks hybrid up to
    _HYBRID_AUTO_MAX_EXTRA_BYTES, onednn above."""
    supported = prepack_supported(device, dtype)
    if name == "auto":                # bf16 prepacking is opt-in: it has not been run on a bf16-native CPU here
        if not (supported and dtype == torch.float32):
            return "torch"
        return "hybrid" if plain_bytes <= _HYBRID_AUTO_MAX_EXTRA_BYTES else "onednn"
    if name in ("onednn", "hybrid") and not supported:
        raise ValueError(f"linear_backend {name!r} needs a CPU device, float32 (or bfloat16 on a CPU with native "
                         f"bf16) and a torch build with oneDNN; got device={device.type}, dtype={dtype}. "
                         f"Use linear_backend: auto or torch")
    return name


# ------------------------------------------------------------------ KV sizing
def num_kv_blocks(config: EngineConfig, model_args: ModelArgs, dtype: torch.dtype, device: torch.device) -> int:
    """cache.num_blocks, or as many blocks as the memory budget holds (on CUDA, unset: 80% of what is free
    now, so call it after the weights are loaded)."""
    c = config.cache
    if c.num_blocks is not None:
        return c.num_blocks
    per_block = kv_bytes_per_block(model_args, c.block_size, dtype)
    budget = c.memory_budget_bytes
    if budget is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * 0.8)
        else:
            budget = DEFAULT_CPU_KV_BYTES
    n = budget // per_block
    if n < 2:
        raise ValueError(f"KV memory budget {budget} bytes holds {n} blocks of {per_block} bytes; "
                         "raise cache.memory_budget_bytes")
    return int(n)


def _cap_to_kv(max_model_len: int, kv_groups: list[KVCacheGroupSpec], num_blocks: int, config: EngineConfig) -> int:
    """max_model_len, lowered to what the pool holds for one request (less the null block)."""
    capacity = tokens_capacity(kv_groups, num_blocks - 1, config.cache.block_size,
                               config.scheduler.max_num_batched_tokens)   # the most one request computes a step
    if capacity < max_model_len:
        logger.warning("KV cache holds %d tokens, less than max_model_len %d: capping max_model_len so every "
                       "admitted request can finish (raise cache.num_blocks / memory_budget_bytes to avoid)",
                       capacity, max_model_len)
        return capacity
    return max_model_len


# ------------------------------------------------------------------ kernels, connector, graphs
def _use_fused_ops(model: torch.nn.Module, backend: AttentionBackend, device: torch.device, dtype: torch.dtype,
                   cpu_kernels: bool) -> None:
    """The per-token ops (norms, RoPE, SiLU) as Triton or C kernels, each only once it passes a self-test."""
    if backend.name == "triton":
        why = fused_ops.self_test(str(device))
        if why is None:
            model.use_fused_ops()
        else:
            logger.warning("fused Triton ops failed their self-test on this device (%s); the model's "
                           "norms, RoPE and SiLU run as torch ops", why)
    elif device.type == "cpu" and dtype == torch.float32 and cpu_kernels:
        from affinity_serve.engine.attention.cpu_kernels import load_ops
        ops = load_ops()                      # None (with a warning) without a C compiler
        why = fused_ops.self_test("cpu", ops) if ops is not None else "no C kernels"
        if why is None:
            model.use_fused_ops(ops=ops)
        elif ops is not None:
            logger.warning("the C per-token ops failed their self-test (%s); the model's norms, RoPE and "
                           "SiLU run as torch ops", why)


def _build_kv_connector(config: EngineConfig, model_path: str, args: ModelArgs, device: torch.device,
                        dtype: torch.dtype) -> tuple[KVConnectorScheduler | None, Any]:
    """(scheduler side, runner side) of the configured KV connector; (None, None) for type none."""
    cfg = config.kv_connector
    if cfg.type == "none":
        return None, None
    layout = model_kv_layout(args.layer_windows, args.num_kv_heads, args.head_dim, config.cache.block_size,
                             str(dtype).removeprefix("torch."), torch.empty((), dtype=dtype).element_size())
    return build_kv_connector(cfg, layout, model_identity=model_identity(model_path, cfg.model_identity),
                              device=device, dtype=dtype, enable_events=config.cache.enable_kv_cache_events)


def _capture_decode_graphs(config: EngineConfig, model: torch.nn.Module, backend: AttentionBackend,
                           runner: ModelRunner, scheduler: Scheduler, max_model_len: int, overlap: bool) -> None:
    """CUDA graphs for decode steps (triton attention only), and with `overlap` the decode step launched
    ahead of the scheduler; a failed capture leaves decode eager."""
    if backend.name != "triton":
        logger.info("CUDA-graph decode needs attention_backend triton (the %s backend reads Python-side "
                    "lengths); decode runs eager", backend.name)
        return
    if runner.windowed:
        logger.info("CUDA-graph decode captures one block table per request; this model's sliding-window "
                    "KV-cache groups have one each: decode runs eager")
        return
    block_size = config.cache.block_size
    try:
        runner.decode_graphs = DecodeGraphs(
            model, runner.kv_caches, backend, graph_sizes(config.scheduler.max_num_seqs),
            -(-max_model_len // block_size), block_size, runner.device)
        if overlap:
            runner.overlap_decode = True
            runner.max_model_len = max_model_len
            scheduler.num_lookahead_tokens = 1
    except Exception as e:                 # graphs are a speed-up: never the reason a replica is down
        logger.warning("CUDA-graph capture failed (%s: %s); decode runs eager (set enforce_eager: "
                       "true to skip the attempt)", type(e).__name__, e)
