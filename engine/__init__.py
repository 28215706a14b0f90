"""The per-replica LLM engine: scheduler, paged KV cache with prefix caching, model runner.

`from affinity_serve.engine import LLM, SamplingParams` works; heavy parts (torch, transformers) load on first use so
the scheduler and the block hashes stay importable without torch.

The public surface is `__all__` plus the torch-free modules in `PUBLIC_MODULES` (boundary types, errors,
limits, block hashes, sampling parameters, configuration). Code outside the engine (app/, autoscale/, observability/)
imports nothing else from it; tests/unit/test_dependency_direction.py keeps that true.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from affinity_serve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from affinity_serve.engine.async_engine import AsyncLLMEngine, EngineHealth
    from affinity_serve.engine.types import EngineLoad
    from affinity_serve.engine.config import CacheConfig, EngineConfig, KVConnectorConfig, SchedulerConfig
    from affinity_serve.engine.llm import LLM
    from affinity_serve.engine.llm_engine import LLMEngine
    from affinity_serve.engine.demo import ensure_demo_model, write_demo_model
    from affinity_serve.engine.gc_policy import tune_gc_for_serving
    from affinity_serve.engine.limits import EngineLimits
    from affinity_serve.engine.types import EngineRequest, RequestDelta
    from affinity_serve.engine.models.checkpoint import (check_engine_support, derive_max_model_len,
                                                         resolve_context_length, validate_checkpoint)
    from affinity_serve.engine.tokenizer import apply_chat_template, load_tokenizer, token_ids_only_error
    from affinity_serve.engine.kv_connector import check_kv_connector
    from affinity_serve.engine.kv_connector.shared_store import (UnsafeSharedStoreError, check_shared_root,
                                                                 default_shared_root)
    from affinity_serve.engine.kv_connector.pd import (KVTransferError, ReadRecord, RemoteDecode, RemotePrefill,
                                                       TransferRecords)
    from affinity_serve.engine.kv_connector.nixl import NixlAddress, NixlTransport

PUBLIC_MODULES = tuple(f"affinity_serve.engine.{m}" for m in ("config", "errors", "hashing", "limits",
                                                                 "sampling_params", "types", "structured_output"))

_LAZY = {
    "LLM": "affinity_serve.engine.llm",
    "LLMEngine": "affinity_serve.engine.llm_engine",
    "AsyncLLMEngine": "affinity_serve.engine.async_engine",
    "EngineLoad": "affinity_serve.engine.types",
    "EngineHealth": "affinity_serve.engine.async_engine",
    "EngineLimits": "affinity_serve.engine.limits",
    "EngineRequest": "affinity_serve.engine.types",
    "RequestDelta": "affinity_serve.engine.types",
    "load_tokenizer": "affinity_serve.engine.tokenizer",
    "apply_chat_template": "affinity_serve.engine.tokenizer",
    "token_ids_only_error": "affinity_serve.engine.tokenizer",
    "EngineConfig": "affinity_serve.engine.config",
    "CacheConfig": "affinity_serve.engine.config",
    "SchedulerConfig": "affinity_serve.engine.config",
    "KVConnectorConfig": "affinity_serve.engine.config",
    "write_demo_model": "affinity_serve.engine.demo",
    "ensure_demo_model": "affinity_serve.engine.demo",
    "validate_checkpoint": "affinity_serve.engine.models.checkpoint",
    "resolve_context_length": "affinity_serve.engine.models.checkpoint",
    "derive_max_model_len": "affinity_serve.engine.models.checkpoint",
    "check_engine_support": "affinity_serve.engine.models.checkpoint",
    "is_hub_id": "affinity_serve.engine.models.hub",
    "tune_gc_for_serving": "affinity_serve.engine.gc_policy",
    "check_shared_root": "affinity_serve.engine.kv_connector.shared_store",
    "check_kv_connector": "affinity_serve.engine.kv_connector",
    "default_shared_root": "affinity_serve.engine.kv_connector.shared_store",
    "UnsafeSharedStoreError": "affinity_serve.engine.kv_connector.shared_store",
    "RemoteDecode": "affinity_serve.engine.kv_connector.pd",
    "RemotePrefill": "affinity_serve.engine.kv_connector.pd",
    "KVTransferError": "affinity_serve.engine.kv_connector.pd",
    "ReadRecord": "affinity_serve.engine.kv_connector.pd",
    "TransferRecords": "affinity_serve.engine.kv_connector.pd",
    "NixlTransport": "affinity_serve.engine.kv_connector.nixl",
    "NixlAddress": "affinity_serve.engine.kv_connector.nixl",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(module), name)


__all__ = ["LLM", "LLMEngine", "AsyncLLMEngine", "EngineLoad", "EngineHealth", "SamplingParams", "EngineConfig",
           "CacheConfig", "SchedulerConfig", "KVConnectorConfig", "EngineLimits", "EngineRequest", "RequestDelta",
           "load_tokenizer", "apply_chat_template", "token_ids_only_error", "write_demo_model", "ensure_demo_model",
           "validate_checkpoint", "resolve_context_length", "derive_max_model_len", "check_engine_support",
           "is_hub_id", "tune_gc_for_serving",
           "check_shared_root", "check_kv_connector", "default_shared_root", "UnsafeSharedStoreError", "RemoteDecode",
           "RemotePrefill", "KVTransferError", "ReadRecord", "TransferRecords", "NixlTransport", "NixlAddress"]
