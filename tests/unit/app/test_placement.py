"""Placement: the Serve options build_app derives from the serve section's placement keys."""
import pytest

from affinity_serve.app.builder import ingress_deployment, replica_deployment, serve_start_options
from affinity_serve.app.config import AppConfig, ConfigError


def _cfg(engine=None, **serve):
    return AppConfig.from_dict({"engine": {"model": "/m", **(engine or {})}, "serve": serve})


def test_defaults_place_nothing_specially_and_proxy_runs_on_the_head_only():
    cfg = _cfg()
    d = replica_deployment(cfg)
    assert d.ray_actor_options == {"num_cpus": 1.0}            # a CPU share, no GPU, no custom resource
    assert d._replica_config.max_replicas_per_node is None
    ing = ingress_deployment(cfg)
    assert ing.ray_actor_options == {"num_cpus": 0.0}
    assert serve_start_options(cfg) == {"proxy_location": "HeadOnly",
                                        "http_options": {"host": "127.0.0.1", "port": 8000}}


def test_gpu_replicas_take_a_gpu_and_a_worker_slot_and_spread_one_per_node():
    cfg = _cfg(engine={"device": "cuda"}, replica_num_cpus=2, replica_resources={"llm_replica_slot": 1},
               max_replicas_per_node=1, num_replicas=4)
    d = replica_deployment(cfg)
    assert d.ray_actor_options == {"num_cpus": 2.0, "num_gpus": 1.0, "resources": {"llm_replica_slot": 1.0}}
    assert d._replica_config.max_replicas_per_node == 1 and d.num_replicas == 4
    assert d._replica_config.placement_group_bundles is None   # Serve refuses bundles with max_replicas_per_node


def test_fractional_gpu_share_is_passed_through():
    d = replica_deployment(_cfg(replica_num_gpus=0.5, max_replicas_per_node=2))
    assert d.ray_actor_options["num_gpus"] == 0.5 and d._replica_config.max_replicas_per_node == 2


def test_ingress_requests_its_custom_resource_and_never_a_gpu():
    cfg = _cfg(engine={"device": "cuda"}, ingress_resources={"cpu_node": 0.001}, ingress_num_cpus=0.5)
    ing = ingress_deployment(cfg)
    assert ing.ray_actor_options == {"num_cpus": 0.5, "resources": {"cpu_node": 0.001}}


def test_every_node_proxies_and_a_public_bind_only_when_configured():
    opts = serve_start_options(_cfg(proxy_location="EveryNode", host="0.0.0.0", port=9000))
    assert opts == {"proxy_location": "EveryNode", "http_options": {"host": "0.0.0.0", "port": 9000}}


@pytest.mark.parametrize("serve, problem", [
    ({"replica_resources": {"GPU": 1}}, "serve.replica_resources: GPU: not a custom resource"),
    ({"ingress_resources": {"CPU": 1, "memory": 1}}, "serve.ingress_resources: CPU, memory: not a custom resource"),
    ({"replica_resources": {"slot": 0}}, "serve.replica_resources.slot: Input should be greater than 0"),
    ({"max_replicas_per_node": 0}, "serve.max_replicas_per_node: Input should be greater than or equal to 1"),
    ({"proxy_location": "Everywhere"}, "serve.proxy_location: Input should be 'HeadOnly' or 'EveryNode'"),
])
def test_bad_placement_keys_get_one_clear_line(serve, problem):
    with pytest.raises(ConfigError) as e:
        _cfg(**serve)
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith(problem), e.value.problems
