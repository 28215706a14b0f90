"""Issue 27: the grammar bitmask is filled while the forward runs (on CPU on the manager's worker thread, from
the moment the step is scheduled; on CUDA when the sampler reads it, after the forward was launched). The
outputs must be exactly those of a fill done in order, and valid, under batching with unconstrained rows,
n > 1, preemption with chunked prefill, and aborts, with every matcher and KV block released."""
from __future__ import annotations

import gc
import json
import re
import threading
import weakref

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from affinity_serve.engine.config import EngineConfig  # noqa: E402
from affinity_serve.engine.llm_engine import LLMEngine, StepError  # noqa: E402
from affinity_serve.engine.sampling_params import SamplingParams  # noqa: E402
from affinity_serve.engine.structured_output import StructuredOutputSpec  # noqa: E402
from tests.unit.engine.test_structured_output import SCHEMAS, _assert_released  # noqa: E402


def _engine(checkpoints, fill_on_thread: bool, check_first: bool = False, **kw) -> LLMEngine:
    """`check_first` off by default: these tests are about the whole fill (greedy steps would ask first)."""
    cfg = {"model": checkpoints["llama"], "cache": {"num_blocks": 128, "block_size": 4}, **kw}
    eng = LLMEngine.from_config(EngineConfig.model_validate(cfg))
    eng.structured_output.fill_on_thread = fill_on_thread
    eng.structured_output.check_first = check_first
    return eng


def _workload(eng: LLMEngine) -> None:
    """Constrained rows of every kind beside unconstrained ones, greedy and seeded-sampled, n = 2 and 3."""
    for i, schema in enumerate(SCHEMAS):
        eng.add_request(eng.make_request(f"Item {i} as JSON", SamplingParams(
            n=2, max_tokens=120, temperature=1.0, seed=10 + i,
            structured_output=StructuredOutputSpec.from_schema(schema)), req_id=f"json{i}"))
    eng.add_request(eng.make_request("Code:", SamplingParams(max_tokens=12, temperature=0.0,
                                                             structured_output=StructuredOutputSpec(regex=r"[A-Z]{3}-\d{4}")),
                                     req_id="regex"))
    mood = StructuredOutputSpec(choice=("good", "bad"))
    eng.add_request(eng.make_request("Mood:", SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=3,
                                                             structured_output=mood),
                                     req_id="choice"))
    for i in range(3):
        eng.add_request(eng.make_request([5 + i, 6, 7, 8], SamplingParams(max_tokens=30, temperature=0.0,
                                                                    ignore_eos=True), req_id=f"free{i}"))


def _step(eng: LLMEngine, out: dict[tuple[str, int], list]) -> None:
    for d in eng.step().deltas:
        ids, text, _ = out.setdefault((d.req_id, d.index), [[], "", None])
        out[(d.req_id, d.index)] = [ids + d.token_ids, text + d.text, d.finish_reason if d.finished else None]


def _run(eng: LLMEngine, out: dict | None = None) -> dict[tuple[str, int], tuple[list[int], str, str]]:
    """(request id, index) -> (token ids, text, finish_reason), adding to `out` (deltas of earlier steps)."""
    out = {} if out is None else out
    while eng.has_unfinished_requests():
        _step(eng, out)
    return {k: tuple(v) for k, v in out.items()}


def _check_valid(out) -> None:
    for (rid, _), (_, text, reason) in out.items():
        if rid.startswith("json"):
            assert reason == "stop", text
            jsonschema.validate(json.loads(text), SCHEMAS[int(rid[4:])])
        elif rid == "regex":
            assert re.fullmatch(r"[A-Z]{3}-\d{4}", text) and reason == "stop", text
        elif rid == "choice":
            assert text in ("good", "bad") and reason == "stop", text
        elif rid.startswith("loose"):
            assert re.fullmatch(r"[^{}]*", text), text


@pytest.mark.parametrize("kw", [
    {},
    # a pool too small for all rows at once (preempted and recomputed mid-grammar), prompts in chunks of 4
    {"cache": {"num_blocks": 40, "block_size": 4},
     "scheduler": {"long_prefill_token_threshold": 4, "max_num_batched_tokens": 16}},
], ids=["batched", "preempted"])
def test_a_fill_on_the_thread_gives_exactly_the_in_order_outputs(checkpoints, kw):
    ref = _engine(checkpoints, fill_on_thread=False, **kw)
    _workload(ref)
    want = _run(ref)
    eng = _engine(checkpoints, fill_on_thread=True, **kw)
    _workload(eng)
    got = _run(eng)
    assert got == want
    _check_valid(got)
    if kw:
        assert eng.last_stats.num_preemptions_total > 0
    _assert_released(eng)
    _assert_released(ref)


def test_the_fill_runs_on_the_worker_thread_before_the_forward_ends(checkpoints, monkeypatch):
    """On CPU the engine fills on its worker thread (fill_on_thread is its default there; from 4 constrained
    rows: n = 4 here), and the fill is handed to that thread before the step's logits are computed: it
    overlaps the forward instead of following it. (When the thread actually starts is the OS's choice: the
    hand-off is what the engine controls.)"""
    eng = LLMEngine.from_config(EngineConfig.model_validate({"model": checkpoints["llama"],
                                                 "cache": {"num_blocks": 128, "block_size": 4}}))
    assert eng.structured_output.fill_on_thread
    eng.structured_output.check_first = False          # greedy rows would be asked first, not filled ahead
    events: list[tuple[str, str]] = []
    fill = eng.structured_output._fill

    def recording_fill(*a):
        events.append(("fill", threading.current_thread().name))
        return fill(*a)

    monkeypatch.setattr(eng.structured_output, "_fill", recording_fill)
    handed = eng.structured_output.grammar_bitmask

    def recording_hand_off(*a):
        bitmask = handed(*a)
        if bitmask is not None:
            events.append(("handed", ""))
        return bitmask

    monkeypatch.setattr(eng.structured_output, "grammar_bitmask", recording_hand_off)
    model = eng.runner.model
    logits = model.compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda h: (events.append(("logits", "")), logits(h))[1])
    eng.add_request(eng.make_request("x", SamplingParams(n=4, max_tokens=30, temperature=0.0,
                                                         structured_output=StructuredOutputSpec.from_schema(SCHEMAS[0])),
                                     req_id="j"))
    out = _run(eng)
    for i in range(4):
        jsonschema.validate(json.loads(out[("j", i)][1]), SCHEMAS[0])
    fills = [i for i, (what, _) in enumerate(events) if what == "fill"]
    assert len(fills) == len(out[("j", 0)][0])           # one fill per step (the 4 rows run in step)
    assert all(events[i][1].startswith("grammar-bitmask") for i in fills)
    # each step's fill was handed to the thread before that step's logits (the next "logits" event)
    steps = [what for what, _ in events if what in ("handed", "logits")]
    handed_at = [i for i, w in enumerate(steps) if w == "handed"]
    assert len(handed_at) == len(fills) and all(steps[i + 1] == "logits" for i in handed_at)


@pytest.mark.parametrize("fill_on_thread", [False, True])
def test_aborts_mid_grammar_release_the_matchers(checkpoints, fill_on_thread):
    """Aborted while their grammars are advancing (n = 4, beside a request that goes on): the aborted
    sequences' matchers are freed (nothing in the manager or a pending fill holds them), the survivor still
    validates, every KV block returns."""
    eng = _engine(checkpoints, fill_on_thread)
    spec = StructuredOutputSpec.from_schema(SCHEMAS[1])
    eng.add_request(eng.make_request("a", SamplingParams(n=4, max_tokens=60, temperature=1.0, seed=1,
                                                         structured_output=spec),
                                     req_id="gone"))
    eng.add_request(eng.make_request("b", SamplingParams(max_tokens=200, temperature=1.0, seed=2,
                                                         structured_output=spec),
                                     req_id="kept"))
    refs, seen = [], {}
    while len(refs) < 4:
        _step(eng, seen)
        refs = [weakref.ref(eng.scheduler.requests[f"gone#{i}"].structured_output.matcher) for i in range(4)
                if eng.scheduler.requests[f"gone#{i}"].structured_output.is_ready]
    for _ in range(3):
        _step(eng, seen)
    assert all(seen.get(("gone", i)) and seen[("gone", i)][2] is None for i in range(4))   # mid-grammar
    eng.abort_request("gone")
    out = _run(eng, seen)
    gc.collect()
    assert all(r() is None for r in refs)
    _, text, reason = out[("kept", 0)]
    assert reason == "stop", text
    jsonschema.validate(json.loads(text), SCHEMAS[1])
    _assert_released(eng)


def test_a_failed_step_waits_for_its_fill_and_frees_the_rows(checkpoints, monkeypatch):
    """The forward raises while the fill runs on the thread: the step waits for the fill before the failed
    requests' matchers are dropped, and the engine serves the next request."""
    eng = _engine(checkpoints, fill_on_thread=True)
    spec = StructuredOutputSpec.from_schema(SCHEMAS[0])
    eng.add_request(eng.make_request("x", SamplingParams(n=4, max_tokens=40, temperature=0.0, structured_output=spec),
                                     req_id="a"))
    while not eng.scheduler.requests["a#0"].output_token_ids:
        eng.step()
    fill_done = threading.Event()
    fill = eng.structured_output._fill
    monkeypatch.setattr(eng.structured_output, "_fill", lambda *a: (fill(*a), fill_done.set())[0])
    model = eng.runner.model
    real = model.compute_logits

    def boom(h):
        raise RuntimeError("device lost")

    monkeypatch.setattr(model, "compute_logits", boom)
    with pytest.raises(StepError):
        eng.step()
    assert fill_done.is_set()
    monkeypatch.setattr(model, "compute_logits", real)
    eng.add_request(eng.make_request("y", SamplingParams(max_tokens=40, temperature=0.0, structured_output=spec),
                                     req_id="b"))
    out = _run(eng)
    jsonschema.validate(json.loads(out[("b", 0)][1]), SCHEMAS[0])
    _assert_released(eng)


def _counting(eng: LLMEngine, monkeypatch) -> tuple[list[int], list[int]]:
    """[rows filled], [tokens asked] of `eng`'s manager, counted as it runs."""
    filled, asked = [0], [0]
    fill, ask = eng.structured_output._fill, eng.structured_output._ask
    monkeypatch.setattr(eng.structured_output, "_fill",
                        lambda m, *a: (filled.__setitem__(0, filled[0] + len(m)), fill(m, *a))[1])
    monkeypatch.setattr(eng.structured_output, "_ask",
                        lambda *a: (asked.__setitem__(0, asked[0] + len(a[2])), ask(*a))[1])
    return filled, asked


def _greedy_workload(eng: LLMEngine) -> None:
    """Every row greedy (so steps ask first): JSON schemas (n = 1 and 2), regexes, a choice (n = 3), free rows.
    The loose regex's rows mostly allow the random model's argmax (only those are not filled)."""
    for i, schema in enumerate(SCHEMAS):
        eng.add_request(eng.make_request(f"Item {i} as JSON", SamplingParams(
            n=1 + i % 2, max_tokens=120, temperature=0.0,
            structured_output=StructuredOutputSpec.from_schema(schema)), req_id=f"json{i}"))
    eng.add_request(eng.make_request("Code:", SamplingParams(
        max_tokens=12, temperature=0.0, structured_output=StructuredOutputSpec(regex=r"[A-Z]{3}-\d{4}")),
        req_id="regex"))
    eng.add_request(eng.make_request("Mood:", SamplingParams(
        n=3, max_tokens=8, temperature=0.0, structured_output=StructuredOutputSpec(choice=("good", "bad"))),
        req_id="choice"))
    for i in range(4):
        eng.add_request(eng.make_request(f"Words {i}:", SamplingParams(
            max_tokens=24, temperature=0.0, structured_output=StructuredOutputSpec(regex="[^{}]+")),
            req_id=f"loose{i}"))
    for i in range(3):
        eng.add_request(eng.make_request([5 + i, 6, 7, 8], SamplingParams(max_tokens=30, temperature=0.0,
                                                                    ignore_eos=True), req_id=f"free{i}"))


@pytest.mark.parametrize("kw", [
    {},
    {"cache": {"num_blocks": 40, "block_size": 4},
     "scheduler": {"long_prefill_token_threshold": 4, "max_num_batched_tokens": 16}},
], ids=["batched", "preempted"])
def test_greedy_steps_that_ask_first_give_exactly_the_whole_fills_outputs(checkpoints, kw, monkeypatch):
    """check_first: a greedy step asks each row's matcher about its argmax and fills only the rows it bans;
    the tokens are exactly those of the whole fill (on the thread or when read), batched and under preemption
    with chunked prefill, and fewer rows are filled."""
    want = whole = None
    for fill_on_thread in (False, True):
        ref = _engine(checkpoints, fill_on_thread, **kw)
        filled, _ = _counting(ref, monkeypatch)
        _greedy_workload(ref)
        out = _run(ref)
        assert want is None or out == want
        want, whole = out, filled[0]
        _assert_released(ref)
    eng = _engine(checkpoints, fill_on_thread=True, check_first=True, **kw)
    filled, asked = _counting(eng, monkeypatch)
    _greedy_workload(eng)
    got = _run(eng)
    assert got == want
    _check_valid(got)
    # the random model's argmax is often banned in JSON (then its rows or, for a while, all rows are filled)
    assert asked[0] > 0 and filled[0] < whole
    if kw:
        assert eng.last_stats.num_preemptions_total > 0
    _assert_released(eng)


def test_asking_a_matcher_agrees_with_its_filled_bitmask_for_every_token(tmp_path):
    """The manager's single-token question is exactly the filled bitmask's bit, for every id of a padded
    vocabulary (ids past the tokenizer never), in regex, choice and JSON states (JSON: no control bytes), and
    leaves the matcher where it was."""
    import torch
    from transformers import AutoTokenizer

    from affinity_serve.engine.demo import write_demo_model
    from affinity_serve.engine.structured_output.manager import StructuredOutputManager
    tok = AutoTokenizer.from_pretrained(str(write_demo_model(tmp_path / "m")))
    vocab = max(tok.get_vocab().values()) + 1 + 70
    mgr = StructuredOutputManager(tok, vocab, [tok.convert_tokens_to_ids("<|im_end|>")])
    cases = [(StructuredOutputSpec(regex="[a-z ]+"), ["", "ab"]),
             (StructuredOutputSpec(choice=("yes", "no")), ["", "y", "yes"]),
             (StructuredOutputSpec.from_schema(SCHEMAS[0]), ["", '{"name": "', '{"name": "ab", "age": 1'])]
    for spec, prefixes in cases:
        is_json = spec.key[0] == "json"
        for prefix in prefixes:
            st = mgr.new_state(spec)
            st._future.result()
            assert st.matcher.accept_string(prefix), (spec, prefix)
            bits = mgr._fill([st.matcher], [0] if is_json else [])
            before = bits.clone()
            allowed = [(int(bits[0, t >> 5]) >> (t & 31)) & 1 == 1 for t in range(vocab)]
            asked = [mgr._allows(st.matcher, t, is_json) for t in range(vocab)]
            assert asked == allowed, (spec, prefix)
            assert any(asked)
            assert not is_json or any(t in mgr._control_byte_ids for t in range(vocab))   # some to refuse
            assert torch.equal(mgr._fill([st.matcher], [0] if is_json else []), before)   # not advanced
            # the whole step's asking in one loop says the same, and leaves it too
            assert mgr._ask([st], frozenset([0] if is_json else []), [0] * vocab, range(vocab), False) == allowed
            assert torch.equal(mgr._fill([st.matcher], [0] if is_json else []), before)
    mgr.close()


def test_a_token_kept_when_asked_is_accepted_once_and_undone_when_not_taken(tmp_path):
    """keep (greedy steps asking first): a matcher that allows the sampled token takes it when asked; the
    engine's accept of that token then only confirms it (the matcher advanced once), another token undoes it
    first, and a release, a fill of the row, the whole fill and `settle` (which the next step's bitmask calls
    where the token's output was dropped) undo it."""
    import torch
    from transformers import AutoTokenizer

    from affinity_serve.engine.demo import write_demo_model
    from affinity_serve.engine.structured_output.grammar import GrammarBitmask, TokenMask
    from affinity_serve.engine.structured_output.manager import StructuredOutputManager, _StepRows
    tok = AutoTokenizer.from_pretrained(str(write_demo_model(tmp_path / "m")))
    vocab = max(tok.get_vocab().values()) + 1
    mgr = StructuredOutputManager(tok, vocab, [tok.convert_tokens_to_ids("<|im_end|>")])
    spec = StructuredOutputSpec(regex="[a-z]+ [0-9]")

    def state(prefix: str = "ab"):
        st = mgr.new_state(spec)
        st._future.result()
        assert st.matcher.accept_string(prefix)
        return st

    ref = state()
    bits = mgr._fill([ref.matcher], [])
    allowed = [t for t in range(vocab) if (int(bits[0, t >> 5]) >> (t & 31)) & 1]
    banned = [t for t in range(vocab) if t not in allowed]
    a, b = allowed[0], allowed[-1]

    def after(tokens):
        st = state()
        for t in tokens:
            assert st.matcher.accept_token(t)
        return mgr._fill([st.matcher], [])

    st = state()
    rows = _StepRows(mgr, [st], [])
    assert rows.allows([0, 0], [banned[0], a], keep=True) == [False, True]
    assert st._ahead == a
    assert st.accept([a]) and st._ahead is None
    assert torch.equal(mgr._fill([st.matcher], []), after([a]))          # advanced once, not twice
    st = state()
    _StepRows(mgr, [st], []).allows([0], [a], keep=True)
    assert st.accept([b])                                               # another token: a undone first
    assert torch.equal(mgr._fill([st.matcher], []), after([b]))
    for undo in ("release", "fill", "full", "settle"):
        st = state()
        rows = _StepRows(mgr, [st], [])
        rows.allows([0], [a], keep=True)
        if undo == "release":
            rows.release()
        elif undo == "fill":
            assert torch.equal(rows.fill([0]), bits)
        elif undo == "full":
            mask = GrammarBitmask(["r"], lambda: mgr._fill([st.matcher], []), check=rows)
            assert torch.equal(TokenMask(mask, [0], vocab).full()[0],
                               torch.tensor([t in allowed for t in range(vocab)]))
        else:
            st.settle()
        assert st._ahead is None and torch.equal(mgr._fill([st.matcher], []), bits), undo
    mgr.close()


def _sampled_workload(eng: LLMEngine, top_k: bool = False) -> None:
    """Sampled constrained rows: seeded at temperature 0.7 to 1.4 (n = 1 to 3), loose regexes whose rows mostly
    allow the random model's winner, a greedy row; unconstrained rows with top-p beside them. All seeded: an
    unseeded row's draw depends on which rows share its steps, which the compiles' timing decides (the
    sampler's tests cover unseeded rows). `top_k`: one constrained request samples with top-k (its filter
    reads the masked distribution, so steps with it fill the whole mask)."""
    for i, schema in enumerate(SCHEMAS):
        eng.add_request(eng.make_request(f"Item {i} as JSON", SamplingParams(
            n=2, max_tokens=120, temperature=(1.0, 0.7)[i % 2], seed=10 + i,
            structured_output=StructuredOutputSpec.from_schema(schema)), req_id=f"json{i}"))
    eng.add_request(eng.make_request("Code:", SamplingParams(
        max_tokens=12, temperature=0.0, structured_output=StructuredOutputSpec(regex=r"[A-Z]{3}-\d{4}")),
        req_id="regex"))
    eng.add_request(eng.make_request("Mood:", SamplingParams(
        n=3, max_tokens=8, temperature=1.0, seed=3, top_k=2 if top_k else None,
        structured_output=StructuredOutputSpec(choice=("good", "bad"))), req_id="choice"))
    for i in range(4):
        eng.add_request(eng.make_request(f"Words {i}:", SamplingParams(
            max_tokens=24, temperature=0.8 + 0.2 * i, seed=40 + i,
            structured_output=StructuredOutputSpec(regex="[^{}]+")), req_id=f"loose{i}"))
    for i in range(3):
        eng.add_request(eng.make_request([5 + i, 6, 7, 8], SamplingParams(max_tokens=30, temperature=1.0, top_p=0.9,
                                                                    seed=i, ignore_eos=True), req_id=f"free{i}"))


@pytest.mark.parametrize("kw", [
    {},
    {"cache": {"num_blocks": 40, "block_size": 4},
     "scheduler": {"long_prefill_token_threshold": 4, "max_num_batched_tokens": 16}},
], ids=["batched", "preempted"])
def test_sampled_steps_that_ask_first_give_exactly_the_whole_fills_outputs(checkpoints, kw, monkeypatch):
    """check_first with sampled rows: a row drawing by temperature alone takes its unmasked race winner where
    its grammar allows it (the masked race's winner too), so the step asks instead of filling; the tokens are
    exactly those of the whole fill, seeded, n > 1, batched and under preemption with chunked
    prefill. With a constrained top-k row running, its steps fill the whole mask (and still agree)."""
    for top_k in (False, True):
        ref = _engine(checkpoints, fill_on_thread=True, **kw)
        whole, _ = _counting(ref, monkeypatch)
        _sampled_workload(ref, top_k)
        want = _run(ref)
        _assert_released(ref)
        eng = _engine(checkpoints, fill_on_thread=True, check_first=True, **kw)
        filled, asked = _counting(eng, monkeypatch)
        _sampled_workload(eng, top_k)
        got = _run(eng)
        assert got == want, top_k
        _check_valid(got)
        assert asked[0] > 0 and filled[0] < whole[0]
        if kw:
            assert eng.last_stats.num_preemptions_total > 0
        _assert_released(eng)
