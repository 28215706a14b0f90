"""P/D disaggregation on a real Ray Serve (app/disagg.py): 1 prefill + 1 decode replica, KV through Ray's
object store. Token-exact greedy output against transformers, streamed and whole, n > 1, logprobs, stop
strings; short prompts served by the decode replica itself; a prefill pool that fails makes the decode replica
recompute; both pools end with every KV block free."""
from __future__ import annotations

import contextlib
import random

import httpx
import pytest

from tests.integration.conftest import app_config, wait_running
from tests.integration.waiting import wait_until

pytestmark = pytest.mark.slow         # deploys its own 1P+1D app
APP = "affinity-disagg"
BLOCK = 4
MIN_REMOTE = 12
PREFILL_TIMEOUT_S = 6.0
PREFILL_BACKOFF_S = 20.0      # longer than the recompute and checks after the timeout take here


@contextlib.contextmanager
def deployed_pd(base_url: str, model: str, app: str, prefix: str, disaggregation: dict):
    """A 1 prefill + 1 decode app of `model` on the running Serve, deployed and running until the block ends."""
    from ray import serve

    from affinity_serve.app.builder import build_app

    cfg = app_config(model)
    cfg["disaggregation"] = {"enabled": True, "prefill": {
        "num_replicas": 1, "engine": {"scheduler": {"max_num_batched_tokens": 64}}},
        "decode": {"num_replicas": 1}, **disaggregation}
    serve.run(build_app(cfg), name=app, route_prefix=prefix)
    try:
        wait_running(app, "LLMReplica", 1)
        wait_running(app, "PrefillReplica", 1)
        yield base_url + prefix
    finally:
        serve.delete(app)


def pd_state(app: str, deployment: str) -> dict:
    from ray import serve
    return serve.get_deployment_handle(deployment, app_name=app).debug_state.remote().result(timeout_s=30)


def pd_pools_empty(app: str) -> bool:
    """Both pools hold no request and every KV block is free."""
    for dep in ("LLMReplica", "PrefillReplica"):
        st = pd_state(app, dep)
        if st["num_free_blocks"] != st["num_blocks"] - 1 or st["num_requests"]:
            return False
    return True


@pytest.fixture(scope="module")
def pd_url(ray_serve, checkpoints):
    with deployed_pd(ray_serve, checkpoints["llama"], APP, "/disagg", {
            "min_remote_prefill_tokens": MIN_REMOTE, "transfer_timeout_s": 5.0,
            "prefill_timeout_s": PREFILL_TIMEOUT_S, "prefill_backoff_s": PREFILL_BACKOFF_S}) as url:
        yield url


def _state(deployment: str) -> dict:
    return pd_state(APP, deployment)


def _ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(10, 700) for _ in range(n)]


def _complete(c, url, prompt, **kw):
    r = c.post(f"{url}/v1/completions", json={"prompt": prompt, "temperature": 0, "ignore_eos": True,
                                               "return_token_ids": True, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def _pools_empty():
    return pd_pools_empty(APP)


def test_pd_greedy_equals_transformers_whole_and_streamed(pd_url, checkpoints, hf_reference):
    path = checkpoints["llama"]
    with httpx.Client(timeout=60) as c:
        for n_prompt in (13, 16, 31, 57):
            prompt = _ids(n_prompt, n_prompt)
            ref = hf_reference(path, prompt, 10)
            out = _complete(c, pd_url, prompt, max_tokens=10)
            assert out["choices"][0]["token_ids"] == ref
            assert out["usage"]["completion_tokens"] == 10
            streamed = []
            with c.stream("POST", f"{pd_url}/v1/completions", json={
                    "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "stream": True,
                    "return_token_ids": True}) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        import json
                        ch = json.loads(line[6:])["choices"]
                        if ch:
                            streamed.extend(ch[0].get("token_ids") or [])
            assert streamed == ref
    conn = _state("LLMReplica")["kv_connector"]
    assert conn["loads_ok"] >= 4 and conn["loads_failed"] == 0
    wait_until(_pools_empty, timeout_s=60, what="both pools to free every block")


def test_pd_n_logprobs_and_stop_strings_behave_as_unified(pd_url, checkpoints, hf_reference):
    path = checkpoints["llama"]
    prompt = _ids(40, 5)
    ref = hf_reference(path, prompt, 8)
    with httpx.Client(timeout=60) as c:
        out = _complete(c, pd_url, prompt, max_tokens=8, n=2, logprobs=2)
        assert [ch["token_ids"] for ch in sorted(out["choices"], key=lambda ch: ch["index"])] == [ref, ref]
        for ch in out["choices"]:
            assert len(ch["logprobs"]["tokens"]) == 8 and len(ch["logprobs"]["top_logprobs"][0]) == 2
        full = _complete(c, pd_url, prompt, max_tokens=8)["choices"][0]["text"]
        stop = full[len(full) // 2:len(full) // 2 + 2]
        if stop.strip():
            cut = _complete(c, pd_url, prompt, max_tokens=8, stop=[stop])["choices"][0]
            assert cut["finish_reason"] == "stop" and cut["text"] == full[:full.index(stop)]
        one = _complete(c, pd_url, prompt, max_tokens=1)["choices"][0]
        assert one["token_ids"] == ref[:1] and one["finish_reason"] == "length"
    wait_until(_pools_empty, timeout_s=60, what="both pools to free every block")


def test_pd_transfer_metrics_reach_the_metrics_endpoint(pd_url):
    """Both pools export their P/D series through the app's metrics hub: the decode replica's reads (count,
    bytes, time histogram) and the prefill replica's holds freed by a read; the count moves with a request."""
    import re

    def total(text, series):
        return sum(float(v) for v in re.findall(rf"^{re.escape(series)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))

    with httpx.Client(timeout=60) as c:
        def held_read(text):
            return sum(float(v) for v in re.findall(
                r'^affinity_pd_holds_total\{[^}]*outcome="read"[^}]*\} (\S+)$', text, re.M))

        first = c.get(f"{pd_url}/metrics").text
        before = total(first, "affinity_pd_transfer_time_seconds_count")
        holds_before = held_read(first)

        def moved():
            # the decode side's read and the prefill side's freed hold reach the hub on their own replicas'
            # pushes (the prefill replica frees the hold when the read's confirmation arrives): wait for both
            text = c.get(f"{pd_url}/metrics").text
            read = total(text, "affinity_pd_transfer_time_seconds_count") > before
            return text if read and held_read(text) > holds_before else None

        _complete(c, pd_url, _ids(40, 1234), max_tokens=4)
        text = wait_until(moved, 30, "a new read and a hold freed by it on /metrics")
    assert re.search(r'^affinity_pd_transfers_total\{[^}]*outcome="read"[^}]*\} [1-9]', text, re.M), text
    assert total(text, "affinity_pd_transfer_bytes_total") > 0
    assert "affinity_pd_held_blocks{" in text


def test_pd_seeded_sampling_equals_one_engine(pd_url, checkpoints):
    """A seeded sampled request: each sequence's tokens after the first (the decode replica's) are those one
    engine draws (seed + the sequence's index, at each output index)."""
    from affinity_serve.engine import LLM, SamplingParams
    prompt = _ids(40, 4321)
    with httpx.Client(timeout=60) as c:
        out = _complete(c, pd_url, prompt, max_tokens=8, temperature=1.0, seed=7, n=2)
    got = [ch["token_ids"] for ch in sorted(out["choices"], key=lambda ch: ch["index"])]
    one = LLM(checkpoints["llama"], cache={"num_blocks": 64, "block_size": BLOCK}).generate(
        prompt, SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=7, ignore_eos=True), use_tqdm=False)
    assert got == [o.token_ids for o in sorted(one[0].outputs, key=lambda o: o.index)]
    wait_until(_pools_empty, timeout_s=60, what="both pools to free every block")


def test_pd_structured_output_equals_one_engine_greedy(pd_url, checkpoints):
    """Structured outputs go through the prefill pool too: the first token masked there, the rest by the decode
    replica's matcher started past it; the same tokens as one engine, and a read was made."""
    from affinity_serve.engine import LLM, SamplingParams
    from affinity_serve.engine.structured_output.spec import StructuredOutputSpec
    prompt = _ids(44, 8765)
    before = _state("LLMReplica")["kv_connector"]["loads_ok"]
    with httpx.Client(timeout=60) as c:
        out = _complete(c, pd_url, prompt, max_tokens=20, structured_outputs={"regex": r"[a-z]{2,5}-[0-9]{3}"})
    one = LLM(checkpoints["llama"], cache={"num_blocks": 64, "block_size": BLOCK}).generate(
        prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                               structured_output=StructuredOutputSpec(regex=r"[a-z]{2,5}-[0-9]{3}")), use_tqdm=False)
    assert out["choices"][0]["token_ids"] == one[0].outputs[0].token_ids
    assert _state("LLMReplica")["kv_connector"]["loads_ok"] > before
    wait_until(_pools_empty, timeout_s=60, what="both pools to free every block")


def test_short_uncached_part_is_served_by_the_decode_replica(pd_url, checkpoints, hf_reference):
    path = checkpoints["llama"]
    before = _state("LLMReplica")["kv_connector"]
    prompt = _ids(MIN_REMOTE - 3, 77)
    with httpx.Client(timeout=60) as c:
        assert _complete(c, pd_url, prompt, max_tokens=5)["choices"][0]["token_ids"] == hf_reference(path, prompt, 5)
    after = _state("LLMReplica")["kv_connector"]
    assert after["lookups"] == before["lookups"]        # never asked for remote KV


def test_ray_transport_read_of_a_dead_prefill_owner_fails_as_missing(ray_serve):
    """The object store path: blocks put by a process that then died cannot be read (Ray's owner-died error),
    which the decode engine turns into a recompute (engine tests cover that fallback)."""
    import numpy as np
    import ray

    from affinity_serve.app.disagg import RayObjectTransport
    from affinity_serve.engine import KVTransferError, RemotePrefill

    @ray.remote(num_cpus=0)
    class Owner:
        def put(self, n, width):
            return [ray.put(np.arange(n * width, dtype=np.uint8).reshape(n, width))]

    owner = Owner.remote()
    [ref] = ray.get(owner.put.remote(3, 8))
    [unread] = ray.get(owner.put.remote(4, 1 << 18))
    t = RayObjectTransport()
    remote = RemotePrefill("p", "t", "k", 12, 4, 1, address=(ref, 1))
    h = t.start_read(remote, 2, 2)
    got = None

    def read():
        nonlocal got
        got = h.poll()
        return got is not None

    wait_until(read, timeout_s=30, what="the read")
    assert got.tolist() == np.arange(24, dtype=np.uint8).reshape(3, 8)[1:3].tolist()
    with pytest.raises(KVTransferError):            # blocks before what the prefill copied out
        t.start_read(remote, 0, 2)
    ray.kill(owner)
    wait_until(lambda: _dead(unread), timeout_s=20, what="the owner's death to reach the object")


def _dead(ref) -> bool:
    from affinity_serve.app.disagg import _ObjectRead
    from affinity_serve.engine import KVTransferError
    try:
        _ObjectRead(ref, 0, 1).poll()
        return False
    except KVTransferError as e:
        return e.cause == "missing"


def test_prefill_pool_down_the_decode_replica_recomputes(pd_url, checkpoints, hf_reference):
    import ray
    path = checkpoints["llama"]
    with httpx.Client(timeout=120) as c:
        _complete(c, pd_url, _ids(40, 98), max_tokens=2)        # the decode replica's prefill router exists
        for round_ in range(2):     # a second round if the replacement ran before the request came
            wait_running(APP, "PrefillReplica", 1, timeout_s=90)
            wait_until(lambda: _state("LLMReplica")["prefill_pool_size"] == 1, timeout_s=60,
                       what="the decode replica to see one prefill replica")
            victim = _state("PrefillReplica")["replica_id"]
            before = _state("LLMReplica")["disaggregation"]
            ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#PrefillReplica#{victim}", namespace="serve"),
                     no_restart=True)
            # sent at once, while Serve's controller still lists the dead replica: the call finds it dead, the
            # pool is empty, and Serve would hold the call until a replacement has started: the decode replica
            # cancels it and recomputes
            prompt = _ids(48, 99 + 2 * round_)        # new prompts: none held by the decode replica
            out = _complete(c, pd_url, prompt, max_tokens=6)
            assert out["choices"][0]["token_ids"] == hf_reference(path, prompt, 6)
            # until a replacement runs, later requests skip the pool without calling it
            size = _state("LLMReplica")["prefill_pool_size"]
            prompt = _ids(48, 100 + 2 * round_)
            out = _complete(c, pd_url, prompt, max_tokens=6)
            after = _state("LLMReplica")["disaggregation"]
            assert out["choices"][0]["token_ids"] == hf_reference(path, prompt, 6)
            if after["prefill_failed"] == before["prefill_failed"] + 2:
                break
    # both requests recomputed here; each for one cause: usually the pool found empty (the call cancelled, then
    # not called), but on a slow machine the dead replica's call may time out first and hold it back (CI)
    assert after["prefill_failed"] == before["prefill_failed"] + 2, (before, after)
    causes = ("prefill_pool_empty", "prefill_timeouts", "prefill_suspect")
    assert sum(after[k] - before[k] for k in causes) == 2, (before, after)
    if size == 0:           # the second request found no running prefill replica: not called
        assert after["prefill_pool_empty"] > before["prefill_pool_empty"], (before, after)
    wait_running(APP, "PrefillReplica", 1, timeout_s=90)
    wait_until(_pools_empty, timeout_s=60, what="both pools to free every block")


def test_a_hung_prefill_replica_costs_a_recompute_after_the_prefill_timeout(pd_url, checkpoints, hf_reference):
    """The prefill replica's process is stopped (SIGSTOP: alive, listed, never answering, as a replica whose
    host stalls): the decode replica stops waiting at disaggregation.prefill_timeout_s, cancels the call and
    recomputes, and holds that replica back for prefill_backoff_s: the next request is prefilled on the decode
    replica at once (the only prefill replica is held back) instead of waiting the timeout again; after the
    back-off the replica, running again, is tried and answers; the cancelled prefill frees its blocks."""
    import os
    import signal

    import ray
    path = checkpoints["llama"]
    with httpx.Client(timeout=120) as c:
        _complete(c, pd_url, _ids(40, 120), max_tokens=2)        # the decode replica's prefill router exists
        wait_running(APP, "PrefillReplica", 1, timeout_s=90)
        wait_until(lambda: _state("LLMReplica")["prefill_pool_size"] == 1, timeout_s=60,
                   what="the decode replica to see one prefill replica")
        victim = _state("PrefillReplica")["replica_id"]
        actor = ray.get_actor(f"SERVE_REPLICA::{APP}#PrefillReplica#{victim}", namespace="serve")
        pid = ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()), timeout=30)
        before = _state("LLMReplica")["disaggregation"]
        prompt = _ids(48, 121)
        os.kill(pid, signal.SIGSTOP)
        try:
            out = _complete(c, pd_url, prompt, max_tokens=6)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert out["choices"][0]["token_ids"] == hf_reference(path, prompt, 6)
        after = _state("LLMReplica")["disaggregation"]
        assert after["prefill_timeouts"] == before["prefill_timeouts"] + 1, (before, after)
        assert after["prefill_failed"] == before["prefill_failed"] + 1
        assert after["prefill_pool_empty"] == before["prefill_pool_empty"]     # listed all along: not "down"
        assert list(_state("LLMReplica")["prefill_backoff"]) == [victim]
        # held back: prefilled on the decode replica, the prefill replica not called (no second timeout)
        prompt = _ids(48, 123)
        out = _complete(c, pd_url, prompt, max_tokens=6)
        assert out["choices"][0]["token_ids"] == hf_reference(path, prompt, 6)
        held = _state("LLMReplica")["disaggregation"]
        assert held["prefill_suspect"] == after["prefill_suspect"] + 1, (after, held)
        assert held["prefill_timeouts"] == after["prefill_timeouts"] and held["remote"] == after["remote"]
        # after the back-off the same replica is tried again and answers (cleared), and nothing stays held
        wait_until(lambda: all(v == 0 for v in _state("LLMReplica")["prefill_backoff"].values()),
                   timeout_s=PREFILL_BACKOFF_S + 30, what="the prefill replica's back-off to end")
        prompt = _ids(48, 122)
        out = _complete(c, pd_url, prompt, max_tokens=6)
        assert out["choices"][0]["token_ids"] == hf_reference(path, prompt, 6)
        done = _state("LLMReplica")
        assert done["disaggregation"]["remote"] == held["remote"] + 1 and done["prefill_backoff"] == {}
        assert _state("PrefillReplica")["replica_id"] == victim
    wait_until(_pools_empty, timeout_s=60, what="both pools to free every block")
