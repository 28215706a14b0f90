"""Prefix-affinity routing on a real Ray Serve: 2 model replicas, 2 ingress replicas (each with its own
router, fed by the replicas' KV events), requests over HTTP through Serve's proxy."""
from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from tests.integration.conftest import ROUTING_APP

pytestmark = pytest.mark.slow
PERIOD_S = 0.25


def _ingress():
    from ray import serve
    return serve.get_app_handle(ROUTING_APP)


def _model_replicas():
    from ray import serve
    return serve.get_deployment_handle("LLMReplica", app_name=ROUTING_APP)


def _states(n: int = 50, want: int = 2, tries: int = 40) -> dict[str, dict]:
    """routing_decisions from each ingress replica (calls land on a random one: ask until `want` answered)."""
    h, out = _ingress(), {}
    for _ in range(tries):
        st = h.routing_decisions.remote(n).result(timeout_s=30)
        out[st["ingress_replica_id"]] = st
        if len(out) >= want:
            break
    return out


def _prompt(prefix_seed: int, n_prefix: int, tail: int) -> list[int]:
    rng = random.Random(prefix_seed)
    return [rng.randrange(5, 600) for _ in range(n_prefix)] + [600 + tail % 100, 700 + tail // 100 % 20]


def _post(c: httpx.Client, url: str, prompt: list[int], max_tokens: int = 4) -> dict:
    r = c.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def _wait_until(cond, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def url(routing_url):
    """Both ingress replicas' routers built and synced with both replicas' KV state (Serve builds a router
    on its first request; until its first pull it routes on load alone)."""
    with httpx.Client(timeout=60) as c:
        for i in range(12):
            _post(c, routing_url, _prompt(1000 + i, 8, i))

    def synced():
        sts = _states()
        return len(sts) == 2 and all(st["routers"] and not any(
            r["needs_snapshot"] for r in st["routers"][0]["replicas"].values()) and
            len(st["routers"][0]["replicas"]) == 2 for st in sts.values())
    _wait_until(synced, 30, "both ingress routers to sync")
    return routing_url


def test_shared_prefix_lands_on_one_replica_and_hits_the_cache_from_both_ingress_replicas(url):
    with httpx.Client(timeout=60) as c:
        first = _post(c, url, _prompt(1, 96, 0))
        time.sleep(4 * PERIOD_S)                   # both routers pull the stored blocks
        repeats = [_post(c, url, _prompt(1, 96, i)) for i in range(1, 13)]
    assert {r["system_fingerprint"] for r in repeats} == {first["system_fingerprint"]}
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in repeats]
    assert all(n >= 88 for n in cached), cached
    target = first["system_fingerprint"].removeprefix("replica:")
    sts = _states(200)
    assert len(sts) == 2
    for st in sts.values():                        # each ingress's router chose the holder on its own
        assert st["routers"][0]["counters"]["num_accuracy_samples"] > 0    # first tokens reach the router
        decisions = st["routers"][0]["decisions"]
        assert any(d["chosen"] == target and d["reason"] in ("affinity", "hot_replica")
                   and max(c["predicted_cached_tokens"] for c in d["candidates"]) >= 88 for d in decisions)


def test_hot_prefix_spills_to_the_second_replica_once_the_first_is_full(url):
    async def go():
        async with httpx.AsyncClient(timeout=120) as c:
            rs = await asyncio.gather(*[c.post(f"{url}/v1/completions", json={
                "prompt": _prompt(2, 64, i), "max_tokens": 24, "ignore_eos": True}) for i in range(24)])
        return rs
    rs = asyncio.run(go())
    assert all(r.status_code == 200 for r in rs)
    replicas = {r.json()["system_fingerprint"] for r in rs}
    assert len(replicas) == 2, replicas


def test_reset_prefix_cache_reaches_the_routers_index_within_a_few_periods(url):
    with httpx.Client(timeout=60) as c:
        target = _post(c, url, _prompt(3, 64, 0))["system_fingerprint"].removeprefix("replica:")
    _wait_until(lambda: all(st["routers"][0]["replicas"][target]["num_held_blocks"] >= 16
                            for st in _states().values()), 5, "the prefix in both indexes")
    h = _model_replicas()
    epochs: dict[str, str] = {}
    for _ in range(40):                            # reset replicas until the target's epoch moved
        h.reset_prefix_cache.remote().result(timeout_s=30)
        for _ in range(6):
            s = h.debug_state.remote().result(timeout_s=30)
            epochs[s["replica_id"]] = s["stats"]["cache_epoch"]
        if target in epochs and any(st["routers"][0]["replicas"][target]["epoch"] != epochs[target]
                                    for st in _states().values()):
            break
    new_epoch = epochs[target]
    start = time.monotonic()
    _wait_until(lambda: all(st["routers"][0]["replicas"][target]["epoch"] == new_epoch
                            and st["routers"][0]["replicas"][target]["num_held_blocks"] == 0
                            for st in _states().values()), 8 * PERIOD_S + 3, "the reset in both indexes")
    assert time.monotonic() - start < 8 * PERIOD_S + 3


def test_a_router_error_falls_back_instead_of_hanging(url):
    armed: set[str] = set()
    for _ in range(30):
        armed.add(_ingress().debug_inject_routing_errors.remote(2).result(timeout_s=30)["ingress_replica_id"])
        if len(armed) == 2:
            break
    before = sum(st["routers"][0]["num_shell_errors"] for st in _states().values())
    with httpx.Client(timeout=30) as c:            # a hang would time out here
        for i in range(6):
            _post(c, url, _prompt(4, 16, i))
    after = _states()
    assert sum(st["routers"][0]["num_shell_errors"] for st in after.values()) > before
