"""KV connector scheduling without a model: WAITING_FOR_KV loads, failures, timeouts, aborts, held saves.

A fake connector with injectable outcomes (lookups pending, loads that succeed, fail or take several steps,
saves that hold blocks) drives the real Scheduler; a property test checks ref counts after every step and
that nothing is held or pending once everything ends.
"""
from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from affinity_serve.engine.kv_connector.base import (KVConnectorMetadata, KVConnectorOutput, KVConnectorScheduler,
                                      KVConnectorUpdate, KVLayout, KVTransfer, PoolChanges)
from affinity_serve.engine.kv_connector.offload import OffloadConnectorScheduler
from affinity_serve.engine.request import RequestStatus
from affinity_serve.engine.types import BlockRemoved, BlockStored, ModelRunnerOutput

from tests.unit.engine.helpers import assert_all_blocks_free, make_request, make_scheduler, runner_output

BS = 4


class FakeConnector(KVConnectorScheduler):
    """A tier holding a set of hashes; the test decides each lookup, load and save outcome."""

    medium = "fake"
    wants_cached = True

    def __init__(self, rng: random.Random, *, p_pending=0.0, p_fail=0.0, max_delay=0, p_hold=0.0,
                 load_timeout_s=1e9):
        super().__init__()
        self.rng = rng
        self.p_pending, self.p_fail, self.max_delay, self.p_hold = p_pending, p_fail, max_delay, p_hold
        self.load_timeout_s = load_timeout_s
        self.tier: set[bytes] = set()
        self._pending: list[KVTransfer] = []
        self.in_flight: dict[str, list] = {}          # req_id -> [steps left, ok, block ids]
        self.saves: dict[str, int] = {}               # req_id -> steps left
        self.loaded: list[tuple[str, list[int]]] = []

    def get_num_new_matched_tokens(self, request, num_local_tokens):
        if self.rng.random() < self.p_pending:
            return None, True
        n = 0
        for h in request.block_hashes[num_local_tokens // BS:]:
            if h not in self.tier:
                break
            n += 1
        return n * BS, True

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        assert len(block_ids) * BS == num_external_tokens
        assert request.status is RequestStatus.WAITING_FOR_KV
        self._pending.append(KVTransfer(request.req_id, list(block_ids), []))

    def build_connector_meta(self, scheduler_output, changes: PoolChanges):
        meta = KVConnectorMetadata(loads=self._pending)
        self._pending = []
        if changes.cached:
            meta.stores.append(KVTransfer(None, [b for b, _ in changes.cached], [h for _, h in changes.cached]))
        return meta

    def execute(self, meta: KVConnectorMetadata) -> KVConnectorOutput:
        """The runner side: loads finish after a random delay with a random outcome; stores at once."""
        out = KVConnectorOutput()
        for t in meta.stores:
            out.finished_stores.append((t.block_hashes, True))
        for t in meta.loads:
            self.in_flight[t.req_id] = [self.rng.randint(0, self.max_delay), self.rng.random() >= self.p_fail,
                                        t.block_ids]
        for req_id, entry in list(self.in_flight.items()):
            if entry[0] == 0:
                del self.in_flight[req_id]
                out.finished_loads[req_id] = entry[1]
                if entry[1]:
                    self.loaded.append((req_id, entry[2]))
            else:
                entry[0] -= 1
        return out

    def update_connector_output(self, output):
        for hashes, ok in output.finished_stores:
            if ok:
                self.tier.update(hashes)
        done = set()
        for req_id in list(self.saves):
            self.saves[req_id] -= 1
            if self.saves[req_id] <= 0:
                done.add(req_id)
                del self.saves[req_id]
        return KVConnectorUpdate(dict(output.finished_loads), done)

    def request_finished(self, request, block_ids):
        if block_ids and self.rng.random() < self.p_hold:
            self.saves[request.req_id] = self.rng.randint(1, 3)
            return True
        return False

    def has_pending_work(self):
        return bool(self._pending or self.in_flight or self.saves)


def _sched(conn, num_blocks=64, **kw):
    sched = make_scheduler(num_blocks=num_blocks, block_size=BS, **kw)
    sched.__init__(sched.config, sched.kv, sched.max_model_len, kv_connector=conn)
    return sched


def _step(sched, conn, token_fn=lambda rid, n: 50 + n):
    so = sched.schedule()
    ro = runner_output(sched, so, token_fn)
    ro.kv_connector_output = conn.execute(so.kv_connector_metadata)
    return so, sched.update_from_output(so, ro)


def _drain(sched, conn, max_steps=2000):
    outs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        _, out = _step(sched, conn)
        for d in out.outputs:
            outs.setdefault(d.req_id, []).extend(d.token_ids)
    assert not sched.has_unfinished_requests(), "scheduler did not drain"
    return outs


def check_ref_counts(sched) -> None:
    """Every block's ref_cnt equals the tables and transfer holds that name it; none is held twice."""
    refs: Counter[int] = Counter()
    for blocks in list(sched.kv.req_to_blocks.values()) + sched.held_blocks():
        refs.update(b.block_id for b in blocks)
    for b in sched.kv.pool.blocks[1:]:
        assert b.ref_cnt == refs.get(b.block_id, 0), f"{b} named {refs.get(b.block_id, 0)} times"
    for rid, load in sched._loading.items():
        assert load.request.status is RequestStatus.WAITING_FOR_KV and rid in sched.kv.req_to_blocks
    assert all(r.status is RequestStatus.RUNNING for r in sched.running)


def _fill_tier(sched, conn, prompt):
    """Compute `prompt` once so the tier holds its blocks, then evict it from the pool by resetting."""
    sched.add_request(make_request("warm", prompt, block_size=BS, max_tokens=1))
    _drain(sched, conn)
    assert sched.kv.reset_prefix_cache()


# ---------------------------------------------------------------- deterministic cases
def test_load_waits_outside_the_budget_then_hits_the_loaded_blocks():
    conn = FakeConnector(random.Random(0), max_delay=0)
    sched = _sched(conn)
    prompt = list(range(100, 130))            # 7 full blocks + 2 tokens
    _fill_tier(sched, conn, prompt)
    sched.add_request(make_request("r", prompt + [7, 8], block_size=BS, max_tokens=2))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {}                  # no budget spent on the loading request
    assert sched.requests["r"].status is RequestStatus.WAITING_FOR_KV
    assert sched.make_stats().num_waiting_reqs == 1
    [load] = so.kv_connector_metadata.loads
    assert len(load.block_ids) == 7
    ro = ModelRunnerOutput([], [], kv_connector_output=conn.execute(so.kv_connector_metadata))
    sched.update_from_output(so, ro)
    so, out = _step(sched, conn)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 28       # admitted as a hit on the loaded blocks
    assert so.num_scheduled_tokens == {"r": 4}
    _drain(sched, conn)
    assert_all_blocks_free(sched)


def test_failed_load_recomputes_and_never_asks_again():
    conn = FakeConnector(random.Random(0), p_fail=1.0)
    sched = _sched(conn)
    prompt = list(range(200, 224))
    _fill_tier(sched, conn, prompt)
    sched.add_request(make_request("r", prompt + [1], block_size=BS, max_tokens=2))
    _step(sched, conn)                                    # load issued and reported failed
    so, _ = _step(sched, conn)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0 and so.num_scheduled_tokens["r"] == 25
    assert sched.requests["r"].num_cached_tokens == 0
    _drain(sched, conn)
    assert_all_blocks_free(sched)


def test_timed_out_load_recomputes_and_its_blocks_wait_for_the_late_report():
    conn = FakeConnector(random.Random(0), max_delay=0, load_timeout_s=0.0)
    sched = _sched(conn)
    prompt = list(range(300, 320))
    _fill_tier(sched, conn, prompt)
    conn.max_delay = 3
    sched.add_request(make_request("r", prompt + [1], block_size=BS, max_tokens=2))
    so = sched.schedule()
    conn.execute(so.kv_connector_metadata)                # in flight for a few steps
    conn.in_flight["r"][0] = 2
    sched.update_from_output(so, ModelRunnerOutput([], []))
    so, _ = _step(sched, conn)                            # timed out: recomputes now with fresh blocks
    assert so.num_scheduled_tokens["r"] == 21
    assert len(sched.held_blocks()) == 1 and check_ref_counts(sched) is None
    _drain(sched, conn)
    assert not sched.held_blocks()
    assert_all_blocks_free(sched)


def test_abort_during_a_load_holds_blocks_until_the_runner_reports():
    conn = FakeConnector(random.Random(0), max_delay=0)
    sched = _sched(conn)
    prompt = list(range(400, 420))
    _fill_tier(sched, conn, prompt)
    conn.max_delay = 2
    sched.add_request(make_request("r", prompt + [1], block_size=BS))
    so = sched.schedule()
    sched.abort_requests("r")
    assert sched.held_blocks() and all(b.ref_cnt == 1 for b in sched.held_blocks()[0])
    ro = ModelRunnerOutput([], [], kv_connector_output=conn.execute(so.kv_connector_metadata))
    out = sched.update_from_output(so, ro)
    assert [d.finish_reason for d in out.outputs] == ["abort"]
    _drain(sched, conn)
    assert_all_blocks_free(sched)


def test_a_second_request_waits_for_a_prefix_being_loaded_then_hits_it():
    conn = FakeConnector(random.Random(0), max_delay=0)
    sched = _sched(conn)
    prompt = list(range(500, 532))
    _fill_tier(sched, conn, prompt)
    sched.add_request(make_request("a", prompt + [1], block_size=BS, max_tokens=3))
    sched.add_request(make_request("b", prompt + [2], block_size=BS, max_tokens=3))
    so, _ = _step(sched, conn)
    assert len(so.kv_connector_metadata.loads) == 1      # b did not load the same blocks again
    _step(sched, conn)
    assert sched.requests["b"].num_cached_tokens == 32 and sched.requests["a"].num_cached_tokens == 32
    _drain(sched, conn)
    assert_all_blocks_free(sched)


def test_held_save_keeps_blocks_until_reported():
    conn = FakeConnector(random.Random(0), p_hold=1.0)
    sched = _sched(conn)
    sched.add_request(make_request("r", 20, block_size=BS, max_tokens=1))
    _step(sched, conn)
    assert "r" not in sched.requests and sched.held_blocks()
    check_ref_counts(sched)
    _drain(sched, conn)
    assert_all_blocks_free(sched)


def test_synchronous_loads_are_refused_clearly():
    class Sync(FakeConnector):
        def get_num_new_matched_tokens(self, request, num_local_tokens):
            n, _ = super().get_num_new_matched_tokens(request, num_local_tokens)
            return n, False
    conn = Sync(random.Random(0))
    sched = _sched(conn)
    prompt = list(range(600, 620))
    _fill_tier(sched, conn, prompt)
    sched.add_request(make_request("r", prompt + [1], block_size=BS))
    try:
        sched.schedule()
    except ValueError as e:
        assert "asynchronous" in str(e)
    else:
        raise AssertionError("a synchronous load was accepted")


# ---------------------------------------------------------------- property
@settings(max_examples=60)
@given(seed=st.integers(0, 2**32 - 1), num_blocks=st.integers(12, 40),
       p_pending=st.sampled_from([0.0, 0.3]), p_fail=st.sampled_from([0.0, 0.3, 1.0]),
       max_delay=st.integers(0, 3), p_hold=st.sampled_from([0.0, 0.5]),
       timeout=st.sampled_from([0.0, 1e9]), budget=st.sampled_from([7, 64]))
def test_random_workload_keeps_ref_counts_and_ends_clean(seed, num_blocks, p_pending, p_fail, max_delay, p_hold,
                                                         timeout, budget):
    rng = random.Random(seed)
    conn = FakeConnector(random.Random(seed + 1), p_pending=p_pending, p_fail=p_fail, max_delay=max_delay,
                         p_hold=p_hold, load_timeout_s=timeout)
    sched = _sched(conn, num_blocks=num_blocks, max_num_batched_tokens=budget)
    prefixes = [[rng.randrange(100, 900) for _ in range(rng.choice([8, 12, 16]))] for _ in range(3)]
    live: list[str] = []
    for i in range(40):
        op = rng.random()
        if op < 0.45:
            rid = f"r{i}"
            prompt = rng.choice(prefixes) + [rng.randrange(100, 900) for _ in range(rng.randint(1, 6))]
            sched.add_request(make_request(rid, prompt, block_size=BS, max_tokens=rng.randint(1, 5)))
            live.append(rid)
        elif op < 0.55 and live:
            sched.abort_requests(live.pop(rng.randrange(len(live))))
        elif op < 0.65:
            sched.kv.reset_prefix_cache()           # pushes prefixes out of the pool: later loads
        _step(sched, conn, lambda rid, n: 3 + (n % 7))
        check_ref_counts(sched)
    _drain(sched, conn)
    check_ref_counts(sched)
    assert_all_blocks_free(sched)
    assert not sched.held_blocks() and not sched._loading and not sched.has_pending_kv_transfers()
    assert not conn.in_flight and not conn.saves


# ---------------------------------------------------------------- the offload tier's bookkeeping
_LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=BS, dtype="float32", element_size=4)


def test_offload_tier_lru_pins_and_events():
    tier = OffloadConnectorScheduler(_LAYOUT, 3, enable_events=True)
    hashes = [bytes([i]) * 32 for i in range(5)]
    meta = tier.build_connector_meta(None, PoolChanges([], [(i + 1, h) for i, h in enumerate(hashes[:3])]))
    [store] = meta.stores
    tier.update_connector_output(KVConnectorOutput(finished_stores=[(store.block_hashes, True)]))
    assert tier.block_hashes() == hashes[:3]
    tier.check_accounting()
    req = make_request("r", 9, block_size=BS)
    req.block_hashes[:2] = hashes[:2]
    assert tier.get_num_new_matched_tokens(req, 0) == (8, True)
    req.num_computed_tokens = 0
    tier.update_state_after_alloc(req, [10, 11], 8)            # pins hashes 0 and 1, now most recent
    meta = tier.build_connector_meta(None, PoolChanges([], [(20, hashes[3]), (21, hashes[4])]))
    assert meta.loads[0].tier_slots and len(meta.stores[0].block_hashes) == 1   # one unpinned slot to reuse
    out = KVConnectorOutput({"r": True}, [(meta.stores[0].block_hashes, True)])
    tier.update_connector_output(out)
    tier.check_accounting()
    assert set(tier.block_hashes()) == {hashes[0], hashes[1], hashes[3]}
    events = tier.take_events()
    assert [type(e) for e in events] == [BlockStored, BlockRemoved, BlockStored]
    assert all(e.medium == "offload" for e in events) and events[1].block_hashes == [hashes[2]]


# ---------------------------------------------------------------- the real offload tier, contents modelled
class ContentModel:
    """Stands in for KV bytes: which block hash each pool block and each tier slot holds."""

    def __init__(self, sched, tier: OffloadConnectorScheduler, rng: random.Random, p_fail: float):
        self.sched, self.tier, self.rng, self.p_fail = sched, tier, rng, p_fail
        self.pool: dict[int, bytes] = {}
        self.slots: dict[int, bytes] = {}
        self.loads_ok = 0

    def execute(self, meta: KVConnectorMetadata) -> KVConnectorOutput:
        out = KVConnectorOutput()
        for t in meta.stores:                     # before the forward pass: evicted blocks still hold their KV
            for b, h, slot in zip(t.block_ids, t.block_hashes, t.tier_slots):
                assert self.pool.get(b) == h, "a store read a block that no longer holds its hash's KV"
                self.slots[slot] = h
            out.finished_stores.append((t.block_hashes, True))
        for t in meta.loads:
            ok = self.rng.random() >= self.p_fail
            if ok:
                for b, h, slot in zip(t.block_ids, t.block_hashes, t.tier_slots):
                    assert self.slots.get(slot) == h, "a load read a slot that holds another block"
                    self.pool[b] = h
                self.loads_ok += 1
            out.finished_loads[t.req_id] = ok
        return out

    def after_update(self) -> None:
        """Blocks the step computed now hold their hash's KV (the pool registers them as cached)."""
        for h, entry in self.sched.kv.pool.cached.items():
            for b in ([entry] if not isinstance(entry, dict) else entry.values()):
                self.pool[b.block_id] = h


@settings(max_examples=40)
@given(seed=st.integers(0, 2**32 - 1), num_blocks=st.integers(10, 30), capacity=st.integers(1, 24),
       p_fail=st.sampled_from([0.0, 0.3]), store_on=st.sampled_from(["evict", "finish"]))
def test_offload_tier_contents_match_its_accounting(seed, num_blocks, capacity, p_fail, store_on):
    rng = random.Random(seed)
    tier = OffloadConnectorScheduler(_LAYOUT, capacity, store_on=store_on)
    sched = _sched(tier, num_blocks=num_blocks, max_num_batched_tokens=32)
    model = ContentModel(sched, tier, random.Random(seed + 1), p_fail)
    prefixes = [[rng.randrange(100, 900) for _ in range(12)] for _ in range(4)]
    for i in range(60):
        if rng.random() < 0.5:
            prompt = rng.choice(prefixes) + [rng.randrange(100, 900) for _ in range(rng.randint(1, 5))]
            sched.add_request(make_request(f"r{i}", prompt, block_size=BS, max_tokens=rng.randint(1, 4)))
        so = sched.schedule()
        ro = runner_output(sched, so)
        ro.kv_connector_output = model.execute(so.kv_connector_metadata)
        sched.update_from_output(so, ro)
        model.after_update()
        check_ref_counts(sched)
        tier.check_accounting()
        for h, slot in tier._index.items():
            assert model.slots.get(slot) == h, "the tier's index names a slot holding other KV"
    for _ in range(500):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        ro = runner_output(sched, so)
        ro.kv_connector_output = model.execute(so.kv_connector_metadata)
        sched.update_from_output(so, ro)
        model.after_update()
    assert_all_blocks_free(sched)
    tier.check_accounting()
    assert not tier.has_pending_work() and not tier._pins and len(tier.block_hashes()) <= capacity


def test_a_load_in_flight_survives_preemption_of_running_requests():
    conn = FakeConnector(random.Random(0), max_delay=0)
    sched = _sched(conn, num_blocks=14)
    prompt = list(range(700, 724))                     # 6 blocks
    _fill_tier(sched, conn, prompt)
    for r in ("x", "y"):
        sched.add_request(make_request(r, 9, block_size=BS, max_tokens=12))
    outs: dict[str, list[int]] = {}

    def collect(out):
        for d in out.outputs:
            outs.setdefault(d.req_id, []).extend(d.token_ids)
    collect(_step(sched, conn)[1])
    conn.max_delay = 6
    sched.add_request(make_request("c", prompt + [1], block_size=BS, max_tokens=2))
    so = sched.schedule()
    assert sched.requests["c"].status is RequestStatus.WAITING_FOR_KV
    assert not conn.execute(so.kv_connector_metadata).finished_loads
    conn.in_flight["c"][0] = 6                           # the load takes a while; x and y grow meanwhile
    collect(sched.update_from_output(so, runner_output(sched, so)))
    preempted = 0
    for _ in range(6):
        so, out = _step(sched, conn)
        collect(out)
        preempted += len(so.preempted_req_ids)
        check_ref_counts(sched)
    assert preempted > 0, "the pool was meant to run out while c held its load blocks"
    for rid, toks in _drain(sched, conn).items():
        outs.setdefault(rid, []).extend(toks)
    assert len(outs["x"]) == len(outs["y"]) == 12 and len(outs["c"]) == 2
    assert_all_blocks_free(sched)


def test_a_failed_step_fails_its_transfers_and_the_request_recomputes():
    tier = OffloadConnectorScheduler(_LAYOUT, 16)
    sched = _sched(tier, num_blocks=20)
    model = ContentModel(sched, tier, random.Random(0), 0.0)
    prompt = list(range(800, 820))
    sched.add_request(make_request("warm", prompt, block_size=BS, max_tokens=1))
    for _ in range(3):
        so = sched.schedule()
        ro = runner_output(sched, so)
        ro.kv_connector_output = model.execute(so.kv_connector_metadata)
        sched.update_from_output(so, ro)
        model.after_update()
    big = make_request("big", 19 * BS - 1, block_size=BS, max_tokens=1)   # the whole pool: evicts the prompt
    sched.add_request(big)
    while "big" in sched.requests:
        so = sched.schedule()
        ro = runner_output(sched, so)
        ro.kv_connector_output = model.execute(so.kv_connector_metadata)
        sched.update_from_output(so, ro)
        model.after_update()
    assert len(tier.block_hashes()) == 5
    sched.add_request(make_request("r", prompt + [1], block_size=BS, max_tokens=2))
    so = sched.schedule()
    assert so.kv_connector_metadata.loads and sched.requests["r"].status is RequestStatus.WAITING_FOR_KV
    sched.fail_kv_transfers(so)                 # what LLMEngine.step does when the runner raised
    assert sched.requests["r"].status is RequestStatus.WAITING and not tier._pins
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"r": 21}    # recomputes: no second load
    ro = runner_output(sched, so)
    ro.kv_connector_output = model.execute(so.kv_connector_metadata)
    sched.update_from_output(so, ro)
    _drain(sched, _NoTransfers())
    assert_all_blocks_free(sched)
    tier.check_accounting()


class _NoTransfers:
    def execute(self, meta):
        assert not meta.loads
        return KVConnectorOutput(finished_stores=[(t.block_hashes, True) for t in meta.stores])
