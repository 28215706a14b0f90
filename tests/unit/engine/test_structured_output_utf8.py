"""A constrained output is always valid UTF-8: xgrammar (0.2.9) takes a UTF-16 surrogate's bytes (ED A0-BF xx)
for a character, so the manager also masks every token that would make the output's bytes invalid UTF-8 (its
own bytes, or with the incomplete character the output ends in), checked here against Python's UTF-8 decoder
on a hand-built byte-level vocabulary, and end to end on the demo model pushed towards surrogates."""
from __future__ import annotations

import codecs
import json
import random

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from affinity_serve.engine.errors import InvalidRequestError  # noqa: E402
from affinity_serve.engine.structured_output import StructuredOutputSpec  # noqa: E402
from affinity_serve.engine.structured_output.utf8 import REJECT, advance, token_transitions  # noqa: E402

#: beside the 256 single bytes: tokens valid or not alone, or only after (or before) some bytes
EXTRA = [b"\xa0\x80", b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xed\x9f\xbf", b"\xed\xa0", b"\xc0\x80", b"\xc1\xbf",
         b"\xe0\x80\x80", b"\xe0\xa0\x80", b"\xf0\x8f\xbf\xbf", b"\xf0\x90\x80\x80", b"\xf4\x8f\xbf\xbf",
         b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80", b"a\xed", b"\xe4\xb8\xad", b"\xb8\xad", b"\xad\xed", b"\x80\x80",
         b"ab", b"\xe4\xb8", b"\xc3\xa9\xf4"]
VOCAB = [bytes([i]) for i in range(256)] + EXTRA
STOP = len(VOCAB)                   # "<|end|>": the stop token, no bytes of the output
#: after an incomplete character's bytes, a valid continuation: a first continuation byte, then any
_COMPLETIONS = [b""] + [bytes([c]) + b"\x80" * k for c in range(0x80, 0xC0) for k in range(3)]


def _valid_prefix(data: bytes) -> bool:
    """Whether `data` begins some valid UTF-8 text (Python's decoder on it and on its completions)."""
    dec = codecs.getincrementaldecoder("utf-8")()
    try:
        dec.decode(data, final=False)
    except UnicodeDecodeError:
        return False
    tail = dec.getstate()[0]
    for end in _COMPLETIONS:
        try:
            (tail + end).decode("utf-8")
            return True
        except UnicodeDecodeError:
            continue                 # this completion does not finish the character: try the next one
    return False


def _complete(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_the_token_transitions_accept_exactly_the_valid_utf8_prefixes():
    """Every pair of tokens, and random runs of up to 6, from a character's start: the state is REJECT exactly
    where the bytes so far begin no UTF-8 text, and back at a character's start exactly where they decode
    whole; a stop token only there."""
    rows = [r.tobytes() for r in token_transitions(VOCAB, len(VOCAB) + 1, [STOP])]
    for a in range(len(VOCAB)):
        after_a = advance(rows, 0, [a])
        assert (after_a != REJECT) == _valid_prefix(VOCAB[a]), VOCAB[a]
        assert (advance(rows, 0, [a, STOP]) != REJECT) == _complete(VOCAB[a]), VOCAB[a]
        for b in range(len(VOCAB)):
            data = VOCAB[a] + VOCAB[b]
            s = advance(rows, 0, [a, b])
            assert (s != REJECT) == _valid_prefix(data), data
            assert (s == 0) == _complete(data), data
    rng = random.Random(0)
    # weighted towards the bytes that begin or continue a character (ASCII mostly ends the run fast)
    pool = list(range(0x80, 256)) * 2 + list(range(256, len(VOCAB))) * 8 + [0x61, 0x22]
    for _ in range(20000):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 6))]
        data = b"".join(VOCAB[t] for t in ids)
        s = advance(rows, 0, ids)
        assert (s != REJECT) == _valid_prefix(data), data
        assert s == REJECT or (s == 0) == _complete(data), data
    assert rows[0][STOP] == 0 and all(rows[s][STOP] == REJECT for s in range(1, len(rows)))
    # an id past the vocabulary (a padded one) never
    assert all(r[-1] == REJECT for r in [t.tobytes() for t in token_transitions(VOCAB, len(VOCAB) + 5, [])])


def _byte_level_tokenizer():
    """A Hugging Face byte-level BPE tokenizer whose ids are VOCAB's (then the stop token)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = bytes_to_unicode()
    vocab = {"".join(chars[c] for c in b): i for i, b in enumerate(VOCAB)}
    assert len(vocab) == len(VOCAB)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|end|>", special=True)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")
    assert fast.eos_token_id == STOP
    return fast


@pytest.mark.parametrize("spec, opening", [
    (StructuredOutputSpec.from_schema({"type": "string", "maxLength": 4}), b'"'),
    (StructuredOutputSpec.from_schema({"type": "object", "properties": {"s": {"type": "string"}},
                                       "required": ["s"], "additionalProperties": False}), b'{"s": "'),
    (StructuredOutputSpec(regex=".{1,4}"), b""),
    (StructuredOutputSpec(grammar='root ::= [^a]+ "a"'), b""),
])
def test_a_grammars_mask_is_xgrammars_less_exactly_the_tokens_that_make_invalid_utf8(spec, opening):
    """After each output so far (accepted token by token), a row's filled bitmask, its single-token question
    and the whole step's asking allow token t exactly where xgrammar does and the output's bytes then still
    begin valid UTF-8 (a stop token: and decode whole; JSON: no control byte). Where the output ends in ED,
    xgrammar allows A0-BF, a surrogate, and the mask does not."""
    import torch
    import xgrammar as xgr

    from affinity_serve.engine.structured_output.grammar import unpack_bitmask
    from affinity_serve.engine.structured_output.manager import StructuredOutputManager
    tok = _byte_level_tokenizer()
    vocab = len(VOCAB) + 1
    mgr = StructuredOutputManager(tok, vocab, [STOP])
    is_json = spec.key[0] == "json"
    tails = [b"", b"\xed", b"\xed\x9f", b"\xe0", b"\xe0\xa0", b"\xf0", b"\xf4", b"\xf4\x8f", b"\xf1\x80\x80",
             b"\xe4\xb8", b"\xc3"]
    surrogate_banned = 0
    rows = []
    for tail in tails:
        st = mgr.new_state(spec)
        st._future.result()
        ids = list(opening + tail)                         # each byte as its own token
        assert st.accept(ids), tail
        ref = xgr.GrammarMatcher(st._future.result())
        assert all(ref.accept_token(t) for t in ids)
        want_bits = torch.zeros((1, -(-vocab // 32)), dtype=torch.int32)
        ref.fill_next_token_bitmask(want_bits, 0)
        by_xgrammar = unpack_bitmask(want_bits, vocab)[0].tolist()
        data = opening + tail
        want = [by_xgrammar[t] and (_complete(data) if t == STOP else _valid_prefix(data + VOCAB[t]))
                and not (is_json and t != STOP and any(c < 0x20 for c in VOCAB[t])) for t in range(vocab)]
        alone = mgr._fill([st.matcher], [0] if is_json else [], [st._utf8])
        rows.append((st, alone))
        got = unpack_bitmask(alone, vocab)[0].tolist()
        assert got == want, (tail, [VOCAB[t] for t in range(vocab) if got[t] != want[t]][:8])
        assert any(got), tail
        assert [mgr._allows(st.matcher, t, is_json, st._utf8) for t in range(vocab)] == want, tail
        assert mgr._ask([st], frozenset([0] if is_json else []), [0] * vocab, range(vocab), False) == want, tail
        if tail == b"\xed":
            assert all(by_xgrammar[c] and not got[c] for c in range(0xA0, 0xC0))        # a surrogate's bytes
            assert all(got[c] for c in range(0x80, 0xA0))
            surrogate_banned += 1
        if tail == b"":
            for t in (256, 257, 258, 260):               # A0 80 alone; ED A0 80, ED BF BF, ED A0: surrogates
                assert not got[t], VOCAB[t]
            assert got[VOCAB.index(b"\xed\x9f\xbf")] == by_xgrammar[VOCAB.index(b"\xed\x9f\xbf")]   # U+D7FF
    assert surrogate_banned == 1
    # every row in one fill (xgrammar's batch fill; rows in different states, each ANDed with its own mask)
    together = mgr._fill([st.matcher for st, _ in rows], list(range(len(rows))) if is_json else [],
                         [st._utf8 for st, _ in rows])
    assert len({st._utf8 for st, _ in rows}) > 1
    assert torch.equal(together, torch.cat([alone for _, alone in rows]))
    mgr.close()


def test_a_token_that_would_make_invalid_utf8_is_refused_by_accept_and_a_pd_prefix_sets_the_state():
    """accept (the engine's check of each sampled token) refuses a token the mask bans, so a sequence never
    goes on past invalid UTF-8 (the engine ends it with an error, as for a token outside the grammar); a P/D
    decode engine's sequence starts in the state its prefill engine's tokens left."""
    from affinity_serve.engine.structured_output.manager import StructuredOutputManager
    mgr = StructuredOutputManager(_byte_level_tokenizer(), len(VOCAB) + 1, [STOP])
    st = mgr.new_state(StructuredOutputSpec(regex=".{1,4}"))
    st._future.result()
    assert st.accept([0xED]) and st._utf8 != 0
    assert not st.accept([0xA0])                          # xgrammar's matcher takes it; UTF-8 does not
    ok = mgr.new_state(StructuredOutputSpec(regex=".{1,4}"))
    ok._future.result()
    assert ok.accept([0xED, 0x9F, 0xBF]) and ok._utf8 == 0        # U+D7FF
    # P/D: the prefill engine's first token(s) set the state too; one the UTF-8 bans stops the prefix there
    for prefix, taken in (((0xED,), b"\xed"), ((0xED, 0xA0), b"\xed"), ((0xED, 0x80), b"\xed\x80")):
        st = mgr.new_state(StructuredOutputSpec(regex=".{1,4}"), prefix)
        st._future.result()
        m = st.matcher                                     # takes the prefix
        bits = mgr._fill([m], [], [st._utf8])
        allowed = [(int(bits[0, t >> 5]) >> (t & 31)) & 1 == 1 for t in range(len(VOCAB))]
        assert allowed == [_valid_prefix(taken + b) for b in VOCAB], prefix
    mgr.close()


def test_engine_outputs_pushed_towards_surrogates_are_valid_utf8_json_within_max_length(checkpoints):
    """The demo model with a strong logit_bias on ED and on A0-BF (applied after the grammar mask, so it picks
    whatever the mask leaves of them): without the UTF-8 mask every string is surrogates, decoded as U+FFFD
    three times a character; with it, each output, over many seeds and the three ways a row samples (greedy,
    temperature alone, top-p: asked first or masked first), is valid UTF-8 JSON within maxLength."""
    from transformers import AutoTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from affinity_serve.engine.config import EngineConfig
    from affinity_serve.engine.llm_engine import LLMEngine
    from affinity_serve.engine.sampling_params import SamplingParams
    chars = bytes_to_unicode()
    tok = AutoTokenizer.from_pretrained(checkpoints["llama"])
    byte_id = {b: tok.convert_tokens_to_ids(chars[b]) for b in range(256)}
    bias = {byte_id[0xED]: 100.0, **{byte_id[b]: 50.0 for b in range(0xA0, 0xC0)}}
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}}, "required": ["s"],
              "additionalProperties": False}
    spec = StructuredOutputSpec.from_schema(schema)
    eng = LLMEngine.from_config(EngineConfig.model_validate(
        {"model": checkpoints["llama"], "cache": {"num_blocks": 128, "block_size": 4}}))
    ways = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=1.0, top_p=0.9)]
    params = {}
    for seed in range(12):
        for w, way in enumerate(ways):
            for biased in (True, False):
                rid = f"s{seed}-w{w}-{'b' if biased else 'u'}"
                params[rid] = SamplingParams(max_tokens=40, seed=seed, structured_output=spec,
                                             logit_bias=bias if biased else None, **way)
                eng.add_request(eng.make_request("Give me JSON:", params[rid], req_id=rid))
    texts: dict[str, str] = {}
    reasons: dict[str, str] = {}
    for _ in range(2000):
        if not eng.has_unfinished_requests():
            break
        for d in eng.step().deltas:
            texts[d.req_id] = texts.get(d.req_id, "") + d.text
            if d.finished:
                reasons[d.req_id] = d.finish_reason
    assert not eng.has_unfinished_requests() and len(reasons) == len(params)
    non_ascii = 0
    for rid, text in texts.items():
        assert reasons[rid] == "stop", (rid, text)
        assert "\ufffd" not in text, (rid, text)
        text.encode("utf-8")                              # no lone surrogate either
        value = json.loads(text)
        jsonschema.validate(value, schema)
        if rid.endswith("-b"):
            # the bias reached the string: ED and a continuation the mask leaves (80-9F): U+D000-U+D7FF
            assert value["s"] and all("\ud000" <= c <= "\ud7ff" for c in value["s"]), (rid, value)
        non_ascii += any(ord(c) > 0x7F for c in value["s"])
    assert non_ascii >= 36
    eng.close()


@pytest.mark.parametrize("spec_kwargs", [
    {"regex": r"[a-z]+\uD800"},
    {"regex": r"x[\uDC00-\uDFFF]y"},
    {"regex": r"\uD83D\uDE00"},                        # a pair: xgrammar keeps two surrogates, not one emoji
    {"grammar": 'root ::= "a" "\\uDBFF"'},
    {"json": json.dumps({"type": "string", "pattern": "^\\ud800$"})},
    {"regex": r"\U0000D800"},                          # xgrammar reads \U and \x with any run of hex digits
    {"regex": r"\xD800"},
    {"grammar": 'root ::= "\\xDFFF"'},
    {"json": json.dumps({"type": "object", "patternProperties": {"^\\uD800$": {"type": "integer"}},
                         "minProperties": 1})},
])
def test_a_grammar_naming_a_surrogate_is_refused_before_it_runs(spec_kwargs):
    """No UTF-8 output can hold a UTF-16 surrogate, and every constrained output is kept valid UTF-8: a pattern
    that needs one would end in an error mid-generation, so it is a 400 (`invalid_grammar`) at the request."""
    spec = StructuredOutputSpec(**spec_kwargs)
    with pytest.raises(InvalidRequestError) as e:
        spec.check()
    assert e.value.code == "invalid_grammar" and "surrogate" in str(e.value)
    assert "\\\\" not in str(e.value)                    # the escape as written, not repr-doubled


@pytest.mark.parametrize("pattern", [r"\\uD800", r"[\u0000-\uFFFF]+", r"\uD7FF\uE000", r"\u0D80", r"\xD8",
                                     r"[^\uD800]{3}", r"\U0001F600", r"[\uD7FF-\uE000]{2}"])
def test_patterns_that_only_look_like_a_surrogate_escape_are_accepted(pattern):
    StructuredOutputSpec(regex=pattern).check()       # an escaped backslash, a range across, neighbours


def test_in_a_grammar_a_bracket_in_a_string_literal_opens_no_class():
    from affinity_serve.engine.structured_output.spec import surrogate_escape
    StructuredOutputSpec(grammar='root ::= "[" [^\\uD800] "]"').check()      # a literal '[', then a negated class
    assert surrogate_escape('root ::= "[" [^\\uD800] "]"', ebnf=True) is None
    assert surrogate_escape('root ::= "[" "\\uD800"', ebnf=True) is not None     # in a literal: refused
    assert surrogate_escape('root ::= "\\"[" "\\uD800"', ebnf=True) is not None  # an escaped quote stays inside
    assert surrogate_escape('root ::= [^"] "\\uD800"', ebnf=True) is not None      # a quote inside a class
    # a comment runs to its line's end: its quotes open no string, its escapes name nothing
    assert surrogate_escape('# a 12" screen\nroot ::= "a" [^\\uD800-\\uDFFF]', ebnf=True) is None
    assert surrogate_escape('root ::= "a" # not \\uD800 here\n', ebnf=True) is None
    assert surrogate_escape('# "\nroot ::= "\\uD800"', ebnf=True) is not None
    assert surrogate_escape('root ::= "#" "\\uD800"', ebnf=True) is not None          # '#' in a literal


def test_the_surrogate_check_is_one_pass_however_many_escapes_a_pattern_holds():
    """Each escape rescanned the pattern from its start for the class it sits in: 2,000 escapes in a negated
    class took ~10 s of one request's CPU (a body may hold ~600k). The check carries the class state on: 50,000
    escapes take well under a second here, where the rescanning version ran past the suite's per-test timeout."""
    from affinity_serve.engine.structured_output.spec import surrogate_escape
    StructuredOutputSpec(regex="[^" + "\\uD800" * 2_000 + "]{3}").check()
    assert surrogate_escape("[^" + "\\uD800" * 50_000 + "]") is None
    assert surrogate_escape("[^" + "\\uD800" * 50_000 + "]\\uD800") is not None      # the one outside
    assert surrogate_escape("[^]\\uD800]") is None and surrogate_escape("[]\\uD800]") is not None
