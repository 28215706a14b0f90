"""Issue 33.12: a megabyte prompt is refused by its length before it is tokenized (a clear 400 naming the
bound), and what a large text's tokenizing frees goes back to the OS instead of staying in the ingress."""
from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from affinity_serve.app.prompts import NORMALIZATION_SLACK, max_token_chars
from affinity_serve.app.serving import RELEASE_AFTER_CHARS, _releasing_memory, release_freed_memory
from affinity_serve.engine import load_tokenizer
from tests.unit.app.test_hostile_inputs import http_request, ingress

TEXT = "Once upon a time there was a little robot who liked prime numbers. "


class CountingTokenizer:
    """The real tokenizer, counting the characters it was asked to encode."""

    def __init__(self, tok):
        self._tok = tok
        self.encoded_chars = 0

    def encode(self, text, *a, **kw):
        self.encoded_chars += len(text)
        return self._tok.encode(text, *a, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __len__(self):
        return len(self._tok)


async def _post(ing, body: dict, path: str):
    from affinity_serve.app.prompts import RequestKind
    kind = RequestKind.CHAT if "messages" in body else RequestKind.COMPLETION
    r = await ing._http(kind, http_request(json.dumps(body).encode(), path))
    return r.status_code, json.loads(r.body)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_megabyte_prompt_is_a_400_before_it_is_tokenized(checkpoints, path):
    ing, _ = ingress(checkpoints, max_request_body_bytes=8 * 2**20)
    spy = CountingTokenizer(ing.serving.tokenizer)
    ing.serving.tokenizer = spy
    text = (TEXT * 16000)[:1_000_000]
    body = {"messages": [{"role": "user", "content": text}]} if "chat" in path else {"prompt": text}
    status, out = await _post(ing, body | {"max_tokens": 4}, path)
    assert status == 400 and out["error"]["code"] == "context_length_exceeded", out
    bound = 64 * max_token_chars(spy) * NORMALIZATION_SLACK          # the fake replica's max_model_len is 64
    assert out["error"]["message"] == (
        f"the prompt has 1000000 characters, more than this model's maximum context length of 64 tokens can hold "
        f"(at most {bound} characters); shorten the prompt")
    assert out["error"]["param"] == ("messages" if "chat" in path else "prompt")
    assert spy.encoded_chars == 0


async def test_a_text_within_the_bound_is_tokenized_and_checked_by_tokens(checkpoints):
    """The bound never refuses a prompt that could fit: one at the bound is tokenized, then the token count
    decides."""
    ing, _ = ingress(checkpoints)
    spy = CountingTokenizer(ing.serving.tokenizer)
    ing.serving.tokenizer = spy
    bound = 64 * max_token_chars(spy) * NORMALIZATION_SLACK
    status, out = await _post(ing, {"prompt": "a" * bound, "max_tokens": 4}, "/v1/completions")
    assert spy.encoded_chars == bound and status == 400
    assert out["error"]["code"] == "context_length_exceeded" and "tokens" in out["error"]["message"]


def test_the_longest_token_bounds_the_text_one_token_covers(checkpoints):
    tok = load_tokenizer(checkpoints["llama"])
    longest = max_token_chars(tok)
    assert longest >= max(len(tok.decode([i])) for i in range(len(tok)))


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not release_freed_memory(), reason="glibc's malloc_trim is not available")
def test_a_large_text_tokenized_on_the_prepare_thread_leaves_no_memory_behind(checkpoints):
    """Measured on the process: tokenizing ~1 MB of text frees ~140 MB that glibc keeps in the thread's
    arena unless trimmed (the ingress's +142 MB); with the release after a large text it stays small."""
    tok = load_tokenizer(checkpoints["llama"])
    text = (TEXT * 16000)[:1_000_000]
    assert len(text) >= RELEASE_AFTER_CHARS
    with ThreadPoolExecutor(1) as thread:
        thread.submit(_releasing_memory, len(text), tok.encode, text[:50_000]).result()   # warm caches
        release_freed_memory()
        before = _rss_mb()
        ids = thread.submit(_releasing_memory, len(text), tok.encode, text).result()
        assert len(ids) > 100_000
        del ids
        kept = _rss_mb() - before
    # without the release ~133 MB stay (see above); 90 leaves room for what the test process's other threads
    # (a session's Ray driver) allocate meanwhile (make test once measured 60.5 MB)
    assert kept < 90, f"{kept:.0f} MB kept after tokenizing 1 MB of text"
