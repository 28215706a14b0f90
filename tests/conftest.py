"""Shared fixtures: tiny random HF checkpoints written once per session, and transformers references."""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

# Property tests: "ci" (default; `make test`) replays the same derandomized examples on every run, so a
# red build means a bug, not bad luck; "explore" (`make test-explore`, or HYPOTHESIS_PROFILE=explore)
# draws many fresh ones and keeps failures in .hypothesis/ to replay.
# No deadline and no too-slow health check: on a loaded 2-core CI machine an example's wall time says
# nothing about correctness (speed is measured in benchmarks/), and a timing flake must not fail CI.
_NO_TIMING = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=300, derandomize=True, database=None, print_blob=True, **_NO_TIMING)
settings.register_profile("explore", max_examples=3000, derandomize=False, print_blob=True, **_NO_TIMING)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Without CUDA, the Triton attention kernels run on CPU tensors through Triton's interpreter, which has to
# be chosen before triton is first imported (its own library functions are jitted at import).
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# `make test` runs two pytest-xdist workers with `--dist loadgroup`. The Ray tests (tests/integration: the
# session's one Ray, and the multi-node scenario and CLI servers that start their own) form one group, so one
# worker runs them all in their file order, as a plain `pytest` would. The few files outside it whose
# assertions bound wall time (sub-second waits, drivers sending on time) join that group, so they run at full
# priority too. The other worker runs the rest (unit tests, the simulators, the `ray up` test, whose cluster
# lives in a PID namespace of its own) at a lower CPU priority: it uses
# the time the Ray tests spend waiting on replica start-ups and timers, and takes no CPU from them, so their
# timing bounds hold as in one process.
RAY_GROUP = "ray"
TIMED_FILES = frozenset({
    "tests/unit/app/test_http_limits.py",
    "tests/unit/app/test_replica_wait.py",
    "tests/unit/app/test_prompt_memory.py",
    "tests/unit/engine/test_structured_output.py",
    "tests/benchmarks/routing/test_real_trace.py",
})
_niced: list[bool] = []


def ray_group_scope(nodeid: str) -> str | None:
    """The scheduling group of a test id: RAY_GROUP for the Ray tests and TIMED_FILES, None for a test any
    worker may run."""
    path = nodeid.split("::", 1)[0]
    return RAY_GROUP if path.startswith("tests/integration/") or path in TIMED_FILES else None


@pytest.hookimpl(tryfirst=True, optionalhook=True)   # optional: a plain `pytest` without xdist runs too
def pytest_xdist_make_scheduler(config, log):
    """With `--dist loadgroup`, the Ray tests are grouped by their path (ray_group_scope). xdist's own
    `xdist_group` mark does not group here: it rewrites the item's private `_nodeid`, and under pytest 9.2 the
    scheduler is sent `nodeid` without the group."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class RayTogether(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return ray_group_scope(nodeid) or super()._split_scope(nodeid)

    return RayTogether(config, log)


def pytest_runtest_setup(item):
    """Under xdist, a worker that runs a test outside the Ray group drops its CPU priority, once (xdist hands
    the Ray group out first, so the worker that holds it gets others only after its last Ray test)."""
    if os.environ.get("PYTEST_XDIST_WORKER") and not _niced and ray_group_scope(item.nodeid) is None:
        os.nice(10)
        _niced.append(True)


TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
            max_position_embeddings=512)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """name -> checkpoint dir, generated lazily."""
    from affinity_serve.engine.demo import write_demo_model

    root = tmp_path_factory.mktemp("ckpt")
    made: dict[str, str] = {}
    specs = {
        "llama": dict(arch="llama", seed=1),
        "qwen2": dict(arch="qwen2", seed=2),
        "mistral": dict(arch="mistral", seed=3),
        "llama_tied_sharded": dict(arch="llama", seed=4, tie_word_embeddings=True, shards=3),
        "llama_linear": dict(arch="llama", seed=5, rope_scaling={"rope_type": "linear", "factor": 2.0}),
        "llama_llama3": dict(arch="llama", seed=6, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}),
        "qwen2_yarn": dict(arch="qwen2", seed=7, rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
    }

    class _Lazy(dict):
        def __missing__(self, name):
            path = root / name
            write_demo_model(path, **{**TINY, **specs[name]})
            self[name] = str(path)
            return self[name]

    return _Lazy(made)


@pytest.fixture(scope="session")
def hf_reference():
    """(checkpoint, prompt ids, n) -> transformers greedy continuation (cached models)."""
    import torch

    from tests.unit.engine.tiny_hf import load_reference_model

    models = {}

    def model(path):
        if path not in models:
            models[path] = load_reference_model(path)
        return models[path]

    def greedy(path, ids, n):
        m = model(path)
        with torch.no_grad():
            out = m.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return out[0, len(ids):].tolist()

    def logits(path, ids):
        with torch.no_grad():
            return model(path)(torch.tensor([ids])).logits[0].float()

    greedy.logits = logits
    greedy.model = model
    return greedy
