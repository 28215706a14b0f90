"""Seeded workload generator for the routing benchmark: a JSONL trace of token-id requests.

Traffic mix (PCR-Bench defaults, ../shared/ROUTING_NOTES.md (iii), lengths scaled down with the KV pool):
- A (40%) multi-tenant shared system prompts, tenant popularity Zipf(0.8);
- B (35%) multi-turn sessions: each turn's prompt is the previous prompt + its answer + a new message;
  half the sessions start with one shared agent preamble; a turn is released `think_s` after its
  parent finished (closed loop), so a session never outruns its own answers;
- C (10%) bursts of 4-16 siblings sharing a prefix, arriving within 20 ms;
- D (15%) no reuse.
`--hot`: one prefix takes 90% of the requests, the other 10% are D.
`--long-tail`: lengths as production traces have them (LONG_TAIL below): system prompts, turn messages and
no-reuse prompts with a heavy tail up to 32k tokens, contexts up to 34k; pair it with a GPU-sized KV pool
(`--kv-blocks 8192` or more per replica).

Sizing. Load is the arrival rate over the no-cache saturation rate of the fleet (one replica's rate,
measured by running a sample of this very mix through the simulated replica with prefix caching off,
times N). Cache pressure is the time-averaged number of distinct live prefix tokens over the total KV
tokens of all replicas; a block is live from the first request that holds it until the last request
whose prompt reuses it (blocks nobody reuses never count). The number of tenants and the sessions'
think time are scaled until the measured pressure is within 5% of the target (mixed mode only).

    python -m benchmarks.routing.workload --replicas 8 --pressure 0.75 --load 1.0 --out trace.jsonl
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from benchmarks.routing.replica import ReplicaSpec, TimingModel, measure_saturation_rps

# ---------------------------------------------------------------- lengths (tokens): (median, sigma, lo, hi)
SYSTEM_PROMPT = (1200, 0.5, 300, 4000)
QUESTION = (100, 0.6, 20, 600)
OUTPUT = (100, 0.6, 16, 400)
TURN_MESSAGE = (250, 0.8, 50, 1500)     # user or tool message appended per turn (heavy tail)
MEAN_EXTRA_TURNS = 3.0                  # turns = 1 + Geometric(mean 3)
MAX_TURNS = 12
PREAMBLE_TOKENS = 1000                  # one agent preamble shared by half the sessions
BURST_PREFIX = (600, 2400)              # uniform
BURST_SIBLINGS = (4, 16)
BURST_SPREAD_S = 0.020
BURST_OUTPUT = (16, 256)
NO_REUSE_INPUT = (200, 1500)
NO_REUSE_OUTPUT = (30, 300)
HOT_PREFIX_TOKENS = 2000
MAX_CONTEXT = 8192                      # prompt + output; a session ends before it would pass this
FIRST_TOKEN_ID = 3                      # ids below are special in most vocabularies
PRESSURE_TOLERANCE = 0.05
RATE_TOLERANCE = 0.03
#: --long-tail: (median, sigma, lo, hi) with sigma 1.0-1.2 (p99 ~10-15x the median), capped at 32k tokens
LONG_TAIL = {"SYSTEM_PROMPT": (1500, 1.1, 300, 32000), "QUESTION": (150, 0.8, 20, 2000),
             "OUTPUT": (150, 0.8, 16, 1000), "TURN_MESSAGE": (300, 1.2, 50, 16000),
             "NO_REUSE_INPUT": (600, 1.2, 100, 32000), "BURST_PREFIX": (600, 8000), "MAX_CONTEXT": 34000,
             "PREAMBLE_TOKENS": 2000}
DEFAULT_LENGTHS = {"SYSTEM_PROMPT": SYSTEM_PROMPT, "QUESTION": QUESTION, "OUTPUT": OUTPUT,
                   "TURN_MESSAGE": TURN_MESSAGE, "NO_REUSE_INPUT": None, "BURST_PREFIX": BURST_PREFIX,
                   "MAX_CONTEXT": MAX_CONTEXT, "PREAMBLE_TOKENS": PREAMBLE_TOKENS}
CALIBRATION_REQUESTS = 200
MAX_SIZING_ROUNDS = 10
MAX_CALIBRATION_ROUNDS = 4
SATURATION_TOLERANCE = 0.03


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    num_replicas: int = 8
    pressure: float = 0.75
    load: float = 1.0
    hot: bool = False
    seed: int = 0
    requests_per_replica: int = 300
    warmup_fraction: float = 0.25       # metrics skip requests arriving before this fraction of the trace
    shares: tuple[float, float, float, float] = (0.40, 0.35, 0.10, 0.15)    # A, B, C, D
    zipf_alpha: float = 0.8
    hot_share: float = 0.9
    vocab_size: int = 32000
    long_tail: bool = False

    def lengths(self) -> dict:
        return LONG_TAIL if self.long_tail else DEFAULT_LENGTHS


@dataclass(slots=True)
class TraceRequest:
    req_id: str
    arrival_s: float                    # release time; for a session turn, its nominal (earliest) time
    component: str                      # "A" | "B" | "C" | "D" | "hot"
    group: str                          # prefix group: tenant, session, burst ("" for no reuse)
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    parent_id: str | None = None        # the previous turn: released think_s after it finished
    think_s: float = 0.0


@dataclass(slots=True)
class TraceMeta:
    spec: WorkloadSpec
    replica: ReplicaSpec
    saturation_rps_per_replica: float
    arrival_rate_rps: float
    duration_s: float
    warmup_s: float
    num_tenants: int
    think_mean_s: float
    measured_pressure: float
    measured_load: float
    num_requests: int = 0
    component_counts: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class Trace:
    meta: TraceMeta
    requests: list[TraceRequest]


# ================================================================== generation
@dataclass(slots=True)
class _Knobs:
    rate_rps: float
    duration_s: float
    num_tenants: int
    think_mean_s: float
    #: session starts per second x mean turns / B's request rate: sessions cut short by MAX_TURNS,
    #: MAX_CONTEXT or the trace end make fewer turns than the mean, so sizing raises this above 1
    session_rate_scale: float = 1.0


class _Gen:
    """One pass of generation with fixed knobs.

    Every tenant, session and burst draws from its own seeded stream and arrival times from their own, so
    a change of one knob (more tenants, longer thinking) moves the trace smoothly instead of reshuffling it.
    """

    _A, _B, _C, _D, _HOT, _SHARED, _TIMES = range(1, 8)

    def __init__(self, spec: WorkloadSpec, knobs: _Knobs, timing: TimingModel):
        self.spec, self.k, self.timing = spec, knobs, timing
        self.L = spec.lengths()
        self.out: list[TraceRequest] = []

    def rng(self, *key: int) -> np.random.Generator:
        return np.random.default_rng([self.spec.seed, *key])

    def tokens(self, rng: np.random.Generator, n: int) -> list[int]:
        return rng.integers(FIRST_TOKEN_ID, self.spec.vocab_size, n).tolist()

    @staticmethod
    def lognormal(rng: np.random.Generator, dist: tuple[float, float, int, int]) -> int:
        median, sigma, lo, hi = dist
        return int(np.clip(round(median * np.exp(sigma * rng.standard_normal())), lo, hi))

    def arrivals(self, component: int, rate: float, start: float = 0.0) -> np.ndarray:
        """A Poisson process on [start, T] given its count (round(rate x span): no count noise in the
        load), as normalized sums of unit exponentials: a rate change rescales the same draws."""
        span = self.k.duration_s - start
        n = int(round(rate * span)) if rate > 0 else 0
        gaps = self.rng(self._TIMES, component).exponential(1.0, n + 1)
        return start + span * np.cumsum(gaps)[:n] / gaps.sum()

    def run(self) -> list[TraceRequest]:
        s, rate = self.spec, self.k.rate_rps
        if s.hot:
            self.hot(rate * s.hot_share)
            self.no_reuse(rate * (1 - s.hot_share))
        else:
            a, b, c, d = s.shares
            self.tenants(rate * a)
            self.sessions(rate * b)
            self.bursts(rate * c)
            self.no_reuse(rate * d)
        self.out.sort(key=lambda r: (r.arrival_s, r.req_id))
        return self.out

    def tenants(self, rate: float) -> None:
        g = self.k.num_tenants
        systems = []
        for k in range(g):
            rng = self.rng(self._A, 0, k)
            systems.append(self.tokens(rng, self.lognormal(rng, self.L["SYSTEM_PROMPT"])))
        weights = 1.0 / np.arange(1, g + 1) ** self.spec.zipf_alpha
        times = self.arrivals(self._A, rate)
        rng = self.rng(self._A, 1)
        picks = rng.choice(g, size=len(times), p=weights / weights.sum())
        for i, (t, k) in enumerate(zip(times, picks)):
            prompt = systems[k] + self.tokens(rng, self.lognormal(rng, self.L["QUESTION"]))
            self.out.append(TraceRequest(f"A{i:06d}", float(t), "A", f"tenant{k}", prompt,
                                         self.tokens(rng, self.lognormal(rng, self.L["OUTPUT"]))))

    def sessions(self, rate: float) -> None:
        """Sessions start over [-lifetime, T] so the trace opens in steady state; turns before 0 are
        dropped (the first kept turn arrives with its history, as a resumed conversation does)."""
        think = self.k.think_mean_s
        mean_turns = 1 + MEAN_EXTRA_TURNS
        L = self.L
        lifetime = mean_turns * (think + self.nominal_latency_s(L["TURN_MESSAGE"][0], L["OUTPUT"][0]))
        preamble = self.tokens(self.rng(self._SHARED, 0), L["PREAMBLE_TOKENS"])
        starts = self.arrivals(self._B, rate * self.k.session_rate_scale / mean_turns, start=-lifetime)
        for sid, t in enumerate(starts):
            rng = self.rng(self._B, sid)
            num_turns = min(MAX_TURNS, int(rng.geometric(1 / (1 + MEAN_EXTRA_TURNS))))
            history = list(preamble) if rng.random() < 0.5 else []
            parent = None
            for turn in range(num_turns):
                message = self.tokens(rng, self.lognormal(rng, L["TURN_MESSAGE"]))
                output = self.tokens(rng, self.lognormal(rng, L["OUTPUT"]))
                prompt = history + message
                if len(prompt) + len(output) > L["MAX_CONTEXT"]:
                    break
                think_s = think * float(rng.exponential(1.0)) if turn else 0.0
                t = t + think_s
                if t > self.k.duration_s:
                    break
                req_id = f"B{sid:05d}t{turn:02d}"
                if t >= 0:
                    self.out.append(TraceRequest(req_id, float(t), "B", f"session{sid}", prompt, output,
                                                 parent_id=parent, think_s=think_s if parent else 0.0))
                    parent = req_id
                history = prompt + output
                t += self.nominal_latency_s(len(message), len(output))

    def bursts(self, rate: float) -> None:
        lo, hi = BURST_SIBLINGS
        for b, t in enumerate(self.arrivals(self._C, rate / ((lo + hi) / 2))):
            rng = self.rng(self._C, b)
            prefix = self.tokens(rng, int(rng.integers(*self.L["BURST_PREFIX"])))
            for k in range(int(rng.integers(lo, hi + 1))):
                prompt = prefix + self.tokens(rng, int(rng.integers(20, 200)))
                self.out.append(TraceRequest(f"C{b:05d}s{k:02d}", float(t + rng.uniform(0, BURST_SPREAD_S)), "C",
                                             f"burst{b}", prompt, self.tokens(rng, int(rng.integers(*BURST_OUTPUT)))))

    def no_reuse(self, rate: float) -> None:
        rng = self.rng(self._D)
        tail = self.L["NO_REUSE_INPUT"]
        for i, t in enumerate(self.arrivals(self._D, rate)):
            n = self.lognormal(rng, tail) if tail else int(rng.integers(*NO_REUSE_INPUT))
            self.out.append(TraceRequest(f"D{i:06d}", float(t), "D", "", self.tokens(rng, n),
                                         self.tokens(rng, int(rng.integers(*NO_REUSE_OUTPUT)))))

    def hot(self, rate: float) -> None:
        rng = self.rng(self._HOT)
        prefix = self.tokens(self.rng(self._SHARED, 1), HOT_PREFIX_TOKENS)
        for i, t in enumerate(self.arrivals(self._HOT, rate)):
            prompt = prefix + self.tokens(rng, self.lognormal(rng, self.L["QUESTION"]))
            self.out.append(TraceRequest(f"H{i:06d}", float(t), "hot", "hot", prompt,
                                         self.tokens(rng, self.lognormal(rng, self.L["OUTPUT"]))))

    def nominal_latency_s(self, new_tokens: float, output_tokens: float) -> float:
        """An unloaded replica's end-to-end time (history cached): for session turns' nominal arrivals."""
        tm = self.timing
        return new_tokens * tm.prefill_per_token_s + output_tokens * tm.step_base_s * 1.5


def measure_pressure(requests: list[TraceRequest], block_size: int, total_kv_tokens: int,
                     window: tuple[float, float]) -> dict[str, float]:
    """Time-averaged distinct live prefix tokens over `window` divided by `total_kv_tokens`, per component
    (a block counts for the component of the first request holding it); the sum is the cache pressure.

    A full block is live from the arrival of the first request holding it (prompt or answer) until the
    arrival of the last request whose prompt contains it; blocks no later prompt reuses never count.
    """
    first: dict[int, tuple[float, str]] = {}
    last: dict[int, float] = {}
    bs = block_size
    weights = np.random.default_rng(0).integers(1, 1 << 62, bs, dtype=np.int64)
    for r in sorted(requests, key=lambda r: r.arrival_s):
        toks = r.prompt_token_ids + r.output_token_ids
        num_blocks = len(toks) // bs
        num_prompt_blocks = len(r.prompt_token_ids) // bs
        # a 64-bit content key per block (wrapping arithmetic), chained so equal keys mean equal prefixes
        content = (np.asarray(toks[:num_blocks * bs], dtype=np.int64).reshape(num_blocks, bs) * weights).sum(1)
        key = 0
        for i, c in enumerate(content.tolist()):
            key = hash((key, c))
            if key not in first:
                first[key] = (r.arrival_s, r.component)
            elif i < num_prompt_blocks:
                last[key] = r.arrival_s
    w0, w1 = window
    out: dict[str, float] = {}
    for k, t1 in last.items():
        t0, component = first[k]
        live = min(t1, w1) - max(t0, w0)
        if live > 0:
            out[component] = out.get(component, 0.0) + live
    scale = bs / (w1 - w0) / total_kv_tokens
    return {c: v * scale for c, v in sorted(out.items())}


def measure_load(requests: list[TraceRequest], window: tuple[float, float], fleet_saturation_rps: float) -> float:
    w0, w1 = window
    n = sum(1 for r in requests if w0 <= r.arrival_s < w1)
    return n / (w1 - w0) / fleet_saturation_rps


def _initial_knobs(spec: WorkloadSpec, replica: ReplicaSpec, rate: float, duration: float) -> _Knobs:
    """Analytic first guess: half the working set in tenants' system prompts, half in live sessions."""
    working_set = spec.pressure * spec.num_replicas * replica.num_kv_tokens
    L = spec.lengths()
    tenants = max(1, round(0.5 * working_set / L["SYSTEM_PROMPT"][0] * 1.5))   # some tenants are never reused
    live_sessions = 0.5 * working_set / (L["PREAMBLE_TOKENS"] / 2 + 2 * (L["TURN_MESSAGE"][0] + L["OUTPUT"][0]))
    think = max(0.2, live_sessions / max(rate * spec.shares[1], 1e-9))
    return _Knobs(rate, duration, tenants, think)


def generate(spec: WorkloadSpec, replica: ReplicaSpec = ReplicaSpec(), timing: TimingModel = TimingModel(),
             progress=None) -> Trace:
    """Build the trace: calibrate the saturation rate, then size tenants and think time to the pressure."""
    say = progress or (lambda msg: None)
    total = spec.requests_per_replica * spec.num_replicas
    total_kv = spec.num_replicas * replica.num_kv_tokens
    guess = 3.0 * spec.num_replicas
    requests = _Gen(spec, _initial_knobs(spec, replica, guess, total / guess), timing).run()
    sat = None
    for _ in range(MAX_CALIBRATION_ROUNDS):
        # the mix's lengths (session histories) move with the sizing, so calibrate on the sized trace
        step = max(1, len(requests) // CALIBRATION_REQUESTS)
        new_sat = measure_saturation_rps([(r.prompt_token_ids, r.output_token_ids) for r in requests[::step]],
                                         replica, timing)
        say(f"calibrated: no-cache saturation {new_sat:.2f} req/s per replica")
        if sat is not None and abs(new_sat / sat - 1) <= SATURATION_TOLERANCE:
            break
        sat = new_sat
        rate = spec.load * spec.num_replicas * sat
        duration = total / rate
        window = (spec.warmup_fraction * duration, duration)
        knobs = replace(_initial_knobs(spec, replica, rate, duration), rate_rps=rate, duration_s=duration)
        requests, parts = _size(spec, knobs, timing, window, total_kv, replica.block_size, say)
    pressure = sum(parts.values())
    if not spec.hot and abs(pressure / spec.pressure - 1) > PRESSURE_TOLERANCE:
        say(f"warning: pressure {pressure:.3f} is off its target {spec.pressure}: too few requests for this "
            "working set (raise --requests-per-replica)")
    counts: dict[str, int] = {}
    for r in requests:
        counts[r.component] = counts.get(r.component, 0) + 1
    meta = TraceMeta(spec, replica, sat, rate, duration, window[0], knobs.num_tenants, knobs.think_mean_s,
                     pressure, measure_load(requests, window, spec.num_replicas * sat), len(requests), counts)
    return Trace(meta, requests)


def _size(spec: WorkloadSpec, knobs: _Knobs, timing: TimingModel, window: tuple[float, float], total_kv: int,
          block_size: int, say) -> tuple[list[TraceRequest], dict[str, float]]:
    """Scale the tenant count (A) and the think time (B) until the pressure is on target; `knobs` ends
    at the returned trace's values.

    A holds its share of what A and B must hold; B fills the rest. A knob that stops paying (more
    tenants, each reused less; longer thinking, turns falling past the trace end) is frozen where it was.
    """
    share_a = spec.shares[0] / (spec.shares[0] + spec.shares[1])
    frozen = {"A": spec.hot, "B": spec.hot}
    prev: tuple[_Knobs, dict[str, float]] | None = None
    best = None
    for attempt in range(MAX_SIZING_ROUNDS):
        requests = _Gen(spec, knobs, timing).run()
        parts = measure_pressure(requests, block_size, total_kv, window)
        total = sum(parts.values())
        say(f"sizing {attempt}: {knobs.num_tenants} tenants, think {knobs.think_mean_s:.2f} s -> pressure "
            f"{total:.3f} (target {spec.pressure}; " + ", ".join(f"{c} {v:.3f}" for c, v in parts.items()) + ")")
        b_rate = sum(1 for r in requests if r.component == "B" and window[0] <= r.arrival_s < window[1])
        b_rate /= window[1] - window[0]
        b_target = spec.shares[1] * knobs.rate_rps
        b_ok = spec.hot or abs(b_rate / b_target - 1) <= RATE_TOLERANCE
        # how far off, in tolerances (< 1 on both: done)
        miss = 0.0 if spec.hot else max(abs(total / spec.pressure - 1) / PRESSURE_TOLERANCE,
                                        abs(b_rate / b_target - 1) / RATE_TOLERANCE)
        if best is None or miss < best[0]:
            best = (miss, requests, parts, replace(knobs))
        if miss <= 1.0:
            break
        if not b_ok:
            knobs.session_rate_scale *= b_target / max(b_rate, 1e-9)
        pa, pb = parts.get("A", 0.0), parts.get("B", 0.0)
        if prev is not None:     # freeze a knob whose last move did not pay
            (pk, pp) = prev
            if knobs.num_tenants > pk.num_tenants and pa < pp.get("A", 0.0) * 1.02:
                frozen["A"], knobs.num_tenants, pa = True, pk.num_tenants, pp.get("A", 0.0)
            if knobs.think_mean_s > pk.think_mean_s and pb < pp.get("B", 0.0) * 1.02:
                frozen["B"], knobs.think_mean_s, pb = True, pk.think_mean_s, pp.get("B", 0.0)
        if frozen["A"] and frozen["B"] and b_ok:
            break
        prev = (replace(knobs), parts)
        other = total - pa - pb
        want_a = share_a * (spec.pressure - other) if not frozen["B"] else spec.pressure - other - pb
        want_b = spec.pressure - other - (want_a if not frozen["A"] else pa)
        if not frozen["A"]:
            knobs.num_tenants = max(1, round(knobs.num_tenants * _clamp(want_a / max(pa, 1e-6))))
        if not frozen["B"]:
            knobs.think_mean_s = max(0.05, knobs.think_mean_s * _clamp(want_b / max(pb, 1e-6)))
    _, requests, parts, final = best
    knobs.num_tenants, knobs.think_mean_s = final.num_tenants, final.think_mean_s
    knobs.session_rate_scale = final.session_rate_scale
    return requests, parts


def _clamp(ratio: float) -> float:
    return min(3.0, max(1 / 3, ratio))


# ================================================================== JSONL
def _open(path: Path, mode: str):
    return gzip.open(path, mode + "t") if path.suffix == ".gz" else open(path, mode)


def write_trace(trace: Trace, path: str | Path) -> None:
    """First line: {"meta": ...}; then one request per line (token ids, arrival, output)."""
    path = Path(path)
    with _open(path, "w") as f:
        f.write(json.dumps({"meta": asdict(trace.meta)}) + "\n")
        for r in trace.requests:
            f.write(json.dumps(asdict(r), separators=(",", ":")) + "\n")


def read_trace(path: str | Path) -> Trace:
    path = Path(path)
    with _open(path, "r") as f:
        m = json.loads(f.readline())["meta"]
        m["spec"] = WorkloadSpec(**{**m["spec"], "shares": tuple(m["spec"]["shares"])})
        m["replica"] = ReplicaSpec(**m["replica"])
        requests = [TraceRequest(**json.loads(line)) for line in f if line.strip()]
    return Trace(TraceMeta(**m), requests)


def describe(meta: TraceMeta) -> str:
    s = meta.spec
    mode = "hot prefix" if s.hot else "mixed"
    return (f"{mode} trace: {meta.num_requests} requests over {meta.duration_s:.1f} s "
            f"({meta.arrival_rate_rps:.1f} req/s), {s.num_replicas} replicas x {meta.replica.num_kv_tokens} KV tokens; "
            f"pressure {meta.measured_pressure:.2f} (target {s.pressure}), load {meta.measured_load:.2f} "
            f"(target {s.load}) of {meta.saturation_rps_per_replica:.2f} req/s/replica no-cache saturation; "
            f"components {meta.component_counts}")


def add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--pressure", type=float, default=0.75)
    p.add_argument("--load", type=float, default=1.0)
    p.add_argument("--hot", action="store_true", help="one prefix takes 90%% of the requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--requests-per-replica", type=int, default=300)
    p.add_argument("--long-tail", action="store_true", help="production-like lengths: prompts up to 32k tokens")
    p.add_argument("--kv-blocks", type=int, default=None, help="KV blocks of 16 tokens per replica (default "
                   "1024; a GPU holds 8k-25k)")


def spec_from_args(a: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(num_replicas=a.replicas, pressure=a.pressure, load=a.load, hot=a.hot, seed=a.seed,
                        requests_per_replica=a.requests_per_replica, long_tail=getattr(a, "long_tail", False))


def replica_from_args(a: argparse.Namespace) -> ReplicaSpec:
    """The replica each simulated engine runs: KV pool from --kv-blocks; long prompts need a longer
    max_model_len."""
    blocks = getattr(a, "kv_blocks", None)
    base = ReplicaSpec()
    tokens = blocks * base.block_size if blocks else base.num_kv_tokens
    max_len = max(base.max_model_len, LONG_TAIL["MAX_CONTEXT"] + 1024) if getattr(a, "long_tail", False) \
        else base.max_model_len
    return replace(base, num_kv_tokens=tokens, max_model_len=min(max_len, tokens))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_spec_args(p)
    p.add_argument("--out", required=True, help="trace path (.jsonl or .jsonl.gz)")
    a = p.parse_args()
    trace = generate(spec_from_args(a), replica_from_args(a),
                     progress=lambda m: print(m, file=sys.stderr, flush=True))
    write_trace(trace, a.out)
    print(describe(trace.meta))


if __name__ == "__main__":
    main()
