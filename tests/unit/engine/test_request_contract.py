"""The engine's request contract (issue 30.1): one EngineRequest in, checked once, its prompt not copied; one
duplicate-id check with one error type; one delta type out."""
import pytest

from affinity_serve.engine.async_engine import AsyncLLMEngine
from affinity_serve.engine.config import EngineConfig
from affinity_serve.engine.errors import ContextLengthExceededError, DuplicateRequestError
from affinity_serve.engine.limits import EngineLimits
from affinity_serve.engine.llm_engine import LLMEngine
from affinity_serve.engine.sampling_params import SamplingParams
from affinity_serve.engine.types import EngineRequest, RequestDelta

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture
def engine(checkpoints):
    return LLMEngine.from_config(EngineConfig(model=checkpoints["llama"], cache={"num_blocks": 64, "block_size": 4}))


@pytest.fixture
def limits_checks(monkeypatch):
    """Every EngineLimits.check call, as (prompt length, max_tokens)."""
    calls: list[tuple[int, int]] = []
    real = EngineLimits.check

    def counted(self, prompt, max_tokens):
        calls.append((prompt if isinstance(prompt, int) else len(prompt), max_tokens))
        return real(self, prompt, max_tokens)
    monkeypatch.setattr(EngineLimits, "check", counted)
    return calls


def _drain(engine: LLMEngine) -> list[RequestDelta]:
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step().deltas
    return deltas


@pytest.mark.parametrize("n", [1, 3])
def test_limits_are_checked_once_per_request_and_the_prompt_is_not_copied(engine, limits_checks, n):
    prompt = [5, 6, 7, 8, 9]
    req = EngineRequest("a", prompt, SamplingParams(n=n, max_tokens=4, seed=1, temperature=1.0, ignore_eos=True))
    engine.add_request(req)
    assert limits_checks == [(5, 4)]                      # once, whatever n: the siblings share prompt and limits
    seqs = list(engine.scheduler.requests.values())
    assert len(seqs) == n and all(s.prompt_token_ids is prompt for s in seqs)
    deltas = _drain(engine)
    assert {(d.req_id, d.index) for d in deltas} == {("a", i) for i in range(n)}
    assert all(type(d) is RequestDelta for d in deltas) and sum(d.finished for d in deltas) == n
    assert limits_checks == [(5, 4)]
    pool = engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1


def test_a_request_checked_against_these_limits_is_not_checked_again(engine, limits_checks):
    engine.add_request(EngineRequest("a", [5, 6, 7], SamplingParams(max_tokens=2, **GREEDY),
                                     checked_limits=engine.limits))
    assert limits_checks == []
    # checked against other limits (another replica's): checked here
    other = EngineLimits(engine.max_model_len + 1, None, 10**6)
    engine.add_request(EngineRequest("b", [5, 6, 7], SamplingParams(max_tokens=2, **GREEDY), checked_limits=other))
    assert limits_checks == [(3, 2)]
    _drain(engine)


def test_a_request_over_the_limits_changes_nothing(engine):
    with pytest.raises(ContextLengthExceededError) as e:
        engine.add_request(EngineRequest("long", [5] * engine.max_model_len, SamplingParams(max_tokens=1)))
    assert e.value.param == "prompt"
    assert not engine.has_unfinished_requests() and not engine.scheduler.requests


def test_a_duplicate_id_is_one_error_type_for_a_request_and_for_a_sibling(engine):
    engine.add_request(EngineRequest("a", [5, 6, 7], SamplingParams(n=2, max_tokens=3, seed=1, temperature=1.0)))
    before = set(engine.scheduler.requests)
    for dup in (EngineRequest("a", [8, 9], SamplingParams(max_tokens=3)),
                EngineRequest("a#1", [8, 9], SamplingParams(max_tokens=3))):     # sibling 1 of "a"'s id
        with pytest.raises(DuplicateRequestError) as e:
            engine.add_request(dup)
        assert e.value.param == "request_id" and e.value.code == "duplicate_request_id"
    assert set(engine.scheduler.requests) == before
    _drain(engine)
    engine.add_request(EngineRequest("a", [8, 9], SamplingParams(max_tokens=2, **GREEDY)))    # reusable once done
    _drain(engine)


async def test_async_generate_checks_once_and_refuses_an_open_id(engine, limits_checks):
    eng = AsyncLLMEngine(engine, step_in_thread=False)
    first = eng.generate(EngineRequest("x", [5, 6, 7, 8], SamplingParams(max_tokens=3, **GREEDY)))
    d = await first.__anext__()
    with pytest.raises(DuplicateRequestError):
        await eng.generate(EngineRequest("x", [5, 6], SamplingParams(max_tokens=2))).__anext__()
    rest = [c async for c in first]
    assert [t for c in [d, *rest] for t in c.token_ids] and rest[-1].finished
    assert limits_checks == [(4, 3)]          # once; the duplicate is refused before any other check
    await eng.shutdown()
