"""The routing benchmark's workload generator: deterministic per seed, on its pressure and load targets."""
from __future__ import annotations

from benchmarks.routing.replica import ReplicaSpec, TimingModel, measure_saturation_rps
from benchmarks.routing.workload import (WorkloadSpec, generate, measure_load, measure_pressure, read_trace,
                                         write_trace)


def _key(trace):
    return [(r.req_id, r.arrival_s, r.parent_id, r.think_s, r.prompt_token_ids, r.output_token_ids)
            for r in trace.requests]


def test_same_seed_same_trace_other_seed_other_trace():
    spec = WorkloadSpec(num_replicas=2, requests_per_replica=50, seed=7)
    a, b = generate(spec), generate(spec)
    assert _key(a) == _key(b)
    assert a.meta == b.meta
    c = generate(WorkloadSpec(num_replicas=2, requests_per_replica=50, seed=8))
    assert _key(a) != _key(c)


def test_pressure_and_load_on_target(mixed_trace, tmp_path):
    path = tmp_path / "trace.jsonl.gz"
    write_trace(mixed_trace, path)
    trace = read_trace(path)           # what a replayer sees
    assert _key(trace) == _key(mixed_trace) and trace.meta == mixed_trace.meta
    meta, spec = trace.meta, trace.meta.spec
    window = (meta.warmup_s, meta.duration_s)
    # pressure recomputed from the token ids, over the whole fleet's KV
    parts = measure_pressure(trace.requests, meta.replica.block_size, spec.num_replicas * meta.replica.num_kv_tokens,
                             window)
    assert abs(sum(parts.values()) / spec.pressure - 1) <= 0.10, parts
    assert parts["A"] > 0 and parts["B"] > 0          # both tenants and sessions hold a working set
    # load against a saturation rate measured afresh on a sample of the trace itself
    sample = trace.requests[::max(1, len(trace.requests) // 150)]
    sat = measure_saturation_rps([(r.prompt_token_ids, r.output_token_ids) for r in sample], ReplicaSpec(),
                                 TimingModel())
    assert abs(sat / meta.saturation_rps_per_replica - 1) <= 0.15
    assert abs(measure_load(trace.requests, window, spec.num_replicas * sat) / spec.load - 1) <= 0.15
    assert abs(meta.measured_load / spec.load - 1) <= 0.10


def test_mix_shapes(mixed_trace):
    reqs = mixed_trace.requests
    by_id = {r.req_id: r for r in reqs}
    counts = mixed_trace.meta.component_counts
    shares = dict(zip("ABCD", mixed_trace.meta.spec.shares))
    for c, share in shares.items():
        assert abs(counts[c] / len(reqs) - share) < 0.08, counts
    for r in reqs:
        assert len(r.prompt_token_ids) + len(r.output_token_ids) <= 8192
        if r.parent_id is not None:        # a session turn extends its parent's prompt and answer
            p = by_id[r.parent_id]
            history = p.prompt_token_ids + p.output_token_ids
            assert r.prompt_token_ids[:len(history)] == history and r.arrival_s > p.arrival_s
    bursts: dict[str, list] = {}
    for r in reqs:
        if r.component == "C":
            bursts.setdefault(r.group, []).append(r)
    for sib in bursts.values():
        assert 4 <= len(sib) <= 16
        assert max(r.arrival_s for r in sib) - min(r.arrival_s for r in sib) <= 0.02
        prefix = min(len(r.prompt_token_ids) for r in sib) - 200
        assert len({tuple(r.prompt_token_ids[:prefix]) for r in sib}) == 1


def test_hot_prefix_takes_ninety_percent():
    trace = generate(WorkloadSpec(num_replicas=2, hot=True, requests_per_replica=80))
    hot = [r for r in trace.requests if r.component == "hot"]
    assert abs(len(hot) / len(trace.requests) - 0.9) < 0.03
    assert len({tuple(r.prompt_token_ids[:2000]) for r in hot}) == 1
    assert {r.component for r in trace.requests} == {"hot", "D"}
