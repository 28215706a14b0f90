import pytest

from affinity_serve.engine.errors import ContextLengthExceededError, InvalidRequestError
from affinity_serve.engine.limits import EngineLimits
from affinity_serve.engine.request import RequestStatus
from affinity_serve.engine.types import ModelRunnerOutput

from tests.unit.engine.helpers import (EOS, assert_all_blocks_free, make_request, make_scheduler,
                                       run_to_completion, runner_output, step)


# ---------------------------------------------------------------- budget and chunking
def test_chunked_prefill_splits_prompt_across_steps():
    s = make_scheduler(max_num_batched_tokens=8)
    s.add_request(make_request("a", 20, max_tokens=2))
    so, out = step(s)
    assert so.num_scheduled_tokens == {"a": 8} and out.outputs == []
    assert [r.req_id for r in so.scheduled_new_reqs] == ["a"]
    so, out = step(s)
    assert so.num_scheduled_tokens == {"a": 8} and so.scheduled_cached_reqs.num_computed_tokens == [8]
    so, out = step(s)
    assert so.num_scheduled_tokens == {"a": 4}
    assert len(out.outputs) == 1 and len(out.outputs[0].token_ids) == 1   # first token sampled
    so, out = step(s)
    assert so.num_scheduled_tokens == {"a": 1} and out.outputs[0].finish_reason == "length"
    assert_all_blocks_free(s)


def test_no_chunking_blocks_head_of_line():
    s = make_scheduler(max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False)
    s.add_request(make_request("a", 6, max_tokens=4))
    s.add_request(make_request("b", 12, max_tokens=4))
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 6}      # b (12) does not fit the remaining 10
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 1, "b": 12}   # now the whole prompt fits
    run_to_completion(s)
    with pytest.raises(ValueError, match="chunked prefill"):
        make_scheduler(max_num_batched_tokens=8, max_model_len=16, enable_chunked_prefill=False)


def test_long_prefill_threshold_lets_short_requests_in():
    s = make_scheduler(max_num_batched_tokens=16, long_prefill_token_threshold=6)
    s.add_request(make_request("long", 40))
    s.add_request(make_request("short", 5))
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"long": 6, "short": 5}


def test_running_first_then_waiting_and_max_num_seqs():
    s = make_scheduler(max_num_batched_tokens=64, max_num_seqs=2)
    for r in "abc":
        s.add_request(make_request(r, 5))
    so, _ = step(s)
    assert set(so.num_scheduled_tokens) == {"a", "b"}
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}
    assert s.make_stats().num_waiting_reqs == 1
    run_to_completion(s)
    assert_all_blocks_free(s)


def test_admits_waiting_says_whether_the_next_step_may_take_a_waiting_request():
    """The runner launches no decode step ahead while a waiting request may join the next step (overlap_decode)."""
    s = make_scheduler(max_num_batched_tokens=8, max_num_seqs=2)
    s.add_request(make_request("a", 6))
    s.add_request(make_request("b", 6))                    # the budget takes only part of b: a slot is free
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 6, "b": 2} and not so.admits_waiting
    s.add_request(make_request("c", 5))
    so, _ = step(s)
    assert "c" not in so.num_scheduled_tokens and not so.admits_waiting   # max_num_seqs reached: c waits
    s2 = make_scheduler(max_num_batched_tokens=4, max_num_seqs=4)
    s2.add_request(make_request("a", 4))
    s2.add_request(make_request("b", 4))
    so, _ = step(s2)
    assert so.num_scheduled_tokens == {"a": 4} and so.admits_waiting      # b waits with a slot free
    so, _ = step(s2)
    assert not so.admits_waiting
    s3 = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=4)       # 3 usable blocks
    s3.add_request(make_request("a", 7, max_tokens=5))
    s3.add_request(make_request("b", 7, max_tokens=2))
    so, _ = step(s3)                                      # a takes 2 blocks, b's 2 do not fit in the third
    assert so.num_scheduled_tokens == {"a": 7} and so.admits_waiting       # one block free (not enough)
    step(s3)                                              # a's decode at position 7
    so, _ = step(s3)                                      # position 8 takes the last block
    assert so.num_scheduled_tokens == {"a": 1} and s3.kv.pool.num_free_blocks == 0
    assert not so.admits_waiting                          # b waits for a block: the pool is full


def test_lookahead_slot_takes_a_free_block_a_step_early_but_never_preempts():
    """num_lookahead_tokens (set with overlap_decode): a decode whose next token would start a new block gets
    that block in this step when one is free; when none is, it decodes without it and preempts nobody."""
    s = make_scheduler(num_blocks=16, block_size=4)
    s.num_lookahead_tokens = 1
    s.add_request(make_request("a", 3, max_tokens=6))
    step(s)                                                     # prompt: 1 block, token 4 sampled
    assert len(s.kv.req_to_blocks["a"]) == 1
    so, _ = step(s)                                             # computes position 3, the block's last slot
    assert so.num_scheduled_tokens == {"a": 1} and len(so.scheduled_cached_reqs.new_block_ids[0]) == 1
    assert len(s.kv.req_to_blocks["a"]) == 2                    # position 4's block, one step early
    so, _ = step(s)
    assert so.scheduled_cached_reqs.new_block_ids == [[]]       # position 4 fits: nothing new
    run_to_completion(s)
    assert_all_blocks_free(s)
    # a full pool: two requests of one block each, the lookahead block is not to be had
    s = make_scheduler(num_blocks=3, block_size=4, max_model_len=8)
    s.num_lookahead_tokens = 1
    s.add_request(make_request("a", 3, max_tokens=3))
    s.add_request(make_request("b", 3, max_tokens=3))
    step(s)
    assert s.kv.pool.num_free_blocks == 0
    so, _ = step(s)                                             # both decode at their block's last slot
    assert so.num_scheduled_tokens == {"a": 1, "b": 1} and not so.preempted_req_ids
    assert so.scheduled_cached_reqs.new_block_ids == [[], []]
    run_to_completion(s)
    assert_all_blocks_free(s)


def test_lookahead_blocks_come_last_and_never_on_a_last_step():
    """The lookahead block is handed out after every scheduled and admitted request has its blocks: it never
    takes the block another request needs for its own token (which would preempt). A request computing its
    last token gets none."""
    s = make_scheduler(num_blocks=4, block_size=4)               # 3 usable blocks
    s.num_lookahead_tokens = 1
    s.add_request(make_request("a", 3, max_tokens=4))
    s.add_request(make_request("b", 4, max_tokens=4))
    step(s)                                                      # one block each, one free
    so, _ = step(s)       # a computes position 3 (its block's last slot); b's position 4 needs a new block
    assert so.num_scheduled_tokens == {"a": 1, "b": 1} and not so.preempted_req_ids
    assert so.scheduled_cached_reqs.new_block_ids == [[], [3]]   # b got the free block, a no lookahead
    run_to_completion(s)
    assert_all_blocks_free(s)
    s = make_scheduler(num_blocks=16, block_size=4)
    s.num_lookahead_tokens = 1
    s.add_request(make_request("c", 3, max_tokens=2))
    step(s)
    so, _ = step(s)                                              # position 3 gives c's last token
    assert so.scheduled_cached_reqs.new_block_ids == [[]] and len(s.kv.req_to_blocks.get("c", [])) <= 1


def test_token_budget_respected_for_decodes():
    s = make_scheduler(max_num_batched_tokens=3, max_num_seqs=10)
    for r in "abcde":
        s.add_request(make_request(r, 2, max_tokens=4))
    for _ in range(30):
        if not s.has_unfinished_requests():
            break
        so, _ = step(s)
        assert so.total_num_scheduled_tokens <= 3
        assert sum(so.num_scheduled_tokens.values()) == so.total_num_scheduled_tokens
    assert_all_blocks_free(s)


# ---------------------------------------------------------------- prefix cache
def test_prefix_hit_starts_with_computed_tokens():
    s = make_scheduler()
    shared = list(range(200, 212))
    s.add_request(make_request("a", shared + [1, 1]))
    run_to_completion(s)
    s.add_request(make_request("b", shared + [3, 3, 3]))
    so, out = step(s)
    new = so.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 12 and so.num_scheduled_tokens == {"b": 3}
    assert out.outputs[0].num_cached_tokens == 12
    st = out.stats
    assert st.prefix_cache_hits_total == 12 and st.prefix_cache_queries_total == 14 + 15


# ---------------------------------------------------------------- preemption
def _greedy(rid, n):
    return 100 + (n * 7 + len(rid)) % 50


def test_fcfs_preempts_newest_and_resumes_identically():
    ref = make_scheduler(num_blocks=64)
    for r in "abc":
        ref.add_request(make_request(r, 6, max_tokens=10))
    expected = run_to_completion(ref, token_fn=_greedy)

    s = make_scheduler(num_blocks=9)                 # 8 usable blocks of 4: 3 x 16 tokens won't fit
    for r in "abc":
        s.add_request(make_request(r, 6, max_tokens=10))
    preempted = []
    outs: dict[str, list[int]] = {}
    while s.has_unfinished_requests():
        so, out = step(s, token_fn=_greedy)
        preempted += sorted(so.preempted_req_ids)
        for d in out.outputs:
            outs.setdefault(d.req_id, []).extend(d.token_ids)
    assert preempted and preempted[0] == "c"          # the most recently admitted goes first
    assert outs == expected
    assert s.make_stats().num_preemptions_total == len(preempted)
    assert_all_blocks_free(s)


def test_priority_policy_admits_and_preempts_by_priority():
    s = make_scheduler(num_blocks=9, policy="priority", max_num_seqs=8)
    s.add_request(make_request("low", 6, max_tokens=10, priority=5, arrival_time=1.0))
    s.add_request(make_request("high", 6, max_tokens=10, priority=0, arrival_time=2.0))
    s.add_request(make_request("mid", 6, max_tokens=10, priority=1, arrival_time=3.0))
    so, _ = step(s, token_fn=_greedy)
    assert [r.req_id for r in so.scheduled_new_reqs] == ["high", "mid", "low"]
    preempted = []
    while s.has_unfinished_requests():
        so, _ = step(s, token_fn=_greedy)
        preempted += list(so.preempted_req_ids)
    assert preempted and preempted[0] == "low"
    assert_all_blocks_free(s)


def test_priority_victim_already_scheduled_this_step_is_unscheduled():
    s = make_scheduler(num_blocks=5, block_size=4, policy="priority")   # 4 usable blocks
    s.add_request(make_request("low", 7, max_tokens=9, priority=9, arrival_time=0.0))
    s.add_request(make_request("high", 7, max_tokens=9, priority=0, arrival_time=1.0))
    seen_victim_scheduled = False
    while s.has_unfinished_requests():
        so, _ = step(s)
        if so.preempted_req_ids:
            assert not (so.preempted_req_ids & set(so.num_scheduled_tokens))
            assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
            seen_victim_scheduled = True
    assert seen_victim_scheduled
    assert_all_blocks_free(s)


def test_priority_refund_kept_when_the_request_then_preempts_itself():
    # found by `make test-explore`: the budget of a victim scheduled earlier in the step was lost
    s = make_scheduler(num_blocks=10, policy="priority", max_num_batched_tokens=64, max_num_seqs=4,
                       long_prefill_token_threshold=8)
    shared = [11, 12, 13, 14, 15, 16, 17, 18]
    s.add_request(make_request("low", shared + [43], max_tokens=2, priority=1, arrival_time=0.0))
    step(s)
    s.add_request(make_request("a", shared + list(range(40, 53)), max_tokens=1, arrival_time=1.0))
    s.add_request(make_request("b", list(range(20, 33)), max_tokens=1, arrival_time=2.0))
    step(s)
    so = s.schedule()       # low: a decode; a: fits; b: preempts low (already scheduled), then itself
    assert so.preempted_req_ids == {"low", "b"} and so.num_scheduled_tokens == {"a": 5}
    assert so.total_num_scheduled_tokens == 5


# ---------------------------------------------------------------- stop conditions
def _run_one(s, req, tokens):
    s.add_request(req)
    it = iter(tokens)
    got, reason, stop_reason = [], None, None
    while s.has_unfinished_requests():
        _, out = step(s, token_fn=lambda rid, n: next(it))
        for d in out.outputs:
            got += d.token_ids
            reason, stop_reason = d.finish_reason, d.stop_reason
    assert_all_blocks_free(s)
    return got, reason, stop_reason


def test_eos_stops_including_eos_token():
    got, reason, _ = _run_one(make_scheduler(), make_request("a", 3, max_tokens=10), [5, 6, EOS, 7])
    assert got == [5, 6, EOS] and reason == "stop"


def test_ignore_eos_and_min_tokens():
    got, reason, _ = _run_one(make_scheduler(), make_request("a", 3, max_tokens=4, ignore_eos=True),
                              [EOS, EOS, EOS, EOS, 9])
    assert got == [EOS] * 4 and reason == "length"
    got, reason, _ = _run_one(make_scheduler(), make_request("b", 3, max_tokens=5, min_tokens=2),
                              [EOS, 8, EOS, 9])
    assert got == [EOS, 8, EOS] and reason == "stop"


def test_stop_token_ids_report_stop_reason():
    got, reason, stop = _run_one(make_scheduler(), make_request("a", 3, max_tokens=10, stop_token_ids=[42]),
                                 [5, 42, 6])
    assert got == [5, 42] and reason == "stop" and stop == 42


def test_max_tokens_and_max_model_len():
    got, reason, _ = _run_one(make_scheduler(), make_request("a", 3, max_tokens=3), [5] * 10)
    assert got == [5, 5, 5] and reason == "length"
    s = make_scheduler(max_model_len=8)
    got, reason, _ = _run_one(s, make_request("b", 5, max_tokens=3), [5] * 10)
    assert len(got) == 3 and reason == "length"
    s = make_scheduler(max_model_len=8)
    s.max_model_len = 7
    got, reason, _ = _run_one(s, make_request("c", 5, max_tokens=3), [5] * 10)
    assert len(got) == 2 and reason == "length"


def test_tokens_after_stop_in_one_step_are_dropped():
    s = make_scheduler()
    s.add_request(make_request("a", 3, max_tokens=10, stop_token_ids=[7]))
    so = s.schedule()
    from affinity_serve.engine.types import ModelRunnerOutput
    out = s.update_from_output(so, ModelRunnerOutput(["a"], [[4, 7, 8, 9]]))
    assert out.outputs[0].token_ids == [4, 7] and out.outputs[0].finished


# ---------------------------------------------------------------- abort
def test_abort_in_every_state_frees_everything_and_is_reported():
    s = make_scheduler(num_blocks=17, max_num_batched_tokens=8)
    s.add_request(make_request("running", 6, max_tokens=20))
    s.add_request(make_request("chunking", 20, max_tokens=20))
    s.add_request(make_request("waiting", 6, max_tokens=20))
    step(s)
    step(s)
    states = {r: s.requests[r].status for r in s.requests}
    assert states["running"] is RequestStatus.RUNNING and states["waiting"] is RequestStatus.WAITING
    s.abort_requests(["waiting", "unknown-id"])
    s.abort_requests("chunking")
    so, out = step(s)
    assert {"waiting", "chunking"} <= so.finished_req_ids
    assert out.finished_req_ids == {"waiting", "chunking"}
    assert {d.req_id: d.finish_reason for d in out.outputs if d.finished} == {"waiting": "abort",
                                                                              "chunking": "abort"}
    s.abort_requests("running")
    s.abort_requests("running")                    # finished already: no-op
    _, out = step(s)
    assert out.finished_req_ids == {"running"}
    assert_all_blocks_free(s)


def test_abort_preempted_request():
    s = make_scheduler(num_blocks=6)
    s.add_request(make_request("a", 6, max_tokens=12))
    s.add_request(make_request("b", 6, max_tokens=12))
    while not any(r.status is RequestStatus.PREEMPTED for r in s.requests.values()):
        step(s)
    victim = next(r for r in s.requests.values() if r.status is RequestStatus.PREEMPTED)
    s.abort_requests(victim.req_id)
    run_to_completion(s)
    assert_all_blocks_free(s)


def test_output_for_aborted_request_is_dropped():
    s = make_scheduler()
    s.add_request(make_request("a", 3))
    so = s.schedule()
    s.abort_requests("a")
    from affinity_serve.engine.types import ModelRunnerOutput
    out = s.update_from_output(so, ModelRunnerOutput(["a"], [[5]]))
    assert [(d.req_id, d.token_ids, d.finish_reason) for d in out.outputs] == [("a", [], "abort")]
    assert_all_blocks_free(s)


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs,err,param", [
    (dict(prompt=[]), InvalidRequestError, "prompt"),
    (dict(prompt=64), ContextLengthExceededError, "prompt"),
    (dict(prompt=10, max_tokens=100), ContextLengthExceededError, "max_tokens"),
])
def test_bad_requests_rejected_without_side_effects(kwargs, err, param):
    """The engine checks a request against its limits (here: this scheduler's) before the scheduler sees it:
    a request that could never be served is refused whole (test_request_contract pins where)."""
    s = make_scheduler(num_blocks=9, max_model_len=64)     # KV holds 32 tokens
    limits = EngineLimits(s.max_model_len, None, s.kv.max_tokens_capacity(), s.block_size)
    prompt = kwargs["prompt"]
    with pytest.raises(err) as e:
        limits.check(prompt if isinstance(prompt, int) else len(prompt), kwargs.get("max_tokens", 8))
    assert e.value.param == param and str(e.value)


def test_bad_max_tokens_and_ids_reused_once_finished():
    s = make_scheduler()
    s.add_request(make_request("a", 3))
    with pytest.raises(InvalidRequestError) as e:
        make_request("b", 3, max_tokens=0)
    assert e.value.param == "max_tokens"
    run_to_completion(s)
    s.add_request(make_request("a", 3))        # ids may be reused once finished
    run_to_completion(s)


# ---------------------------------------------------------------- stats
def test_stats_track_queue_and_usage():
    s = make_scheduler(max_num_batched_tokens=4)
    s.add_request(make_request("a", 10))
    s.add_request(make_request("b", 6))
    st = s.make_stats()
    assert st.num_waiting_reqs == 2 and st.num_queued_prefill_tokens == 16 and st.kv_cache_usage == 0
    _, out = step(s)
    st = out.stats
    assert st.num_running_reqs == 1 and st.num_waiting_reqs == 1
    assert st.num_queued_prefill_tokens == 6 + 6 and st.num_scheduled_tokens == 4
    assert 0 < st.kv_cache_usage < 1


def test_same_prefix_in_one_step_is_computed_once():
    s = make_scheduler(max_num_batched_tokens=64)
    shared = list(range(300, 316))                       # 4 full blocks
    s.add_request(make_request("a", shared + [1, 2]))
    s.add_request(make_request("b", shared + [3, 4]))
    s.add_request(make_request("c", [7, 7, 7, 7, 7]))    # behind b, unrelated: not held up by b's wait
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 18, "c": 5}   # b would recompute a's blocks: it waits
    assert [r.req_id for r in s.waiting] == ["b"]
    so, out = step(s)
    assert so.num_scheduled_tokens["b"] == 2 and so.scheduled_new_reqs[0].num_computed_tokens == 16
    run_to_completion(s)
    assert_all_blocks_free(s)


def test_requests_waiting_on_in_flight_blocks_keep_their_order():
    s = make_scheduler(max_num_batched_tokens=64)
    shared = list(range(300, 316))
    s.add_request(make_request("a", shared + [1, 2]))
    s.add_request(make_request("b", shared + [3, 4]))
    s.add_request(make_request("d", shared + [5, 6]))
    step(s)
    assert [r.req_id for r in s.waiting] == ["b", "d"]    # both wait for a's blocks, in arrival order
    so, _ = step(s)
    assert [r.req_id for r in so.scheduled_new_reqs] == ["b", "d"]
    assert all(r.num_computed_tokens == 16 for r in so.scheduled_new_reqs)
    run_to_completion(s)
    assert_all_blocks_free(s)


# ---------------------------------------------------------------- schedule() again before the output arrives
def test_schedule_twice_without_update_skips_requests_in_flight():
    s = make_scheduler(num_blocks=128, block_size=16, max_model_len=1024, max_num_batched_tokens=1024)
    s.add_request(make_request("a", 512, block_size=16, max_tokens=3))
    so1 = s.schedule()
    s.add_request(make_request("b", 512, block_size=16, max_tokens=3))
    so2 = s.schedule()              # "a" has nothing left to compute until its token arrives
    assert so1.num_scheduled_tokens == {"a": 512} and so2.num_scheduled_tokens == {"b": 512}
    out1 = s.update_from_output(so1, ModelRunnerOutput(["a"], [[7]]))
    out2 = s.update_from_output(so2, ModelRunnerOutput(["b"], [[8]]))
    assert [(d.req_id, d.token_ids) for d in out1.outputs + out2.outputs] == [("a", [7]), ("b", [8])]
    assert run_to_completion(s) == {"a": [50 + 513, 50 + 514], "b": [50 + 513, 50 + 514]}
    assert_all_blocks_free(s)


def _preempted_while_in_flight():
    """so1 decodes "a"; so2 (made before so1's output) preempts "a" so that "c" can prefill on."""
    s = make_scheduler(num_blocks=5, block_size=4, long_prefill_token_threshold=4)    # 4 usable blocks
    s.add_request(make_request("c", [30 + i for i in range(12)], max_tokens=1))
    s.add_request(make_request("a", [10, 11, 12, 13], max_tokens=3))
    step(s)                                      # c: 4 of 12 prompt tokens, a: whole prompt + 1 token
    so1 = s.schedule()                           # c: 4 more; a: one decode (takes the last free block)
    assert so1.num_scheduled_tokens == {"c": 4, "a": 1} and s.kv.pool.num_free_blocks == 0
    so2 = s.schedule()                           # c needs a block: the newest request "a" is preempted
    assert so2.preempted_req_ids == {"a"} and so2.num_scheduled_tokens == {"c": 4}
    return s, so1, so2


def test_token_for_request_preempted_before_its_output_arrives_is_kept():
    s, so1, so2 = _preempted_while_in_flight()
    a = s.requests["a"]
    out = s.update_from_output(so1, ModelRunnerOutput(["c", "a"], [[], [61]]))
    # computed from valid KV before the preemption: appended, reported, recomputed on resumption
    assert [(d.req_id, d.token_ids, d.finished) for d in out.outputs] == [("a", [61], False)]
    assert a.status is RequestStatus.PREEMPTED and a.num_computed_tokens == 0
    assert a.all_token_ids == [10, 11, 12, 13, 50 + 4, 61] and a.num_tokens == 6
    assert s.kv.num_cached_block["c"] == 2        # so1 computed c's blocks 0-1; block 2 is still in flight
    out = s.update_from_output(so2, ModelRunnerOutput(["c"], [[71]]))
    assert out.finished_req_ids == {"c"}           # so2 completed c's prompt: c sampled its one token
    resumed = None
    while s.has_unfinished_requests():
        so, out = step(s)
        resumed = resumed or next((r for r in so.scheduled_new_reqs if r.req_id == "a"), None)
    assert resumed is not None and resumed.token_ids == [10, 11, 12, 13, 54, 61]
    assert_all_blocks_free(s)


def test_stop_token_for_preempted_request_finishes_it():
    s, so1, so2 = _preempted_while_in_flight()
    out = s.update_from_output(so1, ModelRunnerOutput(["c", "a"], [[], [EOS]]))
    assert [(d.req_id, d.token_ids, d.finish_reason) for d in out.outputs] == [("a", [EOS], "stop")]
    assert out.finished_req_ids == {"a"} and "a" not in s.requests and len(s.waiting) == 0
    s.update_from_output(so2, ModelRunnerOutput(["c"], [[71]]))
    assert s.make_stats().num_queued_prefill_tokens == 0
    run_to_completion(s)
    assert_all_blocks_free(s)


def test_preempted_request_waits_for_its_output_before_resuming():
    s, so1, so2 = _preempted_while_in_flight()
    s.abort_requests("c")                          # frees room for "a" while so1 and so2 are still out
    so3 = s.schedule()
    assert so3.num_scheduled_tokens == {}          # resuming "a" now would lose the token so1 samples
    s.update_from_output(so1, ModelRunnerOutput(["c", "a"], [[], [61]]))
    s.update_from_output(so2, ModelRunnerOutput(["c"], [[71]]))
    s.update_from_output(so3, runner_output(s, so3))
    so, _ = step(s)
    assert so.scheduled_new_reqs[0].token_ids == [10, 11, 12, 13, 54, 61]
    run_to_completion(s)
    assert_all_blocks_free(s)


def test_request_block_size_must_match_the_kv_cache():
    s = make_scheduler(block_size=4)
    with pytest.raises(ValueError, match="block_size 8 but the KV cache.s block size is 4"):
        s.add_request(make_request("a", 10, block_size=8))
    assert not s.requests and len(s.waiting) == 0


def test_stats_report_the_recent_prefix_cache_hit_rate():
    s = make_scheduler(max_num_batched_tokens=64)
    shared = list(range(300, 312))                      # 3 full blocks
    s.add_request(make_request("a", shared + [1, 2]))
    run_to_completion(s)
    s.add_request(make_request("b", shared + [3, 3, 3]))
    _, out = step(s)
    st = out.stats
    assert (st.recent_prefix_cache_queries, st.recent_prefix_cache_hits) == (14 + 15, 12)
    run_to_completion(s)
    assert s.reset_prefix_cache()
    st = s.make_stats()
    assert (st.recent_prefix_cache_queries, st.recent_prefix_cache_hits) == (0, 0)
    assert (st.prefix_cache_queries_total, st.prefix_cache_hits_total) == (14 + 15, 12)


_STEADY_DECODE_GC_PROBE = """
import gc
from tests.unit.engine.helpers import make_request, make_scheduler, step
s = make_scheduler(num_blocks=256, max_model_len=256)
for i in range(16):
    s.add_request(make_request(f"r{i}", 10, max_tokens=200))
for _ in range(5):
    step(s)
s.kv.take_events()
gc.collect()
before = len(gc.get_objects())
for _ in range(40):                 # 16 requests x 10 blocks completed and cached
    step(s)
    s.kv.take_events()
gc.collect()
print(len(gc.get_objects()) - before)
"""


def test_steady_decode_leaves_no_gc_tracked_objects_behind():
    """Long-lived container objects made every step feed full collections (scheduler_step.py's p99).

    Counted in a fresh interpreter: gc.get_objects() is process-wide, and in the full suite background
    threads (Ray's router loops from the integration tests) allocate while this runs."""
    import pathlib
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", _STEADY_DECODE_GC_PROBE], capture_output=True, text=True,
                         cwd=root, check=True)
    assert int(out.stdout.strip()) < 16


def test_load_of_counts_requests_as_make_stats_does():
    """Through chunked prefill and preemptions, load_of(every request) equals make_stats' running, waiting
    and queued prefill tokens (the async engine uses it to count background requests apart), and a split
    of the ids adds up."""
    s = make_scheduler(num_blocks=12, max_num_batched_tokens=8)     # 11 usable blocks of 4: preemptions
    for r, n in (("a", 18), ("b", 10), ("c", 14), ("d", 6)):
        s.add_request(make_request(r, n, max_tokens=12))
    seen_preemption = seen_chunk = False
    while s.has_unfinished_requests():
        so, _ = step(s, token_fn=_greedy)
        seen_preemption |= bool(so.preempted_req_ids)
        st = s.make_stats()
        seen_chunk |= st.num_queued_prefill_tokens > 0 and st.num_running_reqs > 0
        ids = list(s.requests)
        assert s.load_of(ids) == (st.num_running_reqs, st.num_waiting_reqs, st.num_queued_prefill_tokens)
        half = [s.load_of(ids[::2]), s.load_of(ids[1::2])]
        assert tuple(map(sum, zip(*half))) == s.load_of(ids)
    assert seen_preemption and seen_chunk
    assert s.load_of(["gone", "a"]) == (0, 0, 0)                    # finished or unknown ids count nothing
    assert_all_blocks_free(s)


def test_queued_prefill_tokens_count_a_waiting_prompts_uncached_part():
    """A router predicts a queued prompt's uncached tokens; the engine's stat counts the same (not the whole
    prompt), so a snapshot and the router's in-flight accounting agree on a request the cache mostly holds."""
    s = make_scheduler(num_blocks=64, max_num_seqs=1)
    prompt = [100 + i for i in range(32)]                     # 8 blocks of 4
    s.add_request(make_request("a", prompt, max_tokens=4))
    run_to_completion(s)
    s.add_request(make_request("busy", 12, max_tokens=50))   # holds the only seat: b keeps waiting
    step(s)
    s.add_request(make_request("b", prompt + [900 + i for i in range(10)], max_tokens=4))
    st = s.make_stats()
    assert st.num_waiting_reqs == 1
    assert st.num_queued_prefill_tokens == 42 - 32          # b's 32 cached tokens are not work
    assert s.load_of(["b"])[2] == 10
    s.abort_requests(["b"])
    assert s.make_stats().num_queued_prefill_tokens == 0


def _clocked_scheduler(num_blocks: int, **kw):
    """A scheduler on a hand-moved clock (`t[0]`, seconds)."""
    t = [0.0]
    s = make_scheduler(num_blocks=num_blocks, **kw)
    s.clock = lambda: t[0]
    return s, t


def test_kv_wait_counts_only_the_time_the_queue_was_blocked_for_kv_blocks():
    # 8 usable blocks of 4 tokens: "a" (a 28-token prompt: 7 blocks, 8 as it decodes) leaves too little for
    # "b" (12 tokens: 3 blocks) until it finishes
    s, t = _clocked_scheduler(9)
    s.add_request(make_request("a", 28, max_tokens=4))
    t[0] = 1.0
    s.add_request(make_request("b", 12, max_tokens=4))
    steps = 0
    reported = []
    while "b" in s.requests and s.requests["b"].status is RequestStatus.WAITING:
        so, out = step(s)
        reported.append(out.stats.kv_wait_s)
        t[0] += 0.5
        steps += 1
        assert steps < 50
    b = s.requests["b"]
    # "b" found no blocks from the first step (t = 1.0), but that step ran "a"'s prompt: the queue was behind
    # prefill work, not waiting for KV. From the next step (t = 1.5: "a" only decodes) until the step that
    # admitted "b", every half second counted; "a" itself never waited for KV
    assert b.kv_wait_s > 0
    assert b.kv_wait_s == pytest.approx(t[0] - 0.5 - 1.5)
    # the stats tell a router what a request joining the queue can expect: the blocked stretch so far (no
    # admission had waited yet), then nothing once "b" is in and the queue is empty
    assert reported[:4] == [0.0, 0.0, 0.5, 1.0]
    assert s.make_stats().kv_wait_s == 0.0 and s.kv_blocked_s() == 0.0
    run_to_completion(s)
    assert_all_blocks_free(s)
    assert s.kv_blocked_s() == 0.0


def test_kv_wait_is_zero_for_a_queue_held_by_the_token_budget_not_by_kv():
    s, t = _clocked_scheduler(64, max_num_batched_tokens=8)
    for r in "abc":
        s.add_request(make_request(r, 16, max_tokens=2))
    waits = {}
    while s.has_unfinished_requests():
        so, _ = step(s)
        for nr in so.scheduled_new_reqs:
            waits[nr.req_id] = s.requests[nr.req_id].kv_wait_s
        t[0] += 1.0
    assert waits == {"a": 0.0, "b": 0.0, "c": 0.0}


def test_kv_wait_of_a_preempted_request_adds_its_wait_to_resume():
    s, t = _clocked_scheduler(9)
    for r in "abc":
        s.add_request(make_request(r, 6, max_tokens=10))
    waits: dict[str, float] = {}
    preempted = set()
    while s.has_unfinished_requests():
        so, _ = step(s, token_fn=_greedy)
        preempted |= so.preempted_req_ids
        for rid, req in s.requests.items():
            waits[rid] = req.kv_wait_s
        t[0] += 1.0
    assert preempted
    assert all(waits[r] > 0 for r in preempted)      # each waited (blocked) to be admitted again
    assert_all_blocks_free(s)
