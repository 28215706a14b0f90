"""tests/integration/subprocess_scenario.py's BackgroundScenario, which runs the multi-node scenario beside the
Ray tests: its result, the gate that holds its timed part until the result is asked for, and a stop that lets
the scenario's `finally` run (where a real one shuts its simulated cluster down)."""
from __future__ import annotations

import os
import time

import pytest

from tests.integration.subprocess_scenario import (GO_FILE_ENV, BackgroundScenario, _descendants, renice_tree,
                                                   wait_for_go)

STUB = "tests.unit.scenario_stub"


def _wait_for(path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_the_result_is_the_last_stdout_line_and_the_nice_value_is_applied(tmp_path):
    (tmp_path / "hold").write_text("")
    bg = BackgroundScenario(STUB, tmp_path, nice=5)
    _wait_for(tmp_path / "started")
    assert os.getpriority(os.PRIO_PROCESS, bg.proc.pid) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + 5)
    (tmp_path / "hold").unlink()
    assert bg.result(60)["answer"] == 42
    assert (tmp_path / "cleaned").exists()


def test_the_whole_tree_is_reniced_and_gets_the_callers_priority_back_where_allowed(tmp_path):
    """A nice'd scenario is starved on a loaded machine once its caller waits for it (CI: past 285 s): asking
    for the result gives its processes, the Ray ones it started included, the caller's priority back (as
    root, like CI; lowering a niceness is refused to others, who keep the old bound)."""
    (tmp_path / "hold").write_text("")
    (tmp_path / "spawn").write_text("")
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    bg = BackgroundScenario(STUB, tmp_path, nice=5)
    _wait_for(tmp_path / "child")
    child = int((tmp_path / "child").read_text())
    assert {bg.proc.pid, child} <= set(_descendants(bg.proc.pid))
    assert os.getpid() not in _descendants(bg.proc.pid)
    assert renice_tree(bg.proc.pid, min(19, mine + 7)) >= 2     # raising a niceness needs no privilege
    assert os.getpriority(os.PRIO_PROCESS, child) == min(19, mine + 7)
    (tmp_path / "hold").unlink()
    assert bg.result(60)["answer"] == 42
    if os.geteuid() == 0:
        assert bg.reniced >= 2, bg.reniced


def test_stop_unwinds_the_scenario_so_its_finally_runs(tmp_path):
    (tmp_path / "hold").write_text("")
    bg = BackgroundScenario(STUB, tmp_path)
    _wait_for(tmp_path / "started")
    bg.stop()
    assert bg.proc.returncode == 143 and (tmp_path / "cleaned").exists()


def test_a_scenario_still_running_past_the_wait_is_stopped_and_reported(tmp_path):
    (tmp_path / "hold").write_text("")
    bg = BackgroundScenario(STUB, tmp_path)
    _wait_for(tmp_path / "started")
    with pytest.raises(AssertionError, match="ran past"):
        bg.result(0.5)
    assert bg.proc.returncode is not None and (tmp_path / "cleaned").exists()


def test_the_timed_part_waits_until_the_result_is_asked_for(tmp_path):
    bg = BackgroundScenario(STUB, tmp_path)
    _wait_for(tmp_path / "started")
    time.sleep(1.0)
    assert not (tmp_path / "past_go").exists() and bg.proc.poll() is None      # held at wait_for_go
    res = bg.result(60)
    assert res["answer"] == 42 and res["timings_s"]["waited_for_go"] > 0
    assert (tmp_path / "past_go").exists()


def test_outside_a_background_scenario_there_is_no_gate(monkeypatch):
    monkeypatch.delenv(GO_FILE_ENV, raising=False)
    assert wait_for_go(30) < 0.1
