"""Property tests: random add / step / abort interleavings under small KV pools keep every invariant."""
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.errors import InvalidRequestError
from engine.request import RequestStatus
from engine.types import ModelRunnerOutput

from tests.unit.engine.helpers import EOS, assert_all_blocks_free, make_request, make_scheduler

PREFIXES = [[11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24, 25, 26], []]

ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 2), st.integers(1, 14), st.integers(1, 24), st.integers(0, 3)),
    st.tuples(st.just("step"), st.integers(0, 10**6)),
    st.tuples(st.just("step"), st.integers(0, 10**6)),
    st.tuples(st.just("abort"), st.integers(0, 40)),
), min_size=4, max_size=80)


def check_invariants(s, so=None):
    pool = s.kv.pool
    holders = Counter()
    for req_id, blocks in s.kv.req_to_blocks.items():
        assert req_id in s.requests
        assert s.requests[req_id].status is RequestStatus.RUNNING
        for b in blocks:
            holders[b.block_id] += 1
    free_ids = {b.block_id for b in pool.free_queue}
    assert len(free_ids) == pool.num_free_blocks
    for b in pool.blocks[1:]:
        assert b.ref_cnt == holders[b.block_id], (b, holders[b.block_id])
        assert (b.block_id in free_ids) == (b.ref_cnt == 0)
    assert 0 not in free_ids
    for h, entry in pool.cached.items():
        assert entry and all(b.block_hash == h for b in entry.values())
    for req in s.requests.values():
        assert 0 <= req.num_computed_tokens <= req.num_tokens
        if req.status is RequestStatus.RUNNING:
            n_blocks = len(s.kv.req_to_blocks[req.req_id])
            assert n_blocks * s.block_size >= req.num_computed_tokens
    assert len(s.running) <= s.config.max_num_seqs
    assert len(s.running) + len(s.waiting) == len(s.requests)
    if so is not None:
        assert so.total_num_scheduled_tokens <= s.config.max_num_batched_tokens
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert all(n > 0 for n in so.num_scheduled_tokens.values())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, num_blocks=st.integers(5, 16), budget=st.integers(1, 24), max_seqs=st.integers(1, 6),
       policy=st.sampled_from(["fcfs", "priority"]), chunked=st.booleans(),
       threshold=st.sampled_from([None, 3, 8]))
def test_random_interleavings_keep_invariants(ops, num_blocks, budget, max_seqs, policy, chunked, threshold):
    if not chunked:
        budget = 64      # required: see Scheduler.__init__
    s = make_scheduler(num_blocks=num_blocks, block_size=4, max_model_len=64, max_num_batched_tokens=budget,
                       max_num_seqs=max_seqs, policy=policy, enable_chunked_prefill=chunked,
                       long_prefill_token_threshold=threshold)
    ids = []
    finished = set()
    for n, op in enumerate(ops):
        if op[0] == "add":
            _, pre, tail, max_tokens, prio = op
            rid = f"r{n}"
            try:
                s.add_request(make_request(rid, PREFIXES[pre] + [40 + (n + i) % 9 for i in range(tail)],
                                           max_tokens=max_tokens, priority=prio, stop_token_ids=[47]))
                ids.append(rid)
            except InvalidRequestError:
                # only requests that can never fit are refused, and refusing them changes nothing
                assert len(PREFIXES[pre]) + tail + max_tokens > s.kv.max_tokens_capacity()
                assert rid not in s.requests
        elif op[0] == "abort":
            if ids:
                s.abort_requests(ids[op[1] % len(ids)])
        else:
            so = s.schedule()
            check_invariants(s, so)
            seed = op[1]
            sampled = []
            for rid in so.num_scheduled_tokens:
                req = s.requests[rid]
                done = req.num_computed_tokens >= req.num_tokens
                r = (seed + req.num_tokens) % 29
                sampled.append([EOS if r == 0 else 40 + r % 12] if done else [])
            out = s.update_from_output(so, ModelRunnerOutput(list(so.num_scheduled_tokens), sampled))
            finished |= out.finished_req_ids
        check_invariants(s)
    for rid in ids[::3]:
        s.abort_requests(rid)
    steps = 0
    while s.has_unfinished_requests() or s.has_pending_output():
        so = s.schedule()
        check_invariants(s, so)
        sampled = []
        for rid in so.num_scheduled_tokens:
            req = s.requests[rid]
            sampled.append([41] if req.num_computed_tokens >= req.num_tokens else [])
        out = s.update_from_output(so, ModelRunnerOutput(list(so.num_scheduled_tokens), sampled))
        finished |= out.finished_req_ids
        steps += 1
        assert steps < 2000, "no progress"
    assert finished == set(ids)
    assert_all_blocks_free(s)
    PREEMPTIONS_SEEN.append(s.make_stats().num_preemptions_total)


PREEMPTIONS_SEEN: list[int] = []


def test_property_run_exercised_preemption():
    """Guards the generator: the interleavings above must actually preempt sometimes."""
    if not PREEMPTIONS_SEEN:
        test_random_interleavings_keep_invariants()
    assert sum(1 for n in PREEMPTIONS_SEEN if n) >= 5
