"""P/D spans (app/disagg.py): a prefill replica and a decode replica in this process (the prefill pool's handle
a stand-in that pickles the request as Serve does; KV through the session Ray's object store), spans caught by
OpenTelemetry's in-memory exporter. One trace: the decode replica's call to the prefill pool, under it the
prefill replica's prefill and copy-out, then the decode replica's transfer (its size and time) and decode."""
from __future__ import annotations

import asyncio
import pickle
import random

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

BLOCK = 4


class _Pool:
    """The prefill pool's handle: `prefill.remote(req, skip)`, the request pickled as Serve sends it."""

    def __init__(self, replica, fail: bool = False):
        self.replica, self.fail, self.prefill = replica, fail, self

    async def remote(self, req, skip):
        if self.fail:
            raise RuntimeError("prefill pool unreachable")
        return await self.replica.prefill(pickle.loads(pickle.dumps(req)), skip)


@pytest.fixture(scope="module")
def exporter(ray_serve):
    from affinity_serve.observability.setup import setup_telemetry
    exporter = InMemorySpanExporter()
    setup_telemetry().tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


@pytest.fixture
def pd(exporter, checkpoints):
    """Fresh replicas per test: an engine's step loop lives on the event loop of the test that started it."""
    from affinity_serve.app.disagg import DecodeReplica, PrefillReplica
    from affinity_serve.app.disagg_config import DisaggregationSection, PoolSection, pool_engine_config
    from affinity_serve.engine import EngineConfig
    section = DisaggregationSection(enabled=True, min_remote_prefill_tokens=8, transfer_timeout_s=5.0)
    engine = EngineConfig(model=checkpoints["llama"], num_threads=1, cache={"num_blocks": 128, "block_size": BLOCK})
    prefill = PrefillReplica(pool_engine_config(engine, PoolSection(), section))
    decode = DecodeReplica(pool_engine_config(engine, PoolSection(), section), None, None, _Pool(prefill), section)
    return prefill, decode, exporter


def _request(prompt, max_tokens, n=1):
    from opentelemetry import trace

    from affinity_serve.app.protocol import GenerateRequest
    from affinity_serve.engine import SamplingParams
    from affinity_serve.observability.setup import setup_telemetry
    from affinity_serve.observability.tracing import inject_carrier
    root = setup_telemetry().tracer.start_span("client")
    req = GenerateRequest(f"req-{random.random()}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                           ignore_eos=True, n=n),
                          trace_context=inject_carrier(trace.set_span_in_context(root)))
    return req, root


async def _run(decode, req) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    async for c in decode.generate(req):
        out.setdefault(c.index, []).extend(c.token_ids)
    return out


def _spans(exporter, root) -> dict[str, list]:
    trace_id = root.get_span_context().trace_id
    out: dict[str, list] = {}
    for s in exporter.get_finished_spans():
        if s.context.trace_id == trace_id:
            out.setdefault(s.name, []).append(s)
    return out


def _unified(checkpoints, prompt, max_tokens):
    from affinity_serve.engine import LLM, SamplingParams
    llm = LLM(checkpoints["llama"], cache={"num_blocks": 64, "block_size": BLOCK})
    return llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids


async def _pools_empty(*replicas) -> bool:
    deadline = asyncio.get_running_loop().time() + 30       # a loaded 2-core machine: seconds, not 50 ms steps
    while True:
        states = [await r.debug_state() for r in replicas]
        if all(s["num_free_blocks"] == s["num_blocks"] - 1 and not s["num_requests"] for s in states):
            return True
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.05)


async def test_prefill_transfer_and_decode_each_have_a_span_with_the_transfers_size_and_time(pd, checkpoints):
    prefill, decode, exporter = pd
    prompt = [random.Random(7).randrange(10, 700) for _ in range(37)]       # 9 full blocks
    req, root = _request(prompt, 6)
    out = await _run(decode, req)
    root.end()
    assert out[0] == list(_unified(checkpoints, prompt, 6))
    s = _spans(exporter, root)
    call, pre, copy, xfer, dec = (s[name] for name in ("llm.remote_prefill", "llm.pd.prefill", "llm.pd.copy_out",
                                                         "llm.pd.transfer", "llm.pd.decode"))
    assert [len(x) for x in (call, pre, copy, xfer, dec)] == [1, 1, 1, 1, 1]
    call, pre, copy, xfer, dec = call[0], pre[0], copy[0], xfer[0], dec[0]
    root_id = root.get_span_context().span_id
    # the prefill replica's spans hang under the decode replica's call; the rest under the request
    assert pre.parent.span_id == copy.parent.span_id == call.context.span_id
    assert call.parent.span_id == xfer.parent.span_id == dec.parent.span_id == root_id
    assert call.attributes["pd.fallback"] is False and call.attributes["pd.held_sequences"] == 1
    assert call.attributes["pd.prefill_replica"] == prefill.replica_id
    assert pre.attributes["pd.prompt_tokens"] == 37 and pre.attributes["pd.held_sequences"] == 1
    block_bytes = decode.engine.pd_block_bytes
    assert block_bytes > 0
    assert copy.attributes["pd.blocks"] == 9 and copy.attributes["pd.bytes"] == 9 * block_bytes
    a = xfer.attributes
    assert a["pd.outcome"] == "read" and a["pd.blocks"] == 9 and a["pd.bytes"] == 9 * block_bytes
    assert a["pd.seconds"] > 0 and abs((xfer.end_time - xfer.start_time) / 1e9 - a["pd.seconds"]) < 0.01
    # in order: the prefill ends before the copy-out, the copy-out before the read ends, the read before decoding
    assert pre.end_time <= copy.start_time and copy.end_time <= xfer.end_time <= dec.end_time
    assert dec.attributes["pd.output_tokens"] == 5 and dec.attributes["pd.sequences"] == 1
    assert await _pools_empty(prefill, decode)


async def test_n_sequences_make_one_read_and_a_failed_prefill_pool_makes_no_transfer_span(pd, checkpoints):
    prefill, decode, exporter = pd
    prompt = [random.Random(8).randrange(10, 700) for _ in range(29)]
    req, root = _request(prompt, 4, n=2)
    out = await _run(decode, req)
    root.end()
    ref = list(_unified(checkpoints, prompt, 4))
    assert out == {0: ref, 1: ref}
    xfers = _spans(exporter, root)["llm.pd.transfer"]
    outcomes = sorted(x.attributes["pd.outcome"] for x in xfers)
    assert outcomes.count("read") == 1 and set(outcomes) <= {"read", "local"}, outcomes
    assert [x.attributes["pd.blocks"] for x in xfers if x.attributes["pd.outcome"] == "read"] == [7]

    failing = type(decode).__new__(type(decode))          # the same replica, its prefill pool unreachable
    failing.__dict__.update(decode.__dict__)
    failing.prefill_handle = _Pool(prefill, fail=True)
    req, root = _request(prompt[:-1] + [5], 4)
    out = await _run(failing, req)
    root.end()
    s = _spans(exporter, root)
    assert s["llm.remote_prefill"][0].attributes["pd.fallback"] is True
    assert "llm.pd.transfer" not in s and "llm.pd.decode" not in s and "llm.engine" in s
    assert out[0] == list(_unified(checkpoints, prompt[:-1] + [5], 4))
    assert await _pools_empty(prefill, decode)
