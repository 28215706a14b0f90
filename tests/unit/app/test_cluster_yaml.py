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
    from app.config import AppConfig
    cfg = AppConfig.from_yaml(ROOT / "deploy" / "cluster-app.yaml")
    assert cfg.serve.replica_num_gpus == 1 and cfg.engine.cache.block_size % 256 == 0
    assert os.path.basename(cfg.engine.model)
