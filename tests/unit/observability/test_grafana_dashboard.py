"""The Grafana dashboards under deploy/grafana/ query only metrics /metrics exports (issue 32.5): every panel
query and template variable is parsed for its metric names, which must be series declared in
observability/names.py and written by the real exporters; vLLM's own dashboard's names are exported too."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client.parser import text_string_to_metric_families

from affinity_serve.observability import names
from affinity_serve.observability.aggregate import render, snapshot_of
from affinity_serve.observability.metrics import (AutoscalerMetrics, AutoscaleSample, FeedReplicaSample, IndexSample,
                                                 ReplicaLoadSample, ReplicaMetrics, RouterMetrics, RouterSample,
                                                 ServingMetrics)

DASHBOARDS = sorted((Path(__file__).resolve().parents[3] / "deploy" / "grafana").glob("*.json"))

_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                 "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers left once strings, label matchers, ranges,
    grouping clauses, Grafana variables and function calls are taken out."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)       # string literals
    e = re.sub(r"\{[^}]*\}", " ", e)                                          # label matchers
    e = re.sub(r"\[[^\]]*\]", " ", e)                                         # ranges, subqueries
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"\$\{?\w+\}?", " ", e)                                        # Grafana variables
    out = set()
    for m in re.finditer(r"(?<![\w:.])([a-zA-Z_:][\w:]*)(\s*\()?", e):
        name, call = m.group(1), m.group(2)
        if call or name.lower() in _PROMQL_WORDS:
            continue
        out.add(name)
    return out


def _queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target (rows' nested panels too) and query variable."""
    out = []
    stack = list(dashboard.get("panels", []))
    while stack:
        p = stack.pop()
        stack += p.get("panels", [])
        if p.get("type") == "row":
            continue
        targets = p.get("targets") or []
        assert targets, f"panel {p.get('title')!r} has no query"
        out += [(f"panel {p['title']!r}", t["expr"]) for t in targets]
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"label_values\((.+),\s*\w+\)", q.strip())
            assert m, f"variable {var['name']!r}: expected label_values(<selector>, <label>), got {q!r}"
            out.append((f"variable {var['name']!r}", m.group(1)))
    return out


def _rendered_series() -> set[str]:
    """Every sample name the exporters write with all their metrics recorded (a KV tier configured)."""
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("t")
    ing = ServingMetrics(meter)
    ing.record_request(model="m", prompt_tokens=9, output_tokens=3, cached_tokens=4, ttft_s=0.1, e2e_s=0.5,
                       tpot_s=[0.05])
    ing.record_http("/v1/completions", 200)
    ing.record_routing(reason="affinity", decision_time_s=1e-4, predicted_cached_tokens=4, actual_cached_tokens=4)
    rep = ReplicaMetrics(meter, "r1", lambda: ReplicaLoadSample(1, 1, 0.5, 0.5, 0.5, 8, 4, 1), "shared",
                         lambda: {"lookups": 1, "hit_blocks": 1, "hit_tokens": 4, "loads_ok": 1, "loaded_blocks": 1,
                                  "load_failures_missing": 0, "load_failures_damaged": 0,
                                  "load_failures_timed_out": 0, "load_failures_error": 0, "stored_blocks": 1,
                                  "stores_failed": 0, "evicted_blocks": 0, "loaded_bytes": 10, "stored_bytes": 10})
    rep.record_sequence(finish_reason="stop", queue_s=0.01, prefill_s=0.02, decode_s=0.1)
    router = RouterSample("LLMReplica", num_pulls_ok=3, num_events=4, index={"pool": IndexSample(10, 100, 1)},
                          feed={"r1": FeedReplicaSample(0, 0.1)})
    RouterMetrics(meter, lambda: [("ing-1", router)])
    AutoscalerMetrics(meter).record("LLMReplica", AutoscaleSample("up_predicted", 3, 1, 3, 1, 2.2, 2.0, 0.2, 0.4, 0.1))
    text = render(snapshot_of(reader.get_metrics_data()), "m")
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_the_parser_finds_metric_names_and_nothing_else():
    expr = ('histogram_quantile(0.9, sum by (le, replica) (rate(affinity_x_bucket{model=~"$model", '
            'a="b{c}"}[$__rate_interval]))) / on (replica) group_left sum(vllm:y_total offset 5m) > bool 0.5')
    assert metric_names(expr) == {"affinity_x_bucket", "vllm:y_total"}
    assert metric_names("affinity_replica_running_requests") == {"affinity_replica_running_requests"}
    assert metric_names('sum(rate(a_total[1m])) / sum(rate(b_total[1m])) * 100') == {"a_total", "b_total"}


def test_there_is_a_dashboard():
    assert [p.name for p in DASHBOARDS] == ["affinity-serve.json"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_dashboard_query_names_exported_metrics(path):
    dashboard = json.loads(path.read_text())
    queries = _queries(dashboard)
    declared = names.exported_series(vllm_aliases=False)      # the dashboard works with the aliases off too
    rendered = _rendered_series()
    used: set[str] = set()
    for where, expr in queries:
        found = metric_names(expr)
        assert found, f"{path.name}: {where}: no metric in {expr!r}"
        assert found <= declared, f"{path.name}: {where} queries {sorted(found - declared)}, not exported"
        assert found <= rendered, f"{path.name}: {where} queries {sorted(found - rendered)}, never written"
        used |= found
    # the list: replica gauges, phase histograms, preemptions, finish reasons, routing, tier hits; and the
    # autoscaler's target against current replicas and its decisions by reason
    for spec in (names.M_RUNNING, names.M_WAITING, names.M_KV_USAGE, names.M_PREFIX_HIT_RECENT, names.M_QUEUE_TIME,
                 names.M_PREFILL_TIME, names.M_DECODE_TIME, names.M_PREEMPTIONS, names.M_FINISHED,
                 names.M_ROUTING_DECISIONS, names.M_KV_TIER_HIT_TOKENS, names.M_TTFT, names.M_HTTP,
                 names.M_AUTOSCALER_TARGET, names.M_AUTOSCALER_CURRENT, names.M_AUTOSCALER_DECISIONS):
        assert set(names.METRICS[spec].series()) & used, f"{path.name} shows no {spec}"


def test_vllm_dashboard_names_are_exported():
    """The series vLLM's example Grafana dashboard (examples/observability/prometheus_grafana) queries, except
    the two we do not measure (docs/observability.md: inter-token latency per token, max generation tokens
    per sequence group)."""
    vllm_dashboard = {
        "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
        "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:time_to_first_token_seconds_bucket",
        "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count",
        "vllm:kv_cache_usage_perc", "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
        "vllm:request_success_total", "vllm:request_queue_time_seconds_sum", "vllm:request_prefill_time_seconds_sum",
        "vllm:request_decode_time_seconds_sum"}
    missing = vllm_dashboard - _rendered_series()
    assert not missing, missing
    assert missing == vllm_dashboard - names.exported_series()


def test_every_metric_and_alias_is_in_the_docs():
    """docs/observability.md names every exported family (`a_{x,y}_b` in the tables stands for both)."""
    page = (Path(__file__).resolve().parents[3] / "docs" / "observability.md").read_text()
    documented: set[str] = set()
    for token in re.findall(r"`([\w:{},]+)`", page):
        m = re.fullmatch(r"([\w:]*)\{([\w,]+)\}([\w:]*)", token)
        documented |= {m.group(1) + alt + m.group(3) for alt in m.group(2).split(",")} if m else {token}
    for spec in names.METRICS.values():
        for family in (spec.family, *spec.vllm):
            exposed = family + ("_total" if spec.kind is names.Kind.COUNTER else "")
            assert exposed in documented, f"docs/observability.md does not name {exposed}"
