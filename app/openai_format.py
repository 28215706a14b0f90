"""OpenAI response bodies: completions, chat completions, their stream chunks, logprobs and usage.

Pure functions of plain values (no Ray, no tokenizer object): token ids become strings through the
`TokenStr` callable the caller passes in.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from affinity_serve.engine.types import Logprobs

TokenStr = Callable[[int], str]
TokenBytes = Callable[[int], bytes]


def token_id_str(token_id: int) -> str:
    """The token string without a tokenizer (token-ids-only mode), as vLLM writes it."""
    return f"token_id:{token_id}"


def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): each byte is a printable character, the printable Latin-1 ones
    themselves and the others 256 + their rank; as a character -> byte table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_LEVEL = _byte_level_chars()
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def token_bytes(tokenizer: Any, token_id: int, text: str) -> bytes:
    """A token's own bytes, for logprobs' `bytes` (OpenAI: so that a client can rebuild a character split over
    tokens). `text` is its decoded string: used as is unless it holds U+FFFD, the decoder's stand-in for a part
    of a character; then the raw token is read as byte-level BPE (GPT-2's alphabet) or SentencePiece's byte
    fallback (`<0xED>`)."""
    if "\ufffd" not in text or tokenizer is None:
        return text.encode("utf-8")
    raw = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(raw, str):
        return text.encode("utf-8")
    m = _BYTE_FALLBACK.match(raw)
    if m:
        return bytes([int(m.group(1), 16)])
    if all(ch in _BYTE_LEVEL for ch in raw):
        return bytes(_BYTE_LEVEL[ch] for ch in raw)
    return text.encode("utf-8")


@dataclass(frozen=True, slots=True)
class ResponseMeta:
    """What every body and chunk of one response repeats."""

    id: str
    created: int
    model: str


@dataclass(frozen=True, slots=True)
class EchoedPrompt:
    """A completion prompt echoed before its choice: its text, its token ids, and (with `logprobs`) one
    log-probability per token, the first None (it has no context)."""

    text: str
    token_ids: Sequence[int]
    logprobs: Sequence[Logprobs | None] | None = None


@dataclass(frozen=True, slots=True)
class Choice:
    """One finished choice of a non-streamed response."""

    text: str                                # the generated text
    finish_reason: str | None
    logprobs: Sequence[Logprobs] | None      # None: the client did not ask for logprobs
    echo: EchoedPrompt | None = None         # completions with `echo`: put before the text (and logprobs)
    #: completions with vLLM's `prompt_logprobs` extension: that field, formatted (vllm_prompt_logprobs)
    prompt_logprobs: list[dict[int, dict] | None] | None = None
    #: vLLM's `return_token_ids` extension: the generated ids, and (completions) the prompt's ids; None: omitted
    token_ids: Sequence[int] | None = None
    prompt_token_ids: Sequence[int] | None = None
    #: chat with tools: the message's `tool_calls` (its content: `text`, null when empty); None: a plain message
    tool_calls: Sequence[dict] | None = None
    #: vLLM's `stop_reason`: the stop string (str) or stop token id (int) that ended the choice; None otherwise
    stop_reason: int | str | None = None


def fingerprint(replica_ids: Iterable[str]) -> str:
    """`system_fingerprint`: which replica(s) served the request, `replica:<id>[,<id>]`."""
    return "replica:" + ",".join(sorted(replica_ids))


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


# ---------------------------------------------------------------- logprobs
def completion_logprobs(lps: Sequence[Logprobs], token_str: TokenStr, num_top: int, *,
                        echo: EchoedPrompt | None = None, text_offset: int = 0) -> dict:
    """The legacy completions `logprobs` object over the echoed prompt's tokens (if any), then `lps`.

    As OpenAI's legacy API and vLLM: `top_logprobs` holds each token itself and its `num_top` most likely
    alternatives (so up to num_top + 1 entries); the first prompt token has null for both. `text_offset`
    starts at `text_offset` and advances by each token string's length, from the prompt into the completion.
    """
    entries: list[tuple[int, Logprobs | None]] = []
    if echo is not None:
        assert echo.logprobs is not None and len(echo.logprobs) == len(echo.token_ids), "one per prompt token"
        entries += zip(echo.token_ids, echo.logprobs)
    entries += [(lp.token_id, lp) for lp in lps]
    tokens, token_lps, tops, offsets = [], [], [], []
    for token_id, lp in entries:
        s = token_str(token_id)
        tokens.append(s)
        token_lps.append(None if lp is None else lp.logprob)
        tops.append(None if lp is None else {
            token_str(lp.token_id): lp.logprob,
            **{token_str(t): v for t, v in zip(lp.top_token_ids[:num_top], lp.top_logprobs[:num_top])}})
        offsets.append(text_offset)
        text_offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def vllm_prompt_logprobs(token_ids: Sequence[int], lps: Sequence[Logprobs | None], token_str: TokenStr,
                         num_top: int) -> list[dict[int, dict] | None]:
    """vLLM's `prompt_logprobs` choice field: None for the first prompt token, then per token a dict
    token id -> {logprob, rank, decoded_token} holding the token itself and its `num_top` alternatives."""
    def entry(token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": token_str(token_id)}

    out: list[dict[int, dict] | None] = []
    for token_id, lp in zip(token_ids, lps, strict=True):
        if lp is None:
            out.append(None)
            continue
        assert lp.token_id == token_id, "prompt logprobs follow the prompt"
        out.append({lp.token_id: entry(lp.token_id, lp.logprob, lp.rank),
                    **{t: entry(t, v, r) for r, (t, v) in
                       enumerate(zip(lp.top_token_ids[:num_top], lp.top_logprobs[:num_top]), start=1)}})
    return out


def chat_logprobs(lps: Sequence[Logprobs], token_str: TokenStr, token_bytes_: TokenBytes | None = None) -> dict:
    """The chat `logprobs` object: `{"content": [...]}` with bytes for every token (its own, with
    `token_bytes_`; else its text's)."""
    def entry(tid: int, logprob: float) -> dict:
        s = token_str(tid)
        return {"token": s, "logprob": logprob,
                "bytes": list(token_bytes_(tid) if token_bytes_ is not None else s.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(t, v) for t, v in zip(lp.top_token_ids, lp.top_logprobs)]}
                        for lp in lps]}


# ---------------------------------------------------------------- whole responses
def completion_response(meta: ResponseMeta, choices: Sequence[Choice], usage_: dict, fingerprint_: str,
                        token_str: TokenStr, num_top_logprobs: int = 0) -> dict:
    return {"id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
            "system_fingerprint": fingerprint_, "usage": usage_,
            "choices": [_completion_choice(i, c, token_str, num_top_logprobs) for i, c in enumerate(choices)]}


def _completion_choice(index: int, c: Choice, token_str: TokenStr, num_top: int) -> dict:
    out = {"index": index, "text": (c.echo.text if c.echo else "") + c.text, "finish_reason": c.finish_reason,
           "stop_reason": c.stop_reason, "logprobs": None if c.logprobs is None
           else completion_logprobs(c.logprobs, token_str, num_top, echo=c.echo)}
    if c.prompt_logprobs is not None:
        out["prompt_logprobs"] = c.prompt_logprobs
    return _with_token_ids(out, c.token_ids, c.prompt_token_ids)


def _with_token_ids(d: dict, token_ids: Sequence[int] | None, prompt_token_ids: Sequence[int] | None) -> dict:
    """vLLM's `return_token_ids` fields, added to a choice (or a chat body) only when given."""
    if prompt_token_ids is not None:
        d["prompt_token_ids"] = list(prompt_token_ids)
    if token_ids is not None:
        d["token_ids"] = list(token_ids)
    return d


def chat_response(meta: ResponseMeta, choices: Sequence[Choice], usage_: dict, fingerprint_: str,
                  token_str: TokenStr, prompt_token_ids: Sequence[int] | None = None,
                  token_bytes_: TokenBytes | None = None) -> dict:
    """As vLLM, `prompt_token_ids` (return_token_ids) belongs to the whole body: a chat has one prompt."""
    body = {"id": meta.id, "object": "chat.completion", "created": meta.created, "model": meta.model,
            "system_fingerprint": fingerprint_, "usage": usage_,
            "choices": [_chat_choice(i, c, token_str, token_bytes_) for i, c in enumerate(choices)]}
    return _with_token_ids(body, None, prompt_token_ids)


def _chat_choice(index: int, c: Choice, token_str: TokenStr, token_bytes_: TokenBytes | None = None) -> dict:
    message = ({"role": "assistant", "content": c.text} if c.tool_calls is None
               else {"role": "assistant", "content": c.text or None, "tool_calls": list(c.tool_calls)})
    out = {"index": index, "message": message,
           "logprobs": None if c.logprobs is None else chat_logprobs(c.logprobs, token_str, token_bytes_),
           "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
    return _with_token_ids(out, c.token_ids, None)


# ---------------------------------------------------------------- stream chunks
def completion_chunk(meta: ResponseMeta, index: int, text: str, finish_reason: str | None,
                     logprobs: dict | None, fingerprint_: str, with_usage: bool, *,
                     token_ids: Sequence[int] | None = None, prompt_token_ids: Sequence[int] | None = None,
                     stop_reason: int | str | None = None) -> dict:
    """`token_ids`: this chunk's generated ids; `prompt_token_ids`: on a choice's first chunk (return_token_ids);
    `stop_reason` (vLLM's) on the chunk that finishes the choice."""
    choice = {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    chunk = {"id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
             "system_fingerprint": fingerprint_, "choices": [_with_token_ids(choice, token_ids, prompt_token_ids)]}
    if with_usage:
        chunk["usage"] = None            # OpenAI: null on every chunk but the last one
    return chunk


def chat_chunk(meta: ResponseMeta, index: int, text: str, finish_reason: str | None, logprobs: dict | None,
               fingerprint_: str, with_usage: bool, *, token_ids: Sequence[int] | None = None,
               tool_calls: Sequence[dict] | None = None, stop_reason: int | str | None = None) -> dict:
    """`tool_calls`: this chunk's `delta.tool_calls` entries (index, id and name first, then argument
    fragments), sent instead of content."""
    if tool_calls is not None:
        delta = {"tool_calls": list(tool_calls)} if tool_calls else {}
        if text:
            delta = {"content": text, **delta}
    else:
        delta = {"content": text} if text or not finish_reason else {}
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    chunk = {"id": meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model,
             "system_fingerprint": fingerprint_, "choices": [_with_token_ids(choice, token_ids, None)]}
    if with_usage:
        chunk["usage"] = None
    return chunk


def chat_role_chunk(meta: ResponseMeta, index: int, prompt_token_ids: Sequence[int] | None = None) -> dict:
    """The first chunk of each chat choice: OpenAI sends the role before any content (and vLLM the body's
    `prompt_token_ids`, with return_token_ids)."""
    chunk = {"id": meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model,
             "choices": [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}]}
    return _with_token_ids(chunk, None, prompt_token_ids)


def usage_chunk(meta: ResponseMeta, obj: str, usage_: dict) -> dict:
    """The last chunk when `stream_options.include_usage`: no choices, the whole request's usage."""
    return {"id": meta.id, "object": obj, "created": meta.created, "model": meta.model, "choices": [],
            "usage": usage_}
