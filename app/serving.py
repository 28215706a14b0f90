"""OpenAIServing: completions and chat over the replicas, as prepare -> fan out -> format, one span each.

Shared by the HTTP routes and the Python handle API (app/ingress.py); raises APIError-classifiable
exceptions and leaves logging them to its caller.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from app import openai_format as fmt
from app.fanout import RequestRun, merged_chunks, replica_requests
from app.prompts import PreparedRequest, RequestKind, prepare_request
from app.protocol import ChatCompletionRequest, CompletionRequest, ReplicaChunk
from engine import EngineLimits
from observability.metrics import ServingMetrics
from observability.requests import RequestObserver, RequestSpan

OpenAIRequest = CompletionRequest | ChatCompletionRequest


class OpenAIServing:
    def __init__(self, replica: Any, *, model_name: str, tokenizer: Any | None, first_output_timeout_s: float,
                 observer: RequestObserver, metrics: ServingMetrics):
        """`tokenizer` None: token-ids-only mode (no text in, empty text out, `token_id:<id>` token strings)."""
        self.replica = replica
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.first_output_timeout_s = first_output_timeout_s
        self.observer = observer
        self.metrics = metrics
        self._limits: EngineLimits | None = None

    async def limits(self) -> EngineLimits:
        """The engine's limits, asked of a replica once (they are fixed when its KV pool is built)."""
        if self._limits is None:
            self._limits = await self.replica.limits.remote()
        return self._limits

    def token_str(self, token_id: int) -> str:
        if self.tokenizer is None:
            return fmt.token_id_str(token_id)
        return self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    async def prepare(self, kind: RequestKind, req: OpenAIRequest, request_id: str) -> PreparedRequest:
        return prepare_request(kind, req, request_id, model_name=self.model_name, limits=await self.limits(),
                               tokenizer=self.tokenizer)

    # ------------------------------------------------------------------ whole responses
    async def complete(self, kind: RequestKind, req: OpenAIRequest, request_id: str,
                       carrier: dict[str, str]) -> dict:
        p = await self.prepare(kind, req, request_id)
        run = RequestRun(p)
        with self.observer.span(carrier, _span_attributes(p)) as rs:
            async for idx, chunk in merged_chunks(self.replica, replica_requests(p, rs.carrier),
                                                  self.first_output_timeout_s):
                run.add(idx, chunk)
            self._finish(rs, run)
        meta = fmt.ResponseMeta(p.request_id, p.created, p.model)
        usage = fmt.usage(p.num_prompt_tokens, run.num_output_tokens, run.num_cached_tokens)
        choices = []
        for i, seq in enumerate(run.choices()):
            prefix = (p.prompt_texts[i // p.num_choices] or "") if p.echo else ""
            choices.append(fmt.Choice(prefix + seq.text, seq.finish_reason,
                                      seq.logprobs if p.logprobs is not None else None, len(prefix)))
        build = fmt.completion_response if kind is RequestKind.COMPLETION else fmt.chat_response
        return build(meta, choices, usage, fmt.fingerprint(run.replica_ids), self.token_str)

    # ------------------------------------------------------------------ streams
    async def stream(self, kind: RequestKind, req: OpenAIRequest, request_id: str,
                     carrier: dict[str, str]) -> AsyncIterator[dict]:
        """Chunks as OpenAI streams them (best_of > 1 was refused by prepare: choices are sequences)."""
        p = await self.prepare(kind, req, request_id)
        meta = fmt.ResponseMeta(p.request_id, p.created, p.model)
        run = RequestRun(p)
        started: set[int] = set()
        with self.observer.span(carrier, _span_attributes(p)) as rs:
            if kind is RequestKind.CHAT:
                for i in range(len(run.seqs)):
                    yield fmt.chat_role_chunk(meta, i)
            async for idx, c in merged_chunks(self.replica, replica_requests(p, rs.carrier),
                                              self.first_output_timeout_s):
                is_first = idx not in started
                started.add(idx)
                text_before = len(run.seqs[idx].text)
                run.add(idx, c)
                chunk = self._chunk(p, meta, idx, c, is_first, text_before)
                if chunk is not None:
                    yield chunk
            self._finish(rs, run)
        if p.stream_usage:
            obj = "text_completion" if kind is RequestKind.COMPLETION else "chat.completion.chunk"
            yield fmt.usage_chunk(meta, obj, fmt.usage(p.num_prompt_tokens, run.num_output_tokens,
                                                       run.num_cached_tokens))

    def _chunk(self, p: PreparedRequest, meta: fmt.ResponseMeta, idx: int, c: ReplicaChunk, is_first: bool,
               text_before: int) -> dict | None:
        echo = p.echo and is_first
        if not c.text and not c.finish_reason and p.logprobs is None and not echo:
            return None              # text held back (a partial character or a possible stop string)
        fingerprint = fmt.fingerprint([c.replica_id])
        if p.kind is RequestKind.CHAT:
            lps = fmt.chat_logprobs(c.logprobs or [], self.token_str) if p.logprobs is not None else None
            return fmt.chat_chunk(meta, idx, c.text, c.finish_reason, lps, fingerprint, p.stream_usage)
        prefix = (p.prompt_texts[idx // p.num_choices] or "") if echo else ""
        offset = (len(p.prompt_texts[idx // p.num_choices] or "") if p.echo else 0) + text_before
        lps = (fmt.completion_logprobs(c.logprobs or [], self.token_str, offset)
               if p.logprobs is not None else None)
        return fmt.completion_chunk(meta, idx, prefix + c.text, c.finish_reason, lps, fingerprint, p.stream_usage)

    def _finish(self, rs: RequestSpan, run: RequestRun) -> None:
        self.observer.finish(rs, run.record())
        for replica_id, st in run.replica_stats.items():
            self.metrics.record_replica(replica_id, num_running=st.num_running, num_waiting=st.num_waiting,
                                        kv_cache_usage=st.kv_cache_usage, prefix_hit_rate=st.prefix_hit_rate,
                                        recent_prefix_hit_rate=st.recent_prefix_hit_rate)


def _span_attributes(p: PreparedRequest) -> dict[str, Any]:
    return {"model": p.model, "request_id": p.request_id, "kind": p.kind.value,
            "prompt_tokens": p.num_prompt_tokens}
