"""The per-replica LLM engine: scheduler, paged KV cache with prefix caching, model runner.

`from engine import LLM, SamplingParams` works; heavy parts (torch, transformers) load on first use so
the scheduler and the block hashes stay importable without torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.async_engine import AsyncLLMEngine
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine
    from engine.models.checkpoint import validate_checkpoint

_LAZY = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "AsyncLLMEngine": "engine.async_engine",
    "EngineConfig": "engine.config",
    "CacheConfig": "engine.config",
    "SchedulerConfig": "engine.config",
    "write_demo_model": "engine.demo",
    "ensure_demo_model": "engine.demo",
    "validate_checkpoint": "engine.models.checkpoint",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(module), name)


__all__ = ["LLM", "LLMEngine", "AsyncLLMEngine", "SamplingParams", "EngineConfig", "CacheConfig",
           "SchedulerConfig", "write_demo_model", "ensure_demo_model", "validate_checkpoint"]
