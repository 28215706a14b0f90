"""Autoscaling on real local Ray Serve replicas: our engine-aware policy (`autoscaling.policy: engine`)
against Ray Serve's default rule (`autoscaling.policy: requests` at Serve 2.60's shipped defaults), one
model on 1..3 replicas on 127.0.0.1, one seeded open-loop trace replayed over HTTP under each policy in
turn, in one run. The simulated counterpart for 8-64 replicas is benchmarks/autoscale.py.

What 2 cores allow. Each replica runs its engine on one torch thread (one core), so 2 replicas have up to
twice the compute of 1, and a 3rd adds none: it shares the same two cores with the other two, the HTTP
proxy, the ingress and this driver. The policies may go up to 3 (`max_replicas 3`), but only the step from
1 to 2 can buy capacity here; a 3rd replica costs replica-seconds and, while it starts (Python, torch, the
model, the warm-up), takes CPU from the replicas that serve. Two more limits of one small machine:
- the model: with the ~3M-parameter demo model the HTTP path, not the engine, takes most of the CPU (at
  one replica's saturation, ~24 req/s: ingress + proxy + driver about 0.9 core, the replica 0.6), so two
  replicas gave 0.8x the throughput of one (with other work on the machine). The default
  `--model demo-large` is the demo model's family and tokenizer at ~52M parameters (written once next to
  the demo model), where the replica dominates (~8 req/s: 0.8 core against 0.3) and two replicas gave
  1.3x one on a quiet machine. The HTTP path still takes its share, so two replicas never double here;
- Ray starts its workers (proxy, ingress, replicas) at nice 15: any other busy process on the machine
  takes their CPU first. `--ray-worker-niceness 0` gives them an equal share; better, run on a quiet
  machine. The calibration prints X2 / X1 (below): under 1.2, two replicas cannot keep up with the burst
  and the run says little about the policies.

`--emulate`: replicas that each add capacity, as replicas with one GPU each do. Every replica's engine
steps are paced to an emulated device (`engine.pace` = EMULATED_PACE: the real ~3M demo model computes the
tokens in a few ms, then the step waits out the device's modelled time), so a replica mostly sleeps and 6
of them fit on 2 cores beside the HTTP path. Its defaults: the demo model, max 6 replicas, 32-96 output
tokens (the routing simulator's are ~100; the CPU run's 8-16 keep its HTTP path affordable), 768 KV
blocks per replica, the burst at 4 x X1, and C measured from TPOT (below). The calibration prints X2 / X1
and warns under 1.7.

Calibration (skipped for what `--peak-rps`, `--prefill-tokens-per-s`, `--decode-seqs` give). One fixed
replica: its uncached prefill rate R (the TTFT slope between 128- and 1024-token prompts that share
nothing), its unloaded TTFT, and its saturation throughput X1 (closed loop, `--calib-concurrency` N streams
of trace-like requests for `--calib-s`); then two fixed replicas' X2 at 2N streams. Then:
- the burst's rate (the trace's peak) is `--peak-factor` (1.5) x X1, lowered to 0.85 x X2 if two replicas
  could not keep up with that, but never under 1.2 x X1 (the burst must overload one replica). The steady
  phases around the burst run at half the peak, under one replica's X1;
- ours gets `prefill_tokens_per_s` = R and `decode_seqs_per_replica` C = N / (1 - p), where p = X1 x
  (uncached prompt tokens per request) / R is the share of the replica's time spent prefilling at its
  saturation point: one saturated replica then reads load L = p + N / C = 1. With `--emulate`, N streams
  do not saturate a replica (batching is nearly free to a device's decode step), so C is what its name
  says: the sequences at which one replica's TPOT p50 reaches the TPOT SLO, on the line through its TPOT
  at N and at 2N streams (one more closed-loop run).

The trace: Poisson arrivals at `peak x profile(t / duration)`, `profile` being the simulator's load profile
(benchmarks/autoscale.py PROFILE: 0.2 -> ramp to 0.5 -> 0.5 -> 1.0 burst -> 0.5 -> 0.05 quiet for the last
30%), seeded; each request is one of the routing benchmark's tenants' system prompts (Zipf popularity, so
caches matter) plus a short question, 8-16 streamed output tokens (benchmarks/routing/real.py build_trace).

Per policy the app is deployed fresh (min_replicas 1, max_replicas 3, starting at 1; the prefix-affinity
router; 256 KV blocks per replica, which hold every tenant's prompt), warmed up one request at a time with
prompts the trace does not share, left idle 12 s (so no policy sees the warm-up's TTFTs), and the trace is
replayed open loop: each request is sent at its arrival time whatever is in flight (bounded concurrency
would hide the queueing); at most `--max-in-flight` are open at once, and a request that finds them all
taken is not sent and counted as `unsent`. Recorded:
- per request: HTTP status, whether the stream carried an SSE `error` event, TTFT (from the scheduled
  arrival to the first chunk with text, so a lagging driver counts against the run; the driver's send
  lag is reported), end time;
- a timeline every 0.5 s: the replicas by state from `serve.status()` (STARTING, RUNNING, STOPPING, ...),
  the offered rate, the requests in flight; and the Serve controller's up/downscaling log lines.

Results, per policy:
- replica-seconds: the integral, over the span, of the replicas that hold resources, i.e. every replica
  Serve lists (STARTING + RUNNING + STOPPING/draining + any other state), each timeline sample holding
  until the next. The span is the same for every policy: from the first arrival to the end of the trace
  or the last request's end under any policy, whichever is later (a timeline that stops earlier holds its
  last sample);
- TTFT SLO attainment: the share of the trace's requests with TTFT <= `--ttft-slo` (1 s: the unloaded
  replica's p50 is ~0.1 s, its p90 ~0.45 s with cold prefixes); failed and unsent requests are misses.
  TTFT p50 / p99 over the answered requests;
- TPOT SLO attainment: the share of requests with 2+ output tokens whose mean time per output token after
  the first is <= 0.2 s (ours' `tpot_slo_s`, the app's default), failed ones as misses; and TPOT p90.
  Reported beside the target, which is judged on TTFT attainment as the issue states it;
- recovery: from the burst's start to the end of the last 5 s bin (by arrival) after it under 90%
  attainment (benchmarks/autoscale.py's definition; 0 when none);
- failed: a non-200 status, an SSE error event, a stream short of its tokens, or no response;
- peak replicas (all states), each replica's start-up time (STARTING -> RUNNING), ours' replica-seconds
  over the row's, and the issue's target: equal or better attainment with >= 20% fewer replica-seconds
  than Serve's default policy, and zero failed (or unsent) requests;
- with `serve-t<N>` rows (issue 29): the replica-seconds the frontier of those tunings needs for ours' TTFT
  attainment (linear between its non-dominated points, as benchmarks/autoscale_pareto.py), and ours over it;
- the scale-out cliff: the requests each replica that joined during the trace got in its first 20 s
  (count, TTFT p50 / p90, attainment, prefix hit rate from the responses' cached tokens) beside all other
  requests.

Policies (`--policies`):
- `engine`: ours with this app's delays and windows (app/config.py defaults: up 2 s, down 30 s, look-back
  5 s, metrics 1 s), ttft_slo_s = `--ttft-slo`, R and C from the calibration;
- `serve-default`: Serve's rule, ceil(ongoing requests / target_ongoing_requests), at Serve 2.60's shipped
  AutoscalingConfig defaults (target 2, up 30 s, down 600 s, look-back 30 s, metrics 10 s);
- `serve-t<N>` (optional sensitivity row): Serve's rule at target N with this app's delays and windows;
- `engine-nowarm` (optional variant): ours with the router's warm-up on join off (`routing.warmup_on_join:
  false`), to measure whether warming a joining replica pays on a live fleet.
- `engine-warmprefix` (optional variant, issue 29's fifth round): ours with `warm_prefix_headroom: true`
  (the default from that round until 2026-11-29; `VARIANT_OPTIONS`); the table gives its own ratio to Serve's
  frontier.

    python -m benchmarks.autoscale_real --json /tmp/autoscale_real.json --png /tmp/autoscale_real.png
    python -m benchmarks.autoscale_real --duration 60 --policies engine     # a smoke run (~4 min)

`--workload` (issue 29): `burst` is the trace above. The two shift workloads keep the arrival rate
(`--peak-rps`) after a ramp from 0.1 to 1 of it over the first 10% of the trace, and change the work per
request at half the trace, so a request count stops meaning the same load (recovery is then measured from
the shift):
- `output-shift`: the output lengths (`--output-tokens`) grow 4x (chat -> long-form);
- `prompt-shift`: the tenants' cached system prompts give way to unique documents of ~`--doc-tokens`
  tokens (RAG): each request's uncached prefill grows ~20x while its output stays.

    python -m benchmarks.autoscale_real --emulate --workload prompt-shift --duration 150 --peak-rps 2.2 \
        --prefill-tokens-per-s 1000 --decode-seqs 21 --policies engine,serve-t2,serve-t4,serve-t8

Both policies at the default 240 s took 11 minutes here (calibration ~2 min, each policy ~4.5 min with
deploy, warm-up and drain). Writes nothing unless `--json` / `--png` say where; exits 1 if any request
failed or was not sent.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.autoscale import BIN_S, BURST, SERVE_DEFAULTS, profile
from benchmarks.autoscale_pareto import cost_at
from benchmarks.routing import real
from benchmarks.routing.workload import FIRST_TOKEN_ID, TraceRequest

SAMPLE_EVERY_S = 0.5
SETTLE_S = 12.0       # after the warm-up: longer than a replica's 10 s signal window (autoscale.signals), so
                      # the policies do not see the warm-up's cold-prefix TTFTs
PROGRESS_EVERY_S = 5.0
MAX_REPLICAS = 3                         # on the 2-core CPU run; --emulate: EMULATED_MAX_REPLICAS
EMULATED_MAX_REPLICAS = 6
#: engine.pace of an --emulate run: each replica is a slow "device" (prefill 1000 tokens/s; a decode step of
#: n sequences of ~300 tokens takes 0.05 + 0.0075 n s, so ~20 fit a 0.2 s TPOT), slow enough that 6 of them
#: and the HTTP path fit on 2 cores
EMULATED_PACE = {"enabled": True, "step_base_s": 0.05, "prefill_per_token_s": 1e-3,
                 "decode_per_context_token_s": 25e-6}
EMULATED_PEAK_FACTOR = 4.0               # the burst over X1 at 8 streams: ~3 replicas at the TPOT SLO's batch
EMULATED_OUTPUT_TOKENS = (32, 96)        # output lengths of an --emulate run (the CPU run: 8-16)
EMULATED_NUM_BLOCKS = 768                # KV blocks per emulated replica: ~40 sequences of ~300 tokens
EMULATED_MIN_SCALING = 1.7               # X2 / X1 under this: the emulated replicas do not add capacity
SERVE_DEFAULT_POLICY = "serve-default"
TWO_KEEP_UP = 0.85                       # the peak stays under this share of two replicas' throughput ...
MIN_OVERLOAD = 1.2                       # ... but at least this multiple of one replica's


@dataclass(frozen=True, slots=True)
class RealSpec:
    duration_s: float = 240.0
    seed: int = 0
    model: str = "demo-large"
    ttft_slo_s: float = 1.0
    tpot_slo_s: float = 0.2              # ours' tpot_slo_s (the app's default), and the TPOT attainment's
    peak_factor: float = 1.5             # the burst's rate over one replica's saturation throughput
    max_in_flight: int = 512
    request_timeout_s: float = 60.0
    num_blocks: int = 256                # KV blocks per replica: holds every tenant's prompt plus a batch
    output_tokens: tuple[int, int] = (8, 16)   # each request's max_tokens, uniform in this range
    calib_concurrency: int = 8
    calib_s: float = 20.0
    policies: tuple[str, ...] = ("engine", SERVE_DEFAULT_POLICY)
    ray_worker_niceness: int | None = None   # None: Ray's default (15)
    emulate: bool = False                # replicas paced to an emulated device (EMULATED_PACE)
    max_replicas: int = MAX_REPLICAS
    workload: str = "burst"              # or one of SHIFT_WORKLOADS
    doc_tokens: int = 600                # prompt-shift: a document's median length after the shift


@dataclass(slots=True)
class Calibration:
    unloaded_ttft_p50_s: float
    unloaded_ttft_p90_s: float
    prefill_tokens_per_s: float          # R
    saturation_rps: float                # X1, one replica, closed loop at `concurrency`
    saturation_rps_2: float              # X2, two replicas, closed loop at 2 x `concurrency`
    concurrency: int
    uncached_tokens_per_request: float
    prefill_share: float                 # p = X1 x uncached tokens / R
    decode_seqs_per_replica: float       # C = N / (1 - p)
    saturation_ttft_p50_s: float
    peak_rps: float
    source: str                          # "measured" or which values came from the command line
    tpot_p50_s: tuple[float, float] | None = None   # --emulate: one replica's TPOT p50 at N and 2N streams


@dataclass(slots=True)
class Outcome:
    """One trace request as the client saw it; times in seconds from the trace start."""

    req_id: str
    arrival_s: float
    sent_s: float | None = None          # None: not sent (the in-flight cap was full)
    status: int | None = None            # HTTP status; None: no response (connection error, timeout)
    sse_error: bool = False              # the stream carried an SSE `error` event
    first_s: float | None = None         # first chunk with text
    end_s: float | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    expected_tokens: int = 0
    num_prompt_tokens: int = 0
    replica_id: str = ""                 # the replica that answered (the stream's system_fingerprint)
    error: str = ""

    @property
    def ok(self) -> bool:
        return (self.status == 200 and not self.sse_error and self.first_s is not None
                and self.num_output_tokens == self.expected_tokens)

    @property
    def ttft_s(self) -> float:
        """From the scheduled arrival; inf when the request failed or was not sent."""
        return self.first_s - self.arrival_s if self.ok else math.inf

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first; nan with one output token, inf when not ok."""
        if not self.ok:
            return math.inf
        if self.num_output_tokens < 2 or self.end_s is None:
            return math.nan
        return (self.end_s - self.first_s) / (self.num_output_tokens - 1)


@dataclass(slots=True)
class Sample:
    t: float
    states: dict[str, int]
    in_flight: int
    offered_rps: float


@dataclass(slots=True)
class PolicyRun:
    policy: str
    role: str                             # "ours" | "ours-variant" | "baseline" | "sensitivity"
    autoscaling: dict[str, Any]
    outcomes: list[Outcome]
    samples: list[Sample]
    deploy_s: float = 0.0
    scaling_log: list[tuple[float, str]] = field(default_factory=list)   # Serve's up/downscaling lines


@dataclass(slots=True)
class Summary:
    policy: str
    role: str
    num_requests: int
    ttft_slo_attainment: float
    ttft_p50_s: float
    ttft_p99_s: float
    replica_seconds: float
    tpot_slo_attainment: float           # share of requests (with 2+ output tokens) with TPOT <= tpot_slo_s
    tpot_p90_s: float
    recover_s: float
    failed: int
    unsent: int
    peak_replicas: int
    send_lag_p99_s: float
    span_s: tuple[float, float]
    startup_s: list[float] = field(default_factory=list)   # each replica's STARTING -> RUNNING
    #: the requests a replica that joined during the trace got in its first JOIN_WINDOW_S, and all the others
    #: (joined_stats): does the new replica's empty cache make a TTFT cliff?
    joined_first: dict[str, float] = field(default_factory=dict)
    others: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


# ================================================================== trace (pure)
SHIFT_WORKLOADS = ("output-shift", "prompt-shift")
WORKLOADS = ("burst", *SHIFT_WORKLOADS)
SHIFT_AT = 0.5                           # a shift workload's change, as a share of the trace
OUTPUT_SHIFT = 4                         # output-shift: the outputs' growth


def shift_profile(x: float) -> float:
    """A shift workload's rate over the peak at trace fraction x: 0.1 -> 1 over the first 10%, then 1."""
    return 0.1 + 0.9 * min(1.0, x / 0.1)


def workload_profile(workload: str):
    return profile if workload == "burst" else shift_profile


def event_start_s(spec: RealSpec) -> float:
    """Where recovery is measured from: the burst's start, or the shift."""
    return (BURST[0] if spec.workload == "burst" else SHIFT_AT) * spec.duration_s


def arrival_times(duration_s: float, peak_rps: float, seed: int, workload: str = "burst") -> np.ndarray:
    """Poisson arrivals at rate `peak_rps x profile(t / duration_s)`: a homogeneous process at the peak
    rate, each arrival kept with probability profile(t / duration) (thinning), seeded."""
    shape = workload_profile(workload)
    rng = np.random.default_rng([seed, 7])
    n = rng.poisson(peak_rps * duration_s)
    t = np.sort(rng.uniform(0.0, duration_s, n))
    keep = rng.random(n) < np.array([shape(x) for x in t / duration_s])
    return t[keep]


def bench_spec(spec: RealSpec, requests: int) -> real.BenchSpec:
    """The routing benchmark's trace settings (tenants, prompt and output lengths) for `requests`."""
    return real.BenchSpec(replicas=spec.max_replicas, num_blocks=spec.num_blocks, requests=max(1, requests),
                          max_tokens=spec.output_tokens,
                          seed=spec.seed, request_timeout_s=spec.request_timeout_s)


def load_trace(spec: RealSpec, vocab_size: int, peak_rps: float) -> list[TraceRequest]:
    """The routing benchmark's tenant requests, one per arrival of `arrival_times`, shifted from
    SHIFT_AT of the trace on by `shift_request` for the shift workloads."""
    times = arrival_times(spec.duration_s, peak_rps, spec.seed, spec.workload)
    reqs = real.build_trace(bench_spec(spec, len(times)), vocab_size)
    out = [replace(r, arrival_s=float(t)) for r, t in zip(reqs, times)]
    if spec.workload == "burst":
        return out
    rng = np.random.default_rng([spec.seed, 29])
    cut = SHIFT_AT * spec.duration_s
    return [shift_request(r, spec, rng, vocab_size) if r.arrival_s >= cut else r for r in out]


def shift_request(r: TraceRequest, spec: RealSpec, rng: np.random.Generator, vocab_size: int) -> TraceRequest:
    """`r` after the shift: OUTPUT_SHIFT x its output (output-shift), or a unique document of ~doc_tokens
    (0.8-1.2 x) in place of its tenant's system prompt, keeping its question (prompt-shift)."""
    if spec.workload == "output-shift":
        return replace(r, output_token_ids=r.output_token_ids * OUTPUT_SHIFT)
    if spec.workload != "prompt-shift":
        raise ValueError(f"unknown workload {spec.workload!r}: one of {WORKLOADS}")
    question = r.prompt_token_ids[-int(rng.integers(8, 33)):]
    doc = rng.integers(FIRST_TOKEN_ID, vocab_size, int(spec.doc_tokens * rng.uniform(0.8, 1.2))).tolist()
    return replace(r, group="", component="doc", prompt_token_ids=doc + question)


# ================================================================== metrics (pure)
def costly_replicas(states: dict[str, int]) -> int:
    """Replicas that hold resources: every state Serve lists (starting, running, stopping/draining, ...)."""
    return sum(states.values())


def replica_seconds(samples: list[Sample], start: float, end: float) -> float:
    """Integral of costly replicas over [start, end]; each sample holds until the next, the last one until
    `end`, and the first one also covers [start, first sample) if it comes later."""
    if not samples or end <= start:
        return 0.0
    total = 0.0
    for i, s in enumerate(samples):
        lo = start if i == 0 else max(start, s.t)
        hi = min(end, samples[i + 1].t) if i + 1 < len(samples) else end
        if hi > lo:
            total += costly_replicas(s.states) * (hi - lo)
    return total


def startup_times(samples: list[Sample]) -> list[float]:
    """Seconds from a replica's first sample as STARTING to its first as RUNNING, oldest starting first;
    replicas stopped before they ran are dropped."""
    pending: deque[float] = deque()
    out: list[float] = []
    running: int | None = None
    for s in samples:
        num_running, num_starting = s.states.get("RUNNING", 0), s.states.get("STARTING", 0)
        if running is not None and num_running > running:
            out += [s.t - pending.popleft() for _ in range(min(num_running - running, len(pending)))]
        while len(pending) < num_starting:
            pending.append(s.t)
        while len(pending) > num_starting:
            pending.pop()
        running = num_running
    return out


JOIN_WINDOW_S = 20.0


def joined_first_requests(outcomes: list[Outcome], window_s: float = JOIN_WINDOW_S) -> tuple[list[Outcome],
                                                                                              list[Outcome]]:
    """(the answered requests each replica that joined during the trace got within `window_s` of its first
    one, every other answered request). The replica that answered first was up before the trace (the
    benchmark warmed it up); every later one joined by a scale-out, with an empty cache unless the router
    warmed it."""
    answered = sorted((o for o in outcomes if o.replica_id and o.sent_s is not None), key=lambda o: o.sent_s)
    first: dict[str, float] = {}
    for o in answered:
        first.setdefault(o.replica_id, o.sent_s)
    initial = next(iter(first), None)
    early = [o for o in answered if o.replica_id != initial and o.sent_s - first[o.replica_id] < window_s]
    ids = {id(o) for o in early}
    return early, [o for o in answered if id(o) not in ids]


def joined_stats(reqs: list[Outcome], slo_s: float) -> dict[str, float]:
    """Count, TTFT p50 / p90, SLO attainment and prefix hit rate (cached / prompt tokens) of `reqs`."""
    if not reqs:
        return {"n": 0}
    ttfts = np.array([o.ttft_s for o in reqs])
    fin = ttfts[np.isfinite(ttfts)]
    prompt = sum(o.num_prompt_tokens for o in reqs)
    return {"n": len(reqs), "ttft_p50_s": float(np.percentile(fin, 50)) if len(fin) else math.inf,
            "ttft_p90_s": float(np.percentile(fin, 90)) if len(fin) else math.inf,
            "ttft_slo_attainment": float((ttfts <= slo_s).mean()),
            "hit_rate": sum(o.num_cached_tokens for o in reqs) / prompt if prompt else 0.0}


def binned(arrivals: np.ndarray, ttfts: np.ndarray, slo_s: float, end_s: float,
           bin_s: float = BIN_S) -> tuple[np.ndarray, list[float], list[float], list[float]]:
    """Per `bin_s` bin of arrival time: (bin starts, arrivals/s, attainment (1.0 when empty), TTFT p90 with
    failed requests as inf)."""
    bins = np.arange(0.0, end_s + bin_s, bin_s)
    which = np.digitize(arrivals, bins) - 1
    rate, att, p90 = [], [], []
    for b in range(len(bins) - 1):
        m = which == b
        rate.append(int(m.sum()) / bin_s)
        att.append(float((ttfts[m] <= slo_s).mean()) if m.any() else 1.0)
        p90.append(float(np.percentile(ttfts[m], 90, method="higher")) if m.any() else 0.0)   # no inf - inf
    return bins[:-1], rate, att, p90


def recovery_s(bins: np.ndarray, att: list[float], burst_start_s: float, bin_s: float = BIN_S,
               threshold: float = 0.9) -> float:
    """From the burst's start to the end of the last bin at or after it under `threshold` attainment."""
    bad = [b + bin_s for b, a in zip(bins, att) if b >= burst_start_s and a < threshold]
    return max(bad) - burst_start_s if bad else 0.0


def span(runs: list[PolicyRun], duration_s: float) -> tuple[float, float]:
    """The common span: first arrival to the trace's end or the last request's end, whichever is later."""
    first = min((o.arrival_s for r in runs for o in r.outcomes), default=0.0)
    last = max((o.end_s for r in runs for o in r.outcomes if o.end_s is not None), default=0.0)
    return first, max(duration_s, last)


def summarize(run: PolicyRun, spec: RealSpec, window: tuple[float, float]) -> Summary:
    arrivals = np.array([o.arrival_s for o in run.outcomes])
    ttfts = np.array([o.ttft_s for o in run.outcomes])
    answered = ttfts[np.isfinite(ttfts)]
    bins, _, att, _ = binned(arrivals, ttfts, spec.ttft_slo_s, window[1])
    lags = [o.sent_s - o.arrival_s for o in run.outcomes if o.sent_s is not None]
    tpots = np.array([o.tpot_s for o in run.outcomes])
    tpots = tpots[~np.isnan(tpots)]
    early, rest = joined_first_requests(run.outcomes)

    def pct(xs: np.ndarray, p: float) -> float:
        return float(np.percentile(xs, p)) if len(xs) else math.nan

    return Summary(
        policy=run.policy, role=run.role, num_requests=len(run.outcomes),
        ttft_slo_attainment=float((ttfts <= spec.ttft_slo_s).mean()) if len(ttfts) else math.nan,
        ttft_p50_s=pct(answered, 50), ttft_p99_s=pct(answered, 99),
        replica_seconds=replica_seconds(run.samples, *window),
        tpot_slo_attainment=float((tpots <= spec.tpot_slo_s).mean()) if len(tpots) else math.nan,
        tpot_p90_s=pct(tpots[np.isfinite(tpots)], 90),
        recover_s=recovery_s(bins, att, event_start_s(spec)),
        failed=sum(1 for o in run.outcomes if o.sent_s is not None and not o.ok),
        unsent=sum(1 for o in run.outcomes if o.sent_s is None),
        peak_replicas=max((costly_replicas(s.states) for s in run.samples), default=0),
        send_lag_p99_s=pct(np.array(lags), 99), span_s=window,
        startup_s=[round(x, 1) for x in startup_times(run.samples)],
        joined_first=joined_stats(early, spec.ttft_slo_s), others=joined_stats(rest, spec.ttft_slo_s),
        errors=sorted({o.error for o in run.outcomes if o.error})[:5])


def compare(ours: Summary, base: Summary) -> dict[str, Any]:
    """The issue's target against one row: attainment equal or better, <= 0.8 x its replica-seconds, and
    no failed or unsent request."""
    ratio = ours.replica_seconds / base.replica_seconds if base.replica_seconds else math.nan
    return {"against": base.policy, "replica_seconds_ratio": round(ratio, 3),
            "slo_attainment_delta": round(ours.ttft_slo_attainment - base.ttft_slo_attainment, 4),
            "target_met": bool(ours.ttft_slo_attainment >= base.ttft_slo_attainment and ratio <= 0.8
                               and ours.failed + ours.unsent == 0)}


def serve_frontier(results: list[Summary]) -> dict[str, Any] | None:
    """Ours against the frontier of Serve's tuned rule (the `serve-t<N>` rows): the replica-seconds that
    frontier needs for ours' TTFT attainment, interpolated linearly between its non-dominated points
    (benchmarks/autoscale_pareto.py:cost_at), and ours over that. `reached` False: no tuning run reached
    ours' attainment, so the ratio is against the best one's cost (a bound: "<="). None without ours or a
    tuned row. `variants`: the same for each of ours' variant rows (run with or without `engine`)."""
    ours = next((r for r in results if r.role == "ours"), None)
    tuned = [r for r in results if r.role == "sensitivity"]
    if not tuned:
        return None
    points = [(r.replica_seconds, r.ttft_slo_attainment) for r in tuned]

    def at(r: Summary) -> dict[str, Any]:
        cost, reached = cost_at(points, r.ttft_slo_attainment)
        return {"policy": r.policy, "attainment": round(r.ttft_slo_attainment, 4),
                "replica_seconds": round(r.replica_seconds, 1), "serve_replica_seconds": round(cost, 1),
                "reached": reached, "ratio": round(r.replica_seconds / cost, 3)}

    variants = [at(r) for r in results if r.role == "ours-variant"]
    if ours is None:
        return {"targets": [r.policy for r in tuned], "variants": variants} if variants else None
    o = at(ours)
    return {"ours_attainment": o["attainment"], "ours_replica_seconds": o["replica_seconds"],
            "serve_replica_seconds": o["serve_replica_seconds"], "reached": o["reached"], "ratio": o["ratio"],
            "targets": [r.policy for r in tuned], "variants": variants}


# ================================================================== policies
#: ours with the router's warm-up on join turned off (routing.warmup_on_join false): does warming pay?
NO_WARMUP_POLICY = "engine-nowarm"
#: ours with one of the policy's options flipped (issue 29): variant -> the autoscaling keys it sets
VARIANT_OPTIONS: dict[str, dict[str, Any]] = {
    "engine-warmprefix": {"warm_prefix_headroom": True},             # the default of rounds 5-6
}


def policy_role(policy: str) -> str:
    if policy == "engine":
        return "ours"
    if policy == NO_WARMUP_POLICY or policy in VARIANT_OPTIONS:
        return "ours-variant"
    if policy == SERVE_DEFAULT_POLICY:
        return "baseline"
    if policy.startswith("serve-t") and policy[7:].replace(".", "", 1).isdigit():
        return "sensitivity"
    raise ValueError(f"unknown policy {policy!r}: engine, {NO_WARMUP_POLICY}, {', '.join(VARIANT_OPTIONS)}, "
                     f"{SERVE_DEFAULT_POLICY} or serve-t<target>")


def autoscaling_section(policy: str, spec: RealSpec, cal: Calibration) -> tuple[str, dict[str, Any]]:
    """(role, the app's `autoscaling` section) for a policy name."""
    role = policy_role(policy)
    common = {"enabled": True, "min_replicas": 1, "max_replicas": spec.max_replicas}
    if role in ("ours", "ours-variant"):
        extra = VARIANT_OPTIONS.get(policy, {})
        return role, common | {"policy": "engine", "ttft_slo_s": spec.ttft_slo_s, "tpot_slo_s": spec.tpot_slo_s,
                               "prefill_tokens_per_s": round(cal.prefill_tokens_per_s, 1),
                               "decode_seqs_per_replica": round(cal.decode_seqs_per_replica, 2)} | extra
    if role == "baseline":
        d = SERVE_DEFAULTS
        return role, common | {"policy": "requests", "target_ongoing_requests": d["target_ongoing_requests"],
                               "upscale_delay_s": d["upscale_delay_s"], "downscale_delay_s": d["downscale_delay_s"],
                               "downscale_to_zero_delay_s": d["downscale_delay_s"],   # Serve's fallback
                               "look_back_period_s": d["look_back_period_s"],
                               "metrics_interval_s": d["metrics_interval_s"]}
    return role, common | {"policy": "requests", "target_ongoing_requests": float(policy[7:])}


# ================================================================== model
#: write_demo_model arguments of the default model: the demo model's family, tokenizer and vocabulary, but
#: ~52M parameters instead of ~3M, so that a replica's engine, not the HTTP path, takes most of the CPU
LARGE_DEMO = dict(hidden_size=768, num_layers=8, num_heads=12, num_kv_heads=4, intermediate_size=2048)


def resolve_model(name: str) -> str:
    """`demo` (the demo model), `demo-large` (LARGE_DEMO, written once next to the demo model) or a path."""
    from affinity_serve.engine.demo import default_demo_model_dir, ensure_demo_model, write_demo_model
    if name == "demo":
        return str(ensure_demo_model())
    if name != "demo-large":
        return name
    path = default_demo_model_dir().parent / "demo-llama-h768-l8"
    if not (path / "model.safetensors").is_file() or not (path / "tokenizer.json").is_file():
        write_demo_model(path, **LARGE_DEMO)
    return str(path)


# ================================================================== cluster
def real_app_config(spec: RealSpec, model: str, autoscaling: dict[str, Any] | None, replicas: int = 1,
                    warmup_on_join: bool = True) -> dict[str, Any]:
    """The app's config: the routing benchmark's (prefix-affinity router), autoscaled by `autoscaling`
    (None: `replicas` fixed), paced to the emulated device on an --emulate run."""
    cfg = real.app_config(replace(bench_spec(spec, 1), replicas=replicas), "prefix_affinity", model)
    if autoscaling is not None:
        cfg["autoscaling"] = autoscaling
    cfg.setdefault("routing", {})["warmup_on_join"] = warmup_on_join
    if spec.emulate:
        cfg["engine"]["pace"] = dict(EMULATED_PACE)
    return cfg


def deploy(spec: RealSpec, model: str, autoscaling: dict[str, Any] | None, replicas: int = 1,
           warmup_on_join: bool = True) -> float:
    """The demo app on `replicas` fixed replicas, or autoscaled by `autoscaling` from one; returns the
    deploy time."""
    from ray import serve

    from affinity_serve.app.builder import build_app
    t0 = time.monotonic()
    cfg = real_app_config(spec, model, autoscaling, replicas, warmup_on_join)
    serve.run(build_app(cfg), name=real.APP_NAME, route_prefix=real.ROUTE)
    real._wait_running("LLMReplica", replicas)
    return time.monotonic() - t0


def replica_states() -> dict[str, int]:
    from ray import serve
    app = serve.status().applications.get(real.APP_NAME)
    dep = app.deployments.get("LLMReplica") if app is not None else None
    if dep is None:
        return {}
    return {getattr(k, "value", str(k)): int(v) for k, v in dep.replica_states.items() if v}


_SCALING_LINE = re.compile(r"^\w+ (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) controller \d+ -- "
                           r"((?:Up|Down)scaling) Deployment\(name='LLMReplica'[^)]*\) (.*)$")
#: our policy's decision lines (autoscale/serve_policy.py, logger ray.serve.affinity.autoscale) in the same log
_DECISION_LINE = re.compile(r"^\w+ (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) controller \d+ -- "
                            r"[^ ]*/LLMReplica: (up_predicted|up_slo|down|to_zero|cold_start) (.*)$")


def scaling_log(since_wall: float, t0_wall: float) -> list[tuple[float, str]]:
    """The Serve controller's "Upscaling/Downscaling LLMReplica from a to b replicas ..." log lines written
    after `since_wall` (time.time()), as (seconds from the trace start, message): when each policy's
    decision took effect, and with Serve's rule the ongoing requests it saw; with ours, also its decisions
    to scale (reason -> target, with the load breakdown behind them)."""
    import ray
    ctx = ray.get_runtime_context()
    out = []
    for path in sorted((Path(ctx.get_temp_dir()) / ctx.get_session_name() / "logs" / "serve").glob("controller_*.log")):
        for line in path.read_text(errors="replace").splitlines():
            m = _SCALING_LINE.match(line) or _DECISION_LINE.match(line)
            if m and (ts := datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()) >= since_wall:
                out.append((round(ts - t0_wall, 2), f"{m[2]} {m[3]}"))
    return out


class Sampler(threading.Thread):
    """Polls `serve.status()` every SAMPLE_EVERY_S in its own thread (the call blocks on the controller)."""

    def __init__(self, t0: float, offered, in_flight):
        super().__init__(daemon=True)
        self.t0, self.offered, self.in_flight = t0, offered, in_flight
        self.samples: list[Sample] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            t = time.monotonic() - self.t0
            try:
                states = replica_states()
            except Exception:        # a slow controller: keep the previous sample holding
                states = self.samples[-1].states if self.samples else {}
            self.samples.append(Sample(round(t, 3), states, self.in_flight(), self.offered(t)))
            self.stopping.wait(max(0.0, SAMPLE_EVERY_S - (time.monotonic() - self.t0 - t)))

    def latest(self) -> dict[str, int]:
        return self.samples[-1].states if self.samples else {}


# ================================================================== HTTP driver
def _body(r: TraceRequest) -> dict[str, Any]:
    return {"model": "demo", "prompt": r.prompt_token_ids, "max_tokens": len(r.output_token_ids),
            "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def _stream(client: Any, url: str, r: TraceRequest, out: Outcome, t0: float, timeout_s: float) -> None:
    res = real.RequestResult(r.req_id, ok=False)
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=_body(r), timeout=timeout_s) as resp:
            out.status = resp.status_code
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread())[:160]!r}"
            else:
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        out.sse_error = out.sse_error or "error" in chunk
                        real._read_chunk(chunk, res, time.monotonic() - t0)
                out.error = res.error
    except Exception as e:          # a failed request is a result, not a crash
        out.error = f"{type(e).__name__}: {e}"[:200]
    out.end_s = time.monotonic() - t0
    out.first_s, out.num_output_tokens, out.num_cached_tokens = res.ttft_s, res.num_output_tokens, res.num_cached_tokens
    out.replica_id = res.replica_id
    if not out.ok and not out.error:
        out.error = f"incomplete: {out.num_output_tokens} of {out.expected_tokens} tokens"


async def replay(url: str, trace: list[TraceRequest], spec: RealSpec, t0: float, label: str,
                 sampler: Sampler, counter: list[int]) -> list[Outcome]:
    """Send each request at its arrival time (open loop); `counter[0]` is the number in flight."""
    import httpx
    outcomes = [Outcome(r.req_id, r.arrival_s, expected_tokens=len(r.output_token_ids),
                        num_prompt_tokens=len(r.prompt_token_ids)) for r in trace]
    tasks: list[asyncio.Task] = []

    async def one(r: TraceRequest, out: Outcome) -> None:
        counter[0] += 1
        try:
            await _stream(client, url, r, out, t0, spec.request_timeout_s)
        finally:
            counter[0] -= 1

    async def progress() -> None:
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            t = time.monotonic() - t0
            sent = sum(o.sent_s is not None for o in outcomes)
            done = sum(o.end_s is not None for o in outcomes)
            failed = sum(o.end_s is not None and not o.ok for o in outcomes)
            print(f"  [{label}] t={t:.0f}/{spec.duration_s:.0f} s, offered {sampler.offered(t):.1f} req/s, sent "
                  f"{sent}/{len(trace)}, done {done}, failed {failed}, in flight {counter[0]}, replicas "
                  f"{sampler.latest()}", file=sys.stderr, flush=True)

    limits = httpx.Limits(max_connections=spec.max_in_flight, max_keepalive_connections=64)
    async with httpx.AsyncClient(limits=limits) as client:
        ticker = asyncio.create_task(progress())
        try:
            for r, out in zip(trace, outcomes):
                delay = r.arrival_s - (time.monotonic() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                if counter[0] >= spec.max_in_flight:
                    out.error = f"not sent: {spec.max_in_flight} requests in flight"
                    continue
                out.sent_s = time.monotonic() - t0
                tasks.append(asyncio.create_task(one(r, out)))
            await asyncio.gather(*tasks)
        finally:
            ticker.cancel()
    return outcomes


def warm_up(url: str, warmup: list[TraceRequest], timeout_s: float, label: str, settle_s: float = SETTLE_S) -> None:
    """One request at a time (kernels and the first steps, nothing the trace shares), then `settle_s` idle."""
    asyncio.run(real.drive(url, warmup, 1, time.monotonic() + 60, timeout_s, f"{label} warmup"))
    time.sleep(settle_s)


def run_policy(policy: str, spec: RealSpec, cal: Calibration, model: str, url: str, trace: list[TraceRequest],
               warmup: list[TraceRequest]) -> PolicyRun:
    role, section = autoscaling_section(policy, spec, cal)
    say(f"[{policy}] deploying: {json.dumps(section)}")
    since_wall = time.time()
    deploy_s = deploy(spec, model, section, warmup_on_join=policy != NO_WARMUP_POLICY)
    say(f"[{policy}] deployed in {deploy_s:.1f} s; warming up")
    try:
        warm_up(url, warmup, spec.request_timeout_s, policy)
        counter = [0]
        t0, t0_wall = time.monotonic(), time.time()
        shape = workload_profile(spec.workload)
        sampler = Sampler(t0, lambda t: cal.peak_rps * shape(min(t, spec.duration_s) / spec.duration_s)
                          if t < spec.duration_s else 0.0, lambda: counter[0])
        sampler.start()
        try:
            outcomes = asyncio.run(replay(url, trace, spec, t0, policy, sampler, counter))
        finally:
            sampler.stopping.set()
            sampler.join()
        decisions = scaling_log(since_wall, t0_wall)
    finally:
        real.undeploy()
    for t, msg in decisions:
        say(f"[{policy}] t={t:.1f} s: {msg}")
    return PolicyRun(policy, role, section, outcomes, sampler.samples, deploy_s, decisions)


# ================================================================== calibration
def _ttfts(url: str, reqs: list[TraceRequest], timeout_s: float) -> list[float]:
    """Sequential TTFTs (s) of `reqs`, which must all succeed."""
    res, _ = asyncio.run(real.drive(url, reqs, 1, time.monotonic() + 120, timeout_s, "calibration"))
    bad = [r.error for r in res if not r.ok]
    if bad:
        raise RuntimeError(f"calibration requests failed: {bad[:3]}")
    return [r.ttft_s for r in res]


def _prefill_rate(url: str, vocab: int, seed: int) -> float:
    """Uncached prefill tokens/s: the TTFT slope between 128- and 1024-token prompts that share nothing
    (the slope cancels the fixed per-request cost)."""
    rng = np.random.default_rng(seed + 20_000)

    def ttft(n_tokens: int) -> float:
        reqs = [TraceRequest(f"P{n_tokens}-{i}", 0.0, "D", "", rng.integers(FIRST_TOKEN_ID, vocab, n_tokens).tolist(),
                             [0]) for i in range(3)]
        return float(np.median(_ttfts(url, reqs, 30)))

    short = ttft(128)
    return (1024 - 128) / max(1e-3, ttft(1024) - short)


def _saturation(url: str, reqs: list[TraceRequest], concurrency: int, seconds: float,
                timeout_s: float) -> tuple[list[real.RequestResult], float]:
    """Closed loop at `concurrency` streams for `seconds`: the answered requests and requests per second."""
    res, wall = asyncio.run(real.drive(url, reqs, concurrency, time.monotonic() + seconds, timeout_s,
                                       f"calibration, {concurrency} streams"))
    ok = [r for r in res if r.ok]
    return ok, len(ok) / wall


def _tpot_p50(results: list[real.RequestResult]) -> float:
    return float(np.median([(r.e2e_s - r.ttft_s) / (r.num_output_tokens - 1) for r in results
                            if r.num_output_tokens > 1]))


def decode_capacity(tpot_n: float, tpot_2n: float, n: int, tpot_slo_s: float) -> float:
    """C, the sequences one replica decodes within the TPOT SLO, from its TPOT at n and 2n closed-loop
    streams: the linear fit's crossing of the SLO (an emulated device's decode step grows linearly with
    its batch). At least 1; 4n when TPOT did not grow."""
    slope = (tpot_2n - tpot_n) / n
    if slope <= 0:
        return 4.0 * n
    return max(1.0, n + (tpot_slo_s - tpot_n) / slope)


def peak_rps(x1: float, x2: float, factor: float, emulate: bool = False) -> float:
    """`factor` x X1; on the CPU run lowered to TWO_KEEP_UP x X2 so that two replicas keep up, but never
    under MIN_OVERLOAD x X1 (the burst must overload one replica; two then may not keep up). Emulated
    replicas each add capacity: `factor` x X1 as it is."""
    if emulate:
        return factor * x1
    return min(factor * x1, max(TWO_KEEP_UP * x2, MIN_OVERLOAD * x1))


def calibrate(spec: RealSpec, model: str, url: str, vocab: int, given: dict[str, float | None]) -> Calibration:
    """One fixed replica: unloaded TTFT, prefill rate, saturation throughput X1 at `calib_concurrency`
    closed-loop streams of trace-like requests (another seed: not the trace's prompts); then two fixed
    replicas at twice the streams (X2), to check that two keep up with the burst."""
    say("[calibration] deploying one fixed replica")
    deploy(spec, model, None)
    bs = bench_spec(spec, 2000)
    calib = real.build_trace(replace(bs, seed=spec.seed + 30_000), vocab)
    try:
        warm_up(url, real.warmup_trace(bs, vocab), spec.request_timeout_s, "calibration", settle_s=0)
        rate = _prefill_rate(url, vocab, spec.seed)
        unloaded = _ttfts(url, calib[:10], 30)
        one, x1 = _saturation(url, calib[10:], spec.calib_concurrency, spec.calib_s, spec.request_timeout_s)
        tpots = None
        if spec.emulate:      # C from the TPOT slope: one replica at 2N streams too
            two_n, _ = _saturation(url, calib[10:], 2 * spec.calib_concurrency, spec.calib_s, spec.request_timeout_s)
            tpots = (_tpot_p50(one), _tpot_p50(two_n))
        say("[calibration] two fixed replicas")
        deploy(spec, model, None, replicas=2)
        warm_up(url, real.warmup_trace(bs, vocab) * 2, spec.request_timeout_s, "calibration", settle_s=0)
        _, x2 = _saturation(url, calib[10:], 2 * spec.calib_concurrency, spec.calib_s, spec.request_timeout_s)
    finally:
        real.undeploy()
    uncached = float(np.mean([r.num_prompt_tokens - r.num_cached_tokens for r in one]))
    R = given["prefill_tokens_per_s"] or rate
    p = min(0.8, x1 * uncached / R)
    c = (decode_capacity(*tpots, spec.calib_concurrency, spec.tpot_slo_s) if tpots is not None
         else spec.calib_concurrency / (1.0 - p))
    return Calibration(
        unloaded_ttft_p50_s=float(np.median(unloaded)), unloaded_ttft_p90_s=float(np.percentile(unloaded, 90)),
        prefill_tokens_per_s=float(R), saturation_rps=x1, saturation_rps_2=x2, concurrency=spec.calib_concurrency,
        uncached_tokens_per_request=uncached, prefill_share=p,
        decode_seqs_per_replica=float(given["decode_seqs"] or c), tpot_p50_s=tpots,
        saturation_ttft_p50_s=float(np.median([r.ttft_s for r in one])),
        peak_rps=float(given["peak_rps"] or peak_rps(x1, x2, spec.peak_factor, spec.emulate)),
        source=",".join(k for k, v in given.items() if v) or "measured")


def describe(cal: Calibration, spec: RealSpec) -> str:
    scaling = cal.saturation_rps_2 / cal.saturation_rps
    return (f"calibration ({cal.source}): one replica unloaded TTFT p50 {cal.unloaded_ttft_p50_s * 1e3:.0f} ms, "
            f"p90 {cal.unloaded_ttft_p90_s * 1e3:.0f} ms (SLO {spec.ttft_slo_s:g} s); prefill R "
            f"{cal.prefill_tokens_per_s:.0f} tok/s; saturation X1 {cal.saturation_rps:.1f} req/s at "
            f"{cal.concurrency} streams (TTFT p50 {cal.saturation_ttft_p50_s * 1e3:.0f} ms, "
            f"{cal.uncached_tokens_per_request:.0f} uncached prompt tokens/request, prefill share p "
            f"{cal.prefill_share:.2f}) -> {_c_source(cal, spec)} = {cal.decode_seqs_per_replica:.1f}; two replicas X2 "
            f"{cal.saturation_rps_2:.1f} req/s at {2 * cal.concurrency} streams ({scaling:.2f} x X1); peak "
            f"{cal.peak_rps:.1f} req/s = {cal.peak_rps / cal.saturation_rps:.2f} x X1 = "
            f"{cal.peak_rps / cal.saturation_rps_2:.2f} x X2 (steady {0.5 * cal.peak_rps:.1f}, quiet "
            f"{0.05 * cal.peak_rps:.2f} req/s)" + _scaling_warning(scaling, spec))


def _c_source(cal: Calibration, spec: RealSpec) -> str:
    if cal.tpot_p50_s is None:
        return "C = N/(1-p)"
    a, b = cal.tpot_p50_s
    return (f"TPOT p50 {a * 1e3:.0f} ms at N, {b * 1e3:.0f} ms at 2N streams -> C (TPOT {spec.tpot_slo_s * 1e3:.0f} "
            f"ms)")


def _scaling_warning(scaling: float, spec: RealSpec) -> str:
    if spec.emulate and scaling < EMULATED_MIN_SCALING:
        return (f"\nWARNING: two emulated replicas gave {scaling:.2f} x one's throughput (under "
                f"{EMULATED_MIN_SCALING:g}): the CPU or the HTTP path, not the emulated devices, limits the run. "
                "Other work on the machine?")
    if not spec.emulate and scaling < MIN_OVERLOAD:
        return (f"\nWARNING: two replicas gave {scaling:.2f} x one's throughput (under {MIN_OVERLOAD:g}): they "
                "cannot keep up with the burst, so the run says little about the policies. Other work on the "
                "machine? (Ray's workers run at nice 15: see --ray-worker-niceness)")
    return ""


def _what(spec: RealSpec) -> str:
    if spec.emulate:
        return f"{spec.model} model paced to an emulated device, max {spec.max_replicas} replicas"
    return f"{spec.model} model on 2 cores, max {spec.max_replicas} replicas; only 1 -> 2 adds compute"


# ================================================================== report
def table(results: list[Summary], spec: RealSpec) -> str:
    base = next((r for r in results if r.role == "baseline"), None)
    ours = next((r for r in results if r.role == "ours"), None)
    lines = [f"real replicas ({_what(spec)}), {spec.duration_s:g} s trace, "
             f"seed {spec.seed}, TTFT SLO {spec.ttft_slo_s:g} s; span {results[0].span_s[0]:.0f}-"
             f"{results[0].span_s[1]:.0f} s",
             f"{'policy':<34} {'requests':>8} {'SLO att':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT att':>8} "
             f"{'TPOT p90':>8} {'rep-s':>7} "
             f"{'ours/this':>9} {'target':>8} {'recover':>8} {'failed':>6} {'unsent':>6} {'peak':>5}"]
    for r in results:
        ratio, met = "", ""
        if ours is not None:
            c = compare(ours, r)
            ratio = f"{c['replica_seconds_ratio']:.2f}"
            met = {"ours": "", "ours-variant": "variant"}.get(r.role, "met" if c["target_met"] else "NOT met")
        lines.append(f"{r.policy:<34} {r.num_requests:>8} {r.ttft_slo_attainment:>8.3f} {r.ttft_p50_s:>8.2f}s "
                     f"{r.ttft_p99_s:>8.2f}s {r.tpot_slo_attainment:>8.3f} {r.tpot_p90_s * 1e3:>6.0f}ms "
                     f"{r.replica_seconds:>7.0f} {ratio:>9} {met:>8} {r.recover_s:>7.0f}s "
                     f"{r.failed:>6} {r.unsent:>6} {r.peak_replicas:>5}")
    if base is None:
        lines.append("(no Serve default row: the target is judged against it)")
    f = serve_frontier(results)
    if f is not None and "ratio" in f:
        lines.append(f"-> Serve's tuned frontier ({', '.join(f['targets'])}) at ours' attainment "
                     f"{f['ours_attainment']:.3f}: {f['serve_replica_seconds']:.0f} replica-s"
                     f"{'' if f['reached'] else ' (not reached: its best point)'}; ours / it = "
                     f"{'' if f['reached'] else '<= '}{f['ratio']:.2f} (goal <= 0.80)")
    for v in f["variants"] if f is not None else []:
        lines.append(f"-> Serve's tuned frontier at {v['policy']}'s attainment {v['attainment']:.3f}: "
                     f"{v['serve_replica_seconds']:.0f} replica-s; {v['policy']} / it = "
                     f"{'' if v['reached'] else '<= '}{v['ratio']:.2f}")
    lines.append("replica start-up (STARTING -> RUNNING): " + "; ".join(
        f"{r.policy} {', '.join(f'{x:.0f}' for x in r.startup_s) or '-'} s" for r in results)
        + "; driver send lag p99: " + ", ".join(f"{r.send_lag_p99_s * 1e3:.0f} ms" for r in results))

    def js(d: dict[str, float]) -> str:
        if not d.get("n"):
            return "none"
        return (f"{d['n']:.0f} req, TTFT p50 {d['ttft_p50_s']:.2f} s, p90 {d['ttft_p90_s']:.2f} s, att. "
                f"{d['ttft_slo_attainment']:.3f}, prefix hit {d['hit_rate']:.2f}")
    lines.append(f"scale-out cliff? requests a joining replica got in its first {JOIN_WINDOW_S:g} s vs all others:")
    lines += [f"  {r.policy:<20} joined: {js(r.joined_first)}; others: {js(r.others)}" for r in results]
    return "\n".join(lines)


def plot(runs: list[PolicyRun], results: list[Summary], spec: RealSpec, cal: Calibration, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    end = results[0].span_s[1]
    fig, ax = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    t = np.linspace(0, spec.duration_s, 400)
    shape = workload_profile(spec.workload)
    ax[0].plot(t, [cal.peak_rps * shape(x / spec.duration_s) for x in t], color="gray", lw=1, label="offered rate")
    arrivals = np.array([o.arrival_s for o in runs[0].outcomes])
    bins, rate, _, _ = binned(arrivals, np.zeros(len(arrivals)), spec.ttft_slo_s, end)
    ax[0].step(bins, rate, where="post", color="k", label=f"arrivals per {BIN_S:g} s bin")
    ax[0].axhline(cal.saturation_rps, color="r", ls=":", lw=1,
                  label=f"one replica at {cal.concurrency} streams (X1, calibrated)")
    ax[0].set_ylabel("requests / s")
    ax[0].legend(fontsize=8)
    for i, (run, res) in enumerate(zip(runs, results)):
        ts = [s.t for s in run.samples]
        ax[1].step(ts, [costly_replicas(s.states) for s in run.samples], where="post", color=f"C{i}",
                   label=f"{run.policy}: all ({res.replica_seconds:.0f} replica-s)")
        ax[1].step(ts, [s.states.get("RUNNING", 0) for s in run.samples], where="post", color=f"C{i}", ls="--",
                   lw=1, label=f"{run.policy}: running")
        ttfts = np.array([o.ttft_s for o in run.outcomes])
        b, _, _, p90 = binned(np.array([o.arrival_s for o in run.outcomes]), ttfts, spec.ttft_slo_s, end)
        ax[2].step(b, np.minimum(p90, 1e3), where="post", color=f"C{i}",
                   label=f"{run.policy}: SLO att. {res.ttft_slo_attainment:.3f}")
    ax[1].set_ylabel("replicas")
    ax[1].set_ylim(0, spec.max_replicas + 0.5)
    ax[1].legend(fontsize=7, ncol=2)
    ax[2].axhline(spec.ttft_slo_s, color="r", ls="--", lw=1, label="TTFT SLO")
    ax[2].set_yscale("log")
    ax[2].set_ylabel(f"TTFT p90 per {BIN_S:g} s (s)")
    ax[2].set_xlabel("time since the trace start (s)")
    ax[2].legend(fontsize=8)
    for a in ax:
        if spec.workload == "burst":
            a.axvspan(BURST[0] * spec.duration_s, BURST[1] * spec.duration_s, color="orange", alpha=0.1)
        else:
            a.axvline(event_start_s(spec), color="orange", lw=1)
    fig.suptitle(f"Autoscaling on real local replicas ({_what(spec)}), seed {spec.seed}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ================================================================== main
def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(spec: RealSpec, given: dict[str, float | None]) -> tuple[Calibration, list[PolicyRun], list[Summary]]:
    start = time.monotonic()
    model = resolve_model(spec.model)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    if spec.ray_worker_niceness is not None:      # read by the raylet when it starts workers
        os.environ["RAY_worker_niceness"] = str(spec.ray_worker_niceness)
    url = real.start_cluster(bench_spec(spec, 1))
    runs: list[PolicyRun] = []
    try:
        if all(given.values()):
            cal = Calibration(math.nan, math.nan, given["prefill_tokens_per_s"], math.nan, math.nan,
                              spec.calib_concurrency, math.nan, math.nan, given["decode_seqs"], math.nan,
                              given["peak_rps"], "command line")
        else:
            cal = calibrate(spec, model, url, vocab, given)
        say(describe(cal, spec))
        trace = load_trace(spec, vocab, cal.peak_rps)
        event = (f"burst {BURST[0] * spec.duration_s:.0f}-{BURST[1] * spec.duration_s:.0f} s"
                 if spec.workload == "burst" else f"{spec.workload} at {event_start_s(spec):.0f} s")
        say(f"trace: {len(trace)} requests over {spec.duration_s:g} s, peak {cal.peak_rps:.1f} req/s, {event}")
        warmup = real.warmup_trace(bench_spec(spec, 1), vocab)
        for policy in spec.policies:
            runs.append(run_policy(policy, spec, cal, model, url, trace, warmup))
            say(f"[{policy}] done at {time.monotonic() - start:.0f} s")
    finally:
        real.stop_cluster()
    window = span(runs, spec.duration_s)
    return cal, runs, [summarize(r, spec, window) for r in runs]


def _pair(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        sys.exit(f"--output-tokens wants LO,HI (two integers), got {text!r}")
    if not 2 <= lo <= hi:
        sys.exit(f"--output-tokens wants 2 <= LO <= HI, got {text!r}")
    return lo, hi


def main() -> None:
    d = RealSpec()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=d.duration_s, help="trace length, seconds")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--emulate", action="store_true", help="pace every replica's steps to an emulated device "
                   "(engine.pace = EMULATED_PACE), so that each replica adds capacity; defaults then: --model demo, "
                   f"--max-replicas {EMULATED_MAX_REPLICAS}, --peak-factor {EMULATED_PEAK_FACTOR:g}, "
                   f"{EMULATED_OUTPUT_TOKENS[0]}-{EMULATED_OUTPUT_TOKENS[1]} output tokens, "
                   f"{EMULATED_NUM_BLOCKS} KV blocks, and C from the TPOT at N and 2N streams")
    p.add_argument("--model", help="demo-large (default: the demo model's family at ~52M parameters), demo (~3M: "
                   "on the CPU run the HTTP path, not the replicas, then takes most of the CPU; the --emulate "
                   "default), or a path")
    p.add_argument("--max-replicas", type=int, help=f"the policies' max_replicas (default {MAX_REPLICAS}; "
                   f"--emulate: {EMULATED_MAX_REPLICAS})")
    p.add_argument("--ttft-slo", type=float, default=d.ttft_slo_s, help="seconds; ours' ttft_slo_s too")
    p.add_argument("--policies", default=",".join(d.policies),
                   help=f"comma-separated: engine, {SERVE_DEFAULT_POLICY}, serve-t<N> (Serve's rule at target N "
                        f"with this app's delays), {NO_WARMUP_POLICY} (ours without the warm-up on join), "
                        f"{', '.join(VARIANT_OPTIONS)} (ours with off options on: VARIANT_OPTIONS)")
    p.add_argument("--peak-rps", type=float, help="the burst's rate (default: --peak-factor x one replica's "
                   "measured saturation throughput)")
    p.add_argument("--peak-factor", type=float, help=f"the burst over one replica's saturation (default "
                   f"{d.peak_factor:g}; --emulate: {EMULATED_PEAK_FACTOR:g})")
    p.add_argument("--prefill-tokens-per-s", type=float, help="ours' R (default: measured)")
    p.add_argument("--decode-seqs", type=float, help="ours' C (default: from the calibration)")
    p.add_argument("--calib-concurrency", type=int, default=d.calib_concurrency)
    p.add_argument("--calib-s", type=float, default=d.calib_s)
    p.add_argument("--output-tokens", help=f"LO,HI: each request's output length, uniform (default "
                   f"{RealSpec().output_tokens[0]},{RealSpec().output_tokens[1]}; --emulate: "
                   f"{EMULATED_OUTPUT_TOKENS[0]},{EMULATED_OUTPUT_TOKENS[1]})")
    p.add_argument("--num-blocks", type=int, help=f"KV blocks per replica (default {d.num_blocks}; --emulate: "
                   f"{EMULATED_NUM_BLOCKS})")
    p.add_argument("--max-in-flight", type=int, default=d.max_in_flight)
    p.add_argument("--ray-worker-niceness", type=int, help="nice level of Ray's workers (Serve's proxy, ingress, "
                   "replicas); Ray's default 15 makes any other busy process on the machine take their CPU first")
    p.add_argument("--workload", choices=WORKLOADS, default=d.workload, help="the trace (module docstring)")
    p.add_argument("--doc-tokens", type=int, default=d.doc_tokens, help="prompt-shift: a document's median length")
    p.add_argument("--json", help="write the calibration, per-policy results, timelines and requests here")
    p.add_argument("--png", help="write the timeline figure here")
    a = p.parse_args()
    em = a.emulate
    spec = RealSpec(duration_s=a.duration, seed=a.seed, model=a.model or ("demo" if em else d.model),
                    ttft_slo_s=a.ttft_slo,
                    peak_factor=a.peak_factor or (EMULATED_PEAK_FACTOR if em else d.peak_factor),
                    max_in_flight=a.max_in_flight,
                    num_blocks=a.num_blocks or (EMULATED_NUM_BLOCKS if em else d.num_blocks),
                    calib_concurrency=a.calib_concurrency,
                    calib_s=a.calib_s, policies=tuple(x for x in a.policies.split(",") if x),
                    ray_worker_niceness=a.ray_worker_niceness, emulate=em, workload=a.workload,
                    doc_tokens=a.doc_tokens,
                    max_replicas=a.max_replicas or (EMULATED_MAX_REPLICAS if em else MAX_REPLICAS),
                    output_tokens=_pair(a.output_tokens) if a.output_tokens
                    else (EMULATED_OUTPUT_TOKENS if em else d.output_tokens))
    if spec.max_replicas < 2:
        sys.exit("--max-replicas must be at least 2 (the calibration runs two replicas)")
    for pol in spec.policies:
        policy_role(pol)                                # fail early on a bad name
    if a.png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            sys.exit("--png needs matplotlib: pip install -e '.[bench]' (or make bench)")
    given = {"peak_rps": a.peak_rps, "prefill_tokens_per_s": a.prefill_tokens_per_s, "decode_seqs": a.decode_seqs}
    signal.signal(signal.SIGALRM, real._hard_stop)      # a hung deploy must not run forever
    signal.alarm(int(len(spec.policies) * (spec.duration_s + 240) + 300))
    cal, runs, results = run(spec, given)
    signal.alarm(0)
    print(describe(cal, spec))
    print(table(results, spec))
    ours = next((r for r in results if r.role == "ours"), None)
    if a.json:
        doc = {"spec": asdict(spec), "calibration": asdict(cal), "max_replicas": spec.max_replicas,
               "pace": EMULATED_PACE if spec.emulate else None,
               "results": [asdict(r) for r in results],
               "ours_vs": [compare(ours, r) for r in results if not r.role.startswith("ours")] if ours else [],
               "serve_frontier": serve_frontier(results),
               "runs": [{"policy": r.policy, "autoscaling": r.autoscaling, "deploy_s": r.deploy_s,
                         "scaling_log": r.scaling_log, "timeline": [asdict(s) for s in r.samples],
                         "requests": [asdict(o) for o in r.outcomes]} for r in runs]}
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    if a.png:
        plot(runs, results, spec, cal, a.png)
    if any(r.failed + r.unsent for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
