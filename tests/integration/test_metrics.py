"""/metrics a Grafana user can rely on (issue 32.5), on a real Serve app with two ingress replicas and two
model replicas: replica gauges read the requests while they run (not only when one finishes), and counters
only grow across scrapes whichever ingress replica answers them."""
from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import app_config, wait_running
from tests.integration.waiting import wait_until

pytestmark = pytest.mark.slow
METRICS_APP = "affinity-metrics"
STEP_S = 0.02          # paced engine steps: a 100-token stream lasts >= 2 s however fast the CPU is


@pytest.fixture(scope="module")
def url(ray_serve, checkpoints):
    from ray import serve

    from affinity_serve.app.builder import build_app

    cfg = app_config(checkpoints["llama"], ingress_replicas=2)
    cfg["engine"]["pace"] = {"enabled": True, "step_base_s": STEP_S}
    cfg["engine"]["cache"]["num_blocks"] = 512
    cfg["observability"] |= {"metrics_push_interval_s": 0.25}
    serve.run(build_app(cfg), name=METRICS_APP, route_prefix="/metrics-app")
    wait_running(METRICS_APP, "LLMReplica", 2)
    wait_running(METRICS_APP, "Ingress", 2)
    yield ray_serve + "/metrics-app"
    serve.delete(METRICS_APP)


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == name]


def _total(text: str, name: str, **labels: str) -> float:
    return sum(v for lab, v in _samples(text, name) if all(lab.get(k) == x for k, x in labels.items()))


def test_replica_gauges_read_running_requests_while_they_run(url):
    num_streams, max_tokens = 8, 100
    done = threading.Event()
    errors: list[BaseException] = []
    finished_at: list[float] = []

    def stream(i: int) -> None:
        try:
            with httpx.Client(timeout=120) as c:
                r = c.post(f"{url}/v1/completions", json={"prompt": f"long request {i}", "max_tokens": max_tokens,
                                                          "ignore_eos": True, "temperature": 0})
                finished_at.append(time.monotonic())
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == max_tokens
        except BaseException as e:     # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(num_streams)]
    for t in threads:
        t.start()
    watcher = threading.Thread(target=lambda: ([t.join() for t in threads], done.set()))
    watcher.start()
    # (scraped at, running, vllm running, kv usage), summed over the replicas
    seen: list[tuple[float, float, float, float]] = []
    with httpx.Client(timeout=30) as c:
        while not done.is_set():
            text = c.get(f"{url}/metrics").text
            seen.append((time.monotonic(), _total(text, "affinity_replica_running_requests"),
                         _total(text, "vllm:num_requests_running", model_name="tiny-llama"),
                         _total(text, "affinity_replica_kv_cache_usage")))
            time.sleep(0.1)
        watcher.join()
        assert not errors, errors
        # while the 8 streams ran, before any had finished, the gauges said so (they used to be set only
        # when a request finished, so they read 0 here)
        seen = [s[1:] for s in seen if s[0] < min(finished_at)]
        assert seen, "no scrape before the first request finished"
        assert max(r for r, _, _ in seen) >= num_streams // 2, seen
        assert max(v for _, v, _ in seen) >= num_streams // 2, seen
        assert max(k for _, _, k in seen) > 0, seen
        # and they come back to 0 once the streams end, without another request. Each replica's gauges and
        # counters reach the hub on its own push, so a scrape can read one replica's 0 before the other's
        # counts: wait for one that reads both replicas idle and every stream counted (asserted below).
        def settled() -> str | None:
            text = c.get(f"{url}/metrics").text
            gauges = _samples(text, "affinity_replica_running_requests")
            idle = len({lab.get("replica") for lab, _ in gauges}) == 2 and all(v == 0 for _, v in gauges)
            return text if idle and all(ok for _, ok in _stream_counts(text, num_streams, max_tokens)) else None
        text = wait_until(settled, 30, "both replicas idle and every stream counted on /metrics")
    for what, ok in _stream_counts(text, num_streams, max_tokens):
        assert ok, what


def _stream_counts(text: str, num_streams: int, max_tokens: int) -> list[tuple[str, bool]]:
    """What /metrics must count once `num_streams` streams of `max_tokens` paced tokens have finished."""
    checks = [("affinity_requests_finished_total",
               _total(text, "affinity_requests_finished_total", finish_reason="length") >= num_streams),
              ("vllm:request_success_total",
               _total(text, "vllm:request_success_total", finished_reason="length") >= num_streams)]
    checks += [(phase, _total(text, f"affinity_request_{phase}_time_seconds_count") >= num_streams)
               for phase in ("queue", "prefill", "decode")]
    decode_s = _total(text, "affinity_request_decode_time_seconds_sum")
    checks.append((f"decode time {decode_s}", decode_s >= num_streams * (max_tokens - 1) * STEP_S * 0.9))
    return checks


def test_counters_only_grow_across_scrapes_with_two_ingress_replicas(url):
    """Serve's proxy spreads both the requests and the scrapes over the two ingress replicas; each scrape
    reads the app's total (it read 7, 3, 7, 3 when each ingress exported only its own)."""
    route = "/v1/completions"

    def count(text: str) -> float:        # the route label is the whole path, the app's prefix included
        return sum(v for lab, v in _samples(text, "affinity_http_requests_total")
                   if lab.get("route", "").endswith(route) and lab.get("status") == "200")

    with httpx.Client(timeout=60) as c:
        # the baseline must include every earlier request of this module (the previous test's streams reach
        # the hub on each ingress replica's own push): take it once the count has held for 1.5 s of scrapes
        before = wait_until(lambda: _steady(lambda: count(c.get(f"{url}/metrics").text)), 30,
                            "a steady request count before the test's requests")[0]
        readings = []
        for i in range(20):
            r = c.post(f"{url}{route}", json={"prompt": f"count me {i}", "max_tokens": 1})
            assert r.status_code == 200
            readings.append(count(c.get(f"{url}/metrics").text))
        assert all(b >= a for a, b in zip([before, *readings], readings)), (before, readings)
        # once both ingress replicas have pushed, every scrape reads all 20, whichever replica answers
        wait_until(lambda: count(c.get(f"{url}/metrics").text) == before + 20, 30,
                   "the scrapes to read every request")
        settled = [count(c.get(f"{url}/metrics").text) for _ in range(8)]
        assert settled == [before + 20] * 8, settled
        tokens = [_total(c.get(f"{url}/metrics").text, "vllm:generation_tokens_total") for _ in range(8)]
        assert tokens == sorted(tokens) and tokens[0] > 0, tokens


def _steady(read, span_s: float = 1.5) -> tuple[float] | None:
    """(value,) when `read()` returned the same value on every scrape for `span_s` (6 push intervals: every
    replica's push has landed), else None."""
    first = read()
    start = time.monotonic()
    while time.monotonic() - start < span_s:
        if read() != first:
            return None
        time.sleep(0.1)
    return (first,)


def test_routing_series_count_each_request_and_show_each_router_index_and_feed(url):
    """Issue 25: the routers' own state is on /metrics, not only on the debug API: decisions by reason (one per
    request), each router's prefix index (entries from the replicas' KV events) and its feed per replica."""
    num_requests = 6

    def decisions(text: str) -> float:
        return _total(text, "affinity_routing_decisions_total")

    with httpx.Client(timeout=60) as c:
        before = wait_until(lambda: _steady(lambda: decisions(c.get(f"{url}/metrics").text)), 30,
                            "a steady decision count before the test's requests")[0]
        for i in range(num_requests):
            r = c.post(f"{url}/v1/completions", json={"prompt": f"a shared system prompt, then question {i % 2}",
                                                      "max_tokens": 2})
            assert r.status_code == 200

        def routed() -> str | None:
            text = c.get(f"{url}/metrics").text
            entries = [v for lab, v in _samples(text, "affinity_routing_index_entries") if lab["index"] == "pool"]
            counted = decisions(text) == before + num_requests
            return text if counted and entries and max(entries) > 0 and _feeds_everyone(text) else None
        text = wait_until(routed, 30, "every request's decision and each router's index fed by both replicas")
    by_reason = {lab["reason"]: v for lab, v in _samples(text, "affinity_routing_decisions_total")}
    assert set(by_reason) <= {"affinity", "released", "new_group", "spill", "hot_replica"}, by_reason
    replicas = {lab["replica"] for lab, _ in _samples(text, "affinity_replica_running_requests")}
    routers = {lab["router"] for lab, _ in _samples(text, "affinity_routing_index_entries")}
    assert len(replicas) == 2 and 1 <= len(routers) <= 2, (replicas, routers)
    capacity = {(lab["router"], lab["index"]): v for lab, v in _samples(text, "affinity_routing_index_capacity")}
    for lab, v in _samples(text, "affinity_routing_index_entries"):
        assert lab["deployment"] == "LLMReplica" and 0 <= v <= capacity[(lab["router"], lab["index"])], (lab, v)
    # each router follows both model replicas' KV event logs, and they answer (the push is 0.25 s, a router
    # samples every 0.5 s, pulls every 0.25 s: seconds of lag would mean a stuck feed)
    lags = _samples(text, "affinity_routing_kv_feed_lag_seconds")
    assert _feeds_everyone(text) and all(0 <= v < 5 for _, v in lags), lags
    assert all(v == 0 for _, v in _samples(text, "affinity_routing_kv_feed_consecutive_timeouts")), text
    assert _total(text, "affinity_routing_kv_feed_events_total") > 0
    assert _total(text, "affinity_routing_errors_total") == 0


def _feeds_everyone(text: str) -> bool:
    """Every router on the page has feed series for exactly the model replicas on it (a router's first sample
    can come before its feed's first pull)."""
    replicas = {lab["replica"] for lab, _ in _samples(text, "affinity_replica_running_requests")}
    routers = {lab["router"] for lab, _ in _samples(text, "affinity_routing_index_entries")}
    pairs = {(lab["router"], lab["replica"]) for lab, _ in _samples(text, "affinity_routing_kv_feed_lag_seconds")}
    return bool(routers) and pairs == {(r, x) for r in routers for x in replicas}
