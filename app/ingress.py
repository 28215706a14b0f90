"""Ingress: the OpenAI-compatible HTTP routes (FastAPI via @serve.ingress) and the Python handle API.

Routes only. HTTP plumbing (API key, JSON body, SSE) is in app/http.py; the work (prepare -> fan out to
replicas -> format) in app/serving.py. Replicas receive token ids, so the tokenizer and chat template run
here. Every failure leaves through `_fail`: classified, logged and counted once (app/errors.py).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from affinity_serve.app.config import AppConfig, served_model_name
from affinity_serve.app.errors import APIError, drop_serve_duplicate_logs, log_failure, pydantic_error, to_api_error
from affinity_serve.app.http import APIKeyDigest, check_api_key, check_json_value, error_response, read_json_body, sse
from affinity_serve.app.metrics_hub import MetricsExporter, MetricsUnavailable, serve_app_and_replica
from affinity_serve.app.prompts import RequestKind
from affinity_serve.app.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from affinity_serve.app.routing import debug as routing_debug
from affinity_serve.app.serving import OpenAIRequest, OpenAIServing
from affinity_serve.engine import load_tokenizer
from affinity_serve.observability.logs import configure_json_logging, request_id_var
from affinity_serve.observability.metrics import ServingMetrics
from affinity_serve.observability.requests import RequestObserver
from affinity_serve.observability.setup import setup_telemetry
from affinity_serve.observability.tracing import extract_context, inject_carrier

logger = logging.getLogger("affinity.ingress")
# FastAPI's own /docs, /redoc and /openapi.json are off: the Ingress serves them itself, only without an API
# key (a server that requires a key does not describe itself to whoever asks).
fastapi_app = FastAPI(title="affinity-serve", description="OpenAI-compatible LLM serving on Ray Serve",
                      docs_url=None, redoc_url=None, openapi_url=None)

_REQUEST_TYPES = {RequestKind.COMPLETION: CompletionRequest, RequestKind.CHAT: ChatCompletionRequest}
_HEALTH_FIRST_WAIT_S = 2.0     # how long a probe waits for the engine's limits before answering "starting"


@fastapi_app.exception_handler(StarletteHTTPException)
async def _http_exc(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(APIError(str(exc.detail), exc.status_code, "invalid_request_error", None, code))


class Ingress:
    def __init__(self, replica: Any, config: AppConfig, api_key: APIKeyDigest | None = None):
        """`config`: the app's validated AppConfig, as builder.build_app binds it (no second validation here).
        `api_key`: the digest of the key inference routes require (builder.build_app); a key still in
        `config` (a caller that built the Ingress directly) is digested here and dropped."""
        if not isinstance(config, AppConfig):
            raise TypeError(f"Ingress takes an AppConfig (AppConfig.model_validate(...)), not {type(config).__name__}")
        self.cfg = config
        if self.cfg.serve.api_key is not None:
            api_key = api_key or APIKeyDigest.of(self.cfg.serve.api_key.get_secret_value())
            self.cfg = self.cfg.model_copy(update={"serve": self.cfg.serve.model_copy(update={"api_key": None})})
        self.api_key = api_key
        obs = self.cfg.observability
        configure_json_logging(obs.log_level)
        drop_serve_duplicate_logs()
        self.telemetry = setup_telemetry(obs.service_name, obs.traces, obs.otlp_endpoint, obs.max_spans_kept)
        self.metrics = ServingMetrics(self.telemetry.meter)
        serve_ctx = serve_app_and_replica()
        # /metrics on any ingress replica shows the whole app: every process pushes to the app's hub
        self.metrics_exporter = MetricsExporter(self.telemetry.snapshot_reader, serve_ctx and serve_ctx[0],
                                                f"ingress:{serve_ctx[1] if serve_ctx else 'local'}",
                                                obs.metrics_push_interval_s)
        model_dir = self.cfg.engine.model
        assert model_dir, "builder resolves the model directory"
        self.replica = replica
        # P/D: a router over the prefill pool in this process, which the decode pool's router asks for each
        # request's prefill replica before it picks a decode replica near it (app/disagg_router.py)
        self.prefill_view = None
        if self.cfg.disaggregation.enabled and serve_ctx:
            from affinity_serve.app.disagg_router import open_prefill_view
            self.prefill_view = open_prefill_view(serve_ctx[0])
        self.model_name = served_model_name(self.cfg)
        token_ids_only = self.cfg.engine.skip_tokenizer_init      # then no tokenizer is loaded at all
        tokenizer = None if token_ids_only else load_tokenizer(model_dir)
        if tokenizer is not None and self.cfg.serve.chat_template is not None:
            tokenizer.chat_template = self.cfg.serve.chat_template  # chat prompts and the tool parser's choice
        self.serving = OpenAIServing(
            replica, model_name=self.model_name, tokenizer=tokenizer,
            first_output_timeout_s=self.cfg.serve.first_token_timeout_s,
            cold_start_timeout_s=self.cfg.serve.cold_start_timeout_s,
            observer=RequestObserver(self.telemetry.tracer, self.metrics), metrics=self.metrics,
            max_prompts_per_request=self.cfg.serve.max_prompts_per_request,
            max_queue_wait_s=self.cfg.serve.max_queue_wait_s, tool_call_parser=self.cfg.serve.tool_call_parser)
        self._limits_task: asyncio.Future | None = None
        self.draining = False
        self.started_at = int(time.time())   # the model card's `created`
        self.num_in_flight = 0           # HTTP inference requests, streams until their last event
        self._end_streams = asyncio.Event()

    # ================================================================== HTTP routes
    @fastapi_app.post("/v1/completions")
    async def http_completions(self, request: Request) -> Response:
        return await self._http(RequestKind.COMPLETION, request)

    @fastapi_app.post("/v1/chat/completions")
    async def http_chat(self, request: Request) -> Response:
        return await self._http(RequestKind.CHAT, request)

    @fastapi_app.get("/v1/models")
    async def http_models(self, request: Request) -> Response:
        _set_request_id(request)
        try:
            check_api_key(request, self.api_key)
            out = JSONResponse(await self.models())
            self.metrics.record_http("/v1/models", 200)
            return out
        except Exception as e:
            return error_response(self._fail(e, request.url.path))

    @fastapi_app.get("/v1/models/{model_id:path}")
    async def http_model(self, model_id: str, request: Request) -> Response:
        """One model's card, as OpenAI's retrieve-model route (404 `model_not_found` for any other id)."""
        _set_request_id(request)
        try:
            check_api_key(request, self.api_key)
            out = JSONResponse(await self.model(model_id))
            self.metrics.record_http("/v1/models/{model_id}", 200)
            return out
        except Exception as e:
            return error_response(self._fail(e, "/v1/models/{model_id}"))

    @fastapi_app.post("/tokenize")
    async def http_tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: {"prompt": ...} or {"messages": ...} -> {count, max_model_len, tokens}."""
        return await self._http_tokens(request, TokenizeRequest, self.serving.tokenize)

    @fastapi_app.post("/detokenize")
    async def http_detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: {"tokens": [...]} -> {"prompt": text}."""
        return await self._http_tokens(request, DetokenizeRequest, self.serving.detokenize)

    async def _http_tokens(self, request: Request, model: type, work: Any) -> Response:
        route = request.url.path
        _set_request_id(request)
        try:
            check_api_key(request, self.api_key)
            body = await read_json_body(request, self.cfg.serve.max_request_body_bytes, self.cfg.serve.max_json_depth)
            try:
                req = model.model_validate(body)
            except ValidationError as e:
                raise pydantic_error(e) from None
            result = await work(req)
            self.metrics.record_http(route, 200)
            return JSONResponse(result)
        except Exception as e:
            return error_response(self._fail(e, route))

    @fastapi_app.get("/health")
    async def http_health(self) -> Response:
        """Readiness from this ingress's state, never a model replica's request slot (a probe queued behind
        work failed under load and got healthy servers killed). Ready (200) once a model replica has loaded
        the model (it published the engine's limits; asked once, in the background) and this ingress's
        router sees at least one model replica running, or none because autoscaling scaled to zero (a
        request starts one). Otherwise 503: `starting` or `no_replica_running`."""
        retry = self.cfg.serve.retry_after_s
        if self.draining:
            return error_response(APIError("the server is shutting down", 503, "service_unavailable", None,
                                           "draining", retry))
        a = self._model_autoscaling()
        may_be_zero = a.enabled and a.min_replicas == 0
        if (self.serving.known_limits is None and may_be_zero and self._starts_at_zero()
                and not self.serving.replicas_seen()):
            # deployed with no replica (initial_replicas 0) and none seen since: asking one for its limits would
            # start one, so a load balancer's probe would undo the scale to zero (a deployment that starts with
            # replicas says "starting" while they load, as before)
            return JSONResponse({"status": "scaled_to_zero", "model": self.model_name, "num_replicas": 0})
        if self.serving.known_limits is None:
            if self._limits_task is None or self._limits_task.done():
                self._limits_task = asyncio.ensure_future(self.serving.limits())
                self._limits_task.add_done_callback(lambda t: t.cancelled() or t.exception())   # retried next probe
            # an idle replica answers at once: the first probe after start-up need not say "starting"
            await asyncio.wait({self._limits_task}, timeout=_HEALTH_FIRST_WAIT_S)
        if self.serving.known_limits is None:
            return error_response(APIError("the model is loading: no model replica has answered yet", 503,
                                           "service_unavailable", None, "starting", retry))
        num_replicas = self.serving.num_replicas()
        if num_replicas == 0 and not may_be_zero:
            return error_response(APIError("no model replica is running", 503, "service_unavailable", None,
                                           "no_replica_running", retry))
        return JSONResponse({"status": "ok" if num_replicas != 0 else "scaled_to_zero", "model": self.model_name,
                             "num_replicas": num_replicas})

    def _model_autoscaling(self):
        """The autoscaling of the deployment this ingress sends requests to: the autoscaling section, or with
        P/D the decode pool's (its own over the section)."""
        a = self.cfg.autoscaling
        if self.cfg.disaggregation.enabled:
            from affinity_serve.app.disagg_config import pool_autoscaling
            a = pool_autoscaling(a, self.cfg.disaggregation.decode, "decode")
        return a

    def _starts_at_zero(self) -> bool:
        """Whether the model deployment starts with no replica (autoscaling's initial replicas 0; with P/D the
        decode pool's, the ingress's target)."""
        cfg = self.cfg
        if cfg.disaggregation.enabled:
            from affinity_serve.app.disagg_config import pool_initial_replicas
            return pool_initial_replicas(cfg.autoscaling, cfg.disaggregation.decode, "decode") == 0
        return cfg.autoscaling.initial_replicas == 0

    @fastapi_app.get("/openapi.json", include_in_schema=False)
    async def http_openapi(self, request: Request) -> Response:
        self._docs_allowed(request)
        return JSONResponse(fastapi_app.openapi())

    @fastapi_app.get("/docs", include_in_schema=False)
    async def http_docs(self, request: Request) -> Response:
        self._docs_allowed(request)
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(openapi_url=f"{root}/openapi.json", title=f"{fastapi_app.title} - docs",
                                   oauth2_redirect_url=f"{root}/docs/oauth2-redirect")

    @fastapi_app.get("/docs/oauth2-redirect", include_in_schema=False)
    async def http_docs_redirect(self, request: Request) -> Response:
        self._docs_allowed(request)
        return get_swagger_ui_oauth2_redirect_html()

    @fastapi_app.get("/redoc", include_in_schema=False)
    async def http_redoc(self, request: Request) -> Response:
        self._docs_allowed(request)
        return get_redoc_html(openapi_url=f"{request.scope.get('root_path', '')}/openapi.json",
                              title=f"{fastapi_app.title} - ReDoc")

    def _docs_allowed(self, request: Request) -> None:
        """The API description is served only by a server without an API key: 404 otherwise."""
        if self.api_key is not None:
            raise StarletteHTTPException(404, "Not Found")

    @fastapi_app.get("/metrics")
    async def http_metrics(self, request: Request) -> Response:
        """Prometheus text of the whole app (every ingress and model replica, merged by its metrics hub),
        with vLLM's names beside ours (docs/observability.md). Not counted in affinity_http_requests_total,
        answered or not (a scraper's polls are not the API's traffic)."""
        _set_request_id(request)
        try:
            text = await self.metrics_exporter.render(self.model_name, self.cfg.observability.vllm_metric_names)
        except MetricsUnavailable as e:
            # a failed scrape, never this process's numbers alone (they would read as counter resets)
            return error_response(self._fail(APIError(f"{e}; the scrape fails rather than show one process's "
                                                      "numbers as the app's; retry", 503, "service_unavailable",
                                                      None, "metrics_unavailable"), "/metrics", count=False))
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _http(self, kind: RequestKind, request: Request) -> Response:
        route = request.url.path
        # Serve's proxy sets x-request-id when the client did not, and echoes it in the response.
        request_id = request.headers.get("x-request-id") or _new_request_id(kind)
        request_id_var.set(request_id)
        if self.draining:
            response = error_response(self._fail(APIError(
                "the server is shutting down; retry the request (on another server)", 503, "service_unavailable",
                None, "draining"), route))
            response.headers["Connection"] = "close"
            return response
        self.num_in_flight += 1
        handed_off = False               # a stream leaves the count when its last event is sent
        try:
            check_api_key(request, self.api_key)
            req = _parse(kind, await read_json_body(request, self.cfg.serve.max_request_body_bytes,
                                                    self.cfg.serve.max_json_depth))
            carrier = inject_carrier(extract_context(request.headers))
            if req.stream:
                gen = self.serving.stream(kind, req, request_id, carrier)
                first = await gen.__anext__()          # errors before the first byte -> a proper status
                self.metrics.record_http(route, 200)
                events = sse(first, gen, lambda e: self._fail(e, route, count=False), self._end_streams)
                handed_off = True
                return StreamingResponse(self._counted(events), media_type="text/event-stream")
            result = await self.serving.complete(kind, req, request_id, carrier)
            self.metrics.record_http(route, 200)
            return JSONResponse(result)
        except Exception as e:
            return error_response(self._fail(e, route))
        finally:
            if not handed_off:
                self.num_in_flight -= 1

    async def _counted(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        try:
            async for e in events:
                yield e
        finally:
            self.num_in_flight -= 1

    async def drain(self, end_streams: bool = False) -> dict:
        """Shutdown, called by the CLI on each ingress replica: new HTTP requests get 503 `draining` (and
        /health 503) from now on; with `end_streams`, streams still running end at once with an in-band
        error event and [DONE]. Returns this replica's id and its HTTP requests still in flight."""
        from ray import serve
        self.draining = True
        if end_streams:
            self._end_streams.set()
        return {"ingress_replica_id": serve.get_replica_context().replica_id.unique_id,
                "num_in_flight": self.num_in_flight}

    def _fail(self, exc: BaseException, where: str, count: bool = True) -> APIError:
        """The one exit for failures: classify, log once (traceback only if unexpected), count. A 429 or 503
        tells the client to retry after `serve.retry_after_s` (the Retry-After header over HTTP), or after the
        predicted excess wait of an admission refusal (`queue_full`) where that is longer."""
        api = to_api_error(exc)
        if api.status_code in (429, 503):
            predicted = api.retry_after_s if api.code == "queue_full" else None
            api.retry_after_s = max(self.cfg.serve.retry_after_s, predicted or 0)
        log_failure(logger, exc, api, route=where)
        if count:
            self.metrics.record_http(where, api.status_code)
        return api

    # ================================================================== Python handle API
    async def completions(self, request: CompletionRequest | dict, request_id: str | None = None) -> dict:
        """Non-streaming completion; raises APIError (status_code, type, param, code) on bad input."""
        return await self._complete(RequestKind.COMPLETION, request, request_id)

    async def chat(self, request: ChatCompletionRequest | dict, request_id: str | None = None) -> dict:
        return await self._complete(RequestKind.CHAT, request, request_id)

    async def completions_stream(self, request: CompletionRequest | dict,
                                 request_id: str | None = None) -> AsyncIterator[dict]:
        """Streaming completion chunks; call with `handle.options(stream=True)`."""
        async for chunk in self._stream(RequestKind.COMPLETION, request, request_id):
            yield chunk

    async def chat_stream(self, request: ChatCompletionRequest | dict,
                          request_id: str | None = None) -> AsyncIterator[dict]:
        async for chunk in self._stream(RequestKind.CHAT, request, request_id):
            yield chunk

    async def models(self) -> dict:
        """The model list. Its max_model_len is the engine's: a replica's answer (asked once, kept), or while
        asking could start a replica (autoscaling at zero) what the config and checkpoint fix (the engine's
        `derive_max_model_len`), so listing models never scales the deployment up. Only where those leave it to
        the replica's machine (a CUDA pool sized by free memory) is a replica asked, as for a request."""
        max_model_len = await self._max_model_len()
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.started_at,
                                            "owned_by": "affinity-serve", "max_model_len": max_model_len}]}

    async def _max_model_len(self) -> int:
        known = self.serving.known_limits
        if known is not None:
            return known.max_model_len
        a = self._model_autoscaling()
        if a.enabled and a.min_replicas == 0 and not self.serving.num_replicas():
            derived = self._config_max_model_len
            if derived is not None:
                return derived
        return (await self.serving.limits()).max_model_len

    @functools.cached_property
    def _config_max_model_len(self) -> int | None:
        """The engine's `derive_max_model_len` of the config the ingress's replicas run (with P/D, the decode
        pool's)."""
        engine = self.cfg.engine
        if self.cfg.disaggregation.enabled:
            from affinity_serve.app.disagg_config import pool_engine_config
            d = self.cfg.disaggregation
            engine = pool_engine_config(engine, d.decode, d)
        from affinity_serve.engine import derive_max_model_len
        return derive_max_model_len(engine)

    async def model(self, model_id: str) -> dict:
        """The model card of `model_id`; APIError 404 `model_not_found` unless it is the served model."""
        if model_id != self.model_name:
            raise APIError(f"the model '{model_id}' does not exist; this server serves '{self.model_name}'", 404,
                           "invalid_request_error", "model", "model_not_found")
        return (await self.models())["data"][0]

    async def tokenize(self, request: TokenizeRequest | dict) -> dict:
        """vLLM's /tokenize over the handle API; raises APIError as the completions do."""
        try:
            return await self.serving.tokenize(self._coerce_plain(TokenizeRequest, request))
        except Exception as e:
            raise self._fail(e, "handle:tokenize", count=False) from e

    async def detokenize(self, request: DetokenizeRequest | dict) -> dict:
        try:
            return await self.serving.detokenize(self._coerce_plain(DetokenizeRequest, request))
        except Exception as e:
            raise self._fail(e, "handle:detokenize", count=False) from e

    def _coerce_plain(self, model: type, request: Any) -> Any:
        body = _request_body(model.__name__, request)
        check_json_value(body, self.cfg.serve.max_json_depth)
        try:
            return model.model_validate(body)
        except ValidationError as e:
            raise pydantic_error(e) from None

    async def _complete(self, kind: RequestKind, request: Any, request_id: str | None) -> dict:
        request_id = request_id or _new_request_id(kind)
        request_id_var.set(request_id)
        method = "completions" if kind is RequestKind.COMPLETION else "chat"
        try:
            out = await self.serving.complete(kind, self._coerce(kind, request, stream=False), request_id, {})
        except Exception as e:
            api = self._fail(e, f"handle:{kind.value}", count=False)
            self.metrics.record_handle(method, api.status_code)
            raise api from e
        self.metrics.record_handle(method, 200)
        return out

    async def _stream(self, kind: RequestKind, request: Any, request_id: str | None) -> AsyncIterator[dict]:
        request_id = request_id or _new_request_id(kind)
        request_id_var.set(request_id)
        method = "completions_stream" if kind is RequestKind.COMPLETION else "chat_stream"
        try:
            async for chunk in self.serving.stream(kind, self._coerce(kind, request, stream=True), request_id, {}):
                yield chunk
        except Exception as e:
            api = self._fail(e, f"handle:{kind.value}_stream", count=False)
            self.metrics.record_handle(method, api.status_code)
            raise api from e
        self.metrics.record_handle(method, 200)

    def _coerce(self, kind: RequestKind, request: Any, stream: bool) -> OpenAIRequest:
        """A handle caller's request (a dict or a model) checked as an HTTP body is (depth, Unicode). The
        method decides streaming: the *_stream methods stream (the same checks as `stream: true` over HTTP);
        `stream: true` sent to the others is a 400 that names the streaming method."""
        name = "CompletionRequest" if kind is RequestKind.COMPLETION else "ChatCompletionRequest"
        body = _request_body(name, request)
        if stream:
            body["stream"] = True
        elif body.get("stream"):
            method = "completions_stream" if kind is RequestKind.COMPLETION else "chat_stream"
            raise APIError(f"stream: true streams only through handle.options(stream=True).{method}; this method "
                           "returns the whole response (remove stream)", 400, "invalid_request_error", "stream",
                           "invalid_value")
        check_json_value(body, self.cfg.serve.max_json_depth)
        return _parse(kind, body)

    # ================================================================== introspection
    async def debug_spans(self) -> list[dict]:
        """Finished spans kept in memory (observability.traces: memory), for inspection and tests."""
        exp = self.telemetry.span_exporter
        if exp is None:
            return []
        return [{"name": s.name, "trace_id": format(s.context.trace_id, "032x"),
                 "span_id": format(s.context.span_id, "016x"),
                 "parent_id": format(s.parent.span_id, "016x") if s.parent else None,
                 "attributes": dict(s.attributes or {}), "start": s.start_time, "end": s.end_time}
                for s in exp.get_finished_spans()]

    async def replica_state(self) -> dict:
        return await self.replica.debug_state.remote()

    async def routing_decisions(self, n: int = 20) -> dict:
        """The routing state of THIS ingress replica's router (each ingress replica runs its own): the last
        `n` decisions, counters, the feed's counters and, per model replica, the indexed block count, the
        feed's cursor (epoch, next event) and whether a snapshot is due. `{"routers": []}` before the first
        request (Serve builds the router lazily)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise APIError(f"routing_decisions(n): n is how many recent decisions to return, an integer >= 0; "
                           f"got {n!r}", 400, "invalid_request_error", "n", "invalid_value")
        from ray import serve
        ctx = serve.get_replica_context()
        routers = routing_debug.routers_for(self.replica.app_name, self.replica.deployment_name)
        states = [await r.run_on_loop(r.state, n) for r in routers]
        return {"ingress_replica_id": ctx.replica_id.unique_id, "routers": states}

    async def debug_inject_routing_errors(self, n: int) -> dict:
        """Test hook: the next `n` routing decisions of this ingress replica's router(s) raise inside the
        router shell, which must fall back to a load-only ranking."""
        from ray import serve
        routers = routing_debug.routers_for(self.replica.app_name, self.replica.deployment_name)
        for r in routers:
            await r.run_on_loop(r.inject_errors, n)
        return {"ingress_replica_id": serve.get_replica_context().replica_id.unique_id, "num_routers": len(routers)}


def _request_body(name: str, request: Any) -> dict:
    """A handle caller's request as a body to check: a dict (copied) or a request model's fields; anything else
    is a 400 saying what to send."""
    if isinstance(request, dict):
        return dict(request)
    if isinstance(request, BaseModel):
        # the wire names (`schema`, `json`, not the Python ones), and only what the caller set
        return request.model_dump(by_alias=True, exclude_unset=True)
    raise APIError(f"the request must be a {name} or a dict of its fields, got {type(request).__name__}", 400,
                   "invalid_request_error", None, "invalid_value")


def _set_request_id(request: Request) -> None:
    """The request id this request's log lines carry: the client's `x-request-id` (Serve's proxy sets one when
    the client did not); none without the header."""
    rid = request.headers.get("x-request-id")
    if rid:
        request_id_var.set(rid)


def _new_request_id(kind: RequestKind) -> str:
    return f"{'cmpl' if kind is RequestKind.COMPLETION else 'chatcmpl'}-{uuid.uuid4().hex}"


def _parse(kind: RequestKind, body: dict[str, Any]) -> OpenAIRequest:
    try:
        return _REQUEST_TYPES[kind].model_validate(body)
    except ValidationError as e:
        raise pydantic_error(e) from None




def _make_ingress_class():
    from ray import serve
    # Applied at import time in every process: the FastAPI app's class-based routes are rewritten here,
    # so the replica process (which imports this module) serves the same routes as the driver built.
    return serve.ingress(fastapi_app)(Ingress)


IngressServer = _make_ingress_class()
