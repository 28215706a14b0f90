"""AppConfig: the one root configuration (loadable from YAML) with engine, serve, routing,
autoscaling and observability sections. Only builder.py turns it into Serve options."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.config import CacheConfig, SchedulerConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EngineSection(_Strict):
    """Engine settings; `model: null` serves the embedded demo model (generated once, cached)."""

    model: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    attention_backend: Literal["auto", "torch", "flash"] = "auto"
    max_model_len: int | None = Field(None, ge=2)
    seed: int = 0
    num_threads: int | None = Field(None, ge=1)
    cache: CacheConfig = CacheConfig(memory_budget_bytes=256 * 2**20)
    scheduler: SchedulerConfig = SchedulerConfig()


class ServeSection(_Strict):
    app_name: str = "affinity"
    route_prefix: str = "/"
    host: str = Field("127.0.0.1", description="bind address; use 0.0.0.0 only deliberately")
    port: int = Field(8000, ge=1, le=65535)
    model_name: str | None = Field(None, description="name clients send as `model` (default: dir name)")
    num_replicas: int = Field(1, ge=1)
    replica_num_cpus: float = Field(1.0, ge=0, description="CPU share per CPU replica")
    replica_num_gpus: float = Field(0.0, ge=0, description="1 for GPU replicas")
    ingress_num_cpus: float = Field(0.0, ge=0)
    ingress_replicas: int = Field(1, ge=1)
    max_ongoing_requests: int = Field(64, ge=1, description="per replica")
    max_queued_requests: int = Field(256, ge=-1, description="per caller; beyond it requests get 429")
    retry_after_s: int = Field(1, ge=0)
    graceful_shutdown_timeout_s: float = Field(20.0, ge=0)
    health_check_period_s: float = Field(5.0, gt=0)
    health_check_timeout_s: float = Field(10.0, gt=0)
    wedge_timeout_s: float = Field(30.0, gt=0, description="running requests but no step for this long = unhealthy")
    first_token_timeout_s: float = Field(60.0, gt=0, description="503 when no replica produced anything by then")
    api_key: str | None = Field(None, description="require `Authorization: Bearer <key>` on inference routes")
    max_request_body_bytes: int = Field(4 * 2**20, ge=1024)


class RoutingSection(_Strict):
    request_routing_stats_period_s: float = Field(1.0, gt=0)
    request_routing_stats_timeout_s: float = Field(5.0, gt=0)


class AutoscalingSection(_Strict):
    enabled: bool = False
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(2, ge=1)
    target_ongoing_requests: float = Field(8.0, gt=0)
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(60.0, ge=0)

    @model_validator(mode="after")
    def _bounds(self) -> "AutoscalingSection":
        if self.max_replicas < self.min_replicas:
            raise ValueError("autoscaling.max_replicas must be >= min_replicas")
        return self


class ObservabilitySection(_Strict):
    service_name: str = "affinity-serve"
    traces: Literal["none", "memory", "console", "otlp"] = "memory"
    otlp_endpoint: str | None = Field(None, description="OTLP/HTTP endpoint for traces and metrics")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    max_spans_kept: int = Field(2000, ge=0, description="in-memory spans kept for /debug inspection")


class AppConfig(_Strict):
    engine: EngineSection = EngineSection()
    serve: ServeSection = ServeSection()
    routing: RoutingSection = RoutingSection()
    autoscaling: AutoscalingSection = AutoscalingSection()
    observability: ObservabilitySection = ObservabilitySection()

    @classmethod
    def from_yaml(cls, path: str | Path) -> "AppConfig":
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the top level must be a mapping")
        return cls.model_validate(data)
