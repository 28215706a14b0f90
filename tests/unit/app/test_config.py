"""One config schema. The YAML blocks of the README and docs/ load as written, and the generated
configuration reference documents every key with its default: tests/unit/test_docs.py."""
import pytest
from pydantic import ValidationError

from affinity_serve.app.config import AppConfig, AppEngineConfig, ConfigError
from affinity_serve.engine.config import EngineConfig


def test_engine_section_is_the_engine_config():
    assert issubclass(AppEngineConfig, EngineConfig)
    assert list(AppEngineConfig.model_fields) == list(EngineConfig.model_fields)
    # defaults agree (the KV budget drifted once: 256 MiB in the app, 512 MiB in the engine)
    engine_defaults = EngineConfig(model="/m").model_dump()
    assert AppConfig().engine.model_copy(update={"model": "/m"}).model_dump() == engine_defaults
    cfg = AppConfig.from_dict({"engine": {"model": "/m", "linear_backend": "torch", "cpu_kernels": False}})
    assert cfg.engine.to_engine_config() == EngineConfig(model="/m", linear_backend="torch", cpu_kernels=False)
    assert EngineConfig.model_validate(cfg.engine.model_dump()) == cfg.engine.to_engine_config()  # the ingress
    with pytest.raises(ValueError, match="engine.model is unset"):
        AppConfig().engine.to_engine_config()


def test_errors_are_one_line_per_problem_naming_the_dotted_key(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("engine:\n  cache: {block_size: 0}\n  linear_backen: torch\nserve:\n  port: 70000\n")
    with pytest.raises(ConfigError) as ei:
        AppConfig.from_yaml(p)
    assert ei.value.problems == [
        "engine.cache.block_size: Input should be greater than or equal to 1 (got 0)",
        "engine.linear_backen: unknown key (did you mean 'linear_backend'?)",
        "serve.port: Input should be less than or equal to 65535 (got 70000)",
    ]
    assert str(p) in str(ei.value)
    p.write_text("engine: {cache: {num_blocks: 8, memory_budget_bytes: 1024}}\n")
    with pytest.raises(ConfigError, match="engine: set either cache.num_blocks or cache.memory_budget_bytes"):
        AppConfig.from_yaml(p)
    p.write_text("engine: [oops\n")
    with pytest.raises(ConfigError, match="not valid YAML") as ei:
        AppConfig.from_yaml(p)
    assert ei.value.problems == ["not valid YAML at line 2, column 1: expected ',' or ']', but got '<stream end>' "
                                 "(while parsing a flow sequence)"]
    with pytest.raises(ConfigError, match="cannot read the file"):
        AppConfig.from_yaml(tmp_path / "missing.yaml")


def test_cascade_min_tokens_takes_a_positive_count_or_null(tmp_path):
    p = tmp_path / "c.yaml"
    for bad, why in (("0", "greater than or equal to 1 (got 0)"), ("many", "valid integer")):
        p.write_text(f"engine:\n  cascade_min_tokens: {bad}\n")
        with pytest.raises(ConfigError) as ei:
            AppConfig.from_yaml(p)
        assert len(ei.value.problems) == 1 and ei.value.problems[0].startswith("engine.cascade_min_tokens: ")
        assert why in ei.value.problems[0]
    p.write_text("engine:\n  cascade_min_tokens: null\n")
    assert AppConfig.from_yaml(p).engine.cascade_min_tokens is None
    p.write_text("engine:\n  cascade_min_tokens: 128\n")
    assert AppConfig.from_yaml(p).engine.cascade_min_tokens == 128


def test_max_queue_wait_s_says_admission_predicts_the_wait_for_kv_room():
    """Admission adds each replica's wait for KV room to the routing TTFT (docs/limits.md, "Admission
    control"); the key's description (and the generated reference) says so."""
    from affinity_serve.app.config import ServeSection
    text = ServeSection.model_fields["max_queue_wait_s"].description
    assert "wait for KV room" in text and "docs/limits.md" in text


@pytest.mark.parametrize("idle_s, ok", [(0, True), (30, True), (300, True), (5, False), (29.9, False), (-1, False)])
def test_the_routers_idle_pause_is_off_or_longer_than_request_gaps(idle_s, ok):
    cfg = {"routing": {"kv_events_idle_s": idle_s}}
    if ok:
        assert AppConfig.model_validate(cfg).routing.kv_events_idle_s == idle_s
    else:
        with pytest.raises(ValidationError, match="kv_events_idle_s"):
            AppConfig.model_validate(cfg)


@pytest.mark.parametrize("knob, value, problem", [
    ("measured_kv_wait_weight", -1,
     "routing.affinity.measured_kv_wait_weight: Input should be greater than or equal to 0"),
    ("measured_kv_wait_weight", "high", "routing.affinity.measured_kv_wait_weight: Input should be a valid number"),
    ("kv_wait_calibration", "sometimes", "routing.affinity.kv_wait_calibration: Input should be a valid boolean"),
])
def test_the_measured_kv_wait_knobs_refuse_bad_values_naming_the_key(knob, value, problem):
    with pytest.raises(ConfigError, match=problem.replace(".", r"\.")):
        AppConfig.from_dict({"routing": {"affinity": {knob: value}}})
