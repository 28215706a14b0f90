"""Cluster-level benchmark of the node-shared KV store (issue 11): the routing simulator with one store per
node, our router with and without it, on the same trace; prints a table, writes JSON and a PNG.

Each simulated replica runs the real Scheduler and KVCacheManager with the engine's real
`SharedConnectorScheduler` (engine/kv_connector/shared.py: lookups, WAITING_FOR_KV loads, stores of every
computed block, shared-medium KV events). Only the store's bytes and the copies are modelled:
- `NodeStore`: the node's store as a set of block hashes with the real store's capacity and LRU (a read
  refreshes a block; past capacity the least recent tenth goes);
- `SimStoreWorker`: the runner side. A load reads its blocks at issue time (a block evicted before that
  fails the load: the request recomputes, as in the engine) and completes `load_per_token_s` x tokens after
  the replica's previous load (one host link per replica), reported with the first step ending after it; a
  replica with nothing else to run waits for it. Stores happen at once and cost no step time (the engine
  overlaps them on a side stream; see "what the simulation leaves out" in
  docs/benchmarks/kv-connectors.md).
The default load cost, 5 us per token, is the simulated 8B-class model's 128 KiB of KV per token over an
effective 25 GB/s host link: 0.1 x the timing model's 50 us per prefilled token.

    python -m benchmarks.routing.tiers --quick                      # 8 replicas, load 1.0 and 1.5, fewer requests
    python -m benchmarks.routing.tiers --json tiers.json --png tiers.png        # the full run (~10 min here)

`--fleet 5,6 --seeds 0-2` instead runs cells of the fleet suite (benchmarks.routing.simulator's FLEET: long
prompts, 8,192 blocks per replica) with llm-d's precise scorer beside ours, each without and with the store
(llm-d also tier-aware: `LlmdTiered`), and reports ours' TTFT p99 over llm-d's in both (about 50 s a trace).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

from affinity_serve.app.routing import ReplicaInfo
from benchmarks.routing.ours import OursRouter
from benchmarks.routing.replica import ReplicaSpec, SimReplica, TimingModel
from benchmarks.routing.routers import ClusterView, PowerOfTwo, SharedCacheOracle
from benchmarks.routing.simulator import (FLEET, FLEET_KV_BLOCKS, FeedPeriods, PreparedTrace, RunResult, Simulation,
                                         prepare)
from benchmarks.routing.workload import WorkloadSpec, describe, generate, replica_from_args
from affinity_serve.engine.config import SchedulerConfig
from affinity_serve.engine.hashing import BlockHash
from affinity_serve.engine.kv_connector import (KVConnectorMetadata, KVConnectorOutput, KVLayout,
                                 SharedConnectorScheduler)
from affinity_serve.engine.scheduler import Scheduler
from affinity_serve.engine.types import KVCacheSnapshot, ModelRunnerOutput

#: the simulated model's KV layout (8B-class, GQA): 2 x 32 layers x 8 heads x 128 x 2 B = 128 KiB per token
SIM_LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16", element_size=2)
DEFAULT_LOAD_PER_TOKEN_S = 5e-6      # 128 KiB / 25 GB/s


@dataclass(frozen=True, slots=True)
class StoreSpec:
    replicas_per_node: int = 8           # an 8-GPU node
    capacity_x: float = 2.0              # store capacity, in multiples of the node's KV pools together
    load_per_token_s: float = DEFAULT_LOAD_PER_TOKEN_S


class NodeStore:
    """One node's shared store: block hashes with the real store's capacity and LRU policy (the
    `SharedKVStore` surface the connector's scheduler side reads: contains, block_hashes, generation, check_dir,
    close)."""

    def __init__(self, capacity_blocks: int):
        self.capacity_blocks = capacity_blocks
        self.generation = 0         # the real store's count of reopened directories: this one never reopens
        self.low_water = max(0, capacity_blocks - max(1, capacity_blocks // 10))
        self._blocks: OrderedDict[BlockHash, None] = OrderedDict()

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._blocks

    def read(self, block_hash: BlockHash) -> bool:
        if block_hash not in self._blocks:
            return False
        self._blocks.move_to_end(block_hash)
        return True

    def write_many(self, hashes: list[BlockHash]) -> tuple[list[BlockHash], list[BlockHash]]:
        written = [h for h in hashes if h not in self._blocks]
        for h in written:
            self._blocks[h] = None
        evicted: list[BlockHash] = []
        if len(self._blocks) > self.capacity_blocks:
            while len(self._blocks) > self.low_water:
                evicted.append(self._blocks.popitem(last=False)[0])
        return written, evicted

    def block_hashes(self) -> list[BlockHash]:
        return list(self._blocks)

    def check_dir(self) -> None:
        """No directory to lose: nothing to reopen."""

    def close(self) -> None:
        """Nothing outside this process."""


class SimStoreWorker:
    """The runner side: stores at once, loads timed on the replica's own link (see the module docstring)."""

    def __init__(self, store: NodeStore, block_size: int, load_per_token_s: float):
        self.store = store
        self.block_size = block_size
        self.load_per_token_s = load_per_token_s
        self._link_free_at = 0.0
        self._loads: list[tuple[float, str, bool]] = []       # (done at, req_id, ok)
        self._out = KVConnectorOutput()
        self.num_loaded_tokens = 0
        self.num_failed_loads = 0

    def execute(self, meta: KVConnectorMetadata, now: float) -> None:
        for t in meta.stores:
            _, evicted = self.store.write_many(t.block_hashes)
            self._out.finished_stores.append((list(t.block_hashes), True))
            self._out.tier_evicted.extend(evicted)
        for t in meta.loads:
            ok = all([self.store.read(h) for h in t.block_hashes])
            start = max(now, self._link_free_at)
            done = start + len(t.block_hashes) * self.block_size * self.load_per_token_s if ok else now
            self._link_free_at = max(self._link_free_at, done)
            self._loads.append((done, t.req_id, ok))
            if ok:
                self.num_loaded_tokens += len(t.block_hashes) * self.block_size
            else:
                self.num_failed_loads += 1

    def next_done(self) -> float | None:
        return min((d for d, _, _ in self._loads), default=None)

    def poll(self, now: float) -> KVConnectorOutput:
        out, self._out = self._out, KVConnectorOutput()
        keep = []
        for done, req_id, ok in self._loads:
            if done <= now + 1e-12:
                out.finished_loads[req_id] = ok
            else:
                keep.append((done, req_id, ok))
        self._loads = keep
        return out


class StoreReplica(SimReplica):
    """A SimReplica whose scheduler has the engine's SharedConnectorScheduler over its node's store."""

    def __init__(self, index: int, spec: ReplicaSpec, timing: TimingModel, store: NodeStore,
                 load_per_token_s: float):
        super().__init__(index, spec, timing)
        layout = SIM_LAYOUT if SIM_LAYOUT.block_size == spec.block_size else KVLayout(
            32, 8, 128, spec.block_size, "bfloat16", 2)
        self.connector = SharedConnectorScheduler(layout, store, load_timeout_s=1e9, enable_events=True)
        self.scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=spec.max_num_batched_tokens,
                                                   max_num_seqs=spec.max_num_seqs), self.kv, spec.max_model_len,
                                   kv_connector=self.connector)
        self.worker = SimStoreWorker(store, spec.block_size, load_per_token_s)
        self.now = 0.0
        self._step_end = 0.0

    def start_step(self, now: float | None = None) -> float | None:
        if now is not None:
            self.now = now
        now = self.now
        so = self.scheduler.schedule()
        meta = so.kv_connector_metadata
        if meta is not None and not meta.is_empty:
            self.worker.execute(meta, now)
        if so.is_empty:
            wait = self.worker.next_done()
            if wait is None:       # stores are reported at once; nothing to wait for
                self.scheduler.update_from_output(
                    so, ModelRunnerOutput([], [], kv_connector_output=self.worker.poll(now)))
                self.event_log.append(self._epoch(), self._take_events())
                return None
            self._pending, self._step_end = so, max(wait, now)
            return self._step_end - now
        dt = self.timing.step_time_s(so, self.scheduler.requests)
        self._pending, self._step_end = so, now + dt
        return dt

    def _runner_output(self, req_ids: list[str], sampled: list[list[int]]) -> ModelRunnerOutput:
        return ModelRunnerOutput(req_ids, sampled, kv_connector_output=self.worker.poll(self._step_end))

    def _take_events(self) -> list:
        return self.kv.take_events() + self.connector.take_events()

    def kv_snapshot(self) -> KVCacheSnapshot:
        log = self.event_log
        return KVCacheSnapshot(log.epoch, log.next_seq, list(self.kv.pool.cached),
                               {self.connector.medium: self.connector.block_hashes()})


class StoreSimulation(Simulation):
    """The routing simulation with one NodeStore per `replicas_per_node` replicas."""

    def __init__(self, prepared: PreparedTrace, router, store: StoreSpec, **kwargs):
        super().__init__(prepared, router, **kwargs)
        spec = prepared.trace.meta.replica
        n = len(self.replicas)
        per_node = store.replicas_per_node
        capacity = int(store.capacity_x * per_node * spec.num_kv_tokens / spec.block_size)
        self.stores = [NodeStore(capacity) for _ in range((n + per_node - 1) // per_node)]
        self.replicas = [StoreReplica(i, spec, self.timing, self.stores[i // per_node], store.load_per_token_s)
                         for i in range(n)]

    def _start_step(self, rep, now: float) -> None:
        rep.now = now
        super()._start_step(rep, now)


class OursWithNodes(OursRouter):
    """Our router told each replica's node (so shared-medium events count for the whole node), as the Serve
    shell does; snapshots carry the tier hashes for every router (`pull_kv_events`)."""

    def __init__(self, replica: ReplicaSpec, replicas_per_node: int, name: str):
        super().__init__(replica, name=name)
        self.replicas_per_node = replicas_per_node

    def setup(self, cluster: ClusterView, seed: int) -> None:
        super().setup(cluster, seed)
        self.core.set_replicas([ReplicaInfo(rid, f"node-{i // self.replicas_per_node}")
                                for i, rid in enumerate(self.ids)])


# ---------------------------------------------------------------- runs
def _run_row(label: str, sim_cls, router, prepared: PreparedTrace, store: StoreSpec, seed: int,
             periods: FeedPeriods | None, say) -> dict:
    """One router on the trace, in `sim_cls` (with the node stores for StoreSimulation): its table row."""
    kwargs = {"store": store} if sim_cls is StoreSimulation else {}
    sim = sim_cls(prepared, router, seed=seed, progress=say, periods=periods, **kwargs)
    res: RunResult = sim.run()
    row = {"router": label, "hit_rate": res.hit_rate, "ttft_p50_s": res.ttft_p50_s, "ttft_p99_s": res.ttft_p99_s,
           "e2e_mean_s": res.e2e_mean_s, "max_over_mean_load": res.max_over_mean_load,
           "decision_p99_ms": res.decision_p99_ms, "num_measured": res.num_measured,
           "router_summary": res.router_summary, "ttft_s": res.ttft_s,
           "router_class": type(router).__name__, "events_period_s": sim.periods.events_s}
    if sim_cls is StoreSimulation:
        w = [r.worker for r in sim.replicas]
        prompt = sum(len(r.prompt_token_ids) for r in prepared.trace.requests)
        row["loaded_tokens_share"] = sum(x.num_loaded_tokens for x in w) / prompt
        row["failed_loads"] = sum(x.num_failed_loads for x in w)
        row["store_evictions"] = sum(c.connector.stats.evicted_blocks for c in sim.replicas)
    say(f"  {label}: hit {res.hit_rate:.3f}, TTFT p50 {res.ttft_p50_s:.3f} s p99 {res.ttft_p99_s:.3f} s "
        f"({res.sim_wall_s:.0f} s wall)")
    return row


#: the fleet mode's runs: (label, with the store?, router kind)
FLEET_RUNS = (("llm-d precise", False, "llmd"), ("ours", False, "ours"),
              ("llm-d precise + node store", True, "llmd"),
              ("llm-d precise, tier-aware + node store", True, "llmd-tiered"),
              ("ours + node store", True, "ours"))


def run_fleet_cell(cell: int, seed: int, store: StoreSpec, say, requests_per_replica: int | None = None) -> dict:
    """Cell `cell` (1-based) of the fleet suite on `seed`: llm-d's precise scorer and ours, each without and
    with one node store per `store.replicas_per_node` replicas, on the same trace and the suite's feed period."""
    from benchmarks.routing.field import LlmdPrecise, LlmdTiered
    if not 1 <= cell <= len(FLEET):
        raise ValueError(f"fleet cell {cell}: the fleet suite's cells are 1-{len(FLEET)} "
                         "(benchmarks.routing.simulator's FLEET)")
    n, rho, load, hot, rpr, period = FLEET[cell - 1]
    a = argparse.Namespace(kv_blocks=FLEET_KV_BLOCKS, long_tail=True)
    spec = WorkloadSpec(num_replicas=n, pressure=rho, load=load, hot=hot, seed=seed, long_tail=True,
                        requests_per_replica=requests_per_replica or rpr)
    trace = generate(spec, replica_from_args(a), progress=say)
    prepared = prepare(trace)
    say(f"[{cell}, seed {seed}] {describe(trace.meta)}; separate-caches bound {prepared.pinned_bound:.3f}")
    rs = trace.meta.replica
    peak = 1.0 / TimingModel().prefill_per_token_s
    periods = FeedPeriods(period, FeedPeriods.default(n).stats_s)

    def router(kind: str, label: str):
        if kind == "llmd":
            return LlmdPrecise(rs, peak, 18.0, name=label)
        if kind == "llmd-tiered":
            return LlmdTiered(rs, peak, store.replicas_per_node, name=label)
        return OursWithNodes(rs, store.replicas_per_node, label)

    rows = [_run_row(label, StoreSimulation if with_store else Simulation, router(kind, label), prepared, store,
                     seed, periods, say) for label, with_store, kind in FLEET_RUNS]
    return {"cell": cell, "seed": seed, "replicas": n, "pressure": rho, "load": load, "hot": hot,
            "events_period_s": period, "requests": len(trace.requests), "separate_bound": prepared.pinned_bound,
            "store": asdict(store), "rows": rows}


def fleet_table(docs: list[dict]) -> str:
    """Per trace: each run's hit rate and TTFT p99, ours' p99 over llm-d's without the store and over the
    better llm-d with it; their geometric means over the traces last."""
    labels = [label for label, _, _ in FLEET_RUNS]
    out = ["| cell | seed | " + " | ".join(f"{x}: hit / p99 s" for x in labels)
           + " | ours ÷ llm-d, no store | ours ÷ best llm-d, store |", "|---" * (len(labels) + 4) + "|"]
    plain, stored = [], []
    for d in docs:
        by = {r["router"]: r for r in d["rows"]}
        p99 = {k: by[k]["ttft_p99_s"] for k in labels}
        a = p99["ours"] / p99["llm-d precise"]
        b = p99["ours + node store"] / min(p99["llm-d precise + node store"],
                                           p99["llm-d precise, tier-aware + node store"])
        plain.append(a)
        stored.append(b)
        shape = "hot prefix" if d["hot"] else f"ρ {d['pressure']}"
        out.append(f"| {d['replicas']} × {shape}, load {d['load']} | {d['seed']} | "
                   + " | ".join(f"{by[k]['hit_rate']:.3f} / {p99[k]:.3f}" for k in labels)
                   + f" | {a:.2f} | {b:.2f} |")
    if docs:
        gm = lambda xs: math.exp(sum(math.log(x) for x in xs) / len(xs))  # noqa: E731
        out.append(f"| geometric mean | {len(docs)} traces |" + " |" * len(labels)
                   + f" {gm(plain):.2f} | {gm(stored):.2f} |")
    return "\n".join(out)


def run_config(spec: WorkloadSpec, store: StoreSpec, say) -> dict:
    t0 = time.perf_counter()
    trace = generate(spec, progress=say)
    prepared = prepare(trace)
    say(f"{describe(trace.meta)}; bounds: separate caches {prepared.pinned_bound:.3f}, shared infinite cache "
        f"{prepared.shared_bound:.3f} ({time.perf_counter() - t0:.0f} s)")
    rs = trace.meta.replica
    runs = [("ours, no store", Simulation, OursWithNodes(rs, store.replicas_per_node, "ours, no store")),
            ("ours + node store", StoreSimulation, OursWithNodes(rs, store.replicas_per_node, "ours + node store")),
            ("power-of-two + node store", StoreSimulation, PowerOfTwo()),
            ("shared infinite cache (oracle)", Simulation, SharedCacheOracle())]
    rows = [_run_row(label, sim_cls, router, prepared, store, spec.seed, None, say) for label, sim_cls, router in runs]
    return {"replicas": spec.num_replicas, "pressure": spec.pressure, "load": spec.load,
            "requests": len(trace.requests), "separate_bound": prepared.pinned_bound,
            "shared_bound": prepared.shared_bound, "store": asdict(store), "rows": rows}


def table(docs: list[dict]) -> str:
    out = ["| configuration | router | token hit rate | TTFT p50 s | TTFT p99 s | mean e2e s | max/mean load | "
           "loaded from store (share of prompt tokens) |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for d in docs:
        cfg = f"{d['replicas']} × ρ {d['pressure']}, load {d['load']}"
        for r in d["rows"]:
            loaded = f"{r['loaded_tokens_share']:.3f}" if "loaded_tokens_share" in r else ""
            out.append(f"| {cfg} | {r['router']} | {r['hit_rate']:.3f} | {r['ttft_p50_s']:.3f} | "
                       f"{r['ttft_p99_s']:.3f} | {r['e2e_mean_s']:.2f} | {r['max_over_mean_load']:.2f} | {loaded} |")
    out.append("")
    out.append("| configuration | separate-caches bound | shared infinite cache bound | hit: store ÷ no store | "
               "TTFT p99: store ÷ no store | target hit ≥ 0.75 |")
    out.append("|---|---:|---:|---:|---:|---|")
    for d in docs:
        by = {r["router"]: r for r in d["rows"]}
        a, b = by["ours, no store"], by["ours + node store"]
        out.append(f"| {d['replicas']} × ρ {d['pressure']}, load {d['load']} | {d['separate_bound']:.3f} | "
                   f"{d['shared_bound']:.3f} | {b['hit_rate'] / a['hit_rate']:.2f} | "
                   f"{b['ttft_p99_s'] / a['ttft_p99_s']:.2f} | {'met' if b['hit_rate'] >= 0.75 else 'not met'} "
                   f"({b['hit_rate']:.3f}) |")
    return "\n".join(out)


def plot(docs: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    fig, axes = plt.subplots(1, len(docs) + 1, figsize=(5 * (len(docs) + 1), 4))
    names = [r["router"] for r in docs[0]["rows"]]
    x = np.arange(len(docs))
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        axes[0].bar(x + k * width, [next(r["hit_rate"] for r in d["rows"] if r["router"] == name) for d in docs],
                    width, label=name)
    axes[0].axhline(0.75, color="k", ls=":", lw=1, label="target 0.75")
    axes[0].set_xticks(x + 0.4 - width / 2, [f"load {d['load']}" for d in docs])
    axes[0].set_ylabel("token hit rate (pool + store)")
    axes[0].set_ylim(0, 1)
    axes[0].legend(fontsize=7)
    for ax, d in zip(axes[1:], docs):
        for r in d["rows"]:
            t = np.array(r["ttft_s"])
            ax.plot(np.sort(t), np.linspace(0, 1, len(t)), label=r["router"])
        ax.set_xscale("log")
        ax.set_xlabel("TTFT s")
        ax.set_ylabel("CDF")
        ax.set_title(f"{d['replicas']} × ρ {d['pressure']}, load {d['load']}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--pressure", type=float, default=0.75)
    p.add_argument("--loads", default="1.0,1.5")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--requests-per-replica", type=int, default=300)
    p.add_argument("--quick", action="store_true", help="100 requests per replica")
    p.add_argument("--replicas-per-node", type=int, default=StoreSpec().replicas_per_node)
    p.add_argument("--store-x", type=float, default=StoreSpec().capacity_x,
                   help="store capacity in multiples of the node's KV pools together")
    p.add_argument("--load-per-token-s", type=float, default=DEFAULT_LOAD_PER_TOKEN_S)
    p.add_argument("--fleet", default="", help="fleet-suite cells (1-based, e.g. 5,6): llm-d beside ours, each "
                   "without and with the store, instead of the default runs")
    p.add_argument("--seeds", default="0", help="with --fleet: seeds, e.g. 0-2")
    p.add_argument("--json")
    p.add_argument("--png")
    a = p.parse_args()

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    store = StoreSpec(a.replicas_per_node, a.store_x, a.load_per_token_s)

    def slim(docs: list[dict]) -> list[dict]:            # the JSON leaves out the per-request TTFTs
        return [{**d, "rows": [{k: v for k, v in r.items() if k != "ttft_s"} for r in d["rows"]]} for d in docs]

    if a.fleet:
        from benchmarks.routing.seeds import parse_seeds
        try:
            cells, seeds = [int(c) for c in a.fleet.split(",")], parse_seeds(a.seeds)
        except ValueError:
            p.error(f"--fleet takes cell numbers (e.g. 5,6) and --seeds seeds (e.g. 0-2); got {a.fleet!r} / "
                    f"{a.seeds!r}")
        if bad := [c for c in cells if not 1 <= c <= len(FLEET)]:
            p.error(f"--fleet {bad}: the fleet suite's cells are 1-{len(FLEET)}")
        if a.png:
            p.error("--png draws the default runs only; with --fleet write --json")
        docs = [run_fleet_cell(c, seed, store, say, 100 if a.quick else None) for c in cells for seed in seeds]
        print(fleet_table(docs), flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps({"args": vars(a), "fleet": slim(docs)}, indent=1))
        return
    rpr = 100 if a.quick else a.requests_per_replica
    docs = [run_config(WorkloadSpec(num_replicas=a.replicas, pressure=a.pressure, load=float(load), seed=a.seed,
                                    requests_per_replica=rpr), store, say) for load in a.loads.split(",")]
    print(table(docs), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "configs": slim(docs)}, indent=1))
    if a.png:
        plot(docs, Path(a.png))


if __name__ == "__main__":
    main()
