"""The per-replica LLM engine: scheduler, paged KV cache with prefix caching, model runner.

`from engine import LLM, SamplingParams` works; heavy parts (torch, transformers) load on first use so
the scheduler and the block hashes stay importable without torch.

The public surface is `__all__` plus the torch-free modules in `PUBLIC_MODULES` (boundary types, errors,
limits, block hashes, sampling parameters, configuration). Code outside the engine (app/, autoscale/, observability/)
imports nothing else from it; tests/unit/test_dependency_direction.py keeps that true.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.async_engine import AsyncLLMEngine, EngineHealth, EngineLoad
    from engine.config import CacheConfig, EngineConfig, KVConnectorConfig, SchedulerConfig
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine
    from engine.demo import ensure_demo_model, write_demo_model
    from engine.gc_policy import tune_gc_for_serving
    from engine.limits import EngineLimits, check_request, check_request_fits_context
    from engine.models.checkpoint import resolve_context_length, validate_checkpoint
    from engine.tokenizer import apply_chat_template, load_tokenizer, token_ids_only_error
    from engine.kv_connector.shared_store import UnsafeSharedStoreError, check_shared_root, default_shared_root
    from engine.kv_connector.pd import KVTransferError, RemoteDecode, RemotePrefill

PUBLIC_MODULES = ("engine.config", "engine.errors", "engine.hashing", "engine.limits", "engine.sampling_params",
                  "engine.types", "engine.structured_output")

_LAZY = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "AsyncLLMEngine": "engine.async_engine",
    "EngineLoad": "engine.async_engine",
    "EngineHealth": "engine.async_engine",
    "EngineLimits": "engine.limits",
    "check_request": "engine.limits",
    "check_request_fits_context": "engine.limits",
    "load_tokenizer": "engine.tokenizer",
    "apply_chat_template": "engine.tokenizer",
    "token_ids_only_error": "engine.tokenizer",
    "EngineConfig": "engine.config",
    "CacheConfig": "engine.config",
    "SchedulerConfig": "engine.config",
    "KVConnectorConfig": "engine.config",
    "write_demo_model": "engine.demo",
    "ensure_demo_model": "engine.demo",
    "validate_checkpoint": "engine.models.checkpoint",
    "resolve_context_length": "engine.models.checkpoint",
    "tune_gc_for_serving": "engine.gc_policy",
    "check_shared_root": "engine.kv_connector.shared_store",
    "default_shared_root": "engine.kv_connector.shared_store",
    "UnsafeSharedStoreError": "engine.kv_connector.shared_store",
    "RemoteDecode": "engine.kv_connector.pd",
    "RemotePrefill": "engine.kv_connector.pd",
    "KVTransferError": "engine.kv_connector.pd",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(module), name)


__all__ = ["LLM", "LLMEngine", "AsyncLLMEngine", "EngineLoad", "EngineHealth", "SamplingParams", "EngineConfig",
           "CacheConfig", "SchedulerConfig", "KVConnectorConfig", "EngineLimits", "check_request", "check_request_fits_context",
           "load_tokenizer", "apply_chat_template", "token_ids_only_error", "write_demo_model", "ensure_demo_model",
           "validate_checkpoint", "resolve_context_length", "tune_gc_for_serving", "check_shared_root",
           "default_shared_root", "UnsafeSharedStoreError", "RemoteDecode", "RemotePrefill", "KVTransferError"]
