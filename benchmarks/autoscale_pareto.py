"""Autoscaling Pareto comparison (issue 29): every tuning of Serve's request-count rule against our policy's
curve, on workloads whose mix shifts, in benchmarks/autoscale.py's simulator.

For each workload and fleet size it runs
- Serve's rule (⌈ongoing ÷ target⌉, benchmarks/autoscale.py:RayDefaultPolicy) at each `--targets` value,
  with this app's delays and metric windows (2 s up, 30 s down, look-back 5 s, metrics 1 s);
- ours (autoscale/policy.py) at each `--utils` value of `target_utilization` (downscale_utilization at
  0.625 x it, the default's ratio) and each `--zs` value of `headroom_z` (the spare capacity for arrival
  noise, which sizes small fleets more than the utilization does), the first of each being the operating
  point (the defaults: 0.8, 2);
- ablations at the operating point: priors only (no online R/C, no KV growth), no trend, no headroom, no
  queued-cost projection, no overload skip of the up delay, neither of those two (the policy before them), no
  cache-loss headroom, the trend projected over trend_lead_s instead of the measured start-up, no scale-in
  on a falling trend, the scale-down band sized by the measured forecast error (off by default), a
  fixed narrow band (1.23 instead of 1.6), a replica at its batch cap with a queue asking for one more
  (`saturation_scale_out`), following today's down target on a falling trend (`falling_trend_hold_s` 0),
  the same only while the last start-up also falls (`falling_trend_confirm`), the narrow band with both,
  the narrow band with one spare replica above the up target (`downscale_spare_replicas`) and the
  largest down target of the last 10 s on a falling trend, and the planner-style feed-forward target
  (`feedforward_target`: arrivals x learned work per request as the steady state both ways, the headroom and
  band only while evidence fires), the feed-forward target holding its largest for 60 s after a burst
  (`feedforward_burst_hold_s`), and the headroom pricing the prefill of prefixes turning warm as the
  cold window shows it (`warm_prefix_headroom`: on by default from round 5 until its re-measure on
  2026-11-29, off since). Rounds 4-5's batching
  headroom, rounded headroom and small fleet's z were measured, lost and were removed
  (docs/benchmarks/autoscaling.md);
- a Dynamo-planner-style baseline (benchmarks/autoscale.py:DynamoPlannerPolicy) at each `--dynamo-utils`;
- the clairvoyant schedule (`ClairvoyantPolicy`) at each `--oracle-utils`: it reads the trace's future
  arrivals and their work by the timing model and asks for the replicas that load needs one start-up ahead,
  through the same simulator (same start-up, same replicas); its frontier at ours' attainment says what
  knowing the future buys, and whether 0.8 x Serve's best is reachable at all (it is an achievable point,
  so where it is below 0.8 x Serve's best the goal is feasible; where above, no schedule of this family
  reaches it);
and reports, at our operating point, the replica-seconds Serve's best tuning needs for the same TTFT SLO
attainment, linearly interpolated along Serve's Pareto frontier (its non-dominated points), and our
replica-seconds over that. Serve's frontier may not reach our attainment: then the ratio is against its
best point and marked as a bound ("<=").

Workloads (seeded; `mix_trace`): the arrival rate is sized so the heaviest phase needs about `--load` of
the fleet by the timing model.
- `output-shift`: chat (output median 100 tokens) -> long-form (400) at half the trace, same arrivals (the
  three shift workloads ramp from 0.1 to 1 of their rate over the first 10% of the trace);
- `prompt-shift`: prompts of ~500 tokens -> ~8k (RAG documents, unique) at half the trace;
- `reuse-collapse`: 3k-token prompts sharing one of 8 prefixes of 2.8k tokens -> no shared prefix;
- `diurnal`: one day's ramp compressed, rate 0.1 -> 1 -> 0.1 of the peak with x lognormal(0.25) noise per
  5 s, the chat mix throughout;
- `base`: benchmarks/autoscale.py's trace (ramp, 2x burst, quiet), 8 replicas (its generator is slow).
Mix workloads run on a GPU-sized KV pool (64k tokens per replica, `MIX_SPEC`) so an 8k prompt fits many
times; ours' prior C for it is 48 (`--decode-seqs`), R 20k tokens/s (the timing model's).

    python -m benchmarks.autoscale_pareto --workloads prompt-shift --fleets 8 --duration 240
    python -m benchmarks.autoscale_pareto                        # all mix workloads, 8 and 32 (about an hour)
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from affinity_serve.autoscale.policy import PolicyConfig
from affinity_serve.engine.hashing import hash_block_chain
from benchmarks.autoscale import (APP_LOOK_BACK_S, APP_METRICS_INTERVAL_S, AutoscaleSim,
                                  DynamoPlannerPolicy, EnginePolicy, RayDefaultPolicy, RunResult, SimConfig,
                                  read_trace, shaped_trace, write_trace)
from benchmarks.routing.replica import ReplicaSpec, TimingModel
from benchmarks.routing.workload import Trace, TraceMeta, TraceRequest, WorkloadSpec

MIX_SPEC = ReplicaSpec(num_kv_tokens=65536, max_model_len=16384)
MIX_WORKLOADS = ("output-shift", "prompt-shift", "reuse-collapse", "diurnal")
SHIFT_AT = 0.5                       # the mix shifts at this fraction of the trace
#: the shift workloads' rate ramps from 0.1 to 1 over this fraction of the trace: a fleet starting at one
#: replica is not met by the full rate at once (at 32 replicas that cold start cost every policy ~7%)
RAMP_TO = 0.1
VOCAB = (3, 30000)


# ================================================================== workloads
def _phase(kind: str, x: float) -> dict:
    """The mix at fraction x of the trace: rate multiplier, shared prefix tokens (0: none), reuse probability,
    unique prompt tokens (median), output tokens (median)."""
    late = x >= SHIFT_AT
    ramp = min(1.0, 0.1 + 0.9 * x / RAMP_TO)       # the service's traffic arrives over the first RAMP_TO
    if kind == "output-shift":
        return dict(rate=ramp, prefix=800, reuse=0.7, unique=300, output=400 if late else 100)
    if kind == "prompt-shift":
        return dict(rate=ramp, prefix=300, reuse=0.7, unique=7700 if late else 200, output=100)
    if kind == "reuse-collapse":
        return dict(rate=ramp, prefix=2800, reuse=0.0 if late else 0.9, unique=200, output=100)
    if kind == "diurnal":
        return dict(rate=0.1 + 0.9 * math.sin(math.pi * x) ** 2, prefix=800, reuse=0.7, unique=300, output=150)
    raise ValueError(f"unknown workload {kind!r}; choose from {MIX_WORKLOADS}")


#: the time per output token a loaded replica runs at (decode steps share it with prefill chunks), for sizing
LOADED_TPOT_S = 0.05


def _work_s(ph: dict, timing: TimingModel, spec: ReplicaSpec) -> float:
    """Replica-seconds one request of the mix costs by the timing model: the larger of its compute (its
    uncached prefill plus its share of the decode steps at the batch the KV pool holds) and its KV
    residency (its own context held for its lifetime at LOADED_TPOT_S, over the pool at the 0.85 target)."""
    prompt = ph["prefix"] + ph["unique"]
    uncached = ph["unique"] + ph["prefix"] * (1 - ph["reuse"])
    ctx = prompt + ph["output"] / 2
    batch = max(1.0, min(spec.max_num_seqs, 0.85 * spec.num_kv_tokens / ctx))
    per_token = timing.step_base_s / batch + timing.decode_per_context_token_s * ctx
    compute = uncached * timing.prefill_per_token_s + ph["output"] * per_token
    lifetime = uncached * timing.prefill_per_token_s + ph["output"] * LOADED_TPOT_S
    held = uncached + ph["output"] / 2            # a shared prefix is held once per replica, not per sequence
    return max(compute, lifetime * held / (0.85 * spec.num_kv_tokens))


def mix_trace(kind: str, num_replicas: int, duration_s: float, load: float, seed: int,
              timing: TimingModel = TimingModel(), spec: ReplicaSpec = MIX_SPEC) -> Trace:
    """A seeded trace of `kind` whose heaviest phase needs about `load` x `num_replicas` replicas."""
    _phase(kind, 0.0)                                           # an unknown kind fails here, naming the choices
    rng = np.random.default_rng([seed, MIX_WORKLOADS.index(kind)])
    xs = np.linspace(0, 1, 201)
    peak = max(_phase(kind, x)["rate"] * _work_s(_phase(kind, x), timing, spec) for x in xs)
    rate_max = load * num_replicas / peak                       # requests/s at rate multiplier 1
    noise_bin = 5.0
    noise = rng.lognormal(0.0, 0.25, int(duration_s / noise_bin) + 1) if kind == "diurnal" else None
    prefixes = [rng.integers(*VOCAB, 2800).tolist() for _ in range(8)]
    popularity = 1.0 / np.arange(1, 9) ** 0.8
    popularity /= popularity.sum()
    reqs, t, i = [], 0.0, 0
    bound = rate_max * (1.6 if noise is not None else 1.0) * 2      # thinning envelope
    while True:
        t += rng.exponential(1.0 / bound)
        if t >= duration_s:
            break
        x = t / duration_s
        ph = _phase(kind, x)
        r = rate_max * ph["rate"] * (noise[int(t / noise_bin)] if noise is not None else 1.0)
        if rng.random() >= min(1.0, r / bound):
            continue
        unique = int(np.clip(rng.lognormal(math.log(ph["unique"]), 0.4), 16, 12000))
        out = int(np.clip(rng.lognormal(math.log(ph["output"]), 0.5), 8, 2000))
        if ph["prefix"] and rng.random() < ph["reuse"]:
            g = int(rng.choice(8, p=popularity))
            prompt, group = prefixes[g][:ph["prefix"]], f"p{g}"
        else:
            prompt, group = rng.integers(*VOCAB, ph["prefix"]).tolist(), ""
        prompt = prompt + rng.integers(*VOCAB, unique).tolist()
        reqs.append(TraceRequest(f"{kind}-{i}", float(t), "A" if group else "D", group, prompt,
                                 rng.integers(*VOCAB, out).tolist()))
        i += 1
    meta = TraceMeta(WorkloadSpec(num_replicas=num_replicas, seed=seed), spec,
                     saturation_rps_per_replica=1.0 / peak, arrival_rate_rps=rate_max, duration_s=duration_s,
                     warmup_s=0.0, num_tenants=8, think_mean_s=0.0, measured_pressure=0.0, measured_load=load,
                     num_requests=len(reqs))
    return Trace(meta, reqs)


# ================================================================== the clairvoyant schedule
def request_work(num_prompt: int, num_uncached: int, num_output: int, timing: TimingModel,
                 spec: ReplicaSpec) -> tuple[float, float]:
    """(replica-seconds, lifetime in seconds) of one request by the timing model: `_work_s` for one request
    of these lengths (its compute or its KV residency, the larger), and how long it runs on a loaded replica
    (its prefill, then its output at LOADED_TPOT_S)."""
    ph = dict(prefix=num_prompt - num_uncached, reuse=1.0, unique=num_uncached, output=num_output)
    lifetime = num_uncached * timing.prefill_per_token_s + num_output * LOADED_TPOT_S
    return _work_s(ph, timing, spec), max(lifetime, timing.step_base_s)


def future_load(trace: Trace, timing: TimingModel, spec: ReplicaSpec, grid_s: float) -> np.ndarray:
    """The load in replica units on a grid of `grid_s` over the trace, known from the trace itself: each
    request's work (`request_work`) spread evenly over its lifetime from its arrival, its uncached prompt the
    tokens after the longest block-aligned prefix an earlier request sent (one fleet-wide cache of unbounded
    size: no policy's replicas can cache more)."""
    bs = spec.block_size
    seen: set = set()
    end = trace.meta.duration_s + 120.0
    load = np.zeros(int(end / grid_s) + 2)
    for r in sorted(trace.requests, key=lambda r: r.arrival_s):
        hashes = hash_block_chain(r.prompt_token_ids, bs)
        hit = 0
        while hit < len(hashes) and hashes[hit] in seen:
            hit += 1
        seen.update(hashes)
        num_prompt = len(r.prompt_token_ids)
        uncached = max(1, num_prompt - min(hit * bs, num_prompt - 1))
        work, life = request_work(num_prompt, uncached, len(r.output_token_ids), timing, spec)
        a, b = r.arrival_s / grid_s, min((r.arrival_s + life) / grid_s, len(load) - 1)
        rate = work / life                                  # replica units while it runs
        i0, i1 = int(a), int(b)
        if i0 == i1:
            load[i0] += rate * (b - a)
            continue
        load[i0] += rate * (i0 + 1 - a)
        load[i0 + 1:i1] += rate
        load[i1] += rate * (b - i1)
    return load                                             # mean replica units in each grid cell


class ClairvoyantPolicy:
    """The fewest replicas that carry the load the trace will bring, asked for one start-up ahead: it reads
    the trace (`future_load`), not the replicas. At time t it wants ceil(peak load over [t, t + `window_s`]
    / `utilization`) replicas, and asks at t for what it will want at any moment up to one start-up ahead,
    so a replica asked for now serves when that load comes and none is stopped that a load within a
    start-up needs. Swept over `utilization`, its (replica-seconds, attainment) points are what a policy with
    perfect knowledge of the future arrivals and work, the same start-up time and the same capacity model
    reaches in the same simulator: the clairvoyant frontier, the reference for what any autoscaler can
    save."""

    role = "oracle"

    def __init__(self, trace: Trace, timing: TimingModel, spec: ReplicaSpec, startup_s: float, min_replicas: int,
                 max_replicas: int, utilization: float, window_s: float = 2.0, grid_s: float = 0.5):
        self.name = f"clairvoyant, util {utilization:g}"
        self.look_back_s, self.metrics_interval_s = APP_LOOK_BACK_S, APP_METRICS_INTERVAL_S
        self.decisions: list[tuple[float, int, str]] = []
        load = future_load(trace, timing, spec, grid_s)
        w = max(1, int(round(window_s / grid_s)))
        peak = np.array([load[i:i + w].max() for i in range(len(load))])
        want = np.clip(np.ceil(peak / utilization - 1e-9), min_replicas, max_replicas).astype(int)
        lead = max(1, int(math.ceil(startup_s / grid_s)) + 1)
        self.plan = np.array([want[i:i + lead + 1].max() for i in range(len(want))])
        self.grid_s, self.work_replica_s = grid_s, float(load.sum() * grid_s)

    def __call__(self, signals, total_ongoing: float, current: int, now: float, queued: float = 0.0) -> int:
        target = int(self.plan[min(int(now / self.grid_s), len(self.plan) - 1)])
        if target != current:
            self.decisions.append((round(now, 2), target, "clairvoyant"))
        return target


# ================================================================== Pareto frontier
def frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The non-dominated (replica-seconds, attainment) points: sorted by replica-seconds, each with a higher
    attainment than every cheaper one."""
    out: list[tuple[float, float]] = []
    for cost, att in sorted(points):
        if not out or att > out[-1][1]:
            out.append((cost, att))
    return out


def cost_at(points: list[tuple[float, float]], attainment: float) -> tuple[float, bool]:
    """Replica-seconds the frontier of `points` needs for `attainment`, interpolated linearly between its
    neighbouring points, and whether it reaches it (if not: the cost of its best point)."""
    f = frontier(points)
    if attainment <= f[0][1]:
        return f[0][0], True
    for (c0, a0), (c1, a1) in zip(f, f[1:]):
        if a0 < attainment <= a1:
            return c0 + (c1 - c0) * (attainment - a0) / (a1 - a0), True
    return f[-1][0], False


# ================================================================== runs
def ours_config(n: int, a, util: float, **over) -> PolicyConfig:
    return PolicyConfig(**{"min_replicas": 1, "max_replicas": n, "ttft_slo_s": a.ttft_slo, "tpot_slo_s": a.tpot_slo,
                           "prefill_tokens_per_s": 1.0 / TimingModel().prefill_per_token_s,
                           "decode_seqs_per_replica": a.c_prior, "upscale_delay_s": 2.0, "downscale_delay_s": 30.0,
                           "downscale_to_zero_delay_s": 60.0, "target_utilization": util,
                           "downscale_utilization": 0.625 * util, **over})


def policies(n: int, spec: ReplicaSpec, a) -> list:
    timing = TimingModel()
    out = []
    curve = [(u, a.zs[0]) for u in a.utils] + [(a.utils[0], z) for z in a.zs[1:]]
    for i, (u, z) in enumerate(curve):
        pol = EnginePolicy(ours_config(n, a, u, headroom_z=z), APP_LOOK_BACK_S, APP_METRICS_INTERVAL_S,
                           f"ours, util {u:g}, z {z:g}")
        pol.role = "ours" if i == 0 else "ours-curve"
        out.append(pol)
    if a.ablations:
        u = a.utils[0]
        for label, over in (("priors only (no online R/C)", dict(online_capacity=False)),
                            ("no trend", dict(trend_lead_s=0.0)), ("no headroom", dict(headroom_z=0.0)),
                            ("no queued-cost projection", dict(queued_cost_projection=False)),
                            ("no overload skip of the up delay", dict(overload_skips_delay=False)),
                            ("neither (the policy before)", dict(queued_cost_projection=False,
                                                                 overload_skips_delay=False)),
                            ("no cache-loss headroom", dict(cache_loss_headroom=False)),
                            ("no measured start-up", dict(measured_startup=False)),
                            ("no falling-trend scale-in", dict(trend_scale_in=False)),
                            ("forecast-error band", dict(forecast_error_band=True)),
                            ("narrow band (downscale_utilization 0.65)", dict(downscale_utilization=0.65)),
                            ("saturation scale-out", dict(saturation_scale_out=True)),
                            ("falling trend: today's down target", dict(falling_trend_hold_s=0.0)),
                            ("falling trend: today's, confirmed", dict(falling_trend_hold_s=0.0,
                                                                       falling_trend_confirm=True)),
                            ("narrow, saturation, today's confirmed", dict(
                                downscale_utilization=0.65, saturation_scale_out=True, falling_trend_hold_s=0.0,
                                falling_trend_confirm=True)),
                            ("narrow, one spare, 10 s falling hold", dict(
                                downscale_utilization=0.65, downscale_spare_replicas=1, falling_trend_hold_s=10.0)),
                            ("feed-forward target", dict(feedforward_target=True)),
                            ("feed-forward, 60 s hold after a burst", dict(feedforward_target=True,
                                                                          feedforward_burst_hold_s=60.0)),
                            ("warm-prefix headroom", dict(warm_prefix_headroom=True)),
                            ("KV apart", dict(kv_apart=True))):
            pol = EnginePolicy(ours_config(n, a, u, **{"headroom_z": a.zs[0], **over}), APP_LOOK_BACK_S,
                               APP_METRICS_INTERVAL_S, f"ours, util {u:g}, z {a.zs[0]:g}, {label}")
            pol.role = "ablation"
            out.append(pol)
    for t in a.targets:
        out.append(RayDefaultPolicy(t, 1, n, 2.0, 30.0, APP_LOOK_BACK_S, APP_METRICS_INTERVAL_S,
                                    f"Serve rule, target {t:g}", "serve"))
    for u in a.dynamo_utils:
        out.append(DynamoPlannerPolicy(timing, spec, a.tpot_slo, 1, n, utilization=u))
    return out


def summarize(results: list[RunResult]) -> dict | None:
    """Ours' operating point against Serve's frontier (None without both: a partial run for --merge)."""
    ours = next((r for r in results if r.role == "ours"), None)
    serve = [(r.replica_seconds, r.ttft_slo_attainment) for r in results if r.role == "serve"]
    if ours is None or not serve:
        return None
    cost, reached = cost_at(serve, ours.ttft_slo_attainment)
    oracle = [(r.replica_seconds, r.ttft_slo_attainment) for r in results if r.role == "oracle"]
    extra = {}
    if oracle:
        # what any policy with the same start-up and capacity needs at ours' attainment: the 0.8 goal is
        # out of reach where that is more than 0.8 x Serve's best
        o_cost, o_reached = cost_at(oracle, ours.ttft_slo_attainment)
        extra = {"oracle_replica_seconds_at_ours_attainment": o_cost, "oracle_reaches_ours": o_reached,
                 "oracle_over_serve": o_cost / cost, "goal_feasible": bool(o_cost <= 0.8 * cost),
                 "ours_over_oracle": ours.replica_seconds / o_cost}
    # Serve's cheapest tuning whose attainment is at least ours: its recovery is the one to compare with
    match = [r for r in results if r.role == "serve" and r.ttft_slo_attainment >= ours.ttft_slo_attainment]
    best = min(match, key=lambda r: r.replica_seconds) if match else None
    return {"ours_attainment": ours.ttft_slo_attainment, "ours_replica_seconds": ours.replica_seconds,
            "serve_replica_seconds_at_ours_attainment": cost, "serve_reaches_ours": reached,
            "ratio": ours.replica_seconds / cost, "target_met": bool(reached and ours.replica_seconds <= 0.8 * cost
                                                                     and ours.failed == 0),
            "ours_recover_s": ours.recover_s, "ours_failed": ours.failed,
            "serve_cheapest_matching": best.policy if best else None,
            "serve_cheapest_matching_recover_s": best.recover_s if best else None,
            "failed_any": int(sum(r.failed for r in results)), **extra}


def table(results: list[RunResult], s: dict | None, title: str) -> str:
    lines = [title, f"{'policy':<52} {'SLO att':>8} {'TTFT p99':>9} {'rep-s':>7} {'recover':>8} {'failed':>6} "
                    f"{'peak':>5}"]
    for r in results:
        lines.append(f"{r.policy:<52} {r.ttft_slo_attainment:>8.4f} {r.ttft_p99_s:>8.2f}s {r.replica_seconds:>7.0f} "
                     f"{r.recover_s:>7.0f}s {r.failed:>6} {r.max_replicas_seen:>5}")
    if s is None:
        return "\n".join(lines)
    rel = "" if s["serve_reaches_ours"] else "<="
    lines.append(f"-> Serve's frontier at ours' attainment {s['ours_attainment']:.4f}: "
                 f"{s['serve_replica_seconds_at_ours_attainment']:.0f} replica-s"
                 f"{'' if s['serve_reaches_ours'] else ' (never reached: its best point)'}; ours / Serve's best "
                 f"{rel}{s['ratio']:.2f} ({'met' if s['target_met'] else 'NOT met'} at <= 0.8)")
    if "oracle_replica_seconds_at_ours_attainment" in s:
        goal = "feasible" if s["goal_feasible"] else "INFEASIBLE (even the clairvoyant schedule needs more)"
        never = "" if s["oracle_reaches_ours"] else " (never reached: its best point)"
        lines.append("-> clairvoyant frontier at ours' attainment: "
                     f"{s['oracle_replica_seconds_at_ours_attainment']:.0f} replica-s{never} = "
                     f"{s['oracle_over_serve']:.2f}x Serve's best; ours / it {s['ours_over_oracle']:.2f}; "
                     f"the 0.8 goal is {goal}")
    return "\n".join(lines)


def plot(all_runs: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = list(all_runs)
    cols = min(3, len(keys))
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.2 * rows), squeeze=False)
    style = {"serve": ("o", "tab:blue", "Serve rule (targets; line: its frontier)"),
             "ours": ("*", "tab:red", "ours (operating point)"),
             "ours-curve": ("s", "tab:red", "ours (target_utilization, headroom_z)"),
             "dynamo": ("^", "tab:green", "Dynamo-style planner"), "ablation": ("x", "tab:gray", "ours, ablations"),
             "oracle": ("D", "k", "clairvoyant schedule (utils; line: its frontier)")}
    for ax, key in zip(axes.flat, keys):
        res = all_runs[key]["results"]
        for role, (fmt, color, label) in style.items():
            pts = [r for r in res if r["role"] == role or (role == "ours-curve" and r["role"] == "ours")]
            if not pts:
                continue
            pts = sorted(pts, key=lambda r: r["replica_seconds"])
            ax.plot([r["replica_seconds"] for r in pts], [r["ttft_slo_attainment"] for r in pts], fmt,
                    color=color, label=label, ms=12 if role == "ours" else 6)
            if role in ("serve", "oracle"):
                f = frontier([(r["replica_seconds"], r["ttft_slo_attainment"]) for r in pts])
                ax.plot([c for c, _ in f], [x for _, x in f], "-", color=color, lw=1)
                for r in pts if role == "serve" else ():
                    ax.annotate(r["policy"].split()[-1], (r["replica_seconds"], r["ttft_slo_attainment"]),
                                fontsize=7, xytext=(3, -8), textcoords="offset points")
        s = all_runs[key]["summary"]
        ax.set_title(f"{key}: ours / Serve's best {'' if s['serve_reaches_ours'] else '<='}{s['ratio']:.2f}",
                     fontsize=9)
        ax.set_xlabel("replica-seconds")
        ax.set_ylabel("TTFT SLO attainment")
        ax.set_ylim(max(0.0, min(r["ttft_slo_attainment"] for r in res) - 0.02), 1.005)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def merge(paths: list[Path]) -> dict:
    """The runs of several result files, by workload and fleet; a later file's rows of ours' curve replace an
    earlier file's (a re-run of ours' knobs), every other row is kept (a later row of the same name wins)."""
    runs: dict = {}
    for path in paths:
        for key, run in json.loads(path.read_text())["runs"].items():
            old = runs.get(key)
            if old is None:
                runs[key] = run
                continue
            new_roles = {r["role"] for r in run["results"]}
            names = {r["policy"] for r in run["results"]}
            keep = [r for r in old["results"] if r["policy"] not in names
                    and not ({"ours", "ours-curve"} & new_roles and r["role"] in ("ours", "ours-curve"))]
            runs[key] = {**old, "results": keep + run["results"]}
    for run in runs.values():
        run["summary"] = summarize([SimpleNamespace(**r) for r in run["results"]])
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default=",".join(MIX_WORKLOADS), help=f"of {MIX_WORKLOADS} and base")
    p.add_argument("--fleets", default="8,32", help="max replicas, comma-separated")
    p.add_argument("--duration", type=float, default=240.0, help="trace length (simulated seconds)")
    p.add_argument("--load", type=float, default=0.6, help="the heaviest phase's load / the max fleet")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--targets", default="2,4,6,8,12,16,24,32", help="Serve rule's target_ongoing_requests")
    p.add_argument("--utils", default="0.8,0.6,0.9", help="ours' target_utilization (the first: operating point)")
    p.add_argument("--zs", default="2,1,3", help="ours' headroom_z at the first util (the first: operating point)")
    p.add_argument("--dynamo-utils", default="0.8,1.0", help="the Dynamo-style planner's utilization")
    p.add_argument("--oracle-utils", default="0.8,1.0,1.2,1.4,1.7,2.0",
                   help="the clairvoyant schedule's utilization (its frontier over these; empty: none)")
    p.add_argument("--only", default="", help="run only the policies whose name this regular expression finds "
                   "(e.g. 'z 2$|Serve|clairvoyant': ours' operating point, Serve's rule, the clairvoyant schedule)")
    p.add_argument("--no-ablations", dest="ablations", action="store_false")
    p.add_argument("--ttft-slo", type=float, default=1.0)
    p.add_argument("--tpot-slo", type=float, default=0.15)
    p.add_argument("--c-prior", "--decode-seqs", dest="c_prior", type=float, default=None,
                   help="ours' prior decode_seqs_per_replica (default: 48 on the mix pool, 12 on base)")
    p.add_argument("--speeds", default="", help="heterogeneous fleet: replica k runs speeds[k %% len] x slower")
    p.add_argument("--startup", type=float, default=10.0, help="seconds from asking for a replica to its serving "
                   "(ours' trend_lead_s stays 10: the measured start-up replaces it once a replica came up)")
    p.add_argument("--max-ongoing", type=int, default=0,
                   help="Serve's max_ongoing_requests per replica (the rest wait at the caller); 0: no cap")
    p.add_argument("--out-dir", default="benchmarks/autoscale-results")
    p.add_argument("--merge", default="", help="no runs: merge these result JSONs (comma-separated), print the "
                   "summaries and write autoscale_pareto.json/.png to --out-dir")
    a = p.parse_args()
    a.targets = [float(x) for x in a.targets.split(",") if x]
    a.utils = [float(x) for x in a.utils.split(",") if x]
    a.zs = [float(x) for x in a.zs.split(",") if x]
    a.dynamo_utils = [float(x) for x in a.dynamo_utils.split(",") if x]
    a.oracle_utils = [float(x) for x in a.oracle_utils.split(",") if x]
    speeds = tuple(float(x) for x in a.speeds.split(",") if x)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if a.merge:
        runs = merge([Path(x) for x in a.merge.split(",") if x])
        for key, run in runs.items():
            print(table([SimpleNamespace(**r) for r in run["results"]], run["summary"], key))
        merged = [Path(x).name for x in a.merge.split(",") if x]
        (out / "autoscale_pareto.json").write_text(json.dumps({"merged": merged, "runs": runs}, indent=1))
        plot(runs, out / "autoscale_pareto.png")
        return

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    all_runs: dict = {}
    for kind in a.workloads.split(","):
        for n in [int(x) for x in a.fleets.split(",")]:
            t0 = time.perf_counter()
            if kind == "base":
                spec, c_prior, event = ReplicaSpec(), 12.0, 0.5
                cached = out / f"trace_n{n}_d{a.duration:g}_l0.9_s{a.seed}.jsonl.gz"
                trace = read_trace(cached) if cached.exists() else shaped_trace(n, a.duration, 0.9, a.seed, say)
                if not cached.exists():
                    write_trace(trace, cached)
            else:
                spec, c_prior, event = MIX_SPEC, 48.0, SHIFT_AT if kind != "diurnal" else 0.25
                trace = mix_trace(kind, n, a.duration, a.load, a.seed)
            a_run = argparse.Namespace(**{**vars(a), "c_prior": a.c_prior or c_prior})
            cfg = SimConfig(min_replicas=1, max_replicas=n, ttft_slo_s=a.ttft_slo, speeds=speeds, event_frac=event,
                            max_ongoing=a.max_ongoing, startup_s=a.startup)
            results = []
            oracles = [ClairvoyantPolicy(trace, TimingModel(), spec, a.startup, 1, n, u) for u in a.oracle_utils]
            for pol in [q for q in policies(n, spec, a_run) + oracles if re.search(a.only, q.name)]:
                res = AutoscaleSim(trace, pol, cfg, spec, TimingModel(), a.seed).run()
                say(f"  {kind} n={n} {res.policy}: att {res.ttft_slo_attainment:.4f}, {res.replica_seconds:.0f} "
                    f"replica-s, failed {res.failed} ({res.wall_s:.0f} s wall)")
                results.append(res)
            s = summarize(results)
            key = (f"{kind}, {n} replicas" + (f", speeds {a.speeds}" if speeds else "")
                   + (f", start-up {a.startup:g} s" if a.startup != 10.0 else "")
                   + (f", cap {a.max_ongoing}" if a.max_ongoing else ""))
            print(table(results, s, f"{key}: {len(trace.requests)} requests over {trace.meta.duration_s:.0f} s"),
                  flush=True)
            all_runs[key] = {"workload": kind, "max_replicas": n, "num_requests": len(trace.requests),
                             "wall_s": round(time.perf_counter() - t0, 1), "summary": s,
                             "work_replica_seconds": round(oracles[0].work_replica_s, 1) if oracles else None,
                             "results": [{k: (round(v, 4) if isinstance(v, float) else v)
                                          for k, v in asdict(r).items() if k not in ("timeline", "wall_s")}
                                         for r in results]}
    if all(r["summary"] is None for r in all_runs.values()):
        (out / f"autoscale_pareto_partial_{a.workloads.replace(',', '-')}_n{a.fleets.replace(',', '-')}.json"
         ).write_text(json.dumps({"args": vars(a), "runs": all_runs}, indent=1))
        return
    tag = (f"{a.workloads.replace(',', '-')}_n{a.fleets.replace(',', '-')}" + ("_het" if speeds else "")
           + (f"_startup{a.startup:g}" if a.startup != 10.0 else "")
           + (f"_cap{a.max_ongoing}" if a.max_ongoing else ""))
    (out / f"autoscale_pareto_{tag}.json").write_text(json.dumps({"args": vars(a), "runs": all_runs}, indent=1))
    plot(all_runs, out / f"autoscale_pareto_{tag}.png")
    say(f"wrote {out}/autoscale_pareto_{tag}.json and .png")


if __name__ == "__main__":
    main()
