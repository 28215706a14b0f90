"""`make test`'s two workers (tests/conftest.py): the Ray tests and the wall-time-bound files run together at
full priority; a renamed file must not silently fall out of that group."""
from __future__ import annotations

from pathlib import Path

from tests.conftest import RAY_GROUP, TIMED_FILES, ray_group_scope

ROOT = Path(__file__).resolve().parents[2]


def test_every_wall_time_bound_file_exists_and_joins_the_ray_group():
    for path in TIMED_FILES:
        assert (ROOT / path).is_file(), f"{path} is gone: update TIMED_FILES in tests/conftest.py"
        assert ray_group_scope(f"{path}::test_x") == RAY_GROUP


def test_the_ray_tests_are_one_group_and_the_rest_go_anywhere():
    assert ray_group_scope("tests/integration/test_routing.py::test_a[1]") == RAY_GROUP
    assert ray_group_scope("tests/integration/test_cli_attach.py::test_b") == RAY_GROUP
    assert ray_group_scope("tests/unit/engine/test_sampler.py::test_c") is None
    assert ray_group_scope("tests/benchmarks/routing/test_simulator.py::test_d") is None
