"""cluster.yaml is a valid Ray cluster-launcher file, and its app config is a valid AppConfig."""
import json
import os
import pathlib

import jsonschema
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_cluster_yaml_matches_ray_schema_and_launcher_checks():
    import ray
    schema = json.loads((pathlib.Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    cfg = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    jsonschema.validate(cfg, schema)
    from ray.autoscaler._private.util import prepare_config, validate_config
    validate_config(prepare_config(cfg))            # what `ray up` checks, without cloud calls
    gpu = cfg["available_node_types"]["gpu_worker"]["resources"]
    assert gpu["GPU"] == 1 and cfg["head_node_type"] == "head"


def test_cluster_app_config_is_valid_and_uses_gpus():
    from affinity_serve.app.config import AppConfig
    cfg = AppConfig.from_yaml(ROOT / "deploy" / "cluster-app.yaml")
    assert cfg.serve.replica_num_gpus == 1 and cfg.engine.cache.block_size % 256 == 0
    assert os.path.basename(cfg.engine.model)


def test_cluster_nodes_declare_what_the_app_places_on_them():
    """Replicas' custom resources exist only on GPU workers (and fit one per node), the ingress's only on the
    head: a mismatch would leave replicas pending forever or put the ingress on a GPU node."""
    from affinity_serve.app.builder import ingress_placement, replica_placement
    from affinity_serve.app.config import AppConfig
    app = AppConfig.from_yaml(ROOT / "deploy" / "cluster-app.yaml")
    nodes = yaml.safe_load((ROOT / "cluster.yaml").read_text())["available_node_types"]
    head, gpu = nodes["head"]["resources"], nodes["gpu_worker"]["resources"]
    rep = replica_placement(app)
    for name, amount in rep["ray_actor_options"]["resources"].items():
        assert name not in head and gpu[name] >= amount * rep["max_replicas_per_node"]
    assert rep["ray_actor_options"]["num_gpus"] * rep["max_replicas_per_node"] <= gpu["GPU"]
    ing = ingress_placement(app)["ray_actor_options"]
    assert "num_gpus" not in ing and ing["resources"]
    for name, amount in ing["resources"].items():
        assert name not in gpu and head[name] >= amount * app.serve.ingress_replicas
    assert app.serve.proxy_location == "HeadOnly"
    assert nodes["gpu_worker"]["max_workers"] * rep["max_replicas_per_node"] >= app.autoscaling.max_replicas


def test_head_deploys_with_the_cli_and_keeps_the_dashboard_on_loopback():
    cfg = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    start = " ".join(cfg["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in start
    assert "affinity-serve deploy --config ~/affinity-serve.yaml" in start
    assert cfg["file_mounts"]["~/affinity-serve.yaml"] == "./deploy/cluster-app.yaml"
    from affinity_serve.app.cli import _parser
    args = _parser().parse_args(["deploy", "--config", "x.yaml"])
    assert args.cmd == "deploy" and args.address == "auto"


def test_nodes_boot_an_image_of_their_region_with_a_driver_and_install_python_311():
    """Issue 32.6: an AMI id belongs to one region (the one before was another region's); the SSM parameter
    resolves to the Deep Learning Base AMI (NVIDIA driver) of whichever region is configured. Its Python is
    3.10, so the setup installs 3.11; the install steps are a script the `ray up` test runs as users get it."""
    cfg = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    for name, node in cfg["available_node_types"].items():
        image = node["node_config"]["ImageId"]
        assert image.startswith("resolve:ssm:/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-"), name
    assert cfg["setup_commands"] == ["bash ~/affinity-serve/deploy/setup-node.sh"]
    assert cfg["file_mounts"]["~/affinity-serve"] == "." and cfg["rsync_filter"] == [".gitignore"]
    script = (ROOT / "deploy" / "setup-node.sh").read_text()
    assert "uv venv --seed --python 3.11" in script and "nvidia-smi" in script
