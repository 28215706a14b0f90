"""Both multi-node scenarios on one simulated 3-node cluster, run as its own process (one process can join only
one Ray cluster, and pytest's session Ray lives in the test process): `python -m
tests.integration.multinode_scenarios WORKDIR`. Starting the cluster, Ray and Serve once serves both
tests/integration/test_disagg_multinode.py and tests/integration/test_multinode.py (the `multinode_results`
fixture of tests/integration/conftest.py). The nodes declare what both scenarios need: the head `cpu_node` and
`llm_slot`, node A `llm_slot`, `prefill_slot` and `decode_slot`, node B `llm_slot` and `decode_slot`. The P/D
scenario (disagg_multinode_scenario.py; its apps use only the slot resources) runs first and deletes its app;
then the placement and failure scenario (multinode_scenario.py), which removes a worker node, runs last. The
last stdout line is one JSON object: {"disagg": ..., "multinode": ..., "timings_s": ...}."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

from tests.integration import disagg_multinode_scenario as disagg  # noqa: E402
from tests.integration import multinode_scenario as multinode  # noqa: E402
from tests.integration.subprocess_scenario import (  # noqa: E402
    connect, scenario_main, shutdown_cluster, start_cluster)


def scenario(workdir: Path) -> dict:
    from affinity_serve.engine.demo import write_demo_model

    t0 = time.monotonic()
    model = write_demo_model(workdir / "model", seed=11)
    head = {**multinode.HEAD_RESOURCES, "cpu_node": 10}
    cluster, (node_a, node_b) = start_cluster(head, [{**multinode.WORKER_RESOURCES, **disagg.NODE_A_RESOURCES},
                                                     {**multinode.WORKER_RESOURCES, **disagg.NODE_B_RESOURCES}])
    try:
        port = connect(cluster)
        timings = {"cluster_up": time.monotonic() - t0}
        out = {"disagg": disagg.run(cluster, node_a, node_b, model, port)}
        timings["disagg"] = time.monotonic() - t0
        out["multinode"] = multinode.run(cluster, [node_a, node_b], model, port)    # last: it removes a node
        timings["multinode"] = time.monotonic() - t0
        return {**out, "timings_s": timings}
    finally:
        shutdown_cluster(cluster)


if __name__ == "__main__":
    sys.exit(scenario_main(scenario, sys.argv[1:]))
