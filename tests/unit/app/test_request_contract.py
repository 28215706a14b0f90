"""The request contract from the ingress to the engine (issue 30.1): the ingress checks a request against the
replica's published limits once and builds its EngineRequest once; the replica's engine takes that very
object, does not check the limits again, and keeps the prompt list it was given."""
import pytest

from affinity_serve.app.fanout import replica_requests
from affinity_serve.app.prompts import RequestKind, prepare_request
from affinity_serve.app.protocol import CompletionRequest, GenerateRequest
from affinity_serve.engine.async_engine import AsyncLLMEngine
from affinity_serve.engine.config import EngineConfig
from affinity_serve.engine.limits import EngineLimits
from affinity_serve.engine.llm_engine import LLMEngine
from affinity_serve.engine.types import EngineRequest

PROMPT = [301, 415, 293, 606, 285, 114, 77, 508]


@pytest.fixture
def limits_checks(monkeypatch):
    calls: list[int] = []
    real = EngineLimits.check

    def counted(self, prompt, max_tokens):
        calls.append(max_tokens)
        return real(self, prompt, max_tokens)
    monkeypatch.setattr(EngineLimits, "check", counted)
    return calls


@pytest.mark.parametrize("n", [1, 2])
async def test_one_limits_check_from_the_ingress_to_the_scheduler(checkpoints, limits_checks, n):
    engine = LLMEngine.from_config(EngineConfig(model=checkpoints["llama"], cache={"num_blocks": 64, "block_size": 4}))
    eng = AsyncLLMEngine(engine, step_in_thread=False)
    body = CompletionRequest(prompt=PROMPT, max_tokens=3, n=n, temperature=1.0, seed=1)
    p = prepare_request(RequestKind.COMPLETION, body, "client-1", model_name="m",
                        limits=engine.limits, tokenizer=engine.tokenizer)
    [req] = replica_requests(p, {})
    assert isinstance(req, GenerateRequest) and isinstance(req, EngineRequest)
    assert req.request_id == "client-1" and req.req_id != "client-1" and req.checked_limits == engine.limits
    assert limits_checks == [3]                          # the ingress's check
    chunks = [d async for d in eng.generate(req)]
    assert limits_checks == [3]                          # and none in the engine
    assert sorted(d.index for d in chunks if d.finished) == list(range(n))
    assert all(d.req_id == req.req_id for d in chunks)
    await eng.shutdown()


async def test_the_scheduler_holds_the_ingress_prompt_list(checkpoints):
    engine = LLMEngine.from_config(EngineConfig(model=checkpoints["llama"], cache={"num_blocks": 64, "block_size": 4}))
    body = CompletionRequest(prompt=PROMPT, max_tokens=2)
    p = prepare_request(RequestKind.COMPLETION, body, "c", model_name="m", limits=engine.limits,
                        tokenizer=engine.tokenizer)
    [req] = replica_requests(p, {})
    engine.add_request(req)
    [seq] = engine.scheduler.requests.values()
    assert seq.prompt_token_ids is req.prompt_token_ids is p.prompts[0]
    while engine.has_unfinished_requests():
        engine.step()
