"""Admission control sees a backlog bound by KV room (issue 25, under overload): requests that wait for running
sequences to finish and free blocks, which the prefill queue does not show. The routing core's predict_wait
adds each replica's wait for KV room (TTFTModel.kv_wait_many) to its TTFT; routing itself is unchanged."""
from __future__ import annotations

import random

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider

from affinity_serve.app.errors import APIError
from affinity_serve.app.prompts import RequestKind
from affinity_serve.app.protocol import CompletionRequest, ReplicaChunk
from affinity_serve.app.routing import (AffinityConfig, PrefixAffinityRouterCore, ReplicaInfo, ReplicaLoadView,
                                        RouteRequest)
from affinity_serve.app.routing import debug
from affinity_serve.app.routing.load import SEQ_TOKEN_S_PRIOR
from affinity_serve.app.serving import OpenAIServing
from affinity_serve.engine import EngineLimits
from affinity_serve.observability.metrics import ServingMetrics
from affinity_serve.observability.requests import RequestObserver
from tests.unit.app.conftest import LocalHandle
from tests.unit.routing.helpers import Clock

BS = 8
POOL = 40                     # the measured case: a 40-block pool of 8-token blocks
PROMPT, OUT = 120, 150        # one such request needs 34 of its blocks


def _core(calibrate=False, **cfg):
    clock = Clock()
    core = PrefixAffinityRouterCore(AffinityConfig(calibrate=calibrate, **cfg), BS, clock=clock,
                                    rng=random.Random(0))
    core.set_replicas([ReplicaInfo("a")])
    return core, clock


def _req(i: int) -> RouteRequest:
    return RouteRequest(f"q{i}", [], PROMPT, OUT)


def _kv_bound_backlog() -> ReplicaLoadView:
    """One long sequence fills the pool, ten more wait for its blocks."""
    return ReplicaLoadView(num_running=1, num_waiting=10, kv_cache_usage=0.95,
                           num_queued_prefill_tokens=10 * PROMPT, num_blocks=POOL)


def test_a_pool_full_of_long_sequences_with_a_queue_waiting_for_kv_predicts_a_long_wait():
    core, _ = _core()
    core.on_stats("a", _kv_bound_backlog())
    wait = core.predict_wait(_req(0), ["a"])
    # the demand ahead: 38 blocks held, the queue's 10 prompts and outputs (10 x 270 tokens), this request's
    # 34 blocks: 409.5 blocks for 40, so 9.24 pools' worth has to free first, each about one lifetime of a
    # 150-token sequence at the prior's seconds per token
    kv_wait = (0.95 * POOL + 10 * (PROMPT + OUT) / BS + 34 - POOL) / POOL * OUT * SEQ_TOKEN_S_PRIOR
    prefill = (10 * PROMPT + PROMPT) / 10_000 + 1 * 0.002          # the routing TTFT's queue and running terms
    # the wait for room stands in for the routing's KV-pressure penalty (0.8 s here), not on top of it
    assert wait == pytest.approx(prefill + kv_wait, rel=0.005)
    assert wait > 10.0                               # far past a 10 s bound: the 429 path
    assert core.loads.num_in_flight == 0 and core.counters().num_decisions == 0     # recorded nothing


def test_the_same_queue_in_a_pool_it_fits_adds_no_wait():
    core, _ = _core()
    core.on_stats("a", ReplicaLoadView(num_running=1, num_waiting=10, kv_cache_usage=0.02,
                                       num_queued_prefill_tokens=10 * PROMPT, num_blocks=4096))
    ttft = core.model.predict_many([core.loads.get("a")], [PROMPT], None, [34])[0]
    assert core.predict_wait(_req(0), ["a"]) == pytest.approx(ttft)      # the routing TTFT, nothing added
    assert ttft < 1.0


def test_a_burst_sent_between_snapshots_raises_the_wait_with_each_routed_request():
    """The measured case: many requests at once against an idle pool that fits one. Each routed request
    counts its blocks (prompt + expected output) until a snapshot or its finish says otherwise."""
    core, _ = _core()
    core.on_stats("a", ReplicaLoadView(num_blocks=POOL))
    waits = []
    for i in range(6):
        waits.append(core.predict_wait(_req(i), ["a"]))
        core.route(_req(i), ["a"])
    assert waits[0] < 1.0                            # an idle pool: no wait for room
    steps = [b - a for a, b in zip(waits, waits[1:])]
    assert all(s == pytest.approx(34 / POOL * OUT * SEQ_TOKEN_S_PRIOR, rel=0.1) for s in steps[1:]), waits
    assert waits[-1] > 10.0
    for i in range(6):                               # all finished: the wait is gone again
        core.on_first_token(f"q{i}", 0)
        core.on_finished(f"q{i}")
    assert core.predict_wait(_req(9), ["a"]) < 1.0
    assert core.loads.get("a").in_flight_out_tokens == 0


def test_the_wait_scales_with_the_observed_sequence_lifetime():
    core, clock = _core(calibrate=True)
    core.on_stats("a", ReplicaLoadView(num_blocks=POOL))
    for i in range(20):                              # one at a time, each 150 tokens in 6 s: 0.04 s a token
        core.route(_req(i), ["a"])
        core.on_first_token(f"q{i}", 0)
        clock.t += 6.0
        core.on_finished(f"q{i}")
    assert core.model.num_lifetimes == 20
    assert core.model.seq_token_s == pytest.approx(0.04, rel=0.1)
    core.on_stats("a", _kv_bound_backlog())
    slow = core.model.kv_wait_many([core.loads.get("a")], [34], OUT, BS)[0]
    fast_core, _ = _core()
    fast_core.on_stats("a", _kv_bound_backlog())
    prior = fast_core.model.kv_wait_many([fast_core.loads.get("a")], [34], OUT, BS)[0]
    assert slow == pytest.approx(prior * core.model.seq_token_s / SEQ_TOKEN_S_PRIOR)
    assert slow > 1.8 * prior


def test_before_any_request_finished_the_wait_uses_the_replicas_reported_decode_step():
    """A replica's stats carry its mean recent decode step (`step_time_s`): a running sequence gets a token
    per step, so that is the seconds per token it holds its blocks, on this hardware, from the first stats
    on. The fixed prior (a mid-size model's GPU step) was 4x too long on a fast device: the first requests'
    KV wait came out 4x too long (false 429s) until about a dozen had finished."""
    fast = 0.005
    core, clock = _core(calibrate=True)
    core.on_stats("a", _kv_bound_backlog())
    fixed = core.model.kv_wait_many([core.loads.get("a")], [34], OUT, BS)[0]
    reported = ReplicaLoadView(num_running=1, num_waiting=10, kv_cache_usage=0.95,
                               num_queued_prefill_tokens=10 * PROMPT, num_blocks=POOL, step_time_s=fast)
    core.on_stats("a", reported)
    assert core.model.reported_step_s == fast and core.model.seq_token_s == pytest.approx(fast)
    now = core.model.kv_wait_many([core.loads.get("a")], [34], OUT, BS)[0]
    assert now == pytest.approx(fixed * fast / SEQ_TOKEN_S_PRIOR)
    for _ in range(30):                              # later reports move it as a decayed mean
        core.on_stats("a", ReplicaLoadView(num_blocks=POOL, step_time_s=2 * fast))
    assert core.model.seq_token_s == pytest.approx(2 * fast, rel=0.05)
    # observed lifetimes still win: sequences that waited (preempted, queued) hold their blocks longer
    core.on_stats("a", ReplicaLoadView(num_blocks=POOL))
    for i in range(20):                              # 150 tokens in 6 s each: 0.04 s a token
        core.route(_req(i), ["a"])
        core.on_first_token(f"q{i}", 0)
        clock.t += 6.0
        core.on_finished(f"q{i}")
    assert core.model.seq_token_s == pytest.approx(0.04, rel=0.1)
    # with calibration off the fixed prior stays (the routing tests' reproducible setting)
    off, _ = _core(calibrate=False)
    off.on_stats("a", reported)
    assert off.model.seq_token_s == SEQ_TOKEN_S_PRIOR


def test_a_request_never_started_teaches_no_lifetime():
    core, clock = _core(calibrate=True)
    core.route(_req(0), ["a"])
    clock.t += 60.0
    core.on_finished("q0")                           # a timeout or an abort before its first token
    assert core.model.num_lifetimes == 0 and core.model.seq_token_s == SEQ_TOKEN_S_PRIOR


def _distinct(i: int, first_hash: int | None = None) -> RouteRequest:
    """A request of its own prompt (a first block hash of its own): admission holds are matched by kind."""
    return RouteRequest(f"q{i}", [bytes([i if first_hash is None else first_hash]) * 32], PROMPT, OUT)


def test_requests_admitted_before_any_is_routed_hold_their_load_until_routed():
    """The ingress admits a burst faster than Serve routes it: each admitted request holds its load on its
    best replica (hold_admitted), so the next prediction sees it; its route takes the hold's place."""
    core, clock = _core()
    core.on_stats("a", ReplicaLoadView(num_blocks=POOL))
    waits = []
    for i in range(4):                              # admitted one after another, none routed yet
        waits.append(core.predict_wait(_distinct(i), ["a"]))
        assert core.hold_admitted(f"q{i}")
    assert waits[0] < 1.0 and waits[-1] > 5.0 and waits == sorted(waits)
    held = core.predict_wait(_distinct(9), ["a"])
    for i in range(4):                              # Serve routes them
        core.route(_distinct(i), ["a"])
        assert core.loads.num_in_flight == 4
    assert core.predict_wait(_distinct(9), ["a"]) == pytest.approx(held)       # the same load, now routed
    core.predict_wait(_distinct(7, first_hash=2), ["a"])           # admitted, of q2's kind
    core.hold_admitted("q7")
    core.route(_distinct(2), ["a"])                 # Serve asks again for a routed one: it takes no hold
    assert core.loads.num_in_flight == 5
    assert not core.hold_admitted("not-the-last-prediction")


def test_an_admission_hold_nobody_routes_lapses():
    from affinity_serve.app.routing.core import ADMISSION_HOLD_S
    core, clock = _core()
    core.on_stats("a", ReplicaLoadView(num_blocks=POOL))
    idle = core.predict_wait(_distinct(0), ["a"])
    core.hold_admitted("q0")                         # then the request failed before it was routed
    core.predict_wait(_distinct(1), ["a"])
    core.hold_admitted("q1")
    assert core.predict_wait(_distinct(2), ["a"]) > idle + 1.0
    clock.t += ADMISSION_HOLD_S + 0.1
    core.route(_distinct(5), ["a"])                  # any route drops lapsed holds
    core.on_first_token("q5", 0)
    core.on_finished("q5")
    assert core.loads.num_in_flight == 0
    assert core.predict_wait(_distinct(2), ["a"]) == pytest.approx(idle)


# ---------------------------------------------------------------- the ingress's 429 path, on the real core
LIMITS = EngineLimits(max_model_len=512, vocab_size=1000, max_kv_tokens=POOL * BS, block_size=BS)


class _Replica:
    def __init__(self):
        self.calls = 0

    async def limits(self):
        return LIMITS

    async def generate(self, req):
        self.calls += 1
        yield ReplicaChunk("", 0, "", [7], "length", num_prompt_tokens=len(req.prompt_token_ids), replica_id="a")


class _CoreRouter:
    """The shell's surface the ingress uses, over a real core (as serve_router.predicted_wait_s builds it)."""

    def __init__(self, core):
        self.core = core

    def predicted_wait_s(self, request_id, prompt_token_ids, block_hashes, max_tokens, bound=None):
        return self.core.predict_wait(RouteRequest(request_id, list(block_hashes or []), len(prompt_token_ids),
                                                   max_tokens), ["a"], bound)

    async def run_on_loop(self, fn, *args):
        return fn(*args)

    def num_replicas(self):
        return 1

    def call_soon(self, fn, *args):
        """Work the shell would run later on its loop (telemetry): not needed by these tests, dropped."""


async def test_the_ingress_turns_a_kv_bound_backlog_away_with_429_queue_full():
    core, _ = _core()
    core.on_stats("a", _kv_bound_backlog())
    metrics = ServingMetrics(MeterProvider().get_meter("t"))
    replica = _Replica()
    handle = LocalHandle(replica)
    handle.__dict__.update(app_name="kv-wait-admission", deployment_name="LLMReplica")
    router = _CoreRouter(core)                       # registered by weak reference: held here
    debug.register(handle.app_name, handle.deployment_name, router)
    serving = OpenAIServing(handle, model_name="m", tokenizer=None, first_output_timeout_s=5,
                            observer=RequestObserver(TracerProvider().get_tracer("t"), metrics), metrics=metrics,
                            max_queue_wait_s=10.0)
    req = CompletionRequest(prompt=list(range(PROMPT)), max_tokens=OUT)
    with pytest.raises(APIError) as e:
        await serving.complete(RequestKind.COMPLETION, req, "cmpl-kv", {})
    assert e.value.status_code == 429 and e.value.code == "queue_full"
    assert e.value.retry_after_s >= 10 and replica.calls == 0
    assert core.loads.num_in_flight == 0                     # a refused request holds nothing
    core.on_stats("a", ReplicaLoadView(num_blocks=POOL))     # the backlog drained: admitted
    out = await serving.complete(RequestKind.COMPLETION, req, "cmpl-kv2", {})
    assert out["choices"] and replica.calls == 1
    # an admitted one holds its load until a route takes its place (this test's handle routes around the core)
    held = core.loads.get("a")
    assert core.loads.num_in_flight == 1 and held.pending_blocks == 34 and held.in_flight_out_tokens == OUT


def test_a_hold_outlives_the_replicas_next_stats_snapshot():
    """A hold never reaches the replica, so no snapshot includes it: a snapshot after the admission used to drop
    the hold's load (the wait fell back to idle within a stats period while Serve still queued the requests)."""
    core, clock = _core()
    core.on_stats("a", ReplicaLoadView(num_blocks=POOL))
    idle = core.predict_wait(_distinct(0), ["a"])
    for i in range(4):
        core.predict_wait(_distinct(i), ["a"])
        assert core.hold_admitted(f"q{i}")
    held = core.predict_wait(_distinct(9), ["a"])
    assert held > idle + 1.0
    clock.t += 1.0
    core.on_stats("a", ReplicaLoadView(num_blocks=POOL))          # the replica's next (idle) snapshot
    assert core.predict_wait(_distinct(9), ["a"]) == pytest.approx(held)
    for i in range(4):                                            # routed: each takes its hold's place
        core.route(_distinct(i), ["a"])
    assert core.loads.num_in_flight == 4


@pytest.mark.parametrize("seed", range(6))
def test_the_one_pass_admission_wait_equals_the_routing_models_three_passes(seed):
    """`predict_wait` computes each candidate's wait in one pass (TTFTModel.admission_waits); it must equal
    predict_many (with and without the KV-pressure penalty) plus kv_wait_many on every replica state: pools
    known and unknown, full and empty, prefix hits in the pool and in an offload tier, this router's
    in-flight requests and admission holds, calibrated rates."""
    from affinity_serve.app.routing import KVEventBatch
    from affinity_serve.engine.types import MEDIUM_OFFLOAD, BlockStored
    from tests.unit.routing.helpers import chain

    rng = random.Random(seed)
    ids = [f"r{i}" for i in range(12)]
    clock = Clock()
    core = PrefixAffinityRouterCore(AffinityConfig(calibrate=True, kv_pressure_threshold=rng.choice([0.7, 1.0])),
                                    BS, clock=clock, rng=random.Random(seed))
    core.set_replicas([ReplicaInfo(r, f"n{i % 3}") for i, r in enumerate(ids)])
    prefixes = [chain(f"p{k}", 40) for k in range(4)]
    for rid in ids:
        held = [prefixes[rng.randrange(4)][:rng.randrange(0, 40)]]
        events = [BlockStored(h, None, [], BS) for h in held if h]
        if rng.random() < 0.4:
            p = prefixes[rng.randrange(4)]
            events.append(BlockStored(p[:rng.randrange(1, 40)], None, [], BS, medium=MEDIUM_OFFLOAD))
        core.on_kv_events(KVEventBatch(rid, "e", 0, events))
        core.on_stats(rid, ReplicaLoadView(
            num_running=rng.randrange(0, 30), num_waiting=rng.randrange(0, 20),
            kv_cache_usage=rng.random(), num_queued_prefill_tokens=rng.randrange(0, 20_000),
            num_blocks=rng.choice([None, 64, 400, 5000])))
    for k in range(30):                       # in flight, some started, some finished; observed TTFTs
        clock.t += 0.05
        hashes = prefixes[rng.randrange(4)][:rng.randrange(1, 40)] + chain(f"u{k}", rng.randrange(0, 8))
        d = core.route(RouteRequest(f"f{k}", hashes, len(hashes) * BS + rng.randrange(1, BS), rng.randrange(0, 300)),
                       ids)
        if rng.random() < 0.6:
            clock.t += 0.02
            core.on_first_token(d.req_id, 0)
            if rng.random() < 0.5:
                clock.t += 0.3
                core.on_finished(d.req_id, rng.randrange(1, 300))
    for k in range(20):
        hashes = prefixes[rng.randrange(4)][:rng.randrange(0, 40)] + chain(f"q{k}", rng.randrange(0, 8))
        req = RouteRequest(f"q{k}", hashes, max(1, len(hashes) * BS + rng.randrange(0, BS)), rng.randrange(0, 400))
        ref = core._predict_wait_reference(req, ids)
        for rid, want in zip(ids, ref):
            assert core.predict_wait(req, [rid]) == pytest.approx(want, rel=1e-12, abs=1e-12)
        assert core.predict_wait(req, ids) == pytest.approx(min(ref), rel=1e-12, abs=1e-12)
        # with admission's bound: the same verdict on every bound, the exact wait wherever it is over it
        for bound in sorted(ref)[::3] + [max(ref) + 1.0, min(ref) * 0.5]:
            got = core.predict_wait(req, ids, bound)
            assert (got <= bound) == (min(ref) <= bound), (bound, got, min(ref))
            assert got >= min(ref) - 1e-12
            if got > bound:
                assert got == pytest.approx(min(ref), rel=1e-12, abs=1e-12)
        if rng.random() < 0.5:
            assert core.hold_admitted(req.req_id)
    if core.model.tier_load_tokens_per_s >= core.model.prefill_tokens_per_s:     # (the fit may make a tier slow)
        assert core.num_admissions_unmatched > 0                # the pass without the match was taken


def test_far_from_the_bound_admission_skips_the_prefix_match_and_holds_the_prompt_uncached(monkeypatch):
    """Admission asks only whether some replica starts the request within serve.max_queue_wait_s: where one
    would start the whole prompt uncached within it, the prefix match (the larger part of the cost on long
    prompts; the routing does it again) is skipped, and the hold counts the prompt uncached there."""
    from affinity_serve.app.routing import KVEventBatch
    from affinity_serve.engine.types import BlockStored
    from tests.unit.routing.helpers import chain

    core, clock = _core()
    core.set_replicas([ReplicaInfo("a"), ReplicaInfo("b")])
    prefix = chain("p", 14)
    core.on_kv_events(KVEventBatch("a", "e", 0, [BlockStored(prefix, None, [], BS)]))
    core.on_stats("a", ReplicaLoadView(num_blocks=5000, num_queued_prefill_tokens=100))
    core.on_stats("b", ReplicaLoadView(num_blocks=5000, num_queued_prefill_tokens=150))
    req = RouteRequest("q", prefix + chain("u", 1), 15 * BS, 10)
    exact = core.predict_wait(req, ["a", "b"])
    matches = []
    real_match = core.index.match
    monkeypatch.setattr(core.index, "match", lambda *a: matches.append(1) or real_match(*a))
    far = core.predict_wait(req, ["a", "b"], bound=exact + 100.0)
    assert matches == [] and exact < far <= exact + 100.0            # within the bound, unmatched: a uncached
    near = core.predict_wait(req, ["a", "b"], bound=far - 1e-9)        # the uncached start is over it
    assert matches == [1] and near == pytest.approx(exact)
    core.predict_wait(req, ["a", "b"], bound=exact + 100.0)
    assert core.hold_admitted("q")
    hold = [f for k, f in core.loads._in_flight.items() if k.startswith("admission-hold")]
    assert [(h.replica_id, h.uncached_tokens) for h in hold] == [("a", 15 * BS)]


@pytest.mark.parametrize("weight", [0.0, 0.25, 1.0])
def test_kv_wait_weight_prices_kv_pressure_in_the_routing_ttft(weight):
    """routing.kv_wait_weight > 0: the routing TTFT of a replica whose pool cannot take the request adds that
    weight times the predicted wait for KV room (what admission control predicts) in place of the threshold
    penalty; 0 (the default): the penalty (1 s per pool's worth of overage, at most 2 s)."""
    core, _ = _core(kv_wait_weight=weight)
    core.on_stats("a", _kv_bound_backlog())
    ttft = core.route(_req(0), ["a"]).scores.predicted_ttft_s[0]
    prefill = (10 * PROMPT + PROMPT) / 10_000 + 1 * 0.002
    kv_wait = (0.95 * POOL + 10 * (PROMPT + OUT) / BS + 34 - POOL) / POOL * OUT * SEQ_TOKEN_S_PRIOR
    if weight:
        assert ttft == pytest.approx(prefill + weight * kv_wait, rel=0.005)
    else:            # usage with its own 34 blocks: 0.95 + 34/40 = 1.8, so 0.8 pools over: 0.8 s
        assert ttft == pytest.approx(prefill + 0.8, rel=0.005)
    # the same queue in a pool it fits: no KV term at any weight
    core, _ = _core(kv_wait_weight=weight)
    core.on_stats("a", ReplicaLoadView(num_running=1, num_waiting=10, kv_cache_usage=0.1,
                                       num_queued_prefill_tokens=10 * PROMPT, num_blocks=10_000))
    assert core.route(_req(1), ["a"]).scores.predicted_ttft_s[0] == pytest.approx(prefill, rel=0.005)


def test_kv_wait_weight_keeps_the_penalty_where_no_pool_size_is_reported():
    """Without a reported pool size there is no wait to predict: such a replica keeps the threshold penalty."""
    core, _ = _core(kv_wait_weight=1.0, kv_pressure_threshold=0.5)
    core.on_stats("a", ReplicaLoadView(num_running=1, num_waiting=0, kv_cache_usage=0.95,
                                       num_queued_prefill_tokens=0, num_blocks=0))
    ttft = core.route(_req(0), ["a"]).scores.predicted_ttft_s[0]
    # usage 0.95 over threshold 0.5, ramped over 0.5: 0.9 of the 1 s penalty
    assert ttft == pytest.approx(PROMPT / 10_000 + 0.002 + 0.9, rel=0.01)
