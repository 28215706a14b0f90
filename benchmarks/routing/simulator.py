"""Discrete-event simulation of N replicas (the real Scheduler + KVCacheManager, a timing-model runner)
behind each router, all on the same trace; prints a table and writes optional JSON and a PNG.

Time advances from event to event: a request's release (its trace arrival; a session turn think_s after
its parent finished), a replica's step end (duration from replica.TimingModel), and, per replica and
staggered, the two periodic feeds the real shell has: the KV events pulled every --events-period seconds
(routing.kv_events_period_s: 0.25 s, 0.5 s recommended at 128 replicas) and the stats snapshot Serve
delivers every --stats-period seconds (request_routing_stats_period_s: 1 s). Routers that read replica
state therefore see it up to one period stale. A router's
decision is timed around its route() call (for Ray's router: choose_replicas, the shortest-queue pick
and its on_request_routed tree insert) with the thread's CPU clock: the work the decision costs, which
other processes on a shared machine cannot inflate (wall time would count their time slices too).

    python -m benchmarks.routing.simulator --replicas 8 --pressure 0.75 --load 1.0
    python -m benchmarks.routing.simulator --hot --replicas 8 --json out.json --png out.png
    python -m benchmarks.routing.simulator --suite headline --out-dir bench-out
    python -m benchmarks.routing.simulator --suite fleet --out-dir bench-out [--only 1,5]
"""
from __future__ import annotations

import argparse
import gc
import heapq
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.routing import report
from benchmarks.routing.bounds import (footprint_partition, pinned_lru_hit_rate,
                                       shared_cache_hit_rate, ttft_floor_s)
from benchmarks.routing.replica import SimReplica, TimingModel
from benchmarks.routing.routers import (ClusterView, PinnedOracle, PowerOfTwo, RayPrefixAffinity,
                                        RoundRobin, SharedCacheOracle, SimRequest, SimRouter, TokenText)
from benchmarks.routing.workload import (Trace, add_spec_args, describe, generate, read_trace,
                                         replica_from_args, spec_from_args)
from affinity_serve.engine.hashing import BlockHash, hash_block_chain

_STEP_END, _RELEASE, _EVENTS, _STATS = 0, 1, 2, 3
RAY_IMBALANCED_THRESHOLD = 16       # a quarter of max_num_seqs; Ray's docs example uses 10-20


@dataclass(frozen=True, slots=True)
class FeedPeriods:
    """How stale a router's view of the replicas is allowed to get (the real shell's two feeds)."""

    events_s: float
    stats_s: float = 1.0

    @classmethod
    def default(cls, num_replicas: int) -> FeedPeriods:
        """The shell's defaults: KV events every 0.25 s, 0.5 s from 128 replicas (README, Routing), and
        Serve's routing-stats period of 1 s."""
        return cls(0.25 if num_replicas < 128 else 0.5, 1.0)


@dataclass(slots=True)
class PreparedTrace:
    """A trace plus what every run shares: block hashes (prompt, and prompt + answer) and the bounds."""

    trace: Trace
    prompt_hashes: list[list[BlockHash]]
    full_hashes: list[list[BlockHash]]
    measured: list[bool]              # counted in the metrics (arrived after the warm-up)
    partition: dict[str, int]
    shared_bound: float
    pinned_bound: float
    ttft_floor: list[float] = field(default_factory=list)   # per measured request (bounds.ttft_floor_s)


def prepare(trace: Trace) -> PreparedTrace:
    bs = trace.meta.replica.block_size
    prompt_hashes, full_hashes = [], []
    for r in trace.requests:
        p = hash_block_chain(r.prompt_token_ids, bs)
        n = len(r.prompt_token_ids) // bs
        rest = hash_block_chain(r.prompt_token_ids + r.output_token_ids, bs, None, p[-1] if p else None, n)
        prompt_hashes.append(p)
        full_hashes.append(p + rest)
    measured = [r.arrival_s >= trace.meta.warmup_s for r in trace.requests]
    n_rep = trace.meta.spec.num_replicas
    partition = footprint_partition(trace.requests, full_hashes, n_rep)
    shared = shared_cache_hit_rate(trace.requests, full_hashes, bs, measured)
    pinned = pinned_lru_hit_rate(trace.requests, full_hashes, bs, measured, partition,
                                 trace.meta.replica.num_blocks - 1)
    tm = TimingModel()
    floor = ttft_floor_s(trace.requests, full_hashes, bs, measured, tm.step_base_s, tm.prefill_per_token_s,
                         trace.meta.replica.max_num_batched_tokens)
    return PreparedTrace(trace, prompt_hashes, full_hashes, measured, partition, shared, pinned, floor)


@dataclass(slots=True)
class RunResult:
    router: str
    num_replicas: int
    hit_rate: float
    ttft_p50_s: float
    ttft_p99_s: float
    e2e_mean_s: float
    max_over_mean_load: float
    decision_p50_ms: float
    decision_p99_ms: float
    num_requests: int
    num_measured: int
    sim_wall_s: float
    ttft_s: list[float] = field(default_factory=list)        # measured requests, for the CDF
    requests_per_replica: list[int] = field(default_factory=list)
    router_summary: dict = field(default_factory=dict)       # the router's own counters, if it has any


class _EventQueue:
    """Time-ordered events; ties in the order they were pushed (so a run is deterministic)."""

    def __init__(self):
        self._heap: list[tuple[float, int, int, int]] = []
        self._seq = 0

    def push(self, t: float, kind: int, arg: int) -> None:
        heapq.heappush(self._heap, (t, self._seq, kind, arg))
        self._seq += 1

    def pop(self) -> tuple[float, int, int]:
        t, _, kind, arg = heapq.heappop(self._heap)
        return t, kind, arg


class _Record:
    """Per-request times (s, simulated), cached tokens and replica; decision CPU times."""

    def __init__(self, n: int):
        self.release = np.full(n, np.nan)
        self.first = np.full(n, np.nan)
        self.finish = np.full(n, np.nan)
        self.cached = np.zeros(n, dtype=np.int64)
        self.kv_wait = np.zeros(n)            # seconds each waited for KV room before its first token
        self.replica = np.full(n, -1, dtype=np.int64)
        self.decision_s: list[float] = []
        self.num_finished = 0


class Simulation:
    """One router over one trace. `run()` returns the metrics; `replicas` stay for inspection."""

    def __init__(self, prepared: PreparedTrace, router: SimRouter, *, timing: TimingModel = TimingModel(),
                 periods: FeedPeriods | None = None, seed: int = 0, progress=None):
        self.p = prepared
        self.router = router
        self.timing = timing
        self.seed = seed
        self.say = progress or (lambda msg: None)
        meta = prepared.trace.meta
        n = meta.spec.num_replicas
        self.periods = periods or FeedPeriods.default(n)
        shared: set[BlockHash] | None = set() if router.shared_cache else None
        self.replicas = [SimReplica(i, meta.replica, timing, shared_cache=shared) for i in range(n)]
        self.cluster = ClusterView(n)

    def run(self) -> RunResult:
        """Replay the whole trace; raises AssertionError if a request or a KV block is left behind."""
        reqs = self.p.trace.requests
        self.index = {r.req_id: i for i, r in enumerate(reqs)}
        self.children: dict[str, list[int]] = {}
        self.events = _EventQueue()
        for i, r in enumerate(reqs):
            if r.parent_id is None:
                self.events.push(r.arrival_s, _RELEASE, i)
            else:
                self.children.setdefault(r.parent_id, []).append(i)
        n_rep = len(self.replicas)
        self.period = {_EVENTS: self.periods.events_s, _STATS: self.periods.stats_s}
        for k in range(n_rep):
            for kind, period in self.period.items():
                self.events.push(period * (k + 1) / n_rep, kind, k)     # staggered
        self.router.setup(self.cluster, self.seed)
        self.rec = _Record(len(reqs))
        wall0 = time.perf_counter()
        gc_was = gc.isenabled()
        gc.disable()         # millions of long-lived ints (token ids); collections would only cost time
        try:
            self._loop(wall0)
        finally:
            if gc_was:
                gc.enable()
        self._check_conservation()
        return self._metrics(time.perf_counter() - wall0)

    def _loop(self, wall0: float) -> None:
        n = len(self.p.trace.requests)
        next_report = wall0 + 10.0
        handlers = {_STEP_END: self._on_step_end, _RELEASE: self._on_release,
                    _EVENTS: self._on_feed_events, _STATS: self._on_feed_stats}
        while self.rec.num_finished < n:
            now, kind, arg = self.events.pop()
            handlers[kind](arg, now)
            if time.perf_counter() > next_report:
                next_report += 10.0
                self.say(f"  {self.router.name}: {self.rec.num_finished}/{n} finished, sim t={now:.1f} s, "
                         f"wall {time.perf_counter() - wall0:.0f} s")

    def _on_release(self, i: int, now: float) -> None:
        r, rec = self.p.trace.requests[i], self.rec
        rec.release[i] = now
        hashes = self.p.prompt_hashes[i]
        req = SimRequest(r.req_id, r.prompt_token_ids, hashes, len(r.output_token_ids), r.group)
        t0 = time.thread_time()
        k = self.router.route(req, now)
        rec.decision_s.append(time.thread_time() - t0)
        rec.replica[i] = k
        self.cluster.ongoing[k] += 1
        rep = self.replicas[k]
        rep.add_request(r.req_id, r.prompt_token_ids, r.output_token_ids, hashes)
        if not rep.is_busy:
            self._start_step(rep, now)

    def _on_step_end(self, k: int, now: float) -> None:
        rep, rec, router = self.replicas[k], self.rec, self.router
        res = rep.end_step()
        for req_id in res.first_token_ids:
            i = self.index[req_id]
            rec.first[i] = now
            rec.cached[i] = res.num_cached_tokens[req_id]
            rec.kv_wait[i] = res.kv_wait_s[req_id]
            router.on_first_token(req_id, k, int(rec.cached[i]), now, float(rec.kv_wait[i]))
        for req_id in res.finished_ids:
            rec.finish[self.index[req_id]] = now
            rec.num_finished += 1
            self.cluster.ongoing[k] -= 1
            router.on_finished(req_id, k, now)
            for c in self.children.get(req_id, ()):      # the session's next turn, after thinking
                self.events.push(now + self.p.trace.requests[c].think_s, _RELEASE, c)
        self._start_step(rep, now)

    def _on_feed_events(self, k: int, now: float) -> None:
        self.router.on_kv_events(k, self.replicas[k], now)
        self.events.push(now + self.period[_EVENTS], _EVENTS, k)

    def _on_feed_stats(self, k: int, now: float) -> None:
        self.router.on_stats(k, self.replicas[k], now)
        self.events.push(now + self.period[_STATS], _STATS, k)

    def _start_step(self, rep: SimReplica, now: float) -> None:
        dt = rep.start_step(now)
        if dt is not None:
            self.events.push(now + dt, _STEP_END, rep.index)

    def _check_conservation(self) -> None:
        for rep in self.replicas:
            if rep.has_work or rep.num_held_blocks():
                raise AssertionError(f"replica {rep.index} ended with {rep.scheduler.num_unfinished_requests} "
                                     f"requests and {rep.num_held_blocks()} held KV blocks")
        if any(self.cluster.ongoing):
            raise AssertionError(f"requests left in flight: {self.cluster.ongoing}")

    def _metrics(self, wall_s: float) -> RunResult:
        reqs, rec = self.p.trace.requests, self.rec
        m = np.array(self.p.measured)
        prompt = np.array([len(r.prompt_token_ids) for r in reqs])
        release, first, finish, cached = rec.release, rec.first, rec.finish, rec.cached
        ttft = (first - release)[m]
        e2e = (finish - release)[m]
        per_rep = np.bincount(rec.replica[m], minlength=len(self.replicas))
        dec_ms = np.array(rec.decision_s) * 1e3
        return RunResult(
            router=self.router.name, num_replicas=len(self.replicas),
            hit_rate=float(cached[m].sum() / prompt[m].sum()),
            ttft_p50_s=float(np.percentile(ttft, 50)), ttft_p99_s=float(np.percentile(ttft, 99)),
            e2e_mean_s=float(e2e.mean()), max_over_mean_load=float(per_rep.max() / per_rep.mean()),
            decision_p50_ms=float(np.percentile(dec_ms, 50)), decision_p99_ms=float(np.percentile(dec_ms, 99)),
            num_requests=len(reqs), num_measured=int(m.sum()), sim_wall_s=wall_s,
            ttft_s=sorted(float(x) for x in ttft), requests_per_replica=per_rep.tolist(),
            router_summary=self.router.summary() if hasattr(self.router, "summary") else {})


# ================================================================== routers by name
ROUTER_NAMES = ("round-robin", "power-of-two", "ray", "ray-threshold", "llmd", "llmd-2s", "sglang", "dynamo",
                "ours", "shared", "pinned")
FIELD = ("llmd", "llmd-2s", "sglang", "dynamo")


def ours_available() -> bool:
    try:
        import affinity_serve.app.routing.api  # noqa: F401
    except ImportError:
        return False
    return True


def make_router(name: str, prepared: PreparedTrace, text: TokenText) -> SimRouter:
    if name == "round-robin":
        return RoundRobin()
    if name == "power-of-two":
        return PowerOfTwo()
    if name == "ray":
        return RayPrefixAffinity(float("inf"), text)
    if name == "ray-threshold":
        return RayPrefixAffinity(RAY_IMBALANCED_THRESHOLD, text)
    if name == "shared":
        return SharedCacheOracle()
    if name == "pinned":
        return PinnedOracle(prepared.partition)
    if name == "ours":
        from benchmarks.routing.ours import OursRouter
        return OursRouter(prepared.trace.meta.replica)
    if name.startswith("ours:"):
        return _ours_variant(name, prepared)
    if name in FIELD:
        from benchmarks.routing.field import DynamoKV, LlmdPrecise, SglangCacheAware
        replica = prepared.trace.meta.replica
        peak = 1.0 / TimingModel().prefill_per_token_s
        if name == "llmd":
            return LlmdPrecise(replica, peak, 18.0)
        if name == "llmd-2s":
            return LlmdPrecise(replica, peak, 2.0)
        if name == "sglang":
            return SglangCacheAware(replica)
        return DynamoKV(replica)
    raise ValueError(f"unknown router {name!r}; one of {', '.join(ROUTER_NAMES)}")


def _ours_variant(name: str, prepared: PreparedTrace) -> SimRouter:
    """`ours:KNOB=VALUE[:KNOB=VALUE...]`: our router with these `AffinityConfig` knobs overridden (values as
    JSON), so several settings run on one generated trace."""
    from affinity_serve.app.routing import AffinityConfig
    from benchmarks.routing.ours import OursRouter
    overrides = {}
    for item in name.split(":")[1:]:
        knob, sep, value = item.partition("=")
        if not sep or knob not in AffinityConfig.model_fields:
            raise ValueError(f"router {name!r}: write ours:KNOB=VALUE with KNOB an AffinityConfig field, "
                             f"not {item!r}")
        overrides[knob] = json.loads(value)
    label = ", ".join(f"{k}={v}" for k, v in overrides.items())
    return OursRouter(prepared.trace.meta.replica, AffinityConfig(**overrides),
                      name=f"ours (prefix affinity, {label})")


def default_routers() -> list[str]:
    return [n for n in ROUTER_NAMES if (n != "ours" and n not in FIELD) or ours_available()]


def run_all(trace: Trace, routers: list[str], *, periods: FeedPeriods | None = None, seed: int = 0,
            say=lambda m: None) -> tuple[PreparedTrace, list[RunResult]]:
    t0 = time.perf_counter()
    prepared = prepare(trace)
    say(f"prepared (hashes, bounds) in {time.perf_counter() - t0:.1f} s: shared-cache bound "
        f"{prepared.shared_bound:.3f}, separate-caches bound {prepared.pinned_bound:.3f}")
    text = TokenText(trace.meta.spec.vocab_size)
    results = []
    for name in routers:
        sim = Simulation(prepared, make_router(name, prepared, text), periods=periods, seed=seed,
                         progress=say)
        res = sim.run()
        say(f"  {res.router}: hit {res.hit_rate:.3f}, TTFT p99 {res.ttft_p99_s:.2f} s "
            f"({res.sim_wall_s:.1f} s wall)")
        results.append(res)
    return prepared, results


# ================================================================== CLI
HEADLINE = [  # (replicas, pressure, load, hot prefix, requests per replica)
    (8, 0.75, 1.0, False, 300), (8, 0.75, 1.5, False, 300), (8, 1.5, 1.0, False, 300), (8, 1.5, 1.5, False, 300),
    (8, 0.75, 1.0, True, 300), (8, 0.75, 1.5, True, 300),
    (32, 0.75, 1.0, False, 300), (32, 0.75, 1.5, False, 300), (32, 1.5, 1.0, False, 300),
    (32, 1.5, 1.5, False, 300), (32, 0.75, 1.5, True, 300),
    (128, 0.75, 1.0, False, 150),
]


#: issue 25's harder suite: long-tail prompts (up to 32k tokens), 8,192 KV blocks per replica, the field's
#: strongest routers. (replicas, pressure, load, hot prefix, requests per replica, KV-event period s)
FLEET = [(8, rho, load, False, 600, 0.5) for rho in (0.3, 0.75, 1.5) for load in (0.5, 1.0, 1.5)] + [
    (8, 0.75, 1.0, False, 600, 2.0), (8, 0.75, 1.5, False, 600, 2.0),
    (8, 0.75, 1.0, True, 600, 0.5), (8, 0.75, 1.5, True, 600, 0.5),
    (32, 0.3, 1.5, False, 300, 0.5), (32, 0.75, 1.0, False, 300, 0.5), (32, 0.75, 1.5, False, 300, 0.5),
    (32, 1.5, 1.0, False, 300, 0.5), (32, 0.75, 1.5, True, 300, 0.5),
    (128, 0.75, 1.0, False, 150, 0.5),
]
FLEET_ROUTERS = "power-of-two,ray-threshold,llmd,sglang,dynamo,ours,shared"
FLEET_KV_BLOCKS = 8192


def _run_one(args, spec, say, out_stem: Path | None) -> dict:
    t0 = time.perf_counter()
    trace = (read_trace(args.trace) if getattr(args, "trace", None)
             else generate(spec, replica_from_args(args), progress=say))
    say(f"{describe(trace.meta)} (built in {time.perf_counter() - t0:.1f} s)")
    routers = args.routers.split(",") if args.routers else default_routers()
    periods = FeedPeriods.default(trace.meta.spec.num_replicas)
    periods = FeedPeriods(args.events_period or periods.events_s, args.stats_period or periods.stats_s)
    prepared, results = run_all(trace, routers, periods=periods, seed=args.seed, say=say)
    doc = report.to_json(prepared, results, events_period_s=periods.events_s, stats_period_s=periods.stats_s)
    print(report.table_doc(doc), flush=True)
    if out_stem is not None:
        report.write_json(doc, Path(f"{out_stem}.json"))      # not with_suffix: stems hold dots (l1.5)
        report.plot_doc(doc, Path(f"{out_stem}.png"))
    return doc


def _stem(out: Path, n: int, rho: float, load: float, hot: bool) -> Path:
    return out / (f"n{n}_hot_l{load}" if hot else f"n{n}_p{rho}_l{load}")


def _run_suite(a: argparse.Namespace, say) -> None:
    """Run the headline configurations (or those --only names) one at a time, each to its own JSON and PNG,
    then summarize every configuration whose JSON is in the output folder."""
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    only = {int(k) for k in a.only.split(",")} if a.only else None
    for k, (n, rho, load, hot, rpr) in enumerate(HEADLINE, 1):
        if only is not None and k not in only:
            continue
        say(f"[{k}/{len(HEADLINE)}] {n} replicas, pressure {rho}, load {load}{', hot prefix' if hot else ''}")
        a.replicas, a.pressure, a.load, a.hot, a.requests_per_replica = n, rho, load, hot, rpr
        _run_one(a, spec_from_args(a), say, _stem(out, n, rho, load, hot))
    docs = [json.loads(p.read_text()) for p in (Path(f"{_stem(out, *c[:4])}.json") for c in HEADLINE) if p.exists()]
    for d in docs:
        d["targets"] = report.check_targets(d)      # as this version of the targets reads them
    report.write_json({"runs": docs}, out / "summary.json")
    (out / "summary.md").write_text(report.summary_markdown(docs))
    print(report.headline_markdown(docs) + "\n\n" + report.targets_markdown(docs))


def _fleet_stem(out: Path, n: int, rho: float, load: float, hot: bool, period: float) -> Path:
    return out / (f"fleet_n{n}_hot_l{load}_e{period}" if hot else f"fleet_n{n}_p{rho}_l{load}_e{period}")


def _run_fleet_suite(a: argparse.Namespace, say) -> None:
    """Issue 25's configurations one at a time (each to its own JSON and PNG), then a summary of every one
    whose JSON is in the output folder: ours against every baseline, the bounds and the TTFT floor."""
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    only = {int(k) for k in a.only.split(",")} if a.only else None
    a.long_tail, a.kv_blocks = True, FLEET_KV_BLOCKS
    a.routers = a.routers or FLEET_ROUTERS
    for k, (n, rho, load, hot, rpr, period) in enumerate(FLEET, 1):
        if only is not None and k not in only:
            continue
        say(f"[{k}/{len(FLEET)}] {n} replicas, pressure {rho}, load {load}, events every {period} s"
            f"{', hot prefix' if hot else ''}")
        a.replicas, a.pressure, a.load, a.hot, a.requests_per_replica = n, rho, load, hot, rpr
        a.events_period = period
        stem = _fleet_stem(out, n, rho, load, hot, period)
        if a.resume and Path(f"{stem}.json").exists():
            say(f"  {stem}.json exists: kept (--resume)")
            continue
        _run_one(a, spec_from_args(a), say, stem)
    docs = [json.loads(p.read_text()) for p in (Path(f"{_fleet_stem(out, *c[:4], c[5])}.json") for c in FLEET)
            if p.exists()]
    for d in docs:
        d["targets"] = report.check_targets(d)
    report.write_json({"runs": docs}, out / "fleet_summary.json")
    (out / "fleet_summary.md").write_text(report.fleet_summary_markdown(docs))
    print(report.fleet_markdown(docs) + "\n\n" + report.targets_markdown(docs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_spec_args(p)
    p.add_argument("--trace", help="replay this JSONL trace instead of generating one")
    p.add_argument("--routers", help=f"comma-separated subset of {','.join(ROUTER_NAMES)} (default: all "
                   "available); ours:KNOB=VALUE[:KNOB=VALUE] runs ours with AffinityConfig knobs overridden")
    p.add_argument("--events-period", type=float, help="seconds between a router's KV-event pulls of each "
                   "replica (default 0.25; 0.5 from 128 replicas)")
    p.add_argument("--stats-period", type=float, help="seconds between stats snapshots of each replica (default 1)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--png", help="write the TTFT CDF and hit-rate figure here")
    p.add_argument("--suite", choices=["headline", "fleet"], help="run the headline configurations (short "
                   "prompts, 1k KV blocks, Ray's router as the rival) or the fleet ones (long-tail prompts, 8k "
                   "KV blocks, the field's strongest routers) one at a time")
    p.add_argument("--out-dir", default="benchmarks/routing/results", help="with --suite: JSON, PNG and a summary here")
    p.add_argument("--only", help="with --suite: run only these configurations (1-based, comma-separated)")
    p.add_argument("--resume", action="store_true", help="with --suite fleet: keep configurations whose JSON "
                   "is in the output folder")
    a = p.parse_args()

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if ours_available():
        import benchmarks.routing.ours  # noqa: F401  (load the core now: every run uses this version)
    say(f"source: {report.source_version()}")

    if a.suite == "fleet":
        _run_fleet_suite(a, say)
        return
    if a.suite:
        _run_suite(a, say)
        return
    doc = _run_one(a, spec_from_args(a), say, None)
    if a.json:
        report.write_json(doc, Path(a.json))
    if a.png:
        report.plot_doc(doc, Path(a.png))


if __name__ == "__main__":
    main()
