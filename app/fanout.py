"""Fan-out of one prepared request over the replicas and back: one replica stream per prompt (each with
params.n sequences) under a unique engine id, merged into one stream with a first-output timeout; the
sequences accumulated, best_of selection, and what the request's telemetry needs."""
from __future__ import annotations

import asyncio
import contextvars
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from affinity_serve.app.errors import APIError
from affinity_serve.app.prompts import PreparedRequest
from affinity_serve.app.protocol import GenerateRequest, ReplicaChunk
from affinity_serve.engine.types import Logprobs
from affinity_serve.observability.requests import RequestRecord, RoutingRecord


def replica_requests(p: PreparedRequest, carrier: dict[str, str]) -> list[GenerateRequest]:
    """One GenerateRequest per prompt, each keyed by a fresh id: a client's x-request-id may be reused
    (by retries, proxies, or concurrent calls), so it only labels logs and spans."""
    hashes = p.block_hashes or [None] * len(p.prompts)
    return [GenerateRequest(uuid.uuid4().hex, ids, p.params, p.priority, p.cache_salt, carrier, block_hashes=h,
                            checked_limits=p.checked_limits, request_id=p.request_id)
            for ids, h in zip(p.prompts, hashes)]


@dataclass(slots=True, frozen=True)
class ReplicaWait:
    """How long a call waits for a model replica's first answer.

    Normally `first_output_s`. While no model replica is running (scaled to zero, or every one starting or
    stopping), Serve queues the call and starts one; the call waits up to `cold_start_s` for it, and a
    replica that comes up gets the full `first_output_s` from then. `num_replicas()` says how many replicas
    the caller's router sees now (None: unknown, counted as some).
    """

    first_output_s: float
    cold_start_s: float
    num_replicas: Callable[[], int | None] = lambda: None
    poll_s: float = 0.5

    async def first(self, aw: Awaitable[Any], what: str) -> Any:
        """`aw`'s result within the bounds above; otherwise it is cancelled and a 503 raised. The replica
        count is looked at every `poll_s` (at most) while waiting, and at each deadline."""
        task = asyncio.ensure_future(aw)
        loop = asyncio.get_running_loop()
        start = loop.time()
        since: float | None = None          # since when replicas were there
        try:
            while True:
                now, n = loop.time(), self.num_replicas()
                if n is None or n > 0:
                    since = now if since is None else since
                    left = since + self.first_output_s - now
                    if left <= 0:
                        raise APIError(f"no model replica produced {what} within {self.first_output_s:g}s", 503,
                                       "service_unavailable", None, "replica_unavailable", retry_after_s=1)
                else:
                    since = None
                    left = start + self.cold_start_s - now
                    if left <= 0:
                        raise APIError(f"no model replica is running and none started within "
                                       f"{self.cold_start_s:g}s (serve.cold_start_timeout_s); retry later", 503,
                                       "service_unavailable", None, "no_replica_running", retry_after_s=1)
                done, _ = await asyncio.wait({task}, timeout=min(left, self.poll_s))
                if done:
                    return task.result()
        finally:
            if not task.done():
                task.cancel()


async def merged_chunks(replica: Any, reqs: list[GenerateRequest],
                        wait: ReplicaWait | float) -> AsyncIterator[tuple[int, ReplicaChunk]]:
    """(sequence index, chunk) from every prompt's replica stream, as they arrive.

    Prompt i's sequence j is sequence i * n + j. A stream that yields nothing within `wait`'s bounds fails
    the request with a 503 (a bare number: the same bound for both); leaving early (or failing) cancels
    every stream.
    """
    if not isinstance(wait, ReplicaWait):
        wait = ReplicaWait(float(wait), float(wait))
    handle = replica.options(stream=True)
    if len(reqs) == 1:
        async for c in _with_first_timeout(handle.generate.remote(reqs[0]), wait):
            yield c.index, c
        return
    queue: asyncio.Queue = asyncio.Queue()
    unfinished: dict[int, Any] = {}

    async def pump(i: int, req: GenerateRequest) -> None:
        try:
            gen = unfinished[i] = own_serve_call(lambda: handle.generate.remote(req))
            async for c in _with_first_timeout(gen, wait):
                await queue.put((i * req.sampling_params.n + c.index, c))
            del unfinished[i]
            await queue.put((i, None))
        except BaseException as e:   # noqa: BLE001 - delivered to the consumer
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(reqs)]
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
        # Each call has its own Serve id (own_serve_call), so Serve's cascade on the parent request's
        # cancellation would miss those still waiting for a replica: cancel the unfinished ones here.
        for gen in list(unfinished.values()):
            gen.cancel()


def own_serve_call(call: Callable[[], Any]) -> Any:
    """`call()` (a handle call) made under its own Serve internal request id.

    A handle call made inside a Serve request inherits that request's internal id, and Ray 2.60's router
    indexes the calls waiting for a replica by it: of several concurrent calls sharing one id, only one is
    ever assigned and the rest wait until they time out (batched prompts hung the fleet, issue 33). Outside
    Serve (no request context) the call is made as it is: Serve then draws a fresh id itself.
    """
    try:
        from ray.serve import context as serve_context
    except ImportError:                 # no Ray here (unit tests with local handles)
        return call()
    current = serve_context._serve_request_context.get()      # noqa: SLF001 - no public way to set it
    if current is None or not current._internal_request_id:  # noqa: SLF001
        return call()
    own = replace(current, _internal_request_id=uuid.uuid4().hex)

    def in_own_context() -> Any:
        serve_context._serve_request_context.set(own)         # noqa: SLF001
        return call()
    return contextvars.copy_context().run(in_own_context)


async def _with_first_timeout(gen: Any, wait: ReplicaWait) -> AsyncIterator[ReplicaChunk]:
    """Iterate a replica stream; if nothing arrives within `wait`'s bounds, cancel it and fail with a 503."""
    it = gen.__aiter__()
    try:
        first = await wait.first(it.__anext__(), "output")
    except StopAsyncIteration:
        return
    except APIError:
        gen.cancel()
        raise
    yield first
    async for c in it:
        yield c


@dataclass(slots=True)
class SequenceResult:
    """One generated sequence, accumulated from its chunks."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None     # the stop string (str) or stop token id that ended it
    first_token_ns: int | None = None
    last_token_ns: int | None = None

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp.logprob for lp in self.logprobs)

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None below two tokens."""
        if len(self.token_ids) < 2 or self.first_token_ns is None or self.last_token_ns is None:
            return None
        return (self.last_token_ns - self.first_token_ns) / 1e9 / (len(self.token_ids) - 1)


class RequestRun:
    """Everything one request's merged replica streams said: sequences, usage, replicas, timings."""

    def __init__(self, p: PreparedRequest):
        self.p = p
        self.seqs = [SequenceResult() for _ in range(len(p.prompts) * p.params.n)]
        #: each sequence's prefix-cache hit; a prompt's is its sequences' least (a sibling that started later
        #: hits the blocks the first one computed for the same prompt: not cached for the request)
        self.cached_by_seq: dict[int, int] = {}
        #: per prompt, when asked for (params.prompt_logprobs): computed once, on the prompt's sequence 0
        self.prompt_logprobs: list[list[Logprobs | None] | None] = [None] * len(p.prompts)
        self.replica_ids: set[str] = set()
        self.kv_tiers: dict[str, tuple[str, dict[str, int]]] = {}   # replica -> (tier, counters), latest
        self.replica_trace_ids: set[str] = set()
        self.timings: dict[str, float] | None = None
        self.first_token_ns: int | None = None
        self.routing: list[RoutingRecord] = []      # per prompt, in first-token order

    def add(self, seq_index: int, c: ReplicaChunk) -> ReplicaChunk:
        """Record a chunk; return it as the client sees it (echo_only: the token run is dropped)."""
        if self.p.echo_only:   # max_tokens 0: the one token run (to get prompt logprobs) is not an output
            c = replace(c, text="", token_ids=[], logprobs=None,
                        finish_reason="length" if c.finish_reason == "stop" else c.finish_reason)
        now = time.time_ns()
        seq = self.seqs[seq_index]
        seq.text += c.text
        seq.token_ids += c.token_ids
        seq.logprobs += c.logprobs or []
        if c.token_ids:
            seq.first_token_ns = seq.first_token_ns or now
            seq.last_token_ns = now
            self.first_token_ns = self.first_token_ns or now
        if c.finish_reason:
            seq.finish_reason, seq.stop_reason = c.finish_reason, c.stop_reason
        prompt = seq_index // self.p.params.n
        self.cached_by_seq[seq_index] = c.num_cached_tokens
        if c.prompt_logprobs is not None:
            self.prompt_logprobs[prompt] = c.prompt_logprobs
        if c.replica_id:
            self.replica_ids.add(c.replica_id)
        if c.timings and self.timings is None:
            self.timings = c.timings
        if c.kv_tier is not None:
            self.kv_tiers[c.replica_id] = c.kv_tier
        if c.trace_id:
            self.replica_trace_ids.add(c.trace_id)
        return c

    def prompt_logprobs_of(self, prompt: int) -> list[Logprobs | None]:
        """Prompt `prompt`'s logprobs; a replica that did not send them (asked for) is a server error."""
        lps = self.prompt_logprobs[prompt]
        if lps is None or len(lps) != len(self.p.prompts[prompt]):
            raise RuntimeError(f"the replica returned no prompt logprobs for prompt {prompt}")
        return lps

    @property
    def num_output_tokens(self) -> int:
        """Every generated token, the best_of sequences that were not returned included (as OpenAI bills)."""
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def num_cached_tokens(self) -> int:
        n = self.p.params.n
        least: dict[int, int] = {}
        for seq_index, cached in self.cached_by_seq.items():
            prompt = seq_index // n
            least[prompt] = min(least.get(prompt, cached), cached)
        return sum(least.values())

    def choices(self) -> list[SequenceResult]:
        """The sequences to return, prompt by prompt: all of them, or the best of each prompt's best_of
        by cumulative logprob (highest first), as OpenAI and vLLM do."""
        n_seqs, n_choices = self.p.params.n, self.p.num_choices
        if n_seqs == n_choices:
            return list(self.seqs)
        out: list[SequenceResult] = []
        for i in range(len(self.p.prompts)):
            group = self.seqs[i * n_seqs:(i + 1) * n_seqs]
            out += sorted(group, key=lambda s: s.cumulative_logprob, reverse=True)[:n_choices]
        return out

    def record(self) -> RequestRecord:
        timings = self.timings or {}
        return RequestRecord(
            request_id=self.p.request_id, model=self.p.model, num_prompt_tokens=self.p.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens, num_cached_tokens=self.num_cached_tokens,
            replica_ids=sorted(self.replica_ids), replica_trace_ids=sorted(self.replica_trace_ids),
            first_token_ns=self.first_token_ns, tpot_s=[s.tpot_s for s in self.seqs if s.tpot_s is not None],
            queue_s=timings.get("queue_s", 0.0), prefill_s=timings.get("prefill_s", 0.0),
            decode_s=timings.get("decode_s", 0.0), routing=list(self.routing))
