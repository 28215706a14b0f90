"""The TTFT floor is causal: a block is a shared-cache hit only once some earlier request could have computed it."""
import pytest

from benchmarks.routing.bounds import ttft_floor_s
from benchmarks.routing.workload import TraceRequest

BS, STEP, PER_TOKEN, BUDGET = 4, 0.01, 0.001, 1000


def req(rid, t, prompt, out=(), parent=None, think=0.0):
    return TraceRequest(rid, t, "C", "g", list(prompt), list(out), parent, think)


def hashes_of(r):
    toks = r.prompt_token_ids + r.output_token_ids
    return [tuple(toks[: (i + 1) * BS]) for i in range(len(toks) // BS)]


def floor(reqs):
    return ttft_floor_s(reqs, [hashes_of(r) for r in reqs], BS, [True] * len(reqs), STEP, PER_TOKEN, BUDGET)


def test_a_sibling_arriving_during_the_prefix_prefill_waits_for_it_or_computes_it():
    prefix = list(range(400))                                    # 100 blocks: 0.41 s alone
    a, b = req("a", 0.0, prefix + [1, 2, 3]), req("b", 0.2, prefix + [4, 5, 6])
    fa, fb = floor([a, b])
    assert fa == pytest.approx(STEP + 403 * PER_TOKEN)
    # b can hit a's prefix only once a computed it (0.41 s after 0), not from its arrival
    assert fb == pytest.approx(STEP + 400 * PER_TOKEN - 0.2 + STEP + 3 * PER_TOKEN)
    # arriving just after a, waiting saves nothing: computing the prefix itself is as fast
    assert floor([a, req("b", 0.001, prefix + [4, 5, 6])])[1] == pytest.approx(STEP + 403 * PER_TOKEN)
    later = req("c", 5.0, prefix + [7, 8, 9])                    # long after: a plain hit
    assert floor([a, later])[1] == pytest.approx(STEP + 3 * PER_TOKEN)


def test_a_session_turn_hits_its_parents_answer():
    parent = req("p", 0.0, list(range(40)), out=list(range(100, 120)))
    child = req("q", 0.0, list(range(40)) + list(range(100, 120)) + [9, 9, 9], parent="p", think=1.0)
    assert floor([parent, child])[1] == pytest.approx(STEP + 3 * PER_TOKEN)
