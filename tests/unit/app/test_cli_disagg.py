"""The CLI with P/D disaggregation: problems are one line each and exit 2 before Ray starts; the replica count
it reports and splits the cores by is the pools'."""
import json

import pytest

from affinity_serve.app import cli
from affinity_serve.app.cli import main
from tests.unit.app.ray_guard import RayStarted, no_ray  # noqa: F401 (the fixture)


class _Deploying(Exception):
    """The CLI reached the deploy step."""


pytestmark = pytest.mark.usefixtures("no_ray")


def _write(tmp_path, data: dict):
    p = tmp_path / "c.yaml"
    p.write_text(json.dumps(data))                       # JSON is YAML
    return str(p)


@pytest.mark.parametrize("cmd", ["config", "serve", "deploy"])
def test_incompatible_pool_overrides_are_one_line_each_and_exit_2(tmp_path, capsys, cmd):
    """A per-pool block size, dtype, model or kv_connector used to be accepted (and a pool's model to fail
    ~20 s into `serve`, with a traceback)."""
    p = _write(tmp_path, {"disaggregation": {"enabled": True, "prefill": {"engine": {
        "cache": {"block_size": 32}, "dtype": "float32", "model": "/elsewhere", "kv_connector": {"type": "offload"}}}}})
    rc = main([cmd, "--config", p])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines[0] == f"affinity-serve: error: invalid configuration in {p}:"
    assert [line.split(":")[0].strip() for line in lines[1:]] == [
        "disaggregation.prefill.engine.model", "disaggregation.prefill.engine.dtype",
        "disaggregation.prefill.engine.cache.block_size", "disaggregation.prefill.engine.kv_connector"]
    assert "set engine.model in the top-level engine section" in lines[1]


def test_replicas_flag_is_refused_with_disaggregation(tmp_path, capsys):
    p = _write(tmp_path, {"disaggregation": {"enabled": True}})
    assert main(["serve", "--config", p, "--replicas", "4"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 2 and "--replicas 4: with disaggregation each pool has its own size" in err
    assert "disaggregation.prefill.num_replicas and disaggregation.decode.num_replicas" in err


def _start(monkeypatch, checkpoints, tmp_path, capsys, data: dict, *argv: str) -> tuple[str, str, object]:
    """Run `serve` up to the deployment (Ray not started): its stdout, stderr and the config it deploys."""
    seen = {}

    def deploy(cfg):
        seen["cfg"] = cfg
        raise _Deploying
    monkeypatch.setattr(cli, "init_ray", lambda *a, **kw: None)
    monkeypatch.setattr(cli, "start_serve", deploy)
    monkeypatch.setattr(cli.os, "cpu_count", lambda: 8)
    p = _write(tmp_path, {"engine": {"model": checkpoints["llama"], "device": "cpu"}, **data})
    with pytest.raises(_Deploying):
        main(["serve", "--config", p, *argv])
    out, err = capsys.readouterr()
    return out, err, seen["cfg"]


def test_serve_counts_the_pools_replicas_for_its_message_and_the_core_split(monkeypatch, checkpoints, tmp_path,
                                                                            capsys):
    """serve.num_replicas (1 by default) used to be reported ("deploying 1 replica(s)" for 1 prefill + 3
    decode) and to divide the cores, so every pool replica got all of them."""
    out, err, cfg = _start(monkeypatch, checkpoints, tmp_path, capsys,
                           {"disaggregation": {"enabled": True, "decode": {"num_replicas": 3}}})
    assert "deploying 1 prefill + 3 decode replica(s) of " in out
    assert cfg.engine.num_threads == 2 and "warning" not in err          # 8 cores over 4 replicas
    # autoscaled pools: their initial counts
    out, err, cfg = _start(monkeypatch, checkpoints, tmp_path, capsys, {
        "autoscaling": {"enabled": True, "max_replicas": 4},
        "disaggregation": {"enabled": True, "prefill": {"autoscaling": {"initial_replicas": 2}},
                           "decode": {"num_replicas": 2}}})
    assert "deploying 2 prefill + 2 decode replica(s)" in out and cfg.engine.num_threads == 2
    # without P/D, as before
    out, err, cfg = _start(monkeypatch, checkpoints, tmp_path, capsys, {}, "--replicas", "4")
    assert "deploying 4 replica(s) of " in out and cfg.engine.num_threads == 2


@pytest.mark.parametrize("cmd", ["serve", "config"])
def test_a_config_files_serve_num_replicas_is_said_to_be_ignored_with_disaggregation(monkeypatch, checkpoints,
                                                                                     tmp_path, capsys, cmd):
    data = {"serve": {"num_replicas": 4}, "disaggregation": {"enabled": True}}
    warning = ("[affinity-serve] warning: serve.num_replicas (4) is ignored with disaggregation: each pool has its "
               "own size (disaggregation.prefill.num_replicas, disaggregation.decode.num_replicas)")
    if cmd == "serve":
        out, err, cfg = _start(monkeypatch, checkpoints, tmp_path, capsys, data)
        assert "deploying 1 prefill + 1 decode replica(s)" in out and cfg.engine.num_threads == 4
    else:
        p = _write(tmp_path, {"engine": {"model": checkpoints["llama"]}, **data})
        assert main(["config", "--config", p]) == 0
        err = capsys.readouterr().err
    assert warning in err.splitlines()
    # the same file without P/D: no warning
    data["disaggregation"]["enabled"] = False
    p = _write(tmp_path, {"engine": {"model": checkpoints["llama"]}, **data})
    assert main(["config", "--config", p]) == 0 and "warning" not in capsys.readouterr().err


def test_the_ingress_sizes_its_concurrency_by_the_decode_pool():
    from affinity_serve.app.builder import ingress_deployment
    from affinity_serve.app.config import AppConfig
    cfg = AppConfig.model_validate({"serve": {"max_ongoing_requests": 64},
                                    "disaggregation": {"enabled": True, "decode": {"num_replicas": 8}}})
    assert ingress_deployment(cfg).max_ongoing_requests == 64 * 8 * 4


@pytest.mark.parametrize("cmd", ["serve", "config"])
def test_pd_with_a_sliding_window_model_is_refused_before_ray(tmp_path, capsys, cmd):
    """The engine refuses the pd connector for a model with sliding-window layers; with disaggregation the
    connector is the builder's (engine.kv_connector.type stays none), so the checkpoint check must ask too."""
    from tests.unit.engine.tiny_hf import write_tiny_hf
    d = str(write_tiny_hf(tmp_path / "mistral", "MistralConfig", sliding_window=16))
    capsys.readouterr()
    p = _write(tmp_path, {"engine": {"model": d}, "disaggregation": {"enabled": True}})
    assert main([cmd, "--config", p]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("affinity-serve: error: invalid configuration: disaggregation.enabled: P/D moves one "
                           "block table per request and this model has sliding-window layers (a table per "
                           "KV-cache group); serve it without disaggregation")


@pytest.mark.parametrize("cmd", ["config", "serve"])
def test_a_num_replicas_outside_the_autoscaling_bounds_is_refused_not_clamped(tmp_path, capsys, cmd):
    """serve.num_replicas 5 with max_replicas 2 was clamped to 2 without a word (a pool's was refused)."""
    p = _write(tmp_path, {"engine": {"model": "/m"}, "serve": {"num_replicas": 5},
                          "autoscaling": {"enabled": True, "max_replicas": 2}})
    assert main([cmd, "--config", p]) == 2
    err = capsys.readouterr().err
    assert "serve.num_replicas: 5 is outside the autoscaling bounds [1, 2]" in err and "Traceback" not in err
    if cmd == "serve":
        p = _write(tmp_path, {"engine": {"model": "/m"}, "autoscaling": {"enabled": True, "max_replicas": 2}})
        assert main([cmd, "--config", p, "--replicas", "3"]) == 2
        assert "serve.num_replicas: 3 is outside" in capsys.readouterr().err


def test_the_start_message_counts_the_replicas_autoscaling_starts_with():
    from affinity_serve.app.config import AppConfig
    cfg = lambda a, **s: AppConfig.model_validate({"engine": {"model": "/m"}, "serve": s,      # noqa: E731
                                                   "autoscaling": {"enabled": True, **a}})
    assert cli.describe_replicas(cfg({"initial_replicas": 2, "max_replicas": 3})) == "2 replica(s)"
    assert cli.describe_replicas(cfg({"min_replicas": 0, "initial_replicas": 0})) == "0 replica(s)"
    assert cli.describe_replicas(cfg({"min_replicas": 2, "max_replicas": 4})) == "2 replica(s)"
    assert cli.describe_replicas(cfg({"max_replicas": 4}, num_replicas=3)) == "3 replica(s)"


def test_target_ongoing_requests_with_the_engine_policy_is_refused_not_ignored():
    from affinity_serve.app.config import AppConfig, ConfigError
    with pytest.raises(ConfigError) as e:
        AppConfig.from_dict({"engine": {"model": "/m"}, "autoscaling": {"enabled": True,
                                                                        "target_ongoing_requests": 2}})
    assert "target_ongoing_requests applies to policy: requests" in str(e.value)
    AppConfig.from_dict({"engine": {"model": "/m"}, "autoscaling": {"enabled": True, "policy": "requests",
                                                                    "target_ongoing_requests": 2}})


def test_ray_serve_nesting_points_to_where_this_config_keeps_it():
    from affinity_serve.app.config import AppConfig, ConfigError
    for data, hint in (({"deployment_config": {"autoscaling_config": {}}}, "the top-level sections"),
                       ({"serve": {"autoscaling_config": {"min_replicas": 1}}}, "the top-level `autoscaling`"),
                       ({"serve": {"ray_actor_options": {"num_gpus": 1}}}, "serve.replica_num_gpus")):
        with pytest.raises(ConfigError) as e:
            AppConfig.from_dict({"engine": {"model": "/m"}, **data})
        assert "a Ray Serve deployment option; here use" in str(e.value) and hint in str(e.value), str(e.value)


@pytest.mark.parametrize("cmd", ["config", "serve"])
def test_min_replicas_above_one_without_disaggregation_is_not_a_pool_error(tmp_path, capsys, cmd):
    """The CLI re-validates a dumped config, where every field reads as set: the pools' default num_replicas 1
    was then 'outside' min_replicas 2 (with disaggregation off), and so was serve.num_replicas 1."""
    p = _write(tmp_path, {"engine": {"model": "/m"}, "autoscaling": {"enabled": True, "min_replicas": 2,
                                                                     "max_replicas": 4}})
    if cmd == "config":
        assert main([cmd, "--config", p]) == 0
        dumped = capsys.readouterr().out                    # the effective config, fed back in
        (tmp_path / "dump.yaml").write_text(dumped)
        assert main([cmd, "--config", str(tmp_path / "dump.yaml")]) == 0
    else:                                                   # serve's loading (re-validates the dump)
        cfg = cli._load_config(cli._parser().parse_args([cmd, "--config", p]))
        assert cfg.autoscaling.min_replicas == 2 and "outside" not in capsys.readouterr().err
