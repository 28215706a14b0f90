from affinity_serve.engine.demo import build_tokenizer
from affinity_serve.engine.tokenizer import IncrementalDetokenizer


class _Tok:
    """transformers-like decode() over a raw `tokenizers` tokenizer (the demo's byte-level BPE)."""

    def __init__(self):
        self.t = build_tokenizer()

    def encode(self, s):
        return self.t.encode(s).ids

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return self.t.decode(ids, skip_special_tokens=skip_special_tokens)


def _stream(tok, ids, chunk=1, **kw):
    d = IncrementalDetokenizer(tok, **kw)
    deltas = []
    for i in range(0, len(ids), chunk):
        part = ids[i:i + chunk]
        deltas.append(d.update(part, finished=i + chunk >= len(ids)))
    return deltas, d


def test_multibyte_characters_never_split():
    tok = _Tok()
    text = "café 東京 🙂🚀 naïve"
    # byte-level ids, one byte per token, so every multi-byte char spans several tokens
    ids = [tok.t.token_to_id(ch) for ch in _bytes_to_unicode(text.encode())]
    assert None not in ids
    deltas, _ = _stream(tok, ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_excluded_and_across_deltas():
    tok = _Tok()
    ids = tok.encode("Once upon a time there was a cluster")
    deltas, d = _stream(tok, ids, stop=["a time"])
    assert "".join(deltas) == "Once upon "
    assert d.stop_hit == "a time"
    deltas, _ = _stream(tok, ids, stop=["a time"], include_stop_str_in_output=True)
    assert "".join(deltas) == "Once upon a time"
    deltas, d = _stream(tok, ids, stop=["nothing"])
    assert "".join(deltas) == "Once upon a time there was a cluster" and d.stop_hit is None


def _bytes_to_unicode(b: bytes) -> list[str]:
    from tokenizers import pre_tokenizers  # noqa: F401
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for x in range(256):
        if x not in bs:
            bs.append(x)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, map(chr, cs)))
    return [table[x] for x in b]
