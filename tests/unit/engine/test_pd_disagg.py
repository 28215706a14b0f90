"""P/D disaggregation at the engine level (engine/kv_connector/pd.py): a prefill engine and a decode engine in
one process over the LocalTransport. Greedy output token-exact against unified serving and transformers;
prefix hits on either side; n > 1; failures (the prefill engine gone, a read never made, a slow read, abort
storms) end with every KV block back in both pools."""
from __future__ import annotations

import dataclasses
import random
import time

import pytest

from affinity_serve.engine import LLM, SamplingParams
from affinity_serve.engine.errors import InvalidRequestError
from affinity_serve.engine.kv_connector import LocalTransport, RemoteDecode, RemotePrefill

BS = 8
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(10, 700) for _ in range(n)]


def _engine(path, num_blocks=64, transfer_timeout_s=30.0, load_timeout_s=30.0, **kw):
    llm = LLM(path, cache={"num_blocks": num_blocks, "block_size": BS},
              kv_connector={"type": "pd", "transfer_timeout_s": transfer_timeout_s,
                            "load_timeout_s": load_timeout_s}, **kw)
    return llm.engine


def _run(engine, rid, prompt, params, kv_transfer=None, timeout_s=60.0, others=()):
    """Add one request and step until it finishes: (token ids per sequence, finishing deltas by index).
    `others` (engines) step beside it (a prefill engine freeing its holds as they are read)."""
    engine.add_request(engine.make_request(prompt, params, kv_transfer=kv_transfer, req_id=rid))
    toks: dict[int, list[int]] = {}
    final = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for d in engine.step().deltas:
            if d.req_id != rid:
                continue
            toks.setdefault(d.index, []).extend(d.token_ids)
            if d.finished:
                final[d.index] = d
        for o in others:
            o.step()
        if len(final) == params.n:
            return [toks.get(i, []) for i in range(params.n)], [final[i] for i in range(params.n)]
    raise AssertionError(f"{rid} did not finish")


def _prefill(p, rid, prompt, params):
    one = SamplingParams(**{**_fields(params), "max_tokens": 1})
    toks, finals = _run(p, rid, prompt, one, RemoteDecode())
    return toks, [f.kv_transfer for f in finals]


def _fields(params):
    return {k: getattr(params, k) for k in ("n", "temperature", "ignore_eos", "max_tokens", "seed", "logprobs")}


def _pd(p, d, rid, prompt, params):
    """The P/D path: prefill + first token on p, the rest on d; tokens per sequence as one stream."""
    first, remotes = _prefill(p, rid, prompt, params)
    assert all(r is not None for r in remotes)
    rest, _ = _run(d, rid, prompt, params, remotes)
    return [f + r for f, r in zip(first, rest)]


def _settle(*engines, steps=20):
    for _ in range(steps):
        for e in engines:
            e.step()


def _settle_until_empty(*engines, timeout_s=30.0):
    """Step until every block is back, or `timeout_s` passed: a read still running on the transport's thread
    frees its hold on the prefill side when it ends, which a loaded machine can delay (then _assert_empty)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _settle(*engines, steps=1)
        if all(e.kv_cache_manager.pool.num_free_blocks == e.num_blocks - 1 and not e.scheduler.held_blocks()
               and not e.pd.held and not e.scheduler.requests for e in engines):
            return
        time.sleep(0.01)


def async_pd_engine(path: str, transfer_timeout_s: float):
    """An AsyncLLMEngine with the pd connector (a prefill side), 64 blocks of BS tokens."""
    from affinity_serve.engine.async_engine import AsyncLLMEngine
    from affinity_serve.engine.config import EngineConfig
    connector = {"type": "pd", "transfer_timeout_s": transfer_timeout_s}
    return AsyncLLMEngine.from_config(EngineConfig(model=path, cache={"num_blocks": 64, "block_size": BS},
                                                   kv_connector=connector))


async def prefill_and_hold(p, prompt: list[int], req_id: str):
    """Async P/D prefill engine `p` prefills `prompt` (one greedy token) for a remote decode and holds its KV;
    returns the last delta (its first token and kv_transfer)."""
    final = None
    async for delta in p.generate(p.make_request(prompt, SamplingParams(max_tokens=1, **GREEDY),
                                                 kv_transfer=RemoteDecode(), req_id=req_id)):
        final = delta
    assert final is not None and final.finished and final.kv_transfer is not None
    return final


async def decode_held_and_await_freed(p, d, final, prompt: list[int], reference: list[int], timeout_s: float):
    """Decode engine `d` reads the KV async prefill engine `p` holds for `final` (prefill_and_hold's delta) and
    generates len(reference) tokens in all: assert they are `reference`, and that the idle `p` frees the hold
    (read) within `timeout_s` without a step of its own being asked for."""
    import asyncio
    rest, _ = await asyncio.to_thread(_run, d, final.req_id, prompt,
                                      SamplingParams(max_tokens=len(reference), **GREEDY), [final.kv_transfer])
    assert final.token_ids + rest[0] == reference
    await await_holds_freed(p, timeout_s)
    assert p.engine.pd.pd_stats.holds_read == 1


async def await_holds_freed(p, timeout_s: float) -> None:
    """Wait (without stepping: the async engine's own loop must) until async engine `p` holds no P/D transfer and
    every KV block is free; assert it did within `timeout_s`."""
    import asyncio
    pool = p.engine.kv_cache_manager.pool
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not len(p.engine.pd.held) and pool.num_free_blocks == p.engine.num_blocks - 1:
            return
        await asyncio.sleep(0.01)
    assert not len(p.engine.pd.held) and pool.num_free_blocks == p.engine.num_blocks - 1, "holds not freed"


def _assert_empty(*engines):
    for e in engines:
        pool = e.kv_cache_manager.pool
        assert pool.num_free_blocks == e.num_blocks - 1, "KV blocks leaked"
        assert not e.scheduler.held_blocks()
        assert len(e.pd.held) == 0
        assert not e.scheduler.requests


@pytest.fixture
def pair(checkpoints):
    path = checkpoints["llama"]
    p, d = _engine(path), _engine(path)
    yield path, p, d
    p.close()
    d.close()


@pytest.mark.parametrize("n_prompt", [1, 7, 8, 9, 15, 16, 17, 31, 40, 63, 64, 65, 130])
def test_greedy_pd_equals_unified_and_transformers(pair, hf_reference, n_prompt):
    path, p, d = pair
    prompt = _ids(n_prompt, n_prompt)
    params = SamplingParams(max_tokens=8, **GREEDY)
    ref = hf_reference(path, prompt, 8)
    unified = LLM(path, cache={"num_blocks": 64, "block_size": BS}).generate(prompt, params, use_tqdm=False)
    assert unified[0].outputs[0].token_ids == ref
    assert _pd(p, d, "r", prompt, params) == [ref]
    _settle(p, d)
    st = d.pd.stats
    if n_prompt >= BS:
        assert st.loads_ok == 1 and st.loaded_blocks == n_prompt // BS and st.loads_failed == 0
        assert p.pd.pd_stats.holds == p.pd.pd_stats.holds_read == 1
    else:
        assert st.loads_ok == 0 and p.pd.pd_stats.holds == 0     # nothing full to move
    _assert_empty(p, d)


def test_chunked_prefill_on_the_prefill_side(checkpoints, hf_reference):
    path = checkpoints["qwen2"]
    p = _engine(path, scheduler={"max_num_batched_tokens": 16, "long_prefill_token_threshold": 12})
    d = _engine(path)
    prompts = [_ids(n, 100 + n) for n in (45, 77, 96)]
    for i, prompt in enumerate(prompts):
        assert _pd(p, d, f"c{i}", prompt, SamplingParams(max_tokens=10, **GREEDY)) == [hf_reference(path, prompt, 10)]
    _settle(p, d)
    assert d.pd.stats.loads_ok == 3
    _assert_empty(p, d)


def test_prefix_hits_on_either_side_are_not_transferred_again(pair, hf_reference):
    path, p, d = pair
    shared = _ids(48, 7)                         # 6 full blocks
    a, b = shared + _ids(13, 8), shared + _ids(21, 9)
    params = SamplingParams(max_tokens=6, **GREEDY)
    assert _pd(p, d, "a", a, params) == [hf_reference(path, a, 6)]
    loaded_a = d.pd.stats.loaded_blocks
    assert loaded_a == len(a) // BS
    assert _pd(p, d, "b", b, params) == [hf_reference(path, b, 6)]
    # P hit its 6 shared blocks; D had them too and read only b's own full blocks
    assert d.pd.stats.loaded_blocks - loaded_a == len(b) // BS - 6
    assert d.pd.pd_stats.remote_local_blocks == 6
    # the same prompt again: D holds every full block, reads none, and frees P's hold at once
    assert _pd(p, d, "b2", b, params) == [hf_reference(path, b, 6)]
    assert d.pd.stats.loads_ok == 2 and d.pd.pd_stats.remote_released == 1
    _settle(p, d)
    assert p.pd.pd_stats.holds_released == 1
    _assert_empty(p, d)


def test_cached_tokens_count_prefix_hits_on_either_side_not_the_kv_read(pair, checkpoints):
    """A cold prompt reports 0 cached tokens in P/D mode, as in unified mode: the KV the decode engine read was
    computed for this request. The prefill engine's own prefix hits, and the decode engine's, do count."""
    path, p, d = pair
    shared = _ids(48, 11)                        # 6 full blocks
    a, b = shared + _ids(13, 12), shared + _ids(21, 13)
    params = SamplingParams(max_tokens=4, **GREEDY)
    unified = LLM(path, cache={"num_blocks": 64, "block_size": BS})
    expect = [o.num_cached_tokens for o in unified.generate([a], params, use_tqdm=False)]
    expect += [o.num_cached_tokens for o in unified.generate([b], params, use_tqdm=False)]
    assert expect == [0, 48]

    def decode_cached(dec, rid, prompt):
        first, remotes = _prefill(p, rid, prompt, params)
        _, finals = _run(dec, rid, prompt, params, remotes)
        return finals[0].num_cached_tokens

    assert decode_cached(d, "a", a) == 0                 # cold: all 7 blocks read, none of them a hit
    assert decode_cached(d, "b", b) == 48                # both sides hold the shared blocks
    c = shared + _ids(30, 14)
    fresh = _engine(path)
    try:
        assert decode_cached(fresh, "c", c) == 48        # only the prefill engine held them: its hit counts
        assert fresh.kv_cache_manager.stats.hits == 48   # and the hit-rate signals read the same
        _settle(p, d, fresh)
        assert fresh.pd.stats.loaded_blocks == len(c) // BS
        _settle_until_empty(p, d, fresh)
        _assert_empty(p, d, fresh)
    finally:
        fresh.close()


def test_n_greater_than_one_reads_once(pair, hf_reference):
    path, p, d = pair
    prompt = _ids(50, 3)
    params = SamplingParams(n=3, max_tokens=7, **GREEDY)
    out = _pd(p, d, "n3", prompt, params)
    assert out == [hf_reference(path, prompt, 7)] * 3
    _settle(p, d)
    # one sibling read the 6 full blocks; the others hit them locally and released their holds
    assert d.pd.stats.loads_ok == 1 and d.pd.pd_stats.remote_released == 2
    assert p.pd.pd_stats.holds == 3 and p.pd.pd_stats.holds_read == 1 and p.pd.pd_stats.holds_released == 2
    _assert_empty(p, d)


def test_read_starts_on_arrival_not_at_admission(checkpoints, hf_reference):
    """A decode engine full (max_num_seqs 1) with a long decode: a prefilled request that arrives reads its KV
    at once (WAITING_FOR_KV, outside max_num_seqs) while the other decodes, and is admitted as a prefix hit
    when the seat frees; its tokens are still exact."""
    path = checkpoints["llama"]
    p, d = _engine(path), _engine(path, scheduler={"max_num_seqs": 1})
    busy, late = _ids(30, 41), _ids(50, 42)
    d.add_request(d.make_request(busy, SamplingParams(max_tokens=40, **GREEDY), req_id="busy"))
    for _ in range(3):
        d.step()
    params = SamplingParams(max_tokens=6, **GREEDY)
    first, remotes = _prefill(p, "late", late, params)
    d.add_request(d.make_request(late, params, kv_transfer=remotes, req_id="late"))
    seen_loaded_while_busy = False
    toks: dict[str, list[int]] = {"busy": [], "late": []}
    for _ in range(200):
        for delta in d.step().deltas:
            toks[delta.req_id].extend(delta.token_ids)
        if d.pd.stats.loads_ok == 1 and "busy" in d.scheduler.requests:
            seen_loaded_while_busy = True
        if not d.has_unfinished_requests():
            break
    assert seen_loaded_while_busy, "the read waited for the decode seat"
    assert d.pd.stats.loaded_blocks == len(late) // BS and d.pd.stats.lookups == 1
    assert first[0] + toks["late"] == hf_reference(path, late, 6)
    _settle(p, d)
    _assert_empty(p, d)
    p.close()
    d.close()


def test_sampled_first_token_is_continued_not_resampled(pair):
    path, p, d = pair
    prompt = _ids(40, 11)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=5, ignore_eos=True, logprobs=2)
    first, remotes = _prefill(p, "s", prompt, params)
    assert remotes[0].first_token_id == first[0][0]
    rest, finals = _run(d, "s", prompt, params, remotes)
    assert len(rest[0]) == 5 and finals[0].finish_reason == "length"
    _settle(p, d)
    _assert_empty(p, d)


def test_seeded_sampling_continues_as_on_one_engine(pair):
    """A seeded sampled request gives the same tokens in P/D mode as unified, every sequence of n = 3, and a
    sequence continued without its siblings (they ended on their first token) still draws from its own seed."""
    path, p, d = pair
    prompt = _ids(37, 17)
    params = SamplingParams(n=3, max_tokens=9, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    unified = LLM(path, cache={"num_blocks": 64, "block_size": BS}).generate(prompt, params, use_tqdm=False)
    ref = [o.token_ids for o in sorted(unified[0].outputs, key=lambda o: o.index)]
    assert len({tuple(r) for r in ref}) == 3                 # the three draw differently
    assert _pd(p, d, "s3", prompt, params) == ref
    first, remotes = _prefill(p, "gap", prompt, params)
    assert [r.seq_index for r in remotes] == [0, 1, 2]
    rest, _ = _run(d, "gap", prompt, SamplingParams(**{**_fields(params), "n": 2, "top_p": 0.9}), remotes[1:])
    assert [first[1] + rest[0], first[2] + rest[1]] == ref[1:]
    p.kv_source.release_held(remotes[0].transfer_id)        # the sequence that "ended" holds nothing on
    _settle(p, d, steps=40)
    _assert_empty(p, d)


@pytest.mark.parametrize("spec", [
    {"regex": r"[a-z]{2,5}-\d{3}"},
    {"grammar": 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'},
    {"choice": ("alpha", "beta", "gamma delta")},
], ids=["regex", "ebnf", "choice"])
def test_structured_output_continues_from_a_remote_prefill(pair, spec):
    """The prefill engine masks the first token by the grammar; the decode engine's matcher starts past it:
    the output is the one unified serving gives (greedy and seeded n = 2), ending where it ends."""
    pytest.importorskip("xgrammar")
    from affinity_serve.engine.structured_output.spec import StructuredOutputSpec
    path, p, d = pair
    prompt = _ids(29, 5)
    for params in (SamplingParams(max_tokens=30, temperature=0.0, structured_output=StructuredOutputSpec(**spec)),
                   SamplingParams(n=2, max_tokens=30, temperature=1.0, seed=11,
                                  structured_output=StructuredOutputSpec(**spec))):
        unified = LLM(path, cache={"num_blocks": 64, "block_size": BS}).generate(prompt, params, use_tqdm=False)
        outs = sorted(unified[0].outputs, key=lambda o: o.index)
        ref = [o.token_ids for o in outs]
        if "choice" in spec:
            assert all(o.finish_reason == "stop" for o in outs)   # the grammar ends them
        first, finals = _run(p, f"so{params.n}", prompt, dataclasses.replace(params, max_tokens=1), RemoteDecode())
        remotes = [f.kv_transfer for f in finals]
        assert all(r is not None for r in remotes)     # none of these grammars ends on one token
        rest, finals = _run(d, f"so{params.n}", prompt, params, remotes)
        assert [f + r for f, r in zip(first, rest)] == ref
        assert [f.finish_reason for f in finals] == [o.finish_reason for o in outs]
    _settle(p, d)
    _assert_empty(p, d)


def test_stop_on_the_first_token_holds_nothing(pair):
    path, p, d = pair
    prompt = _ids(40, 12)
    tok = _run(p, "probe", prompt, SamplingParams(max_tokens=1, **GREEDY))[0][0][0]
    toks, finals = _run(p, "x", prompt, SamplingParams(max_tokens=1, temperature=0.0, stop_token_ids=[tok]),
                        RemoteDecode())
    assert finals[0].finish_reason == "stop" and finals[0].kv_transfer is None
    assert p.pd.pd_stats.holds == 0
    _assert_empty(p)


# ------------------------------------------------------------------ failures
def test_prefill_engine_gone_before_the_read_recomputes(checkpoints, hf_reference):
    path = checkpoints["llama"]
    transport = LocalTransport()
    p, d = _engine(path), _engine(path)
    for e in (p, d):
        e.set_kv_transport(transport)
    transport.register(p.pd.engine_id, p.kv_source)
    prompt = _ids(60, 21)
    params = SamplingParams(max_tokens=8, **GREEDY)
    first, remotes = _prefill(p, "dead", prompt, params)
    transport.unregister(p.pd.engine_id)           # the prefill replica died
    rest, finals = _run(d, "dead", prompt, params, remotes)
    assert [first[0] + rest[0]] == [hf_reference(path, prompt, 8)]
    assert finals[0].finish_reason == "length"
    st = d.pd.stats
    assert st.loads_failed == 1 and st.load_failures_missing == 1 and st.loads_ok == 0
    _settle(d)
    _assert_empty(d)


def test_unread_transfer_is_freed_at_the_timeout(checkpoints):
    path = checkpoints["llama"]
    p = _engine(path, transfer_timeout_s=0.3)
    prompt = _ids(60, 22)
    _prefill(p, "orphan", prompt, SamplingParams(max_tokens=8, **GREEDY))
    assert len(p.pd.held) == 1 and p.scheduler.held_blocks()
    p.step()
    assert len(p.pd.held) == 1, "freed before the timeout"
    time.sleep(0.35)
    assert p.has_unfinished_requests(), "an expired hold must get a step to free it"
    p.step()
    assert p.pd.pd_stats.holds_expired == 1
    _assert_empty(p)
    # a late reader finds nothing and would recompute
    with pytest.raises(Exception, match="not held"):
        p.kv_source.read_held_blocks("orphan", 0, 1)


def test_read_slower_than_the_timeout_recomputes(checkpoints, hf_reference):
    path = checkpoints["llama"]
    transport = LocalTransport(delay_s=0.6)
    p, d = _engine(path), _engine(path, load_timeout_s=0.2)
    for e in (p, d):
        e.set_kv_transport(transport)
    transport.register(p.pd.engine_id, p.kv_source)
    prompt = _ids(60, 23)
    params = SamplingParams(max_tokens=8, **GREEDY)
    first, remotes = _prefill(p, "slow", prompt, params)
    rest, _ = _run(d, "slow", prompt, params, remotes)
    assert [first[0] + rest[0]] == [hf_reference(path, prompt, 8)]
    assert d.pd.stats.loads_failed == 1 and d.pd.stats.load_failures_timed_out == 1
    _settle_until_empty(p, d, timeout_s=10.0)      # the slow read reaches P at last and frees its hold
    _assert_empty(p, d)
    assert p.pd.pd_stats.holds_expired == 0            # the read freed it, not P's timeout (30 s)


def test_abort_storm_leaks_nothing_on_either_side(checkpoints):
    path = checkpoints["llama"]
    transport = LocalTransport(delay_s=0.01)
    p, d = _engine(path, num_blocks=48, transfer_timeout_s=0.5), _engine(path, num_blocks=48)
    for e in (p, d):
        e.set_kv_transport(transport)
    transport.register(p.pd.engine_id, p.kv_source)
    rng = random.Random(0)
    prompts = [_ids(rng.randrange(5, 90), 300 + i) for i in range(24)]
    remotes = {}
    for i, prompt in enumerate(prompts):
        p.add_request(p.make_request(prompt, SamplingParams(max_tokens=1, **GREEDY), kv_transfer=RemoteDecode(),
                                     req_id=f"p{i}"))
    live_p = {f"p{i}" for i in range(len(prompts))}
    live_d: set[str] = set()
    for step in range(400):
        for d_ in p.step().deltas:
            if d_.finished:
                live_p.discard(d_.req_id)
                if d_.kv_transfer is not None:
                    remotes[d_.req_id] = d_.kv_transfer
        if step % 3 == 0 and live_p:                         # abort prefills mid-flight
            victim = rng.choice(sorted(live_p))
            p.abort_request(victim)
            live_p.discard(victim)
        for rid in list(remotes):
            i = int(rid[1:])
            r = remotes.pop(rid)
            if rng.random() < 0.2:
                continue                                     # this decode never comes: P's timeout frees it
            d.add_request(d.make_request(prompts[i], SamplingParams(max_tokens=12, **GREEDY), kv_transfer=[r],
                                         req_id=f"d{i}"))
            live_d.add(f"d{i}")
        for d_ in d.step().deltas:
            if d_.finished:
                live_d.discard(d_.req_id)
        if step % 2 == 0 and live_d:                         # abort decodes waiting for KV or running
            victim = rng.choice(sorted(live_d))
            d.abort_request(victim)
            live_d.discard(victim)
        if not live_p and not remotes and not live_d and step > 50:
            break
    time.sleep(0.6)                      # past P's transfer timeout: its unread holds expire
    _settle_until_empty(p, d)            # and the reads still on the transport's threads end
    ps = p.pd.pd_stats
    assert ps.holds > 5 and ps.holds_read > 0 and ps.holds_expired > 0, ps   # the storm took every path
    assert ps.holds == ps.holds_read + ps.holds_released + ps.holds_expired
    _assert_empty(p, d)


def test_bad_kv_transfer_requests_are_rejected(pair):
    path, p, d = pair
    prompt = _ids(20, 1)
    with pytest.raises(InvalidRequestError, match="exactly one token"):
        p.add_request(p.make_request(prompt, SamplingParams(max_tokens=4), kv_transfer=RemoteDecode(), req_id="a"))
    remote = RemotePrefill("x", "y", d.pd.layout_key, 20, 2, 5)
    with pytest.raises(InvalidRequestError, match="n=2"):
        d.add_request(d.make_request(prompt, SamplingParams(max_tokens=4, n=2), kv_transfer=[remote], req_id="b"))
    with pytest.raises(InvalidRequestError, match="another length"):
        d.add_request(d.make_request(prompt[:-1], SamplingParams(max_tokens=4), kv_transfer=[remote], req_id="c"))
    with pytest.raises(InvalidRequestError, match="only token"):
        d.add_request(d.make_request(prompt, SamplingParams(max_tokens=1), kv_transfer=[remote], req_id="d"))
    plain = LLM(path, cache={"num_blocks": 16, "block_size": BS}).engine
    with pytest.raises(InvalidRequestError, match="kv_connector.type pd"):
        plain.add_request(plain.make_request(prompt, SamplingParams(max_tokens=1), kv_transfer=RemoteDecode(),
                                             req_id="e"))
    assert not p.scheduler.requests and not d.scheduler.requests


def test_incompatible_layout_recomputes(pair, hf_reference):
    path, p, d = pair
    prompt = _ids(40, 31)
    params = SamplingParams(max_tokens=5, **GREEDY)
    first, remotes = _prefill(p, "i", prompt, params)
    import dataclasses
    bad = [dataclasses.replace(remotes[0], layout_key="other-model")]
    reasons = []
    release = d.pd.transport.release
    d.pd.transport.release = lambda remote, reason="local": (reasons.append(reason), release(remote, reason))[1]
    rest, _ = _run(d, "i", prompt, params, bad)
    assert [first[0] + rest[0]] == [hf_reference(path, prompt, 5)]
    assert d.pd.pd_stats.incompatible == 1 and d.pd.stats.loads_failed == 1
    assert reasons == ["incompatible"]           # the transfer's span says why nothing was read, not "local"
    _settle(p, d)
    assert p.pd.pd_stats.holds_released == 1     # D told P it would read nothing
    _assert_empty(p, d)


def test_stop_string_on_the_first_token_releases_the_hold(pair):
    path, p, d = pair
    prompt = _ids(40, 13)
    text = p.tokenizer.decode(_run(p, "probe", prompt, SamplingParams(max_tokens=1, **GREEDY))[0][0])
    if not text.strip():
        pytest.skip("the first token decodes to whitespace")
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, stop=[text.strip()[:1]])
    toks, finals = _run(p, "s", prompt, params, RemoteDecode())
    assert finals[0].finish_reason == "stop" and finals[0].kv_transfer is None
    _settle(p)
    assert p.pd.pd_stats.holds_released == 1
    _assert_empty(p)


def _text(engine, rid, prompt, params, kv_transfer=None):
    """One sequence's text as its deltas carry it, and its finishing delta."""
    engine.add_request(engine.make_request(prompt, params, kv_transfer=kv_transfer, req_id=rid))
    text, deadline = "", time.monotonic() + 60
    while time.monotonic() < deadline:
        for d in engine.step().deltas:
            if d.req_id == rid:
                text += d.text
                if d.finished:
                    return text, d
    raise AssertionError(f"{rid} did not finish")


def _pd_text(p, d, rid, prompt, params) -> tuple[str, str | None]:
    one = dataclasses.replace(params, max_tokens=1)
    first, fin = _text(p, rid, prompt, one, RemoteDecode())
    if fin.kv_transfer is None:                 # ended on the prefill engine (a stop on the first token)
        return first, fin.finish_reason
    rest, fin = _text(d, rid, prompt, params, [fin.kv_transfer])
    return first + rest, fin.finish_reason


def _unified_text(engine, rid, prompt, params) -> tuple[str, str | None]:
    text, fin = _text(engine, rid, prompt, params)
    return text, fin.finish_reason


def test_text_is_unified_when_the_first_token_only_begins_a_character(pair):
    """A first token that is part of a multi-byte character: the prefill engine used to end its text with
    U+FFFD, and the decode engine then sent the whole character after it (an extra U+FFFD, or one in place of
    a real character). Now the prefill engine holds it back and the decode engine sends it when complete."""
    path, p, d = pair
    params = SamplingParams(max_tokens=5, **GREEDY)
    tried = 0
    for seed in range(60):
        prompt = _ids(40, 500 + seed)
        ids = _run(p, f"u{seed}", prompt, params)[0][0]
        if "\ufffd" not in p.tokenizer.decode(ids[:1]):
            continue
        tried += 1
        assert _pd_text(p, d, f"pd{seed}", prompt, params) == _unified_text(p, f"w{seed}", prompt, params), seed
        if tried == 4:
            break
    assert tried == 4, "fewer prompts whose first token is part of a character than expected"
    _settle_until_empty(p, d)
    _assert_empty(p, d)


def test_a_stop_string_across_the_first_and_second_token_is_cut_as_unified(pair):
    """The stop string starts in the first token's text and ends in the second's: the prefill engine used to
    send the first token's whole text, so the part before the cut was already out (even without streaming)."""
    path, p, d = pair
    tried = 0
    for seed in range(60):
        prompt = _ids(40, 700 + seed)
        ids = _run(p, f"u{seed}", prompt, SamplingParams(max_tokens=6, **GREEDY))[0][0]
        first, whole = (p.tokenizer.decode(x, skip_special_tokens=True, clean_up_tokenization_spaces=False)
                        for x in (ids[:1], ids))
        if not first or "\ufffd" in whole or not whole.startswith(first) or len(whole) <= len(first):
            continue
        stop = whole[len(first) - 1:len(first) + 1]
        if whole.find(stop) != len(first) - 1:
            continue
        tried += 1
        params = SamplingParams(max_tokens=6, stop=[stop], **GREEDY)
        unified = _unified_text(p, f"w{seed}", prompt, params)
        assert unified == (whole[:len(first) - 1], "stop")
        assert _pd_text(p, d, f"pd{seed}", prompt, params) == unified, seed
        if tried == 3:
            break
    assert tried == 3
    _settle_until_empty(p, d)
    _assert_empty(p, d)


def test_min_tokens_is_kept_across_the_split_as_on_one_engine(pair):
    """The prefill call asks for one token: the app's params for it (app/disagg.py prefill_sampling_params) keep
    min_tokens at most 1 (a request's min_tokens 5 with max_tokens 1 was refused there, so every such request
    fell back to recomputing), and the decode side counts the first token towards the rest: the stops masked
    until the 5th token are the unified engine's."""
    from affinity_serve.app.disagg import prefill_sampling_params
    path, p, d = pair
    prompt = _ids(40, 23)
    plain = LLM(path, cache={"num_blocks": 64, "block_size": BS}).generate(
        prompt, SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)[0].outputs[0].token_ids
    # stop on the tokens greedy decoding emits 2nd and 4th: min_tokens 5 masks them until the 5th token
    params = SamplingParams(max_tokens=8, min_tokens=5, stop_token_ids=[plain[1], plain[3]], **GREEDY)
    unified = LLM(path, cache={"num_blocks": 64, "block_size": BS}).generate(prompt, params, use_tqdm=False)
    want = unified[0].outputs[0].token_ids
    assert len(want) >= 5 and want != plain[:len(want)]          # the mask changed the output
    one = prefill_sampling_params(params)
    assert (one.max_tokens, one.min_tokens) == (1, 1)
    first, finals = _run(p, "m", prompt, one, RemoteDecode())
    remotes = [f.kv_transfer for f in finals]
    assert remotes[0] is not None
    rest, _ = _run(d, "m", prompt, params, remotes)
    assert first[0] + rest[0] == want
    _settle(p, d)
    _assert_empty(p, d)


async def test_an_idle_prefill_engine_does_not_spin_while_it_holds_kv_and_frees_it_at_the_timeout(checkpoints):
    """A hold for a reader needs no steps: the async engine's loop sleeps (it used to step thousands of times a
    second for as long as a hold lasted) and wakes at the hold's timeout to free the blocks."""
    import asyncio
    p = async_pd_engine(checkpoints["llama"], 0.6)
    try:
        await prefill_and_hold(p, _ids(40, 3), "h")
        assert len(p.engine.pd.held) == 1
        steps = p.engine.num_steps
        await asyncio.sleep(0.3)
        assert p.engine.num_steps - steps <= 1 and len(p.engine.pd.held) == 1       # idle, still held
        await await_holds_freed(p, 2.0)
        assert p.engine.pd.pd_stats.holds_expired == 1
        assert p.engine.num_steps - steps <= 3
    finally:
        await p.shutdown()


async def test_an_idle_prefill_engine_frees_a_hold_as_soon_as_it_is_read(checkpoints, hf_reference):
    """Over the in-process transport: the read's end wakes the idle async prefill engine (HeldTransfers.on_done),
    which frees the blocks at once, not at the hold's timeout."""
    import asyncio
    path = checkpoints["llama"]
    p = async_pd_engine(path, 60.0)
    d = _engine(path)
    try:
        prompt = _ids(40, 9)
        final = await prefill_and_hold(p, prompt, "z")
        await asyncio.sleep(0.1)
        assert len(p.engine.pd.held) == 1
        await decode_held_and_await_freed(p, d, final, prompt, hf_reference(path, prompt, 4), 1.0)   # not 60 s
    finally:
        d.close()
        await p.shutdown()
