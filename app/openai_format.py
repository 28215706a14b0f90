"""OpenAI response bodies: completions, chat completions, their stream chunks, logprobs and usage.

Pure functions of plain values (no Ray, no tokenizer object): token ids become strings through the
`TokenStr` callable the caller passes in.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from engine.types import Logprobs

TokenStr = Callable[[int], str]


def token_id_str(token_id: int) -> str:
    """The token string without a tokenizer (token-ids-only mode), as vLLM writes it."""
    return f"token_id:{token_id}"


@dataclass(frozen=True, slots=True)
class ResponseMeta:
    """What every body and chunk of one response repeats."""

    id: str
    created: int
    model: str


@dataclass(frozen=True, slots=True)
class Choice:
    """One finished choice of a non-streamed response."""

    text: str
    finish_reason: str | None
    logprobs: Sequence[Logprobs] | None      # None: the client did not ask for logprobs
    text_offset: int = 0                     # where the generated text starts in `text` (echo)


def fingerprint(replica_ids: Iterable[str]) -> str:
    """`system_fingerprint`: which replica(s) served the request, `replica:<id>[,<id>]`."""
    return "replica:" + ",".join(sorted(replica_ids))


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


# ---------------------------------------------------------------- logprobs
def completion_logprobs(lps: Sequence[Logprobs], token_str: TokenStr, text_offset: int = 0) -> dict:
    """The legacy completions `logprobs` object; `text_offset` is where the first token starts."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        s = token_str(lp.token_id)
        tokens.append(s)
        token_lps.append(lp.logprob)
        tops.append({token_str(t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs)})
        offsets.append(text_offset)
        text_offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(lps: Sequence[Logprobs], token_str: TokenStr) -> dict:
    """The chat `logprobs` object: `{"content": [...]}` with bytes for every token."""
    def entry(tid: int, logprob: float) -> dict:
        s = token_str(tid)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(t, v) for t, v in zip(lp.top_token_ids, lp.top_logprobs)]}
                        for lp in lps]}


# ---------------------------------------------------------------- whole responses
def completion_response(meta: ResponseMeta, choices: Sequence[Choice], usage_: dict, fingerprint_: str,
                        token_str: TokenStr) -> dict:
    return {"id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
            "system_fingerprint": fingerprint_, "usage": usage_,
            "choices": [{"index": i, "text": c.text, "finish_reason": c.finish_reason,
                         "logprobs": None if c.logprobs is None
                         else completion_logprobs(c.logprobs, token_str, c.text_offset)}
                        for i, c in enumerate(choices)]}


def chat_response(meta: ResponseMeta, choices: Sequence[Choice], usage_: dict, fingerprint_: str,
                  token_str: TokenStr) -> dict:
    return {"id": meta.id, "object": "chat.completion", "created": meta.created, "model": meta.model,
            "system_fingerprint": fingerprint_, "usage": usage_,
            "choices": [{"index": i, "message": {"role": "assistant", "content": c.text},
                         "logprobs": None if c.logprobs is None else chat_logprobs(c.logprobs, token_str),
                         "finish_reason": c.finish_reason}
                        for i, c in enumerate(choices)]}


# ---------------------------------------------------------------- stream chunks
def completion_chunk(meta: ResponseMeta, index: int, text: str, finish_reason: str | None,
                     logprobs: dict | None, fingerprint_: str, with_usage: bool) -> dict:
    chunk = {"id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
             "system_fingerprint": fingerprint_,
             "choices": [{"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}]}
    if with_usage:
        chunk["usage"] = None            # OpenAI: null on every chunk but the last one
    return chunk


def chat_chunk(meta: ResponseMeta, index: int, text: str, finish_reason: str | None, logprobs: dict | None,
               fingerprint_: str, with_usage: bool) -> dict:
    delta = {"content": text} if text or not finish_reason else {}
    chunk = {"id": meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model,
             "system_fingerprint": fingerprint_,
             "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if with_usage:
        chunk["usage"] = None
    return chunk


def chat_role_chunk(meta: ResponseMeta, index: int) -> dict:
    """The first chunk of each chat choice: OpenAI sends the role before any content."""
    return {"id": meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model,
            "choices": [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}]}


def usage_chunk(meta: ResponseMeta, obj: str, usage_: dict) -> dict:
    """The last chunk when `stream_options.include_usage`: no choices, the whole request's usage."""
    return {"id": meta.id, "object": obj, "created": meta.created, "model": meta.model, "choices": [],
            "usage": usage_}
