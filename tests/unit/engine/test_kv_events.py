"""KV events describe the prefix cache exactly: replaying them into a set gives the pool's cached hashes
after any workload (pool-level ops with duplicates and resets, and whole scheduler runs with preemption);
the numbered log that routers pull from is bounded and tells them when to resync.
"""
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from affinity_serve.engine.block_pool import BlockPool
from affinity_serve.engine.errors import InvalidRequestError
from affinity_serve.engine.hashing import hash_block_chain, hash_block_tokens
from affinity_serve.engine.kv_events import KVEventLog
from affinity_serve.engine.types import AllBlocksCleared, BlockRemoved, BlockStored, ModelRunnerOutput

from tests.unit.engine.helpers import EOS, make_request, make_scheduler


def replay(view: set, events) -> None:
    """Apply events to `view`, checking they are exact set transitions that keep prefixes closed."""
    for e in events:
        if isinstance(e, AllBlocksCleared):
            view.clear()
        elif isinstance(e, BlockStored):
            assert e.parent_block_hash is None or e.parent_block_hash in view, "a block stored before its parent"
            assert len(e.token_ids) == len(e.block_hashes) * e.block_size
            if e.parent_block_hash is not None:       # the chain is the tokens' (block 0 may carry a salt)
                parent = e.parent_block_hash
                for i, h in enumerate(e.block_hashes):
                    parent = hash_block_tokens(parent, e.token_ids[i * e.block_size:(i + 1) * e.block_size])
                    assert parent == h
            for h in e.block_hashes:
                assert h not in view, "stored twice"
                view.add(h)
        else:
            assert isinstance(e, BlockRemoved)
            for h in e.block_hashes:
                assert h in view, "removed but never stored"
                view.remove(h)


# ---------------------------------------------------------------- pool level: duplicates, hits, resets
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5], [1, 2, 3, 4, 5, 6, 7, 8, 3, 3, 3, 3]]
pool_ops = st.lists(st.one_of(
    st.tuples(st.just("compute"), st.integers(0, 3), st.integers(1, 3)),   # allocate fresh blocks, cache in parts
    st.tuples(st.just("hit"), st.integers(0, 3), st.integers(0, 0)),      # reuse the cached prefix, compute the rest
    st.tuples(st.just("free"), st.integers(0, 20), st.integers(0, 0)),
    st.tuples(st.just("reset"), st.integers(0, 0), st.integers(0, 0))), min_size=5, max_size=60)


@given(ops=pool_ops, num_blocks=st.integers(3, 12))
def test_pool_events_replay_to_the_cached_hashes(ops, num_blocks):
    bs = 4
    pool = BlockPool(num_blocks, bs, enable_kv_cache_events=True)
    held: list[list] = []
    view: set = set()
    for op, arg, parts in ops:
        if op in ("compute", "hit"):
            tokens = PROMPTS[arg]
            hashes = hash_block_chain(tokens, bs)
            hits = []
            if op == "hit":
                for h in hashes:
                    b = pool.get_cached_block(h)
                    if b is None:
                        break
                    hits.append(b)
            need = len(hashes) - len(hits) + sum(1 for b in hits if b.ref_cnt == 0)
            if need <= pool.num_free_blocks:
                pool.touch(hits)
                blocks = hits + pool.get_new_blocks(len(hashes) - len(hits))
                done = len(hits)
                for k in range(1, parts + 1):         # computed in `parts` chunks, cached as each completes
                    upto = len(hits) + (len(hashes) - len(hits)) * k // parts
                    pool.cache_full_blocks(blocks, hashes, tokens, done, upto)
                    done = upto
                held.append(blocks)
        elif op == "free" and held:
            pool.free_blocks(reversed(held.pop(arg % len(held))))
        elif op == "reset":
            pool.reset_prefix_cache()
        replay(view, pool.take_events())
        assert view == set(pool.cached)


def test_duplicate_blocks_are_silent_until_the_last_one_goes():
    pool = BlockPool(4, 2, enable_kv_cache_events=True)
    h = hash_block_chain([7, 7], 2)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_full_blocks([b1], h, [7, 7], 0, 1)
    pool.cache_full_blocks([b2], h, [7, 7], 0, 1)       # a duplicate: the hash set did not change
    assert pool.take_events() == [BlockStored(h, None, [7, 7], 2)]
    pool.free_blocks([b1, b2])
    pool.get_new_blocks(2)                              # spare block 3, then b1: b2 still holds the hash
    assert pool.take_events() == []
    pool.get_new_blocks(1)                              # b2: the hash is gone
    assert pool.take_events() == [BlockRemoved(h)]


def test_a_stored_chain_is_split_around_blocks_already_cached():
    pool = BlockPool(8, 2, enable_kv_cache_events=True)
    tokens = [1, 1, 2, 2, 3, 3]
    hs = hash_block_chain(tokens, 2)
    other = pool.get_new_blocks(3)
    pool.cache_full_blocks(other, hs, tokens, 1, 2)      # only the middle block registered (its parent is not:
    pool.take_events()                                   # a contrived state, to split the run)
    mine = pool.get_new_blocks(3)
    pool.cache_full_blocks(mine, hs, tokens, 0, 3)
    assert pool.take_events() == [BlockStored([hs[0]], None, [1, 1], 2), BlockStored([hs[2]], hs[1], [3, 3], 2)]


# ---------------------------------------------------------------- scheduler level: real runs
PREFIXES = [[11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24, 25, 26], []]
add = st.tuples(st.just("add"), st.integers(0, 2), st.integers(1, 14), st.integers(1, 24), st.integers(0, 3))
sched_ops = st.lists(st.one_of(add, add, st.tuples(st.just("step"), st.integers(0, 10**6)),
                               st.tuples(st.just("step"), st.integers(0, 10**6)),
                               st.tuples(st.just("abort"), st.integers(0, 40)), st.tuples(st.just("reset"))),
                     min_size=12, max_size=80)


def _sample(s, so, seed):
    sampled = []
    for rid in so.num_scheduled_tokens:
        req = s.requests[rid]
        r = (seed + req.num_tokens) % 29
        sampled.append([EOS if r == 0 else 40 + r % 12] if req.num_computed_tokens >= req.num_tokens else [])
    return ModelRunnerOutput(list(so.num_scheduled_tokens), sampled)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=sched_ops, num_blocks=st.sampled_from([10, *range(5, 10), *range(11, 17)]), budget=st.integers(1, 24),
       max_seqs=st.sampled_from([4, 1, 2, 3, 5, 6]), salted=st.booleans())
def test_scheduler_events_replay_to_the_cached_hashes(ops, num_blocks, budget, max_seqs, salted):
    s = make_scheduler(num_blocks=num_blocks, block_size=4, max_model_len=64, max_num_batched_tokens=budget,
                       max_num_seqs=max_seqs)
    view: set = set()
    ids: list[str] = []
    for n, op in enumerate(ops):
        if op[0] == "add":
            _, pre, tail, max_tokens, salt = op
            prompt = PREFIXES[pre] + [40 + (n + i) % 9 for i in range(tail)]
            max_tokens = max(1, min(max_tokens, s.kv.max_tokens_capacity() - len(prompt)))
            try:
                s.add_request(make_request(f"r{n}", prompt, max_tokens=max_tokens,
                                           cache_salt=f"t{salt % 2}" if salted and salt else None))
                ids.append(f"r{n}")
            except InvalidRequestError:
                pass
        elif op[0] == "abort" and ids:
            s.abort_requests(ids[op[1] % len(ids)])
        elif op[0] == "step":
            so = s.schedule()
            s.update_from_output(so, _sample(s, so, op[1]))
        elif op[0] == "reset":
            s.reset_prefix_cache()
        replay(view, s.kv.take_events())
        assert view == set(s.kv.pool.cached)


# ---------------------------------------------------------------- the numbered log
def _stored(*tags: int) -> BlockStored:
    return BlockStored([bytes([t]) * 32 for t in tags], None, [0] * 2 * len(tags), 2)


def test_log_numbers_events_and_answers_from_any_held_number():
    log = KVEventLog("b:0", max_blocks=100)
    e = [_stored(1), _stored(2, 3), BlockRemoved([bytes([1]) * 32])]
    log.append("b:0", e[:2])
    log.append("b:0", [])
    log.append("b:0", e[2:])
    r = log.since(0, "b:0")
    assert (r.epoch, r.first_seq, r.events, r.next_seq, r.snapshot_required) == ("b:0", 0, e, 3, False)
    r = log.since(2, "b:0")
    assert (r.first_seq, r.events, r.next_seq) == (2, e[2:], 3)
    r = log.since(3, "b:0")
    assert (r.first_seq, r.events, r.next_seq, r.snapshot_required) == (3, [], 3, False)
    r = log.since(1, max_events=1)
    assert (r.first_seq, r.events, r.next_seq) == (1, e[1:2], 2)


def test_log_asks_for_a_snapshot_when_the_asker_cannot_follow_on():
    log = KVEventLog("b:0", max_blocks=3)
    log.append("b:0", [_stored(1), _stored(2, 3)])      # 3 blocks: both held
    log.append("b:0", [_stored(4)])                     # 4 > 3: the oldest goes
    assert (log.first_seq, log.next_seq, len(log)) == (1, 3, 2)
    assert log.since(0, "b:0").snapshot_required        # fell out of the buffer
    assert log.since(4, "b:0").snapshot_required        # ahead of the engine (another engine's numbers)
    assert log.since(1, "other:0").snapshot_required    # another epoch: a restart or a reset
    r = log.since(1, "b:0")
    assert not r.snapshot_required and r.first_seq == 1 and len(r.events) == 2
    failed = log.since(0, "b:0")
    assert (failed.epoch, failed.first_seq, failed.events, failed.next_seq) == ("b:0", 3, [], 3)


def test_a_new_epoch_empties_the_log_and_numbers_run_on():
    log = KVEventLog("b:0", max_blocks=10)
    log.append("b:0", [_stored(1), _stored(2)])
    log.append("b:1", [AllBlocksCleared(), _stored(3)])
    assert (log.epoch, log.first_seq, log.next_seq) == ("b:1", 2, 4)
    assert log.since(1, "b:0").snapshot_required
    r = log.since(2, "b:1")
    assert r.events == [AllBlocksCleared(), _stored(3)] and r.next_seq == 4


def test_one_event_larger_than_the_buffer_is_still_kept():
    log = KVEventLog("b:0", max_blocks=2)
    log.append("b:0", [_stored(1, 2, 3)])
    assert len(log) == 1 and log.since(0, "b:0").events == [_stored(1, 2, 3)]
