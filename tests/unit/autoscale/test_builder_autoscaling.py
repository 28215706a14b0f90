"""What the builder hands Serve for each autoscaling policy, and the replica's autoscaling metrics."""
from __future__ import annotations

import json

import pytest
from ray.serve.config import AutoscalingConfig

from affinity_serve.app.builder import autoscaling_config, replica_deployment
from affinity_serve.app.config import AppConfig, ConfigError
from affinity_serve.autoscale.policy import PolicyConfig
from affinity_serve.autoscale.serve_policy import EngineAwarePolicy


def _cfg(**autoscaling):
    return AppConfig.model_validate({"engine": {"model": "/m"}, "serve": {"num_replicas": 2},
                                     "autoscaling": {"enabled": True, "max_replicas": 4, **autoscaling}})


def test_engine_policy_is_our_class_with_serves_delays_at_zero():
    cfg = _cfg(ttft_slo_s=1.5, downscale_delay_s=45, min_replicas=0)
    ac = replica_deployment(cfg)._deployment_config.autoscaling_config
    assert ac.policy.policy_function == "affinity_serve.autoscale.serve_policy:EngineAwarePolicy"
    assert (ac.upscale_delay_s, ac.downscale_delay_s, ac.downscale_to_zero_delay_s) == (0, 0, 0)
    assert (ac.min_replicas, ac.max_replicas, ac.initial_replicas) == (0, 4, 2)
    kwargs = ac.policy.policy_kwargs
    json.dumps(kwargs)                                   # Serve requires JSON kwargs
    policy = EngineAwarePolicy(**kwargs)                 # what the controller builds from them
    assert policy.config == PolicyConfig.model_validate(kwargs)
    assert (policy.config.ttft_slo_s, policy.config.downscale_delay_s, policy.config.min_replicas) == (1.5, 45, 0)


def test_requests_policy_is_serves_default_with_our_delays():
    ac = AutoscalingConfig(**autoscaling_config(_cfg(policy="requests", target_ongoing_requests=5,
                                                     upscale_delay_s=3, downscale_delay_s=20)))
    assert ac.policy.policy_function != "affinity_serve.autoscale.serve_policy:EngineAwarePolicy"
    assert (ac.target_ongoing_requests, ac.upscale_delay_s, ac.downscale_delay_s) == (5, 3, 20)
    assert (ac.metrics_interval_s, ac.look_back_period_s) == (1.0, 5.0)


@pytest.mark.parametrize("bad,match", [
    ({"policy": "queue"}, "autoscaling.policy"),
    ({"downscale_utilization": 0.9}, "downscale_utilization"),
    ({"look_back_period_s": 0.5}, "look_back_period_s"),
    ({"ttft_slo_s": 0}, "autoscaling.ttft_slo_s"),
    ({"refill_weight": 1.5}, "autoscaling.refill_weight"),
])
def test_bad_autoscaling_config_names_the_key(bad, match):
    with pytest.raises(ConfigError, match=match):
        AppConfig.from_dict({"autoscaling": bad})
