"""Structured outputs on a CUDA device (issue 27): constrained decoding on the torch and Triton backends (CUDA
graphs with overlap_decode on the latter) gives outputs that parse and validate, greedy and sampled, n > 1,
beside unconstrained rows; the bitmask is filled in pinned host memory when the runner reads it (after the
forward was launched), crosses packed and is unpacked and applied on the device; filling it on the worker
thread instead gives exactly the same tokens. The CPU side of the same paths is tested in
tests/unit/engine/test_structured_output*.py. Skipped cleanly without CUDA or xgrammar."""
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "point": {"type": "object", "properties": {"x": {"type": "number", "minimum": -5, "maximum": 5},
                                                   "y": {"type": "boolean"}},
                  "required": ["x", "y"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}},
     "required": ["point", "tags"], "additionalProperties": False},
]


def _llm(path, backend: str):
    from affinity_serve.engine import LLM
    if backend == "triton":
        pytest.importorskip("triton", reason="needs the triton package")
    return LLM(path, device="cuda", dtype="float32", attention_backend=backend,
               cache={"memory_budget_bytes": 256 << 20}, scheduler={"max_num_seqs": 32})


def _run(eng) -> dict:
    out: dict = {}
    while eng.has_unfinished_requests():
        for d in eng.step().deltas:
            ids, text, _ = out.get((d.req_id, d.index), ([], "", None))
            out[(d.req_id, d.index)] = (ids + d.token_ids, text + d.text, d.finish_reason if d.finished else None)
    return out


def _workload(eng) -> None:
    from affinity_serve.engine import SamplingParams
    from affinity_serve.engine.structured_output import StructuredOutputSpec
    for i, schema in enumerate(SCHEMAS):
        spec = StructuredOutputSpec.from_schema(schema)
        eng.add_request(eng.make_request(f"Item {i}", SamplingParams(max_tokens=120, temperature=0.0,
                                                                  structured_output=spec), req_id=f"greedy{i}"))
        eng.add_request(eng.make_request(f"Item {i}", SamplingParams(n=3, max_tokens=120, temperature=1.0, seed=i,
                                                                     structured_output=spec),
                                         req_id=f"sampled{i}"))
    eng.add_request(eng.make_request("Code:", SamplingParams(max_tokens=12, temperature=0.0, structured_output=(
        StructuredOutputSpec(regex=r"[A-Z]{3}-\d{4}"))), req_id="regex"))
    for i in range(3):
        eng.add_request(eng.make_request([5 + i, 6, 7], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                                         req_id=f"free{i}"))


def _check(out) -> None:
    import re
    for (rid, _), (_, text, reason) in out.items():
        if rid.startswith(("greedy", "sampled")):
            assert reason == "stop", text
            jsonschema.validate(json.loads(text), SCHEMAS[int(rid[-1])])
        elif rid == "regex":
            assert re.fullmatch(r"[A-Z]{3}-\d{4}", text), text


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_constrained_decode_on_cuda_is_valid_and_masks_on_the_device(checkpoints, backend, monkeypatch):
    from affinity_serve.engine.structured_output.grammar import GrammarBitmask
    llm = _llm(checkpoints["llama"], backend)
    eng = llm.engine
    mgr = eng.structured_output
    assert not mgr.fill_on_thread and mgr.pin_memory        # CUDA: filled when read, in pinned memory
    seen: list[tuple[bool, str]] = []
    real = GrammarBitmask.token_mask

    def recording(self, row_req_ids, vocab_size, device):
        mask = real(self, row_req_ids, vocab_size, device)
        seen.append((self.packed.is_pinned(), mask.device.type))
        return mask

    monkeypatch.setattr(GrammarBitmask, "token_mask", recording)
    _workload(eng)
    out = _run(eng)
    _check(out)
    assert seen and all(pinned and dev == "cuda" for pinned, dev in seen)
    pool = eng.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1


def test_a_fill_on_the_thread_gives_the_same_tokens_on_cuda(checkpoints):
    """Same device, same batch: the bitmask filled on the worker thread from the step's start or when the runner
    reads it masks the same tokens, so every row (constrained or not) gets exactly the same ids."""
    outs = []
    for on_thread in (False, True):
        llm = _llm(checkpoints["llama"], "torch")
        llm.engine.structured_output.fill_on_thread = on_thread
        _workload(llm.engine)
        outs.append(_run(llm.engine))
    assert outs[0] == outs[1]
    _check(outs[1])


def test_overlap_decode_launches_nothing_ahead_for_constrained_rows_on_cuda(checkpoints):
    """CUDA graphs with overlap_decode (the Triton backend's default): a step launched ahead would sample before
    the grammar saw the previous token, so batches with constrained rows launch none; once they are done the
    unconstrained rows launch ahead again, and the constrained outputs validate."""
    from affinity_serve.engine import SamplingParams
    from affinity_serve.engine.request import RequestStatus
    from affinity_serve.engine.structured_output import StructuredOutputSpec
    llm = _llm(checkpoints["llama"], "triton")
    eng, runner = llm.engine, llm.engine.runner
    if not runner.overlap_decode:
        pytest.skip("CUDA graphs were not captured here")
    eng.add_request(eng.make_request("x", SamplingParams(max_tokens=120, temperature=0.0, structured_output=(
        StructuredOutputSpec.from_schema(SCHEMAS[1]))), req_id="json"))
    for i in range(4):
        eng.add_request(eng.make_request([9 + i, 10, 11], SamplingParams(max_tokens=200, temperature=0.0,
                                                                   ignore_eos=True), req_id=f"free{i}"))
    launched_while_constrained, text = 0, ""
    while eng.has_unfinished_requests():
        req = eng.scheduler.requests.get("json")
        constrained = req is not None and req.status is RequestStatus.RUNNING
        before = runner.num_launched_ahead
        for d in eng.step().deltas:
            text += d.text if d.req_id == "json" else ""
        if constrained:
            launched_while_constrained += runner.num_launched_ahead - before
    assert launched_while_constrained == 0 and runner.num_ahead_used > 0
    jsonschema.validate(json.loads(text), SCHEMAS[1])
