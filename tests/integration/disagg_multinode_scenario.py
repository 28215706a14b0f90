"""P/D node preference on a simulated 3-node cluster, run as its own process (one process can join only one Ray
cluster, and pytest's session Ray lives in the test process): `python -m tests.integration.disagg_multinode_scenario
WORKDIR`. A ray.cluster_utils.Cluster on 127.0.0.1: the head (ingress, controller, proxy; `cpu_node`), node A
(`prefill_slot` and `decode_slot`) and node B (`decode_slot`), so 1 prefill replica runs on A and the 2 decode
replicas on A and B; 2 ingress replicas on the head, each with its own routers over both pools. It sends
distinct prompts, each long enough for the prefill pool, one at a time (Serve's proxy spreads them over the two
ingress replicas; more are sent until each has routed `MIN_PER_INGRESS`) and records which decode replica served
each (the response's system_fingerprint), each ingress replica's P/D routing counters and the greedy tokens,
against one unified engine's; then the same on fresh replicas under `routing.policy: power_of_two`. The last
stdout line is one JSON object; tests/integration/test_disagg_multinode.py asserts on it."""
from __future__ import annotations

import os
import random
import re
import sys
import time
from pathlib import Path

os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import httpx  # noqa: E402

from tests.integration.subprocess_scenario import (  # noqa: E402
    connect, scenario_main, shutdown_cluster, start_cluster)
from tests.integration.waiting import wait_until  # noqa: E402

APP = "pdmultinode"
BLOCK = 4
MIN_REMOTE = 12
NUM_PROMPTS = 8
MAX_PROMPTS = 20            # 8 requests land all on one of 2 ingress replicas 1 time in 128: send more then
MIN_PER_INGRESS = 2
NUM_PROMPTS_LOAD_ONLY = 4   # the power_of_two phase: 4 requests, more (up to 12) until each ingress routed 1
MAX_PROMPTS_LOAD_ONLY = 12
INGRESS_REPLICAS = 2
MAX_TOKENS = 8


def _log(msg: str) -> None:
    """Progress on stderr (BackgroundScenario.result shows its tail when the scenario fails)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(rng.randrange(24, 48))]


def _states(dep: str) -> dict[str, int]:
    from ray import serve
    st = serve.status().applications.get(APP)
    d = st.deployments.get(dep) if st else None
    return dict(d.replica_states) if d else {}


def _placement() -> dict[str, dict[str, str]]:
    """Replica id -> node id per deployment, from the GCS actor table (no dashboard needed)."""
    from ray._private import state
    out: dict[str, dict[str, str]] = {"LLMReplica": {}, "PrefillReplica": {}, "Ingress": {}}
    for a in state.actors().values():
        name = a.get("Name") or ""
        if a["State"] != "ALIVE" or not name.startswith(f"SERVE_REPLICA::{APP}#"):
            continue
        _, dep, rid = name.split("#")
        out.setdefault(dep, {})[rid] = a["Address"]["NodeID"]
    return out


def _pd_counters(tries: int = 40) -> dict[str, dict]:
    """Each ingress replica's P/D routing counters ({} before its decode-pool router exists: Serve builds it
    on the first request). A call lands on one ingress replica: ask until each answered."""
    from ray import serve
    h, out = serve.get_app_handle(APP), {}
    for _ in range(tries):
        st = h.routing_decisions.remote(0).result(timeout_s=30)
        out[st["ingress_replica_id"]] = st["routers"][0].get("disaggregation", {}) if st["routers"] else {}
        if len(out) == INGRESS_REPLICAS:
            break
    return out


def _delta(after: dict[str, dict], before: dict[str, dict], key: str) -> dict[str, int]:
    return {i: c.get(key, 0) - before.get(i, {}).get(key, 0) for i, c in after.items()}


def _complete(c: httpx.Client, url: str, prompt: list[int]) -> dict:
    r = c.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                               "ignore_eos": True, "return_token_ids": True})
    body = r.json()
    if r.status_code != 200:
        return {"status": r.status_code, "error": body}
    return {"status": 200, "replica": body["system_fingerprint"].removeprefix("replica:"),
            "token_ids": body["choices"][0]["token_ids"]}


def _config(model: Path, port: int, policy: str):
    from affinity_serve.app.config import AppConfig
    engine = {"model": str(model), "num_threads": 1, "cache": {"num_blocks": 512, "block_size": BLOCK}}
    return AppConfig.from_dict({
        "engine": engine,
        "serve": {"port": port, "replica_num_cpus": 0.5, "ingress_resources": {"cpu_node": 1},
                  "ingress_replicas": INGRESS_REPLICAS,
                  "max_ongoing_requests": 4, "health_check_period_s": 1.0, "health_check_timeout_s": 5.0,
                  "graceful_shutdown_timeout_s": 2.0, "first_token_timeout_s": 60.0, "model_name": "demo"},
        "routing": {"policy": policy, "request_routing_stats_period_s": 0.5, "kv_events_period_s": 0.25},
        # idle decode replicas, but stale stats on this busy machine can put tens of ms between their
        # predictions: a slack of 0.5 s keeps "comparable" meaning comparable here. power_of_two compares
        # ongoing requests instead (same_node_slack_requests, default 2; its bound is unit-tested): a router
        # learns that a request finished from the replica's next stats (every 0.5 s), so requests sent one
        # at a time faster than that pile up on node A's count; 16 keeps this test on the node preference
        "disaggregation": {"enabled": True, "min_remote_prefill_tokens": MIN_REMOTE, "same_node_slack_s": 0.5,
                           "same_node_slack_requests": 16,
                           "prefill": {"num_replicas": 1, "replica_resources": {"prefill_slot": 1}},
                           "decode": {"num_replicas": 2, "replica_resources": {"decode_slot": 1}}},
        "observability": {"traces": "none"}})


def _deploy(cfg) -> None:
    from ray import serve

    from affinity_serve.app.builder import build_app
    _log(f"deploying ({cfg.routing.policy})")
    serve.run(build_app(cfg), name=APP, route_prefix="/")
    wait_until(lambda: _states("LLMReplica") == {"RUNNING": 2} and _states("PrefillReplica") == {"RUNNING": 1}
               and _states("Ingress") == {"RUNNING": INGRESS_REPLICAS}, 120,
               "1 prefill, 2 decode and 2 ingress replicas running")


def _reads(c: httpx.Client, url: str) -> float:
    text = c.get(f"{url}/metrics").text
    return sum(float(v) for v in re.findall(
        r'^affinity_pd_transfers_total\{[^}]*outcome="read"[^}]*\} (\S+)$', text, re.M))


def _measure(c: httpx.Client, url: str, first_seed: int, num: int, max_num: int, min_per_ingress: int) -> dict:
    """Warm both ingress replicas, then send `num` prompts one at a time (seeds from `first_seed`), and more,
    up to `max_num` in all, until each ingress replica has routed `min_per_ingress` of them."""
    # each ingress's router over the prefill pool needs to know its replica (it follows that pool from the
    # ingress's start) and its decode-pool router must exist (built on its first request)
    for k in range(60):
        warm = _complete(c, url, _prompt(10_000 + first_seed + k))
        counters = _pd_counters()
        if warm["status"] != 200 or (len(counters) == INGRESS_REPLICAS and all(
                v.get("prefill_picked", 0) > 0 for v in counters.values())):
            break
        time.sleep(0.2)
    _log(f"warmed up after {k + 1} requests")
    reads_before = _reads(c, url)
    before = _pd_counters()
    seeds = list(range(first_seed, first_seed + max_num))
    results = [_complete(c, url, _prompt(i)) for i in seeds[:num]]
    while len(results) < max_num and min(
            _delta(_pd_counters(), before, "prefill_picked").values(), default=0) < min_per_ingress:
        results.append(_complete(c, url, _prompt(seeds[len(results)])))
    _log(f"sent {len(results)} requests")
    try:
        reads = wait_until(lambda: (n := _reads(c, url) - reads_before) >= len(results) and n, 60, "the KV reads")
    except AssertionError:
        reads = _reads(c, url) - reads_before
    return {"warmup": {"requests": k + 1, "status": warm["status"]}, "seeds": seeds[:len(results)],
            "results": results, "kv_reads": reads, "pd_counters_before": before, "pd_counters": _pd_counters()}


NODE_A_RESOURCES = {"prefill_slot": 1, "decode_slot": 1}
NODE_B_RESOURCES = {"decode_slot": 1}


def scenario(workdir: Path) -> dict:
    """The scenario on a 3-node cluster of its own."""
    from affinity_serve.engine.demo import write_demo_model

    model = write_demo_model(workdir / "model", seed=11)
    cluster, (node_a, node_b) = start_cluster({"cpu_node": 10}, [NODE_A_RESOURCES, NODE_B_RESOURCES])
    try:
        return run(cluster, node_a, node_b, model, connect(cluster))
    finally:
        shutdown_cluster(cluster)


def run(cluster, node_a, node_b, model: Path, port: int) -> dict:
    """The scenario on `cluster` (this process connected; Serve started with its HTTP proxy on `port`), whose head
    declares `cpu_node`, `node_a` NODE_A_RESOURCES and `node_b` NODE_B_RESOURCES (and no node else those); it
    deletes its app when done."""
    from ray import serve

    from affinity_serve.engine import LLM, SamplingParams

    out: dict = {"timings_s": {}}
    t0 = time.monotonic()
    out["nodes"] = {"head": cluster.head_node.node_id, "a": node_a.node_id, "b": node_b.node_id}
    url = f"http://127.0.0.1:{port}"
    phases = {}
    with httpx.Client(timeout=120) as c:
        # prefix_affinity: NUM_PROMPTS, more until each ingress routed MIN_PER_INGRESS
        _deploy(_config(model, port, "prefix_affinity"))
        out["timings_s"]["deployed"] = time.monotonic() - t0
        phases["prefix_affinity"] = {"placement": _placement(), **_measure(
            c, url, 0, NUM_PROMPTS, MAX_PROMPTS, MIN_PER_INGRESS)}
        # a load-only policy (node preference by ongoing requests), on fresh replicas
        _log("deleting the app")
        serve.delete(APP)
        _deploy(_config(model, port, "power_of_two"))
        out["timings_s"]["redeployed"] = time.monotonic() - t0
        phases["power_of_two"] = {"placement": _placement(), **_measure(
            c, url, 100, NUM_PROMPTS_LOAD_ONLY, MAX_PROMPTS_LOAD_ONLY, 1)}
    serve.delete(APP)
    llm = LLM(str(model), cache={"num_blocks": 256, "block_size": BLOCK})
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    for ph in phases.values():
        unified = [llm.generate(_prompt(i), params, use_tqdm=False)[0].outputs[0].token_ids for i in ph["seeds"]]
        ph["requests"] = [{**r, "unified": list(u)} for r, u in zip(ph.pop("results"), unified)]
    out["phases"] = phases
    out["timings_s"]["total"] = time.monotonic() - t0
    return out


if __name__ == "__main__":
    sys.exit(scenario_main(scenario, sys.argv[1:]))
