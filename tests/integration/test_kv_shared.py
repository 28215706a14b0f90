"""The node-shared KV store on a real Ray Serve: two replicas on one node share one store
(engine.kv_connector type shared), so a prefix computed on replica A is served from the store on replica B.

Routing is round_robin here, to force the repeat onto the replica that never computed the prompt (the
prefix-affinity router would keep it on A while A is not busy). Which replica served what is read from
the engines' own connector counters (`debug_state()["kv_connector"]`); the speed of a store hit against
a recompute is measured in benchmarks (docs/benchmarks/kv-connectors.md), not asserted here.
"""
from __future__ import annotations

import os
import random
import shutil
import tempfile
import time

import httpx
import pytest

from tests.integration.conftest import app_config, wait_running
from tests.integration.waiting import wait_until

pytestmark = pytest.mark.slow         # deploys its own 2-replica app: ~15 s on top of the session's Ray
APP = "affinity-kvshared"
BLOCK = 4


@pytest.fixture(scope="module")
def shared_url(ray_serve, checkpoints):
    from ray import serve

    from affinity_serve.app.builder import build_app

    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    store = tempfile.mkdtemp(prefix="affinity-kv-test-", dir=shm)
    cfg = app_config(checkpoints["llama"])
    cfg["engine"]["kv_connector"] = {"type": "shared", "shared_dir": store, "capacity_blocks": 2048}
    cfg["routing"] |= {"policy": "round_robin"}
    serve.run(build_app(cfg), name=APP, route_prefix="/kvshared")
    try:
        wait_running(APP, "LLMReplica", 2)
        yield ray_serve + "/kvshared", store
    finally:
        serve.delete(APP)
        shutil.rmtree(store, ignore_errors=True)


def _connector_stats() -> dict[str, dict]:
    """replica id -> its engine's KV connector counters (asks until both replicas answered)."""
    from ray import serve
    h = serve.get_deployment_handle("LLMReplica", app_name=APP)
    out: dict[str, dict] = {}
    for _ in range(40):
        st = h.debug_state.remote().result(timeout_s=30)
        out[st["replica_id"]] = st["kv_connector"]
        if len(out) == 2:
            return out
    raise AssertionError(f"only {len(out)} replica(s) answered debug_state")


def _complete(c: httpx.Client, url: str, prompt: list[int]) -> tuple[dict, float]:
    t0 = time.perf_counter()
    r = c.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json(), time.perf_counter() - t0




def test_a_prefix_computed_on_one_replica_is_loaded_from_the_shared_store_on_the_other(shared_url):
    url, store = shared_url
    rng = random.Random(11)
    prompt = [rng.randrange(5, 600) for _ in range(161)]          # 40 full blocks + 1 token
    num_loadable = (len(prompt) - 1) // BLOCK * BLOCK              # never the last token's block
    with httpx.Client(timeout=60) as c:
        first, _ = _complete(c, url, prompt)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        def stored_once():
            st = _connector_stats()
            writers = [rid for rid, s in st.items() if s["stored_blocks"] >= num_loadable // BLOCK]
            return st if len(writers) == 1 else None
        before = wait_until(stored_once, 60, "the first replica to write the prompt's blocks to the store")
        (a,) = [rid for rid, s in before.items() if s["stored_blocks"]]
        (b,) = [rid for rid in before if rid != a]
        assert before[b]["loaded_blocks"] == 0
        # the store is files on this machine: every block of the prompt (but the last token's) is there
        assert sum(len(files) for _, _, files in os.walk(store)) >= num_loadable // BLOCK

        # round robin: the next requests alternate; the one landing on b can only hit via the store
        served_by_b = None
        for _ in range(4):
            again, _ = _complete(c, url, prompt)
            assert again["choices"][0]["text"] == first["choices"][0]["text"]      # same greedy token
            now = _connector_stats()
            if now[b]["loaded_blocks"] > 0:
                served_by_b = again
                break
        assert served_by_b is not None, "round robin never sent the prompt to the second replica"
        assert now[b]["loads_ok"] == 1 and now[b]["loads_failed"] == 0
        assert now[b]["loaded_blocks"] * BLOCK == num_loadable
        assert served_by_b["usage"]["prompt_tokens_details"]["cached_tokens"] == num_loadable
        assert now[a]["loaded_blocks"] == 0                        # a hit its own pool, never the store


def test_a_damaged_block_in_the_store_is_recomputed_counted_and_repaired(shared_url):
    """Issue 26: a flipped byte in a stored block is a counted miss on the replica that reads it (same
    greedy output as the replica that computed it), and the recompute writes the block again."""
    from affinity_serve.engine.hashing import hash_block_chain
    from affinity_serve.engine.kv_connector.shared_store import HEADER_BYTES, BlockRead, SharedKVStore

    url, store = shared_url
    rng = random.Random(26)
    prompt = [rng.randrange(5, 600) for _ in range(41)]               # 10 full blocks + 1 token
    hashes = hash_block_chain(prompt, BLOCK)[:10]
    with httpx.Client(timeout=60) as c:
        first, _ = _complete(c, url, prompt)
        (ns,) = [d for d in os.listdir(store) if not d.startswith(".")]
        path = os.path.join(store, ns, hashes[4].hex())
        wait_until(lambda: os.path.exists(path), 60, "the prompt's blocks in the store")
        raw = bytearray(open(path, "rb").read())
        raw[HEADER_BYTES + 5] ^= 0x10
        with open(path, "wb") as f:
            f.write(raw)
        before = _connector_stats()

        def damaged_on_one():
            again, _ = _complete(c, url, prompt)
            assert again["choices"][0]["text"] == first["choices"][0]["text"]     # never a wrong token
            now = _connector_stats()
            hit = [rid for rid in now if now[rid]["load_failures_damaged"] > before[rid]["load_failures_damaged"]]
            return (hit, now) if hit else None
        (reader,), now = wait_until(damaged_on_one, 60, "a replica to read the damaged block")
        assert now[reader]["loads_failed"] - before[reader]["loads_failed"] == 1

        def repaired():
            if not os.path.exists(path) or open(path, "rb").read() == bytes(raw):
                return None
            check = SharedKVStore(store, ns, os.path.getsize(path) - HEADER_BYTES, 2048)
            try:
                return check.read(hashes[4], memoryview(bytearray(check.block_bytes))) is BlockRead.OK
            finally:
                check.close()
        assert wait_until(repaired, 60, "the recompute to store the block again")
        assert all(st["kv_tier"] == "shared" for st in _debug_states().values())


def _debug_states() -> dict[str, dict]:
    from ray import serve
    h = serve.get_deployment_handle("LLMReplica", app_name=APP)
    out: dict[str, dict] = {}
    for _ in range(40):
        st = h.debug_state.remote().result(timeout_s=30)
        out[st["replica_id"]] = st
        if len(out) == 2:
            return out
    raise AssertionError(f"only {len(out)} replica(s) answered debug_state")


def test_the_tier_counters_reach_the_ingress_metrics(shared_url):
    """Issue 26: the store's lookups, hits, loads and failures by cause are Prometheus counters on /metrics
    (labelled by replica and tier), not only in debug_state."""
    url, _ = shared_url
    rng = random.Random(7)
    prompt = [rng.randrange(5, 600) for _ in range(33)]
    with httpx.Client(timeout=60) as c:
        _complete(c, url, prompt)
        _complete(c, url, prompt)

        def exported():
            text = c.get(f"{url}/metrics").text
            lines = [ln for ln in text.splitlines() if ln.startswith("affinity_kv_tier_lookups")
                     and 'tier="shared"' in ln]
            return lines if lines and any(float(ln.rsplit(" ", 1)[1]) > 0 for ln in lines) else None
        lines = wait_until(exported, 60, "affinity_kv_tier_lookups on /metrics")
    assert all('replica="' in ln for ln in lines)
