"""P/D over the NIXL transport (engine/kv_connector/nixl.py) at the engine level: a prefill engine and a decode engine,
each with its own NIXL agent (UCX over host memory here; VRAM on a GPU: tests/gpu/test_pd_disagg_cuda.py). The
decode engine reads the held blocks out of the prefill engine's KV cache with one-sided READs. Greedy output
token-exact against transformers; the reader's notification frees the hold; expired holds, a prefill engine gone,
a read slower than the timeout and a full staging area all end with every block back on both sides."""
from __future__ import annotations

import dataclasses
import random
import time

import pytest

from affinity_serve.engine import LLM, SamplingParams
from affinity_serve.engine.kv_connector.nixl import nixl_available
from tests.unit.engine.test_pd_disagg import (_assert_empty, _ids, _run, _settle_until_empty, async_pd_engine,
                                              decode_held_and_await_freed, prefill_and_hold)

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL's Python package is not installed "
                                "(pip install 'affinity-serve[nixl]')")

BS = 8
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _engine(path, transport_kw=None, num_blocks=64, transfer_timeout_s=30.0, load_timeout_s=30.0, **kw):
    from affinity_serve.engine.kv_connector.nixl import NixlTransport
    llm = LLM(path, cache={"num_blocks": num_blocks, "block_size": BS},
              kv_connector={"type": "pd", "transfer_timeout_s": transfer_timeout_s,
                            "load_timeout_s": load_timeout_s}, **kw)
    t = NixlTransport(**(transport_kw or {}))
    llm.engine.set_kv_transport(t)
    return llm.engine, t


def _close(*engines):
    """Close each engine (and with it its NIXL transport: its agent and notification thread)."""
    for e in engines:
        if e is not None:
            e.close()


def _prefill(p, rid, prompt, params):
    one = SamplingParams(**{**{k: getattr(params, k) for k in ("n", "temperature", "ignore_eos", "seed")},
                            "max_tokens": 1})
    from affinity_serve.engine.kv_connector import RemoteDecode
    toks, finals = _run(p, rid, prompt, one, RemoteDecode())
    return toks, [f.kv_transfer for f in finals]


@pytest.fixture
def nixl_pair(checkpoints):
    path = checkpoints["llama"]
    (p, tp), (d, td) = _engine(path), _engine(path)
    yield path, p, d, tp, td
    _close(p, d)


@pytest.mark.parametrize("n_prompt", [9, 17, 40, 65, 130])
def test_greedy_pd_over_nixl_equals_transformers(nixl_pair, hf_reference, n_prompt):
    path, p, d, tp, td = nixl_pair
    prompt = _ids(n_prompt, n_prompt)
    params = SamplingParams(max_tokens=8, **GREEDY)
    ref = hf_reference(path, prompt, 8)
    first, remotes = _prefill(p, "r", prompt, params)
    addr = remotes[0].address
    assert type(addr).__name__ == "NixlAddress" and addr.agent == tp.name and addr.mem_type == "DRAM"
    assert len(addr.block_ids) == n_prompt // BS
    rest, _ = _run(d, "r", prompt, params, remotes, others=(p,))
    assert first[0] + rest[0] == ref
    _settle_until_empty(p, d)
    _assert_empty(p, d)
    assert d.pd.stats.loads_ok == 1 and d.pd.stats.loaded_blocks == n_prompt // BS
    # freed by the reader's notification, not by the timeout
    assert p.pd.pd_stats.holds_read == 1 and p.pd.pd_stats.holds_expired == 0
    assert td.reads_posted == 1 and tp.notifications >= 1
    rec = td.take_record("r")
    assert rec.outcome == "read" and rec.num_blocks == n_prompt // BS


def test_a_local_prefix_is_not_read_again_and_a_whole_hit_releases(nixl_pair, hf_reference):
    path, p, d, tp, td = nixl_pair
    prompt = _ids(64, 3)
    params = SamplingParams(max_tokens=6, **GREEDY)
    ref = hf_reference(path, prompt, 6)
    # the decode engine holds the first 32 tokens (4 blocks) already
    d.add_request(d.make_request(prompt[:33], SamplingParams(max_tokens=1, **GREEDY), req_id="warm"))
    while d.has_unfinished_requests():
        d.step()
    first, remotes = _prefill(p, "a", prompt, params)
    rest, _ = _run(d, "a", prompt, params, remotes, others=(p,))
    assert first[0] + rest[0] == ref
    assert d.pd.stats.loaded_blocks == 8 - 4
    # the same prompt again: the decode engine now holds every block; the prefill side's hold is released
    first, remotes = _prefill(p, "b", prompt, params)
    rest, _ = _run(d, "b", prompt, params, remotes, others=(p,))
    assert first[0] + rest[0] == ref
    _settle_until_empty(p, d)
    _assert_empty(p, d)
    assert p.pd.pd_stats.holds_released == 1 and td.take_record("b").outcome == "local"


def test_n_greater_than_one_reads_each_sequence(nixl_pair, hf_reference):
    path, p, d, tp, td = nixl_pair
    prompt = _ids(40, 5)
    params = SamplingParams(n=3, max_tokens=5, **GREEDY)
    ref = hf_reference(path, prompt, 5)
    first, remotes = _prefill(p, "n3", prompt, params)
    rest, _ = _run(d, "n3", prompt, params, remotes, others=(p,))
    assert [f + r for f, r in zip(first, rest)] == [ref] * 3
    _settle_until_empty(p, d)
    _assert_empty(p, d)


def test_prefill_engine_gone_before_the_read_recomputes(checkpoints, hf_reference):
    path = checkpoints["llama"]
    (p, tp), (d, _) = _engine(path), _engine(path, load_timeout_s=3.0)
    try:
        prompt = _ids(48, 7)
        params = SamplingParams(max_tokens=6, **GREEDY)
        first, remotes = _prefill(p, "g", prompt, params)
        p.close()                       # closes its transport too: its agent is gone
        assert tp.closed
        # its agent is gone: the metadata names an agent nobody answers for (a dead process)
        rest, _ = _run(d, "g", prompt, params, remotes)
        assert first[0] + rest[0] == hf_reference(path, prompt, 6)
        assert d.pd.stats.loads_failed == 1 and d.pd.stats.loads_ok == 0
        _settle_until_empty(d)
        _assert_empty(d)
    finally:
        _close(d)


def test_an_expired_hold_is_not_read(checkpoints, hf_reference):
    path = checkpoints["llama"]
    (p, _), (d, td) = _engine(path, transfer_timeout_s=0.5), _engine(path, transport_kw={"expiry_margin_s": 0.2})
    try:
        prompt = _ids(48, 8)
        params = SamplingParams(max_tokens=6, **GREEDY)
        first, remotes = _prefill(p, "x", prompt, params)
        time.sleep(0.6)
        _settle_until_empty(p)             # the prefill side freed it at its timeout, unread
        assert p.pd.pd_stats.holds_expired == 1
        rest, _ = _run(d, "x", prompt, params, remotes)
        assert first[0] + rest[0] == hf_reference(path, prompt, 6)
        assert d.pd.stats.loads_failed == 1 and td.reads_posted == 0
        assert td.take_record("x").outcome == "expired"
        _settle_until_empty(p, d)
        _assert_empty(p, d)
    finally:
        _close(p, d)


def test_a_full_staging_area_makes_reads_wait_not_fail(checkpoints, hf_reference):
    path = checkpoints["llama"]
    p, tp = _engine(path)
    d = td = None
    try:
        prompt_a, prompt_b = _ids(64, 11), _ids(64, 12)
        params = SamplingParams(max_tokens=4, **GREEDY)
        first_a, ra = _prefill(p, "a", prompt_a, params)
        first_b, rb = _prefill(p, "b", prompt_b, params)
        # room for one 8-block read at a time: the second waits for the first's room
        block_bytes = p.pd_block_bytes
        d, td = _engine(path, transport_kw={"staging_bytes": 8 * block_bytes + 256})
        d.add_request(d.make_request(prompt_a, params, kv_transfer=ra, req_id="a"))
        d.add_request(d.make_request(prompt_b, params, kv_transfer=rb, req_id="b"))
        toks: dict[str, list[int]] = {"a": [], "b": []}
        deadline = time.monotonic() + 30
        while d.has_unfinished_requests() and time.monotonic() < deadline:
            for delta in d.step().deltas:
                toks[delta.req_id].extend(delta.token_ids)
            p.step()
        assert first_a[0] + toks["a"] == hf_reference(path, prompt_a, 4)
        assert first_b[0] + toks["b"] == hf_reference(path, prompt_b, 4)
        assert d.pd.stats.loads_ok == 2 and d.pd.stats.loads_failed == 0
        assert td.reads_posted == 2 and 2 * 8 * block_bytes > td.staging_bytes
        _settle_until_empty(p, d)
        _assert_empty(p, d)
        assert td.staging_bytes_free() == td.staging_bytes      # every region back
    finally:
        _close(p, d)


def test_a_read_larger_than_the_staging_area_gets_its_own_buffer(checkpoints, hf_reference):
    path = checkpoints["llama"]
    (p, _), (d, _) = _engine(path), _engine(path, transport_kw={"staging_bytes": 4096})
    try:
        prompt = _ids(72, 13)
        params = SamplingParams(max_tokens=4, **GREEDY)
        first, remotes = _prefill(p, "big", prompt, params)
        rest, _ = _run(d, "big", prompt, params, remotes, others=(p,))
        assert first[0] + rest[0] == hf_reference(path, prompt, 4)
        assert d.pd.stats.loads_ok == 1
        _settle_until_empty(p, d)
        _assert_empty(p, d)
    finally:
        _close(p, d)


def test_abort_storm_over_nixl_leaks_nothing(checkpoints):
    path = checkpoints["llama"]
    (p, _), (d, td) = _engine(path, num_blocks=128), _engine(path, num_blocks=128)
    try:
        rng = random.Random(0)
        params = SamplingParams(max_tokens=12, **GREEDY)
        remotes = {}
        for i in range(12):
            rid = f"s{i}"
            _, remotes[rid] = _prefill(p, rid, _ids(rng.randrange(9, 70), 100 + i), params)
        for i, (rid, rem) in enumerate(remotes.items()):
            d.add_request(d.make_request(_ids(rem[0].num_tokens, 100 + i), params, kv_transfer=rem, req_id=rid))
        for step in range(40):
            d.step()
            p.step()
            if step % 3 == 0:
                live = [r for r in remotes if r in d._parents]
                if live:
                    d.abort_request(rng.choice(live))
        _settle_until_empty(p, d, timeout_s=20)
        _assert_empty(p, d)
        assert td.num_draining() == 0 and td.staging_bytes_free() == td.staging_bytes and not td._in_flight
    finally:
        _close(p, d)


def test_a_transfer_from_another_transport_recomputes(nixl_pair, hf_reference):
    path, p, d, tp, td = nixl_pair
    prompt = _ids(40, 21)
    params = SamplingParams(max_tokens=4, **GREEDY)
    first, remotes = _prefill(p, "o", prompt, params)
    plain = [dataclasses.replace(r, address=None) for r in remotes]
    rest, _ = _run(d, "o", prompt, params, plain)
    assert first[0] + rest[0] == hf_reference(path, prompt, 4)
    assert d.pd.stats.loads_failed == 1
    assert td.take_record("o").outcome == "incompatible"


def _prefill_in_process(path, prompt, out, cmd):
    """A prefill engine in its own process: prefills `prompt`, sends (first tokens, RemotePrefill), then waits for
    "stats" (sends its P/D counters once its hold is freed) or to be killed."""
    from affinity_serve.engine.kv_connector import RemoteDecode
    p, tp = _engine(path)
    toks, finals = _run(p, "x", prompt, SamplingParams(max_tokens=1, **GREEDY), RemoteDecode())
    out.put((toks, [f.kv_transfer for f in finals]))
    if cmd.get(timeout=60) == "stats":
        deadline = time.monotonic() + 20
        while len(p.pd.held) and time.monotonic() < deadline:
            p.step()
            time.sleep(0.01)
        p.step()
        out.put(dataclasses.asdict(p.pd.pd_stats))
    _close(p)


@pytest.mark.parametrize("prefill_dies", [False, True], ids=["alive", "killed"])
def test_a_prefill_engine_in_another_process(checkpoints, hf_reference, prefill_dies):
    """Across processes (UCX between two agents): the read succeeds and the prefill process frees its hold on the
    reader's notification; or the prefill process is killed (SIGKILL) after its prefill and before the read, and
    the decode engine recomputes, token-exact, with its pool empty and no staging left taken."""
    import multiprocessing as mp
    path = checkpoints["llama"]
    prompt = _ids(56, 31)
    params = SamplingParams(max_tokens=6, **GREEDY)
    ctx = mp.get_context("spawn")
    out, cmd = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_prefill_in_process, args=(path, prompt, out, cmd), daemon=True)
    proc.start()
    d, td = _engine(path, load_timeout_s=5.0)
    try:
        first, remotes = out.get(timeout=120)
        assert remotes[0].address.agent != td.name
        if prefill_dies:
            proc.kill()
            proc.join(timeout=10)
        rest, _ = _run(d, "x", prompt, params, remotes)
        assert first[0] + rest[0] == hf_reference(path, prompt, 6)
        if prefill_dies:
            assert d.pd.stats.loads_failed == 1 and d.pd.stats.loads_ok == 0
        else:
            assert d.pd.stats.loads_ok == 1 and d.pd.stats.loaded_blocks == 56 // BS
            cmd.put("stats")
            stats = out.get(timeout=60)
            assert stats["holds_read"] == 1 and stats["holds_expired"] == 0
        _settle_until_empty(d)
        _assert_empty(d)
        assert td.num_draining() == 0 and td.staging_bytes_free() == td.staging_bytes
    finally:
        if proc.is_alive():
            cmd.put("stop")
            proc.join(timeout=20)
            if proc.is_alive():
                proc.kill()
        _close(d)


@pytest.mark.parametrize("layout", ["torch", "flash", "block-first"])
def test_read_descriptors_cover_each_block_for_any_backend_layout(layout):
    """The READ's descriptor rows, applied as plain byte copies, stage exactly the blocks asked for, whatever the
    prefill backend's axis order, for scattered block ids (runs merged: fewer rows than blocks)."""
    import torch

    from affinity_serve.engine.kv_connector.nixl import NixlAddress, NixlBlocks, _descriptors, _Geometry, _Room
    from affinity_serve.engine.kv_connector.worker import block_view_permutation
    shapes = {"torch": lambda nb, bs, h, d: (2, h, nb, bs, d), "flash": lambda nb, bs, h, d: (2, nb, bs, h, d),
              "block-first": lambda nb, bs, h, d: (nb, 2, h, bs, d)}
    perm = block_view_permutation(shapes[layout])
    shape = shapes[layout](20, 4, 3, 8)
    tensors = [torch.randn(shape) for _ in range(2)]
    ids = [3, 4, 5, 9, 1, 2, 17]
    addr = NixlAddress("a", b"", "DRAM", tuple((t.data_ptr(), 0) for t in tensors), shape, perm, "float32",
                       tuple(ids), 0.0)
    geo = _Geometry(shape, perm, 4)
    start, n = 1, 5                                              # blocks 4, 5, 9, 1, 2
    staging = torch.zeros(geo.block_bytes * n * 2, dtype=torch.uint8)
    local, remote = _descriptors(geo, addr, start, n, staging.data_ptr(), 0)
    assert len(remote) == 2 * geo.chunks * 3                     # runs [4, 5], [9], [1, 2]
    src = {t.data_ptr(): t.view(-1).view(torch.uint8) for t in tensors}
    for (la, ln, _), (ra, rn, _) in zip(local.tolist(), remote.tolist()):
        assert ln == rn
        base = max(b for b in src if b <= ra)
        off = ra - base
        staging[la - staging.data_ptr():la - staging.data_ptr() + ln] = src[base][off:off + rn]
    got = NixlBlocks(None, _Room(staging, 0, staging.numel(), False), geo, 2, torch.float32, n).layers()
    want_ids = torch.tensor(ids[start:start + n])
    for t, g in zip(tensors, got):
        assert torch.equal(g, t.index_select(perm[0], want_ids).permute(perm))


async def test_an_idle_prefill_engine_frees_a_read_hold_at_once(checkpoints, hf_reference):
    """The notification thread wakes an idle AsyncLLMEngine (wake_threadsafe), whose next step frees the blocks:
    not at the next request, nor at transfer_timeout_s."""
    import asyncio

    from affinity_serve.engine.kv_connector.nixl import NixlTransport
    path = checkpoints["llama"]
    p = async_pd_engine(path, 60.0)
    tp = NixlTransport(on_hold_freed=p.wake_threadsafe)
    p.set_kv_transport(tp)
    d, td = _engine(path)
    try:
        prompt = _ids(48, 41)
        final = await prefill_and_hold(p, prompt, "w")
        pool = p.engine.kv_cache_manager.pool
        await asyncio.sleep(0.1)
        assert len(p.engine.pd.held) == 1 and pool.num_free_blocks < p.engine.num_blocks - 1   # held, idle
        await decode_held_and_await_freed(p, d, final, prompt, hf_reference(path, prompt, 4), 2.0)   # not 60 s
    finally:
        _close(d)
        await p.shutdown()              # closes its engine and with it tp
        assert tp.closed


def test_a_read_that_fails_in_flight_gives_everything_back(nixl_pair, hf_reference):
    """NIXL raises from check_xfer_state when a transfer fails (a peer gone mid-read): the read is a 'missing'
    failure, the request recomputes, and its staging room, handle and in-flight count all come back."""
    path, p, d, tp, td = nixl_pair
    prompt = _ids(48, 61)
    params = SamplingParams(max_tokens=4, **GREEDY)
    first, remotes = _prefill(p, "f", prompt, params)

    def broken(handle):
        raise RuntimeError("NIXL_ERR_REMOTE_DISCONNECT")
    td._agent.check_xfer_state = broken
    rest, _ = _run(d, "f", prompt, params, remotes)
    assert first[0] + rest[0] == hf_reference(path, prompt, 4)
    assert d.pd.stats.loads_failed == 1 and d.pd.stats.load_failures_missing == 1
    assert td.take_record("f").outcome == "missing"
    assert td.staging_bytes_free() == td.staging_bytes and not td._in_flight


def test_reads_larger_than_the_area_take_their_own_buffer_one_at_a_time(checkpoints, hf_reference):
    path = checkpoints["llama"]
    (p, _), (d, td) = _engine(path), _engine(path, transport_kw={"staging_bytes": 4096})
    try:
        params = SamplingParams(max_tokens=4, **GREEDY)
        prompts = {"u": _ids(72, 71), "v": _ids(80, 72)}
        prefilled = {rid: _prefill(p, rid, pr, params) for rid, pr in prompts.items()}
        for rid, pr in prompts.items():
            d.add_request(d.make_request(pr, params, kv_transfer=prefilled[rid][1], req_id=rid))
        toks = {rid: [] for rid in prompts}
        deadline = time.monotonic() + 30
        while d.has_unfinished_requests() and time.monotonic() < deadline:
            for delta in d.step().deltas:
                toks[delta.req_id].extend(delta.token_ids)
            assert not (td._own_buffer_busy and td.num_draining())
            p.step()
        for rid, pr in prompts.items():
            assert prefilled[rid][0][0] + toks[rid] == hf_reference(path, pr, 4)
        assert d.pd.stats.loads_ok == 2 and not td._own_buffer_busy
        _settle_until_empty(p, d)
        _assert_empty(p, d)
    finally:
        _close(p, d)


def test_the_transport_checks_its_arguments():
    from affinity_serve.engine.kv_connector.nixl import NixlTransport
    for kw, what in (({"staging_bytes": 0}, "staging_bytes"), ({"notify_poll_s": 0}, "notify_poll_s"),
                     ({"expiry_margin_s": -1}, "expiry_margin_s"), ({"max_records": 0}, "max_records")):
        with pytest.raises(ValueError, match=what):
            NixlTransport(**kw)
