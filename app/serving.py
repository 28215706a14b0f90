"""OpenAIServing: completions and chat over the replicas, as prepare -> fan out -> format, one span each.

Shared by the HTTP routes and the Python handle API (app/ingress.py); raises APIError-classifiable
exceptions and leaves logging them to its caller.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from affinity_serve.app import openai_format as fmt
from affinity_serve.app.errors import APIError
from affinity_serve.app.fanout import ReplicaWait, RequestRun, SequenceResult, merged_chunks, replica_requests
from affinity_serve.app.prompts import (PreparedRequest, RequestKind, detokenize_request, max_token_chars,
                                        prepare_request, text_chars, tokenize_request)
from affinity_serve.app.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, GenerateRequest,
                                         ReplicaChunk, TokenizeRequest)
from affinity_serve.app.tool_calls import (ToolCallMode, ToolCallStream, auto_content, read_calls,
                                           tool_calls_message)
from affinity_serve.app.routing import debug as routing_debug
from affinity_serve.app.routing.serve_compat import handle_has_known_replicas
from affinity_serve.engine import EngineLimits
from affinity_serve.observability.metrics import ServingMetrics
from affinity_serve.observability.requests import RequestObserver, RequestSpan

logger = logging.getLogger("affinity.serving")

OpenAIRequest = CompletionRequest | ChatCompletionRequest


class OpenAIServing:
    def __init__(self, replica: Any, *, model_name: str, tokenizer: Any | None, first_output_timeout_s: float,
                 observer: RequestObserver, metrics: ServingMetrics, cold_start_timeout_s: float | None = None,
                 max_prompts_per_request: int | None = None, max_queue_wait_s: float | None = None,
                 tool_call_parser: str = "auto"):
        """`tokenizer` None: token-ids-only mode (no text in, empty text out, `token_id:<id>` token strings).
        `cold_start_timeout_s` (default: the first-output timeout): how long a request waits for a model
        replica to start while none is running (fanout.ReplicaWait). `max_prompts_per_request`: a
        completion's batch of prompts beyond it is a 400 (None: no bound). `tool_call_parser`: how tool_choice
        "auto" calls are read back (serve.tool_call_parser: "auto" from the chat template, a parser, "none")."""
        self.replica = replica
        self.max_prompts_per_request = max_prompts_per_request
        self.max_queue_wait_s = max_queue_wait_s
        self.tool_call_parser = tool_call_parser
        self._prepare_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prepare")
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.first_output_timeout_s = first_output_timeout_s
        self.cold_start_timeout_s = cold_start_timeout_s or first_output_timeout_s
        self.observer = observer
        self.metrics = metrics
        self._limits: EngineLimits | None = None
        self._token_chars: int | None = None
        self.wait = ReplicaWait(first_output_timeout_s, self.cold_start_timeout_s, self._num_replicas)

    @property
    def known_limits(self) -> EngineLimits | None:
        """The engine's limits if a replica has published them already (no call made)."""
        return self._limits

    def num_replicas(self) -> int | None:
        """Model replicas this process's router(s) can send to now (state only, no call made)."""
        return self._num_replicas()

    def _num_replicas(self) -> int | None:
        """Model replicas this process's router(s) can send to now; None without a router (built lazily by
        Serve on the first call, absent for test doubles of the handle)."""
        try:
            routers = routing_debug.routers_for(self.replica.app_name, self.replica.deployment_name)
        except Exception:
            return None
        return max((r.num_replicas() for r in routers), default=None)

    def replicas_seen(self) -> bool:
        """Whether this process knows of a running model replica: its router counts one now, or Serve's handle
        has once been given a non-empty replica set (state only, no call made)."""
        return bool(self._num_replicas()) or handle_has_known_replicas(self.replica)

    async def limits(self) -> EngineLimits:
        """The engine's limits, asked of a replica once (they are fixed when its KV pool is built).
        No replica answering in time is a 503, as for a generation (ReplicaWait's bounds)."""
        if self._limits is None:
            self._limits = await self.wait.first(self.replica.limits.remote(), "an answer")
        return self._limits

    def token_str(self, token_id: int) -> str:
        if self.tokenizer is None:
            return fmt.token_id_str(token_id)
        return self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (a part of a character is its byte, not U+FFFD's three)."""
        return fmt.token_bytes(self.tokenizer, token_id, self.token_str(token_id))

    async def prepare(self, kind: RequestKind, req: OpenAIRequest, request_id: str) -> PreparedRequest:
        """The prepared request. Tokenizing (a prompt of megabytes takes seconds) and hashing run on one
        worker thread, off the event loop, so other requests' streams go on meanwhile; one thread keeps the
        tokenizer used by one caller at a time, as before."""
        limits = await self.limits()
        p = await asyncio.get_running_loop().run_in_executor(
            self._prepare_thread, functools.partial(
                _releasing_memory, text_chars(kind, req), prepare_request, kind, req, request_id,
                model_name=self.model_name, limits=limits, tokenizer=self.tokenizer,
                max_prompts=self.max_prompts_per_request, max_token_chars=self._max_token_chars(),
                tool_call_parser=self.tool_call_parser))
        self._quiet_cancelled_futures()
        await self._admit(p)
        return p

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        """vLLM's /tokenize response: the ids the completions or chat API would run, their count, the
        context length (and each token's text with `return_token_strs`). On the prepare thread."""
        self._check_model(req.model)
        limits = await self.limits()
        chars = len(req.prompt or "") + sum(len(m.content) for m in req.messages or [] if isinstance(m.content, str))
        ids = await asyncio.get_running_loop().run_in_executor(
            self._prepare_thread, _releasing_memory, chars, tokenize_request, req, self.tokenizer)
        strs = [self.token_str(t) for t in ids] if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": limits.max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        """vLLM's /detokenize response: {"prompt": text}."""
        self._check_model(req.model)
        text = await asyncio.get_running_loop().run_in_executor(
            self._prepare_thread, detokenize_request, req, self.tokenizer)
        return {"prompt": text}

    def _max_token_chars(self) -> int | None:
        """The tokenizer's longest token in characters (the bound on a prompt's text before it is tokenized);
        read once, on the prepare thread's first use. None without a tokenizer."""
        if self.tokenizer is None:
            return None
        if self._token_chars is None:
            self._token_chars = max_token_chars(self.tokenizer)
        return self._token_chars

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                           404, "invalid_request_error", "model", "model_not_found")

    def _quiet_cancelled_futures(self) -> None:
        quiet_cancelled_futures()

    async def _admit(self, p: PreparedRequest) -> None:
        """Admission control (`serve.max_queue_wait_s`): a 429 with Retry-After, before anything is sent,
        when this process's router predicts that no replica would start the request's (first) prompt within
        the bound. Nothing to ask (no router yet, a load-only policy, a failed call) admits the request.

        An admitted request's load is held in the router's core until it is routed (`hold_admitted`, in the
        same call on the router loop as the prediction): a burst admitted faster than Serve routes it would
        otherwise find the replicas as idle as the first of it did."""
        bound = self.max_queue_wait_s
        if bound is None:
            return
        try:
            routers = routing_debug.routers_for(self.replica.app_name, self.replica.deployment_name)
            if not routers:
                return
            # the router that routed last: with several handles in a process, not a shell Serve kept for a
            # dropped one (whose feed admission's asking would keep from pausing)
            router = max(routers, key=lambda r: getattr(r, "last_routed", 0.0))
            hashes = p.block_hashes[0] if p.block_hashes else None
            max_tokens = (p.params.max_tokens or 0) * max(1, p.params.n)

            def predict_and_hold() -> float | None:
                wait = router.predicted_wait_s(p.request_id, p.prompts[0], hashes, max_tokens, bound)
                hold = getattr(getattr(router, "core", None), "hold_admitted", None)
                if wait is not None and wait <= bound and hold is not None:
                    hold(p.request_id)
                return wait

            wait = await router.run_on_loop(predict_and_hold)
        except Exception:
            logger.debug("admission control: no prediction for %s", p.request_id, exc_info=True)
            return
        if wait is not None and wait > bound:
            raise APIError(f"the server is overloaded: the shortest predicted wait for a first token is {wait:.1f}s, "
                           f"over serve.max_queue_wait_s ({bound:g}s); retry later", 429, "rate_limit_error", None,
                           "queue_full", retry_after_s=max(1, math.ceil(wait - bound)))

    # ------------------------------------------------------------------ whole responses
    async def complete(self, kind: RequestKind, req: OpenAIRequest, request_id: str,
                       carrier: dict[str, str]) -> dict:
        p = await self.prepare(kind, req, request_id)
        run = RequestRun(p)
        with self.observer.span(carrier, _span_attributes(p)) as rs:
            try:
                async for idx, chunk in self._chunks(p, rs.carrier, run):
                    run.add(idx, chunk)
            except BaseException:
                self._ended_early(rs, run)
                raise
            self._finish(rs, run)
        meta = fmt.ResponseMeta(p.request_id, p.created, p.model)
        usage = fmt.usage(p.num_prompt_tokens, run.num_output_tokens, run.num_cached_tokens)
        fingerprint = fmt.fingerprint(run.replica_ids)
        if kind is RequestKind.CHAT:
            choices = [fmt.Choice(s.text, s.finish_reason, s.logprobs if p.logprobs is not None else None,
                                  token_ids=s.token_ids if p.return_token_ids else None, stop_reason=s.stop_reason)
                       for s in run.choices()]
            if p.tool_mode is not None:
                choices = [_as_tool_calls(c, p.tool_mode, s.stop_reason) for c, s in zip(choices, run.choices())]
            return fmt.chat_response(meta, choices, usage, fingerprint, self.token_str, _prompt_ids(p, 0),
                                     self.token_bytes)
        choices = [self._completion_choice(p, run, i // p.num_choices, s) for i, s in enumerate(run.choices())]
        return fmt.completion_response(meta, choices, usage, fingerprint, self.token_str, p.logprobs or 0)

    def _completion_choice(self, p: PreparedRequest, run: RequestRun, prompt: int,
                           seq: SequenceResult) -> fmt.Choice:
        """Every choice of a prompt carries that prompt's echo and prompt logprobs (computed once)."""
        prompt_lps = None
        if p.prompt_logprobs is not None:
            prompt_lps = fmt.vllm_prompt_logprobs(p.prompts[prompt], run.prompt_logprobs_of(prompt),
                                                  self.token_str, p.prompt_logprobs)
        return fmt.Choice(seq.text, seq.finish_reason, seq.logprobs if p.logprobs is not None else None,
                          self._echo(p, run, prompt), prompt_lps,
                          token_ids=seq.token_ids if p.return_token_ids else None,
                          prompt_token_ids=_prompt_ids(p, prompt), stop_reason=seq.stop_reason)

    def _echo(self, p: PreparedRequest, run: RequestRun, prompt: int) -> fmt.EchoedPrompt | None:
        if not p.echo:
            return None
        return fmt.EchoedPrompt(p.prompt_texts[prompt] or "", p.prompts[prompt],
                                run.prompt_logprobs_of(prompt) if p.logprobs is not None else None)

    # ------------------------------------------------------------------ streams
    async def stream(self, kind: RequestKind, req: OpenAIRequest, request_id: str,
                     carrier: dict[str, str]) -> AsyncIterator[dict]:
        """Chunks as OpenAI streams them (best_of > 1 was refused by prepare: choices are sequences)."""
        p = await self.prepare(kind, req, request_id)
        meta = fmt.ResponseMeta(p.request_id, p.created, p.model)
        run = RequestRun(p)
        gate = _EchoGate(p, run)
        text_offsets: dict[int, int] = {}     # choice -> `text_offset` of its next token; absent: none sent
        tool_streams: dict[int, ToolCallStream] = {}     # chat with tools: choice -> its tool-call reader
        with self.observer.span(carrier, _span_attributes(p)) as rs:
            chunks = self._chunks(p, rs.carrier, run)
            try:
                # Route first, then start the stream: a refusal (429 overloaded, 503) before any replica
                # output must still be an HTTP status, so chat's role chunks wait for the first output.
                first = await anext(chunks, None)
                if kind is RequestKind.CHAT:
                    for i in range(len(run.seqs)):
                        role = fmt.chat_role_chunk(meta, i, _prompt_ids(p, 0))
                        if p.continuous_usage:
                            role["usage"] = fmt.usage(p.num_prompt_tokens, 0, run.num_cached_tokens)
                        yield role
                while first is not None:
                    idx, c = first
                    for i, ready in gate.release(idx, run.add(idx, c)):
                        chunk = self._chunk(p, meta, run, i, ready, text_offsets, tool_streams)
                        if chunk is not None:
                            if p.continuous_usage:
                                chunk["usage"] = fmt.usage(p.num_prompt_tokens, run.num_output_tokens,
                                                           run.num_cached_tokens)
                            yield chunk
                    first = await anext(chunks, None)
            except BaseException:
                self._ended_early(rs, run)
                raise
            finally:
                await chunks.aclose()
            gate.check_drained()
            self._finish(rs, run)
        if p.stream_usage:
            obj = "text_completion" if kind is RequestKind.COMPLETION else "chat.completion.chunk"
            yield fmt.usage_chunk(meta, obj, fmt.usage(p.num_prompt_tokens, run.num_output_tokens,
                                                       run.num_cached_tokens))

    def _chunk(self, p: PreparedRequest, meta: fmt.ResponseMeta, run: RequestRun, idx: int, c: ReplicaChunk,
               text_offsets: dict[int, int], tool_streams: dict[int, ToolCallStream] | None = None) -> dict | None:
        """Choice `idx`'s chunk for `c`; with echo its first chunk starts with the prompt (and its logprobs),
        with return_token_ids it carries the prompt's ids (chat: on the role chunks) and each chunk its own ids."""
        first = idx not in text_offsets
        prompt = idx // p.num_choices
        echo = self._echo(p, run, prompt) if first else None
        token_ids = c.token_ids if p.return_token_ids else None
        if not c.text and not c.finish_reason and p.logprobs is None and echo is None and not token_ids:
            return None              # text held back (a partial character or a possible stop string)
        fingerprint = fmt.fingerprint([c.replica_id])
        if p.kind is RequestKind.CHAT:
            lps = (fmt.chat_logprobs(c.logprobs or [], self.token_str, self.token_bytes) if p.logprobs is not None
                   else None)
            if p.tool_mode is not None and tool_streams is not None:
                reader = tool_streams.setdefault(idx, ToolCallStream(p.tool_mode))
                calls = reader.feed(c.text, final=bool(c.finish_reason))
                text = reader.content(final=bool(c.finish_reason))
                if not calls and not text and not c.finish_reason and lps is None and not token_ids:
                    return None          # a call's name (or an "auto" call) is not complete yet
                reason = (_tool_finish_reason(c.finish_reason, c.stop_reason, reader.text, p.tool_mode) if reader.sent
                          else c.finish_reason)
                return fmt.chat_chunk(meta, idx, text, reason, lps, fingerprint, p.stream_usage,
                                      token_ids=token_ids, tool_calls=calls, stop_reason=c.stop_reason)
            return fmt.chat_chunk(meta, idx, c.text, c.finish_reason, lps, fingerprint, p.stream_usage,
                                  token_ids=token_ids, stop_reason=c.stop_reason)
        offset = text_offsets.get(idx, 0)
        lps = None
        if p.logprobs is not None:
            lps = fmt.completion_logprobs(c.logprobs or [], self.token_str, p.logprobs, echo=echo,
                                          text_offset=offset)
            offset += sum(len(t) for t in lps["tokens"])
        text_offsets[idx] = offset
        text = (echo.text if echo else "") + c.text
        return fmt.completion_chunk(meta, idx, text, c.finish_reason, lps, fingerprint, p.stream_usage,
                                    token_ids=token_ids, prompt_token_ids=_prompt_ids(p, prompt) if first else None,
                                    stop_reason=c.stop_reason)

    async def _chunks(self, p: PreparedRequest, carrier: dict[str, str],
                      run: RequestRun) -> AsyncIterator[tuple[int, ReplicaChunk]]:
        """The replicas' merged chunks; each prompt's first token (and the cached tokens the engine found)
        is reported to this process's router, which calibrates its TTFT model and index accuracy on it,
        and the router's decision for that prompt joins `run.routing` (for the span and the metrics)."""
        reqs = replica_requests(p, carrier)
        started: set[int] = set()
        chunks = merged_chunks(self.replica, reqs, self.wait)
        try:
            async for idx, c in chunks:
                prompt = idx // p.params.n
                if c.token_ids and prompt not in started:
                    started.add(prompt)
                    self._report_first_token(reqs[prompt].req_id, c.num_cached_tokens, c.kv_wait_s)
                    self._take_decision(run, reqs[prompt], c)
                yield idx, c
        finally:
            await chunks.aclose()      # leaving early cancels the replica streams now, not at GC

    def _report_first_token(self, req_id: str, num_cached_tokens: int, kv_wait_s: float = 0.0) -> None:
        try:
            for router in routing_debug.routers_for(self.replica.app_name, self.replica.deployment_name):
                router.call_soon(router.on_first_token, req_id, num_cached_tokens, kv_wait_s)
        except Exception:      # no router here (a test double for the handle), or it is gone: routing only
            logger.debug("no router to report the first token of %s to", req_id, exc_info=True)

    @staticmethod
    def _take_decision(run: RequestRun, req: GenerateRequest, c: ReplicaChunk) -> None:
        """The router (in this process) left its decision on the request before sending it, so it is there
        by the first token; None without a router here (load-only policies place nothing)."""
        decision, req.routing.value = req.routing.value, None
        if decision is not None:
            run.routing.append(routing_debug.routing_record(decision, c.replica_id, c.num_cached_tokens))

    def _ended_early(self, rs: RequestSpan, run: RequestRun) -> None:
        """A request that ends without its last output (the client gone, a failure) after some replica output:
        its span and the routing metrics still get what is known (RequestObserver.ended_early)."""
        if run.replica_ids:
            self.observer.ended_early(rs, run.record())

    def _finish(self, rs: RequestSpan, run: RequestRun) -> None:
        # the replicas export their own gauges and KV tier counters, on a timer (app/metrics_hub.py)
        self.observer.finish(rs, run.record())


class _EchoGate:
    """Holds back stream chunks until they can be formatted. With echo and logprobs a choice's first chunk
    carries its prompt's logprobs, which the engine computes once, on the prompt's sequence 0 with its first
    token: a sibling's chunks that arrive before them wait (and are released in order)."""

    def __init__(self, p: PreparedRequest, run: RequestRun):
        self.n = p.params.n
        self.run = run
        self.active = p.echo and p.logprobs is not None
        self.held: dict[int, list[ReplicaChunk]] = {}

    def release(self, idx: int, c: ReplicaChunk) -> list[tuple[int, ReplicaChunk]]:
        """(choice, chunk) pairs ready to send now, `c` among them unless it has to wait."""
        if not self.active:
            return [(idx, c)]
        self.held.setdefault(idx, []).append(c)
        prompt = idx // self.n
        if self.run.prompt_logprobs[prompt] is None:
            return []
        return [(i, held) for i in range(prompt * self.n, (prompt + 1) * self.n) for held in self.held.pop(i, [])]

    def check_drained(self) -> None:
        """At the end of the streams: chunks still held mean a prompt's logprobs never came (a 500)."""
        for idx in self.held:
            self.run.prompt_logprobs_of(idx // self.n)


def _tool_finish_reason(reason: str | None, stop_reason: int | str | None, text: str, mode: ToolCallMode
                        ) -> str | None:
    """Output that holds calls: "tool_calls" when it ended by itself (the grammar, the model's end of turn) or by
    one of the request's stop strings after its calls were whole; a stop string that cut a call: "stop"; cut
    short by max_tokens: "length"."""
    if reason != "stop":
        return reason
    if isinstance(stop_reason, str) and not all(whole for *_, whole in read_calls(text, mode, final=True)):
        return "stop"
    return "tool_calls"


def _as_tool_calls(c: fmt.Choice, mode: ToolCallMode, stop_reason: int | str | None) -> fmt.Choice:
    """A chat choice whose output is a grammar-constrained call (or, tool_choice "auto", text that may hold
    calls in the template's format): its text read back as `tool_calls`. Output that holds no call stays
    text: "auto"'s answer in words, or a forced call cut short before its function's name was complete."""
    calls = tool_calls_message(c.text, mode)
    if not calls:
        return c
    return dataclasses.replace(c, text=(auto_content(c.text, mode) or "") if mode.parser else "", tool_calls=calls,
                               finish_reason=_tool_finish_reason(c.finish_reason, stop_reason, c.text, mode))


def _prompt_ids(p: PreparedRequest, prompt: int) -> list[int] | None:
    """Prompt `prompt`'s token ids when the client asked for them (return_token_ids), else None."""
    return p.prompts[prompt] if p.return_token_ids else None


def _span_attributes(p: PreparedRequest) -> dict[str, Any]:
    return {"model": p.model, "request_id": p.request_id, "kind": p.kind.value,
            "prompt_tokens": p.num_prompt_tokens}


class _CancellationNobodyRetrieved(logging.Filter):
    """Drops asyncio's "Future/Task exception was never retrieved" reports of a cancellation."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and _is_cancellation(exc) and "never retrieved" in record.getMessage())


_QUIET_FILTER = _CancellationNobodyRetrieved()


def quiet_cancelled_futures() -> None:
    """A dropped stream cancels its replica calls, and Ray then sets TaskCancelledError on futures nobody
    awaits any more (in Serve's own request handling, on the replica's main loop, and on the loop its handles
    route on); asyncio logged each as "Future exception was never retrieved" with a traceback (hundreds in a
    soak). A disconnect is not a server error: asyncio's logger drops those reports, in this process, on every
    loop; every other report is logged as before. Idempotent."""
    logger_ = logging.getLogger("asyncio")
    if _QUIET_FILTER not in logger_.filters:
        logger_.addFilter(_QUIET_FILTER)


def _is_cancellation(exc: BaseException) -> bool:
    """Ray's or Serve's "this call was cancelled" (the client left), by class name: Ray may be absent."""
    return type(exc).__name__ in ("TaskCancelledError", "RequestCancelledError") or isinstance(
        exc, asyncio.CancelledError)


#: after tokenizing at least this many characters, the prepare thread hands its freed memory back
RELEASE_AFTER_CHARS = 256 * 1024


def _releasing_memory(chars: int, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` on the prepare thread; after a large text (`chars`), glibc's malloc_trim: a
    tokenizer's work on a megabyte prompt frees ~140 MB that glibc otherwise keeps in this thread's arena, so
    the ingress's RSS stayed that much higher after one such request (issue 33.12)."""
    try:
        return fn(*args, **kwargs)
    finally:
        if chars >= RELEASE_AFTER_CHARS:
            release_freed_memory()


def release_freed_memory() -> bool:
    """Return the C allocator's free memory to the OS (glibc only; elsewhere nothing). True when trimmed."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes
            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if not _malloc_trim:
        return False
    _malloc_trim(0)
    return True


_malloc_trim: Any = None
