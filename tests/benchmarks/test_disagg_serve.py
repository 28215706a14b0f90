"""benchmarks/disagg_serve.py without Ray: the two apps it deploys are valid AppConfigs with the same replicas
and paced engines (the P/D one split between the pools), the trace is the engine-level benchmark's, and the
summary counts a request done only with all its tokens, in device time."""
from __future__ import annotations

import argparse

import pytest

from affinity_serve.app.config import AppConfig
from benchmarks import disagg, disagg_serve
from benchmarks.disagg_serve import Result, app_config, parse_args, summarize, trace, verdicts


def test_unified_and_pd_apps_have_the_same_paced_replicas():
    args = parse_args(["--time-dilation", "10", "--num-replicas", "4"])
    unified = AppConfig.model_validate(app_config(args, "/m", None))
    pd = AppConfig.model_validate(app_config(args, "/m", 2))
    assert unified.serve.num_replicas == 4 and not unified.disaggregation.enabled
    assert pd.disaggregation.enabled
    assert pd.disaggregation.prefill.num_replicas + pd.disaggregation.decode.num_replicas == 4
    assert pd.disaggregation.prefill.engine == {"scheduler": {"max_num_batched_tokens": 8192}}
    for cfg in (unified, pd):
        assert cfg.engine.pace.enabled
        assert cfg.engine.pace.step_base_s == pytest.approx(10 * 5.91e-3, rel=1e-3)     # H100 x 10
        assert cfg.engine.scheduler.max_num_batched_tokens == 2048
    with pytest.raises(ValueError, match="1..3 prefill replicas"):
        app_config(args, "/m", 4)
    assert pd.disaggregation.local_prefill_slack_s is None
    slack = AppConfig.model_validate(app_config(args, "/m", 2, local_prefill_slack_s=0.5))
    assert slack.disaggregation.local_prefill_slack_s == 0.5


@pytest.mark.parametrize("value", ["x", "-1", "0.5,-2"])
def test_local_prefill_slacks_that_are_not_seconds_are_refused(value, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--local-prefill-slacks", value])
    assert "--local-prefill-slacks" in capsys.readouterr().err


def test_the_trace_is_the_engine_level_benchmarks():
    args = parse_args(["--rate", "6.5", "--num-requests", "5", "--seed", "3"])
    engine_args = disagg.parse_args(["--device-profile", "h100-llama8b", "--rate", "6.5", "--num-requests", "5",
                                     "--min-prompt", "2048", "--max-prompt", "8000", "--seed", "3"])
    assert trace(args, 3) == disagg._trace(engine_args, 3)
    assert args.wall_rate == pytest.approx(0.65)


def test_summary_in_device_time_and_incomplete_requests_fail():
    whole = Result("a", arrival_s=1.0, max_tokens=3, token_times=[2.0, 2.5, 3.0], end_s=3.0, replica="x")
    short = Result("b", arrival_s=1.0, max_tokens=3, token_times=[2.0], end_s=2.0)
    broken = Result("c", arrival_s=1.0, max_tokens=3, token_times=[2.0, 2.1, 2.2], end_s=2.2, error="boom")
    row = summarize("unified x1", [whole, short, broken], k=10)
    assert row["completed"] == 1 and row["failed"] == 2 and row["errors"] == ["boom"]
    assert row["ttft_p99_s"] == pytest.approx(0.1) and row["tpot_p99_s"] == pytest.approx(0.05)
    assert row["throughput_tok_s"] == pytest.approx(3 / 0.2)
    pd = dict(row, config="P/D 1:1", tpot_p99_s=0.02, ttft_p99_s=0.11, failed=0)
    assert verdicts([row, pd])[0]["met"]


def test_dilation_below_one_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--time-dilation", "0.5"])
    assert "--time-dilation must be >= 1" in capsys.readouterr().err
    assert isinstance(disagg_serve.parse_args([]), argparse.Namespace)
