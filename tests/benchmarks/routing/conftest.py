"""Small traces shared by the routing-benchmark tests (generated once per session: a few seconds)."""
from __future__ import annotations

import pytest

from benchmarks.routing.workload import WorkloadSpec, generate


@pytest.fixture(scope="session")
def mixed_trace():
    return generate(WorkloadSpec(num_replicas=4, pressure=0.75, load=1.0, requests_per_replica=120, seed=1))


@pytest.fixture(scope="session")
def small_trace():
    return generate(WorkloadSpec(num_replicas=3, pressure=0.75, load=1.2, requests_per_replica=60, seed=2))
