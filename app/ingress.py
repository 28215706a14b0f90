"""Ingress: OpenAI-compatible HTTP API (FastAPI via @serve.ingress) and the Python handle API.

Tokenizes and applies the chat template here, so replicas (and the router in front of them) receive
token ids. Every error leaves through `app.errors` as an OpenAI error body with the right status.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.config import AppConfig
from app.errors import APIError, pydantic_error, to_api_error
from app.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest, ReplicaChunk
from engine.errors import EngineError
from engine.types import Logprobs
from observability import names
from observability.metrics import ServingMetrics
from observability.logs import configure_json_logging, request_id_var
from observability.setup import prometheus_text, setup_telemetry
from observability.tracing import extract_context, inject_carrier, trace_id_hex

logger = logging.getLogger("affinity.ingress")
fastapi_app = FastAPI(title="affinity-serve", description="OpenAI-compatible LLM serving on Ray Serve")


def _error_response(err: APIError, request_id: str | None = None) -> JSONResponse:
    headers = {}
    if err.retry_after_s is not None and err.status_code in (429, 503):
        headers["Retry-After"] = str(err.retry_after_s)
    if request_id:
        headers["x-request-id"] = request_id
    return JSONResponse(err.body(), status_code=err.status_code, headers=headers)


@fastapi_app.exception_handler(StarletteHTTPException)
async def _http_exc(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return _error_response(APIError(str(exc.detail), exc.status_code, "invalid_request_error", None, code))


@dataclass
class _Prepared:
    """A validated request: one entry per prompt, each with its token ids."""

    kind: str                      # "completion" | "chat"
    request_id: str
    model: str
    prompts: list[list[int]]
    prompt_texts: list[str | None]
    params: Any
    stream_usage: bool
    logprobs: int | None
    echo: bool = False
    priority: int = 0
    cache_salt: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class _Acc:
    """Accumulated result of one choice."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] = field(default_factory=list)
    finish_reason: str | None = None


class Ingress:
    def __init__(self, replica: Any, config: dict[str, Any]):
        from engine.llm_engine import resolve_max_model_len
        from engine.config import EngineConfig
        from engine.models.config import ModelArgs
        from engine.tokenizer import load_tokenizer

        self.cfg = AppConfig.model_validate(config)
        self.replica = replica
        model_dir = self.cfg.engine.model
        assert model_dir, "builder resolves the model directory"
        self.tokenizer = load_tokenizer(model_dir)
        engine_cfg = EngineConfig.model_validate(self.cfg.engine.model_dump())
        model_args = ModelArgs.from_dir(model_dir)
        self.max_model_len = resolve_max_model_len(engine_cfg, model_args)
        self.vocab_size = model_args.vocab_size
        self.model_name = self.cfg.serve.model_name or Path(model_dir).name
        obs = self.cfg.observability
        self.telemetry = setup_telemetry(obs.service_name, obs.traces, obs.otlp_endpoint, obs.max_spans_kept)
        self.tracer = self.telemetry.tracer
        self.metrics = ServingMetrics(self.telemetry.meter)
        configure_json_logging(obs.log_level)

    # ================================================================== HTTP routes
    @fastapi_app.post("/v1/completions")
    async def http_completions(self, request: Request) -> Response:
        return await self._http("completion", request)

    @fastapi_app.post("/v1/chat/completions")
    async def http_chat(self, request: Request) -> Response:
        return await self._http("chat", request)

    @fastapi_app.get("/v1/models")
    async def http_models(self, request: Request) -> Response:
        err = self._check_auth(request)
        if err is not None:
            return _error_response(err)
        return JSONResponse(await self.models())

    @fastapi_app.get("/health")
    async def http_health(self) -> Response:
        try:
            await asyncio.wait_for(self.replica.debug_state.remote(), timeout=5)
        except Exception as e:
            return _error_response(to_api_error(e) if not isinstance(e, asyncio.TimeoutError) else APIError(
                "no model replica answered", 503, "service_unavailable", None, "replica_unavailable", 1))
        return JSONResponse({"status": "ok", "model": self.model_name})

    @fastapi_app.get("/metrics")
    async def http_metrics(self) -> Response:
        return Response(prometheus_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _http(self, kind: str, request: Request) -> Response:
        route = request.url.path
        request_id = request.headers.get("x-request-id") or f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        request_id_var.set(request_id)
        try:
            err = self._check_auth(request)
            if err is not None:
                raise err
            body = await self._read_json(request)
            model_cls = CompletionRequest if kind == "completion" else ChatCompletionRequest
            try:
                req = model_cls.model_validate(body)
            except ValidationError as e:
                raise pydantic_error(e) from None
            carrier = inject_carrier(extract_context(request.headers))
            if req.stream:
                gen = self._stream(kind, req, request_id, carrier)
                first = await gen.__anext__()          # errors before the first byte -> a proper status
                self.metrics.record_http(route, 200)
                return StreamingResponse(self._sse(first, gen), media_type="text/event-stream")
            result = await self._complete(kind, req, request_id, carrier)
            self.metrics.record_http(route, 200)
            return JSONResponse(result)
        except Exception as e:
            api = to_api_error(e)
            self.metrics.record_http(route, api.status_code)
            logger.info("request rejected", extra={"route": route, "status": api.status_code, "code": api.code,
                                                   "param": api.param})
            return _error_response(api)

    def _check_auth(self, request: Request) -> APIError | None:
        key = self.cfg.serve.api_key
        if key and request.headers.get("authorization") != f"Bearer {key}":
            return APIError("missing or invalid API key (send 'Authorization: Bearer <key>')", 401,
                            "authentication_error", None, "invalid_api_key")
        return None

    async def _read_json(self, request: Request) -> Any:
        size = request.headers.get("content-length")
        limit = self.cfg.serve.max_request_body_bytes
        if size is not None and size.isdigit() and int(size) > limit:
            raise APIError(f"request body is larger than {limit} bytes", 413, "invalid_request_error", None,
                           "request_too_large")
        raw = await request.body()
        if len(raw) > limit:
            raise APIError(f"request body is larger than {limit} bytes", 413, "invalid_request_error", None,
                           "request_too_large")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(f"request body is not valid JSON: {e}", 400, "invalid_request_error", None,
                           "invalid_json") from None
        if not isinstance(body, dict):
            raise APIError("request body must be a JSON object", 400, "invalid_request_error", None, "invalid_json")
        return body

    async def _sse(self, first: dict, gen: AsyncIterator[dict]) -> AsyncIterator[str]:
        yield f"data: {json.dumps(first)}\n\n"
        try:
            async for chunk in gen:
                yield f"data: {json.dumps(chunk)}\n\n"
        except Exception as e:       # the stream already started: report in-band, then end it
            yield f"data: {json.dumps(to_api_error(e).body())}\n\n"
        yield "data: [DONE]\n\n"

    # ================================================================== Python handle API
    async def completions(self, request: CompletionRequest | dict, request_id: str | None = None) -> dict:
        """Non-streaming completion; raises APIError (status_code, type, param, code) on bad input."""
        req = _coerce(CompletionRequest, request)
        return await self._complete("completion", req, request_id or f"cmpl-{uuid.uuid4().hex}", {})

    async def chat(self, request: ChatCompletionRequest | dict, request_id: str | None = None) -> dict:
        req = _coerce(ChatCompletionRequest, request)
        return await self._complete("chat", req, request_id or f"chatcmpl-{uuid.uuid4().hex}", {})

    async def completions_stream(self, request: CompletionRequest | dict,
                                 request_id: str | None = None) -> AsyncIterator[dict]:
        """Streaming completion chunks; call with `handle.options(stream=True)`."""
        req = _coerce(CompletionRequest, request)
        async for chunk in self._stream("completion", req, request_id or f"cmpl-{uuid.uuid4().hex}", {}):
            yield chunk

    async def chat_stream(self, request: ChatCompletionRequest | dict,
                          request_id: str | None = None) -> AsyncIterator[dict]:
        req = _coerce(ChatCompletionRequest, request)
        async for chunk in self._stream("chat", req, request_id or f"chatcmpl-{uuid.uuid4().hex}", {}):
            yield chunk

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "affinity-serve", "max_model_len": self.max_model_len}]}

    async def debug_spans(self) -> list[dict]:
        """Finished spans kept in memory (observability.traces: memory), for inspection and tests."""
        exp = self.telemetry.span_exporter
        if exp is None:
            return []
        out = []
        for s in exp.get_finished_spans():
            out.append({"name": s.name, "trace_id": format(s.context.trace_id, "032x"),
                        "span_id": format(s.context.span_id, "016x"),
                        "parent_id": format(s.parent.span_id, "016x") if s.parent else None,
                        "attributes": dict(s.attributes or {}), "start": s.start_time, "end": s.end_time})
        return out

    async def replica_state(self) -> dict:
        return await self.replica.debug_state.remote()

    # ================================================================== core
    def _prepare(self, kind: str, req: CompletionRequest | ChatCompletionRequest, request_id: str) -> _Prepared:
        if req.model is not None and req.model != self.model_name:
            raise APIError(f"the model '{req.model}' does not exist; this server serves '{self.model_name}'",
                           404, "invalid_request_error", "model", "model_not_found")
        texts: list[str | None]
        if kind == "chat":
            from engine.tokenizer import apply_chat_template
            prompts = [apply_chat_template(self.tokenizer, req.rendered_messages())]
            texts = [None]
            param = "messages"
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
            if req.top_logprobs and not req.logprobs:
                raise APIError("top_logprobs requires logprobs: true", 400, "invalid_request_error",
                               "top_logprobs", "invalid_value")
            max_tokens = req.max_completion_tokens or req.max_tokens
        else:
            prompts, texts = self._completion_prompts(req.prompt)
            param = "prompt"
            logprobs = req.logprobs
            max_tokens = req.max_tokens
        vocab = self.vocab_size
        for ids in prompts:
            if not ids:
                raise APIError("prompt is empty", 400, "invalid_request_error", param, "invalid_value")
            if len(ids) >= self.max_model_len:
                raise APIError(f"this model's maximum context length is {self.max_model_len} tokens, but the "
                               f"prompt has {len(ids)} tokens; shorten it", 400, "invalid_request_error", param,
                               "context_length_exceeded")
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(f"token id {bad} is outside the vocabulary (size {vocab})", 400,
                               "invalid_request_error", "prompt", "invalid_value")
        longest = max(len(p) for p in prompts)
        if max_tokens is None:
            max_tokens = 16 if kind == "completion" else self.max_model_len - longest
        if longest + max_tokens > self.max_model_len:
            raise APIError(f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                           f"{longest} tokens and max_tokens is {max_tokens}; lower max_tokens or shorten the "
                           "prompt", 400, "invalid_request_error", "max_tokens", "context_length_exceeded")
        try:
            params = req.sampling_params(max_tokens, logprobs)
        except EngineError as e:
            raise to_api_error(e) from None
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return _Prepared(kind, req.request_id or request_id, self.model_name, prompts, texts, params, usage,
                         logprobs, getattr(req, "echo", False), req.priority, req.cache_salt)

    def _completion_prompts(self, prompt: Any) -> tuple[list[list[int]], list[str | None]]:
        if isinstance(prompt, str):
            return [self.tokenizer.encode(prompt)], [prompt]
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            return [self.tokenizer.encode(p) for p in prompt], list(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
            return [list(p) for p in prompt], [None] * len(prompt)
        if isinstance(prompt, list) and all(isinstance(p, int) for p in prompt):
            return [list(prompt)], [None]
        raise APIError("prompt must be a string, a list of strings, or token ids", 400, "invalid_request_error",
                       "prompt", "invalid_value")

    async def _chunks(self, p: _Prepared, carrier: dict[str, str]) -> AsyncIterator[tuple[int, ReplicaChunk]]:
        """Merged replica streams of every prompt: (choice index, chunk)."""
        n = p.params.n
        timeout = self.cfg.serve.first_token_timeout_s
        handle = self.replica.options(stream=True)
        if len(p.prompts) == 1:
            gen = handle.generate.remote(self._gen_request(p, 0, carrier))
            async for c in _with_first_timeout(gen, timeout):
                yield c.index, c
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                gen = handle.generate.remote(self._gen_request(p, i, carrier))
                async for c in _with_first_timeout(gen, timeout):
                    await queue.put((i * n + c.index, c))
                await queue.put((i, None))
            except BaseException as e:   # noqa: BLE001 - delivered to the consumer
                await queue.put((i, e))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(p.prompts))]
        try:
            done = 0
            while done < len(tasks):
                idx, item = await queue.get()
                if item is None:
                    done += 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield idx, item
        finally:
            for t in tasks:
                t.cancel()

    def _gen_request(self, p: _Prepared, i: int, carrier: dict[str, str]) -> GenerateRequest:
        rid = p.request_id if len(p.prompts) == 1 else f"{p.request_id}-{i}"
        return GenerateRequest(rid, p.prompts[i], p.params, p.priority, p.cache_salt, carrier, time.time())

    async def _complete(self, kind: str, req, request_id: str, carrier: dict[str, str]) -> dict:
        p = self._prepare(kind, req, request_id)
        with self._span(p, carrier) as (span, ctx, t0):
            accs = [_Acc() for _ in range(len(p.prompts) * p.params.n)]
            info = _RunInfo()
            async for idx, c in self._chunks(p, inject_carrier(ctx) or carrier):
                info.on_chunk(idx, c, p.params.n)
                acc = accs[idx]
                acc.text += c.text
                acc.token_ids += c.token_ids
                if c.logprobs:
                    acc.logprobs += c.logprobs
                if c.finish_reason:
                    acc.finish_reason = c.finish_reason
            self._finish_observation(p, span, ctx, t0, info)
        usage = info.usage(p)
        if kind == "completion":
            choices = []
            for i, acc in enumerate(accs):
                prefix = (p.prompt_texts[i // p.params.n] or "") if p.echo else ""
                choices.append({"index": i, "text": prefix + acc.text, "finish_reason": acc.finish_reason,
                                "logprobs": self._completion_logprobs(acc.logprobs) if p.logprobs is not None else None})
            return {"id": p.request_id, "object": "text_completion", "created": p.created, "model": p.model,
                    "system_fingerprint": info.fingerprint(), "choices": choices, "usage": usage}
        choices = [{"index": i, "message": {"role": "assistant", "content": acc.text},
                    "logprobs": {"content": self._chat_logprobs(acc.logprobs)} if p.logprobs is not None else None,
                    "finish_reason": acc.finish_reason} for i, acc in enumerate(accs)]
        return {"id": p.request_id, "object": "chat.completion", "created": p.created, "model": p.model,
                "system_fingerprint": info.fingerprint(), "choices": choices, "usage": usage}

    async def _stream(self, kind: str, req, request_id: str, carrier: dict[str, str]) -> AsyncIterator[dict]:
        p = self._prepare(kind, req, request_id)
        obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
        base = {"id": p.request_id, "object": obj, "created": p.created, "model": p.model}
        with self._span(p, carrier) as (span, ctx, t0):
            info = _RunInfo()
            if kind == "chat":        # OpenAI sends the role first
                for i in range(len(p.prompts) * p.params.n):
                    yield {**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]}
            async for idx, c in self._chunks(p, inject_carrier(ctx) or carrier):
                first_of_choice = idx not in info.started
                info.on_chunk(idx, c, p.params.n)
                if not c.text and not c.finish_reason and p.logprobs is None and not (p.echo and first_of_choice):
                    continue      # text held back (partial character or possible stop string)
                if kind == "completion":
                    text = c.text
                    if p.echo and first_of_choice:
                        text = (p.prompt_texts[idx // p.params.n] or "") + text
                    choice = {"index": idx, "text": text, "finish_reason": c.finish_reason,
                              "logprobs": self._completion_logprobs(c.logprobs or []) if p.logprobs is not None else None}
                else:
                    choice = {"index": idx, "delta": {"content": c.text} if c.text or not c.finish_reason else {},
                              "logprobs": {"content": self._chat_logprobs(c.logprobs or [])}
                              if p.logprobs is not None else None, "finish_reason": c.finish_reason}
                chunk = {**base, "system_fingerprint": f"replica:{c.replica_id}", "choices": [choice]}
                if p.stream_usage:
                    chunk["usage"] = None
                yield chunk
            self._finish_observation(p, span, ctx, t0, info)
        if p.stream_usage:
            yield {**base, "choices": [], "usage": info.usage(p)}

    # ------------------------------------------------------------------ formatting
    def _token_str(self, tid: int) -> str:
        return self.tokenizer.decode([tid], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _completion_logprobs(self, lps: list[Logprobs]) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = 0
        for lp in lps:
            s = self._token_str(lp.token_id)
            tokens.append(s)
            token_lps.append(lp.logprob)
            tops.append({self._token_str(t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs)})
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _chat_logprobs(self, lps: list[Logprobs]) -> list[dict]:
        out = []
        for lp in lps:
            s = self._token_str(lp.token_id)
            out.append({"token": s, "logprob": lp.logprob, "bytes": list(s.encode("utf-8")),
                        "top_logprobs": [{"token": (ts := self._token_str(t)), "logprob": v,
                                          "bytes": list(ts.encode("utf-8"))}
                                         for t, v in zip(lp.top_token_ids, lp.top_logprobs)]})
        return out

    # ------------------------------------------------------------------ observability
    def _span(self, p: _Prepared, carrier: dict[str, str]):
        from contextlib import contextmanager

        from opentelemetry import trace
        from observability.tracing import context_from_carrier

        @contextmanager
        def cm():
            parent = context_from_carrier(carrier) if carrier else None
            t0 = time.time_ns()
            span = self.tracer.start_span(names.SPAN_REQUEST, context=parent, start_time=t0, attributes={
                "model": p.model, "request_id": p.request_id, "kind": p.kind,
                "prompt_tokens": sum(len(x) for x in p.prompts)})
            ctx = trace.set_span_in_context(span)
            try:
                yield span, ctx, t0
            except BaseException as e:
                span.set_attribute("error", type(e).__name__)
                span.set_status(trace.Status(trace.StatusCode.ERROR, str(e)[:200]))
                raise
            finally:
                span.end()

        return cm()

    def _finish_observation(self, p: _Prepared, span, ctx, t0: int, info: "_RunInfo") -> None:
        end = time.time_ns()
        span.set_attribute("output_tokens", info.output_tokens)
        span.set_attribute("cached_tokens", info.cached_tokens())
        span.set_attribute("replica", ",".join(sorted(info.replicas)))
        span.set_attribute("trace_id", trace_id_hex(span))
        seen = {st.get("trace_id") for st in info.replica_stats.values()} - {None}
        if seen:
            span.set_attribute("replica_trace_id", ",".join(sorted(seen)))
        t = info.timings or {}
        decode_start = end - int(t.get("decode_s", 0) * 1e9)
        prefill_start = decode_start - int(t.get("prefill_s", 0) * 1e9)
        queue_start = max(t0, prefill_start - int(t.get("queue_s", 0) * 1e9))
        prefill_start = max(prefill_start, queue_start)
        decode_start = max(decode_start, prefill_start)
        replica = ",".join(sorted(info.replicas))
        for name, a, b in ((names.SPAN_ROUTING, t0, queue_start), (names.SPAN_QUEUE, queue_start, prefill_start),
                           (names.SPAN_PREFILL, prefill_start, decode_start), (names.SPAN_DECODE, decode_start, end)):
            child = self.tracer.start_span(name, context=ctx, start_time=a, attributes={"replica": replica})
            child.end(end_time=max(a, b))
        ttft = (info.first_token_ns - t0) / 1e9 if info.first_token_ns else None
        logger.info("request finished", extra={
            "request_id": p.request_id, "replica": replica, "prompt_tokens": sum(len(x) for x in p.prompts),
            "output_tokens": info.output_tokens, "cached_tokens": info.cached_tokens(),
            "ttft_s": round(ttft, 4) if ttft is not None else None, "e2e_s": round((end - t0) / 1e9, 4)})
        self.metrics.record_request(model=p.model, prompt_tokens=sum(len(x) for x in p.prompts),
                                    output_tokens=info.output_tokens, cached_tokens=info.cached_tokens(),
                                    ttft_s=ttft, e2e_s=(end - t0) / 1e9)
        for rid, stats in info.replica_stats.items():
            self.metrics.record_replica(rid, stats)


class _RunInfo:
    def __init__(self) -> None:
        self.started: set[int] = set()
        self.output_tokens = 0
        self.cached_by_prompt: dict[int, int] = {}
        self.prompt_tokens_by_prompt: dict[int, int] = {}
        self.replicas: set[str] = set()
        self.timings: dict[str, float] | None = None
        self.first_token_ns: int | None = None
        self.replica_stats: dict[str, dict] = {}

    def on_chunk(self, idx: int, c: ReplicaChunk, n: int) -> None:
        self.started.add(idx)
        self.output_tokens += len(c.token_ids)
        if c.token_ids and self.first_token_ns is None:
            self.first_token_ns = time.time_ns()
        prompt = idx // n
        self.cached_by_prompt[prompt] = max(self.cached_by_prompt.get(prompt, 0), c.num_cached_tokens)
        self.prompt_tokens_by_prompt[prompt] = c.num_prompt_tokens
        if c.replica_id:
            self.replicas.add(c.replica_id)
        if c.timings and self.timings is None:
            self.timings = c.timings
        if c.replica_stats:
            self.replica_stats[c.replica_id] = c.replica_stats

    def fingerprint(self) -> str:
        """Which replica(s) served the request: `replica:<id>[,<id>]`."""
        return "replica:" + ",".join(sorted(self.replicas))

    def cached_tokens(self) -> int:
        return sum(self.cached_by_prompt.values())

    def usage(self, p: _Prepared) -> dict:
        prompt_tokens = sum(len(x) for x in p.prompts)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": self.output_tokens,
                "total_tokens": prompt_tokens + self.output_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens()}}


async def _with_first_timeout(gen, timeout_s: float) -> AsyncIterator[ReplicaChunk]:
    """Iterate a replica stream; if nothing arrives within timeout_s, fail with 503."""
    it = gen.__aiter__()
    try:
        first = await asyncio.wait_for(it.__anext__(), timeout=timeout_s)
    except StopAsyncIteration:
        return
    except asyncio.TimeoutError:
        gen.cancel()
        raise APIError(f"no model replica produced output within {timeout_s:.0f}s", 503, "service_unavailable",
                       None, "replica_unavailable", retry_after_s=1) from None
    yield first
    async for c in it:
        yield c


def _coerce(cls, request):
    if isinstance(request, cls):
        return request
    try:
        return cls.model_validate(request if isinstance(request, dict) else request.model_dump())
    except ValidationError as e:
        raise pydantic_error(e) from None


def _make_ingress_class():
    from ray import serve
    # Applied at import time in every process: the FastAPI app's class-based routes are rewritten here,
    # so the replica process (which imports this module) serves the same routes as the driver built.
    return serve.ingress(fastapi_app)(Ingress)


IngressServer = _make_ingress_class()
