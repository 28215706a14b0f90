"""P/D disaggregation on Ray Serve (issue 28): a prefill pool and a decode pool, KV moved by Ray's object store.

The ingress routes every request to the decode pool (the usual router: prefix affinity on that pool's cache,
which holds the earlier turns of a conversation, against load and KV room). A decode replica asks its local
prefix cache how much of the prompt it already holds; when the rest is at least
`disaggregation.min_remote_prefill_tokens`, it calls the prefill pool (its own router: prefix affinity on the
prefill pool's cache), else it serves the request itself as in unified mode. The prefill replica runs the
prompt and the first token with the engine's P/D connector holding the KV, copies the held blocks the decode
replica lacks into Ray's object store (`ray.put`: zero-copy for a reader on the same node, Ray's object
manager across nodes) and returns the first token with an ObjectRef; the decode replica streams that token at
once and continues the request in its engine, which loads the blocks from the ref while the request waits
outside the token budget. If the prefill call or the read fails, the decode replica recomputes (counted).

With `disaggregation.transport: nixl` nothing is copied out: the prefill replica's answer carries the held
blocks' NIXL address (engine/kv_connector/nixl.py) and the decode replica's engine reads them straight out of the
prefill replica's KV cache; the reader's notification frees them there.

Both replicas are LLMReplicas with a P/D engine; only the decode one holds a handle to the other pool.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from affinity_serve.app.config import AutoscalingSection, ObservabilitySection, ServeSection
from affinity_serve.app.disagg_config import DisaggregationSection
from affinity_serve.app.errors import APIError
from affinity_serve.app.protocol import GenerateRequest, ReplicaChunk
from affinity_serve.app.replica import LLMReplica
from affinity_serve.app.routing import debug
from affinity_serve.app.routing.serve_compat import handle_has_known_replicas
from affinity_serve.autoscale.pools import NUM_WAITING_ON_PREFILL
from affinity_serve.engine import (EngineConfig, KVTransferError, ReadRecord, RemoteDecode, RemotePrefill,
                                   TransferRecords)
from affinity_serve.observability.metrics import PD_FALLBACK_CAUSES, PDSample

logger = logging.getLogger("affinity.disagg")

#: how often a decode replica waiting on the prefill pool checks that the pool still has a running replica (s)
POOL_WATCH_S = 0.05

# Spans (each a child of the request's trace; docs/disaggregation.md, "Spans"):
#: the decode replica's call to the prefill pool (the prefill replica's spans are its children)
SPAN_REMOTE_PREFILL = "llm.remote_prefill"
#: the prefill replica: the prompt and each sequence's first token in its engine
SPAN_PD_PREFILL = "llm.pd.prefill"
#: the prefill replica: one sequence's held blocks gathered from its pool and put in Ray's object store
SPAN_PD_COPY_OUT = "llm.pd.copy_out"
#: the decode replica: one sequence's blocks read from the object store (across nodes: Ray's object manager)
SPAN_PD_TRANSFER = "llm.pd.transfer"
#: the decode replica: the tokens after the first, from the decode engine
SPAN_PD_DECODE = "llm.pd.decode"


# ---------------------------------------------------------------- transport: Ray's object store
class _ObjectRead:
    def __init__(self, ref: Any, offset: int, num_blocks: int, record: ReadRecord | None = None):
        self._ref, self._offset, self._n = ref, offset, num_blocks
        self._record = record or ReadRecord(num_blocks, time.time_ns(), time.monotonic())

    def poll(self) -> Any:
        import ray
        ready, _ = ray.wait([self._ref], timeout=0, fetch_local=True)
        if not ready:
            return None
        try:
            blocks = ray.get(self._ref)
        except Exception as e:       # the prefill replica (the object's owner) died, or the object was lost
            self._record.end("missing")
            raise KVTransferError(f"the prefilled KV is gone: {type(e).__name__}: {e}", "missing") from e
        self._record.end("read")
        return blocks[self._offset:self._offset + self._n]

    def cancel(self) -> None:
        self._record.end("cancelled")  # the object is freed with its last reference


class RayObjectTransport(TransferRecords):
    """Decode side: a RemotePrefill's `address` is (ObjectRef of blocks [first, num_blocks), first). It keeps a
    record of each transfer for its span (TransferRecords)."""

    def start_read(self, remote: RemotePrefill, start_block: int, num_blocks: int):
        record = self._keep(remote.transfer_id, ReadRecord(num_blocks, time.time_ns(), time.monotonic()))
        if remote.address is not None and not isinstance(remote.address, tuple):
            record.end("incompatible")          # e.g. a NixlAddress: the prefill pool runs another transport
            raise KVTransferError(f"the prefill side published a {type(remote.address).__name__}, not an object "
                                  "store reference (the pools run different disaggregation.transport)", "error")
        ref, first = remote.address if remote.address is not None else (None, 0)
        if ref is None or start_block < first:
            # the prefill copied out only what this replica held then; some of it has been evicted since
            record.end("missing")
            raise KVTransferError(f"blocks from {start_block} were not copied out (from {first})", "missing")
        return _ObjectRead(ref, start_block - first, num_blocks, record)

    def release(self, remote: RemotePrefill, reason: str = "local") -> None:
        # the prefill side freed its blocks when it copied them out; the span says why none were read
        self._keep(remote.transfer_id, ReadRecord(0, time.time_ns(), time.monotonic())).end(reason)


# ---------------------------------------------------------------- metrics (both pools)
def pd_sample(stats: Any, kv: Any, fallback_prefill_failed: int = 0) -> PDSample:
    """The metrics' P/D sample from the engine's `take_pd_transfer_stats` and `kv_connector_stats` (the
    decode side's reads are the P/D connector's loads)."""
    pd = stats.pd
    counters = {"reads_ok": kv.loads_ok, "reads_local": pd.remote_released, "reads_failed": kv.loads_failed,
                "read_blocks": kv.loaded_blocks, "read_bytes": kv.loaded_bytes,
                "holds_read": pd.holds_read, "holds_released": pd.holds_released, "holds_expired": pd.holds_expired,
                "fallback_prefill_failed": fallback_prefill_failed}
    for cause in PD_FALLBACK_CAUSES[:-1]:
        counters[f"fallback_{cause}"] = getattr(kv, f"load_failures_{cause}")
    return PDSample(counters, stats.num_held_blocks, stats.read_times_s, stats.hold_times_s)


class _PDMetrics(LLMReplica):
    """Both pools' replicas export the P/D metrics (observability: affinity_pd_*), read at every collection
    of the meter, as the load gauges are."""

    def _load_sample(self):
        stats = self.engine.take_pd_transfer_stats()
        if stats is not None:
            self.metrics.record_pd(pd_sample(stats, self.engine.kv_connector_stats(), self._prefill_failed()))
        return super()._load_sample()

    def _prefill_failed(self) -> int:
        return 0

    async def debug_state(self) -> dict[str, Any]:
        """LLMReplica's, with the P/D counters (holds and how they ended; the decode side's remote requests) and
        the transport's ("nixl": reads posted, notifications taken)."""
        state = await super().debug_state()
        pd = self.engine.pd_counters()
        if pd is not None:
            state["pd"] = pd
        t = getattr(self, "nixl", None) or getattr(self, "transport", None)
        state["pd_transport"] = "nixl" if hasattr(t, "hold_address") else "ray"
        if state["pd_transport"] == "nixl":
            state["nixl"] = {"agent": t.name, "reads_posted": t.reads_posted, "notifications": t.notifications,
                             "staging_bytes_free": t.staging_bytes_free()}
        return state


# ---------------------------------------------------------------- a decode replica's view of hung prefill replicas
class PrefillBreaker:
    """The prefill replicas a decode replica keeps its calls from for a while (a circuit breaker). One whose call
    missed disaggregation.prefill_timeout_s (hung without dying, or too backlogged to answer in time) gets no
    call for `backoff_s`; after that one request at a time tries it again: its answer clears the replica,
    another timeout starts a new back-off. Keys are the router's replica keys. Thread-safe: the decode replica
    marks and asks on its loop, its router over the prefill pool (disagg_router.PrefillPoolRouter) filters on
    its own."""

    def __init__(self, backoff_s: float):
        import threading
        self.backoff_s = backoff_s
        self._lock = threading.Lock()
        self._until: dict[str, float] = {}       # replica key -> the end of its back-off (time.monotonic)
        self._probe: dict[str, str] = {}         # replica key -> the req_id trying it again after its back-off

    def on_timeout(self, key: str, now: float) -> None:
        with self._lock:
            self._until[key] = now + self.backoff_s
            self._probe.pop(key, None)

    def on_answer(self, key: str) -> None:
        with self._lock:
            self._until.pop(key, None)
            self._probe.pop(key, None)

    def release(self, req_id: str) -> None:
        """`req_id`'s call ended: another request may try the replicas it was trying again."""
        with self._lock:
            for key in [k for k, r in self._probe.items() if r == req_id]:
                del self._probe[key]

    def blocked(self, key: str, req_id: str, now: float) -> bool:
        """Whether `req_id` must not call `key` now: in its back-off, or past it while another request tries it."""
        with self._lock:
            return self._blocked(key, req_id, now)

    def _blocked(self, key: str, req_id: str, now: float) -> bool:
        until = self._until.get(key)
        if until is None:
            return False
        if now < until:
            return True
        probe = self._probe.get(key)
        return probe is not None and probe != req_id

    def claim(self, keys: list[str], req_id: str, now: float) -> list[str]:
        """The replicas of `keys` (the running ones) `req_id` may call now. When those are only replicas past
        their back-off, `req_id` becomes the one request trying the first of them again. Marks of replicas no
        longer running are dropped (Serve never reuses a replica's id)."""
        with self._lock:
            for gone in [k for k in self._until if k not in keys]:
                self._until.pop(gone)
                self._probe.pop(gone, None)
            usable = [k for k in keys if not self._blocked(k, req_id, now)]
            if usable and all(k in self._until for k in usable):
                self._probe.setdefault(usable[0], req_id)
            return usable

    def on_routed(self, key: str, req_id: str, now: float) -> None:
        """The router sent `req_id` to `key`: past its back-off with no request trying it, that one does."""
        with self._lock:
            until = self._until.get(key)
            if until is not None and now >= until:
                self._probe.setdefault(key, req_id)

    def state(self, now: float) -> dict[str, float]:
        """Each marked replica's back-off seconds left (0: past it, tried by one request at a time)."""
        with self._lock:
            return {k: round(max(0.0, until - now), 3) for k, until in self._until.items()}


# ---------------------------------------------------------------- the prefill pool
def prefill_sampling_params(params: Any) -> Any:
    """The prefill call's sampling params: the request's, for its first token only (max_tokens 1, and
    min_tokens at most 1: a first token must not be a stop if the request asks for any; the decode side counts
    it towards the rest)."""
    return params.copy_with(max_tokens=1, min_tokens=min(params.min_tokens, 1))


@dataclass
class PrefillResult:
    """One sequence's first token (as the chunk a replica streams) and where its KV is (None: finished)."""

    chunk: ReplicaChunk
    remote: RemotePrefill | None


def make_transport(disaggregation: DisaggregationSection | None, engine: Any, prefill: bool = False) -> Any:
    """This replica's KV transport for `disaggregation.transport`: NIXL (one agent per replica; a read's
    notification wakes the engine so that it frees the hold at once), else None (the Ray object store's: the
    decode side's RayObjectTransport, and nothing on the prefill side)."""
    if disaggregation is None or disaggregation.transport != "nixl":
        return None
    from affinity_serve.engine import NixlTransport
    from affinity_serve.app.disagg_config import NIXL_EXPIRY_MARGIN_S
    return NixlTransport(staging_bytes=disaggregation.nixl_staging_mib << 20, on_hold_freed=engine.wake_threadsafe,
                         expiry_margin_s=NIXL_EXPIRY_MARGIN_S, register_at_bind=prefill)


class PrefillReplica(_PDMetrics):
    """A replica of the prefill pool: `prefill` runs a prompt and its first token for a decode replica."""

    def __init__(self, engine: EngineConfig, serve: ServeSection | None = None,
                 observability: ObservabilitySection | None = None, *,
                 autoscaling: AutoscalingSection | None = None, disaggregation: DisaggregationSection | None = None):
        super().__init__(engine, serve, observability, autoscaling=autoscaling)
        #: NIXL: the held blocks' address travels in each RemotePrefill and the decode replica reads them where
        #: they are (no copy-out here); None: the Ray object store (`_publish` copies them out)
        self.nixl = make_transport(disaggregation, self.engine, prefill=True)
        if self.nixl is not None:
            self.engine.set_kv_transport(self.nixl)

    async def prefill(self, req: GenerateRequest, skip_blocks: int = 0) -> list[PrefillResult]:
        """Each sequence's first token; where the request goes on, its KV beyond the first `skip_blocks` blocks
        (the decode replica holds those) copied into Ray's object store."""
        import ray

        from affinity_serve.observability.tracing import context_from_carrier
        prefill = dataclasses.replace(req, sampling_params=prefill_sampling_params(req.sampling_params),
                                      kv_transfer=RemoteDecode())
        out: dict[int, PrefillResult] = {}
        held: dict[int, RemotePrefill] = {}
        arrival = time.monotonic()
        ctx = context_from_carrier(req.trace_context)
        span = self.tracer.start_span(SPAN_PD_PREFILL, context=ctx, attributes={
            "replica": self.replica_id, "req_id": req.req_id, "pd.prompt_tokens": len(req.prompt_token_ids),
            "pd.skip_blocks": skip_blocks, "pd.sequences": req.sampling_params.n})
        try:
            try:
                async for d in self.engine.generate(prefill):
                    if d.finish_reason == "error":
                        raise APIError("prefill failed inside the engine", 500, "server_error", None, "engine_error")
                    prev = out.get(d.index)
                    chunk = ReplicaChunk.of(d, self.replica_id)
                    chunk.kv_transfer = None                  # travels as the PrefillResult's remote, published
                    if prev is not None:                      # the sequence so far, in one chunk
                        chunk.text = prev.chunk.text + d.text
                        chunk.token_ids = prev.chunk.token_ids + d.token_ids
                        chunk.prompt_logprobs = d.prompt_logprobs or prev.chunk.prompt_logprobs
                    out[d.index] = PrefillResult(chunk, None)
                    if d.finished and d.kv_transfer is not None:
                        held[d.index] = d.kv_transfer
                    span.set_attribute("pd.cached_tokens", d.num_cached_tokens)
            finally:
                span.set_attribute("pd.held_sequences", len(held))
                span.end()
            now = time.monotonic()
            # the prefill pool's autoscaling signal: the prompt tokens computed here (the caller held skip_blocks)
            block_size = self.engine.block_size
            self.signals.on_first_token(now, now - arrival,
                                        max(0, len(req.prompt_token_ids) - skip_blocks * block_size), 0,
                                        len(req.prompt_token_ids))
            for index in sorted(held):
                out[index].remote = await self._publish(held[index], skip_blocks, ray, ctx)
                del held[index]
            return [out[i] for i in sorted(out)]
        finally:
            for remote in held.values():   # failed or cancelled before its copy: free now rather than at the timeout
                self.engine.release_held_kv(remote.transfer_id)

    async def _publish(self, remote: RemotePrefill, skip_blocks: int, ray, ctx: Any) -> RemotePrefill:
        first = min(skip_blocks, remote.num_blocks)
        if first >= remote.num_blocks:
            self.engine.release_held_kv(remote.transfer_id)
            return dataclasses.replace(remote, address=None if self.nixl is not None else (None, first))
        if self.nixl is not None:       # the address of the blocks where they lie: the decode replica reads them
            return remote
        n = remote.num_blocks - first
        span = self.tracer.start_span(SPAN_PD_COPY_OUT, context=ctx, attributes={
            "replica": self.replica_id, "pd.transfer_id": remote.transfer_id, "pd.blocks": n,
            "pd.bytes": n * self.engine.pd_block_bytes, "pd.first_block": first})
        try:
            blocks = await self.engine.read_held_kv(remote.transfer_id, first, n)
            return dataclasses.replace(remote, address=(ray.put(blocks), first))
        finally:
            span.end()


# ---------------------------------------------------------------- the decode pool
@dataclass
class DisaggCounters:
    remote: int = 0             # requests prefilled by the prefill pool
    local_short: int = 0        # served here: the uncached part was below min_remote_prefill_tokens
    local_ineligible: int = 0   # served here: max_tokens 1, no prefill pool, or a prompt past the prefill pool's length
    local_backlog: int = 0      # served here: the ingress predicted the prefill pool too slow for it
                                # (disaggregation.local_prefill_slack_s)
    prefill_failed: int = 0     # the prefill pool failed: recomputed here
    prefill_pool_empty: int = 0  # of those, the pool had no running replica (not called)
    prefill_timeouts: int = 0   # of those, no answer within disaggregation.prefill_timeout_s (the call cancelled)
    prefill_suspect: int = 0    # of those, every running prefill replica was in its back-off after a timeout
                                # (disaggregation.prefill_backoff_s): not called


class _PrefillWait:
    """A request counted in its decode replica's `num_waiting_on_prefill` until `end()` (idempotent)."""

    def __init__(self, replica: DecodeReplica):
        self._replica = replica
        self._waiting = True
        replica.num_waiting_on_prefill += 1

    def end(self) -> None:
        if self._waiting:
            self._waiting = False
            self._replica.num_waiting_on_prefill -= 1


class PrefillTimeout(Exception):
    """The prefill pool did not answer a decode replica's call within disaggregation.prefill_timeout_s."""


class DecodeReplica(_PDMetrics):
    """A replica of the decode pool: takes the ingress's requests, has the prefill pool prefill them."""

    def __init__(self, engine: EngineConfig, serve: ServeSection, observability: ObservabilitySection,
                 prefill: Any, disaggregation: DisaggregationSection, *,
                 autoscaling: AutoscalingSection | None = None, prefill_min_replicas: int = 1,
                 prefill_max_model_len: int | None = None):
        super().__init__(engine, serve, observability, autoscaling=autoscaling)
        self.prefill_handle = prefill
        #: the prefill pool's max_model_len when the builder could derive it: a longer prompt is served here
        #: (the pools may size their KV pools apart, and a call would only be refused there)
        self.prefill_max_model_len = prefill_max_model_len
        # a prefill pool that may scale to zero comes back only on calls queued at its handles
        self.prefill_min_replicas = prefill_min_replicas
        self._pool_was_empty = False
        self._pool_seen_replicas = False       # this process's router over the prefill pool has counted one
        self.pool_watch_s = POOL_WATCH_S
        self.prefill_timeout_s = disaggregation.prefill_timeout((serve or ServeSection()).first_token_timeout_s)
        self.min_remote_prefill_tokens = disaggregation.min_remote_prefill_tokens
        self.transport = make_transport(disaggregation, self.engine) or RayObjectTransport()
        self.engine.set_kv_transport(self.transport)
        self.disagg = DisaggCounters()
        self.prefill_breaker = PrefillBreaker(disaggregation.prefill_backoff_s)
        #: requests this replica holds that wait on the prefill pool (from the call until this replica's engine
        #: holds the request: the engine counts it in flight from then on)
        self.num_waiting_on_prefill = 0

    def record_autoscaling_stats(self) -> dict[str, float]:
        """LLMReplica's, whose in-flight count is this engine's requests only, and the requests waiting on the
        prefill pool apart: that pool's work, counted in flight there; the decode pool's policy counts them only
        so as not to scale to zero under their streams (autoscale/pools.py)."""
        waiting = getattr(self, "num_waiting_on_prefill", 0)   # a collection may come before __init__ set it
        return {**super().record_autoscaling_stats(), NUM_WAITING_ON_PREFILL: float(waiting)}

    async def debug_state(self) -> dict[str, Any]:
        return {**await super().debug_state(), "disaggregation": dataclasses.asdict(self.disagg),
                "prefill_pool_size": self.prefill_pool_size(),
                "prefill_backoff": self.prefill_breaker.state(time.monotonic())}

    def _prefill_routers(self) -> list[Any]:
        """This process's routers over the prefill pool (PrefillPoolRouter: Serve builds it at the first call),
        each given this replica's breaker."""
        h = self.prefill_handle
        app, name = getattr(h, "app_name", None), getattr(h, "deployment_name", None)
        if app is None or name is None:
            return []
        routers = [r for r in debug.routers_for(app, name) if hasattr(r, "routed_to")]
        for r in routers:
            r.breaker = self.prefill_breaker
        return routers

    def _prefill_all_suspect(self, req_id: str) -> bool:
        """Whether every running prefill replica is in its back-off (or being tried again by another request):
        then `req_id` is prefilled here at once rather than sent to wait on a replica that missed its timeout.
        False while this process's router knows no replica (the first call, or a pool still starting)."""
        keys = sorted({k for r in self._prefill_routers() for k in r.node_of})
        return bool(keys) and not self.prefill_breaker.claim(keys, req_id, time.monotonic())

    async def _call_prefill(self, call: GenerateRequest, skip: int) -> list[PrefillResult] | None:
        """The prefill pool's answer to `call`; None when the pool lost its last running replica while the call
        waited. A replica that died without a clean stop (`ray.kill`, a lost node) leaves the pool once a probe
        or a call hits its death, and Serve then holds the call until a replacement has started (a model load):
        the call is cancelled and the request recomputed here instead. A pool that is only busy keeps its
        replicas listed, so its calls wait, up to `prefill_timeout_s` (disaggregation.prefill_timeout_s): a
        replica that hangs without dying, or a backlog that long, raises PrefillTimeout (the call cancelled;
        the caller recomputes)."""
        response = self.prefill_handle.prefill.remote(call, skip)

        async def answer() -> list[PrefillResult]:
            return await response

        task = asyncio.ensure_future(answer())
        deadline = time.monotonic() + self.prefill_timeout_s
        outcome: str | None = None          # "answered" or "timed_out": what the call says of its replica
        try:
            while True:
                left = deadline - time.monotonic()
                done, _ = await asyncio.wait({task}, timeout=max(0.0, min(self.pool_watch_s, left)))
                if done:
                    results = task.result()
                    outcome = "answered"
                    return results
                if self._prefill_pool_down():
                    logger.warning("the prefill pool lost its last running replica while a call waited: "
                                   "recomputing %s here", call.req_id)
                    return None
                if time.monotonic() >= deadline:
                    self.disagg.prefill_timeouts += 1
                    outcome = "timed_out"
                    raise PrefillTimeout(f"no answer from the prefill pool within disaggregation.prefill_timeout_s "
                                         f"({self.prefill_timeout_s:g}s) for {call.req_id}")
        finally:
            if not task.done():
                task.cancel()
                cancel = getattr(response, "cancel", None)
                if cancel is not None:
                    cancel()
            self._settle_prefill_call(call.req_id, outcome)

    def _settle_prefill_call(self, req_id: str, outcome: str | None) -> None:
        """Tell the breaker what the call to the prefill pool said of its replica: an answer clears it, a
        timeout starts its back-off (a call Serve never sent: of the replicas its router offered, none taking it
        or answering Serve's queue-length probe in all that time), and any other end lets another request try."""
        key, offered = None, []
        for r in self._prefill_routers():
            key = r.routed_to.pop(req_id, None) or key
            offered = r.offered.pop(req_id, None) or offered
        b = self.prefill_breaker
        b.release(req_id)
        if outcome == "answered" and key is not None:
            b.on_answer(key)
        elif outcome == "timed_out":
            now = time.monotonic()
            for k in [key] if key is not None else offered:
                b.on_timeout(k, now)
            logger.warning("prefill replica(s) %s did not answer %s within %gs: no prefill calls to them from this "
                           "replica for %gs", key or ", ".join(offered) or "?", req_id, self.prefill_timeout_s,
                           b.backoff_s)

    def prefill_pool_size(self) -> int | None:
        """Running prefill replicas as this process's router over the prefill pool knows them (Serve's
        replica set, pushed by its controller); None until that router has once known some (the first
        call makes it, and its first set may come after a second call: that call waits, as before)."""
        h = self.prefill_handle
        app, name = getattr(h, "app_name", None), getattr(h, "deployment_name", None)
        if app is None or name is None or not handle_has_known_replicas(h):    # no handle, a stand-in, or new
            return None
        routers = debug.routers_for(app, name)
        return max(r.num_replicas() for r in routers) if routers else None

    def _prefill_pool_down(self) -> bool:
        """Whether to recompute here without calling the prefill pool: this process's router over it counted
        replicas before and counts none running now (Serve would hold the call until a replacement has started,
        a model load). Never for a pool that
        may scale to zero (prefill_min_replicas 0): its queued calls are what bring it back."""
        size = self.prefill_pool_size()
        if size:
            self._pool_seen_replicas = True
        # "had replicas" is what this router itself counted: Serve's handle may call its set populated a moment
        # before the request router holds it (seen at start-up: an empty count with the first set on its way)
        empty = self.prefill_min_replicas >= 1 and self._pool_seen_replicas and size == 0
        if empty != self._pool_was_empty:          # one line per change, not one per request
            self._pool_was_empty = empty
            if empty:
                logger.warning("the prefill pool has no running replica: prefilling here until one runs")
            else:
                logger.info("the prefill pool has a running replica again")
        return empty

    def _prefill_failed(self) -> int:
        counters = getattr(self, "disagg", None)      # a collection may come before __init__ has set it
        return counters.prefill_failed if counters is not None else 0

    def _local_hit_blocks(self, req: GenerateRequest) -> int:
        """Leading prompt blocks this replica's pool holds now (a hint: the engine decides at admission)."""
        return self.engine.num_cached_prefix_blocks(req.block_hashes or ())

    def _route(self, req: GenerateRequest) -> int | None:
        """Blocks held here if the prefill pool should prefill `req`, else None (served here)."""
        p = req.sampling_params
        if p.max_tokens <= 1 or self.prefill_handle is None:
            self.disagg.local_ineligible += 1
            return None
        limit = getattr(self, "prefill_max_model_len", None)
        if limit is not None and len(req.prompt_token_ids) >= limit:     # prompt + its first token would not fit
            self.disagg.local_ineligible += 1
            return None
        if req.local_prefill:
            self.disagg.local_backlog += 1
            return None
        k = self._local_hit_blocks(req)
        if len(req.prompt_token_ids) - k * self.engine.block_size < self.min_remote_prefill_tokens:
            self.disagg.local_short += 1
            return None
        return k

    async def generate(self, req: GenerateRequest) -> AsyncIterator[ReplicaChunk]:
        skip = self._route(req)
        if skip is None:
            async for c in super().generate(req):
                yield c
            return
        # waiting on the prefill pool from here until this replica's engine holds the request (or recomputes
        # it): not idle meanwhile (the decode pool must not scale to zero under it, even while the prefill pool
        # starts from zero), yet counted in flight once, by the pool doing its work at the time
        wait = _PrefillWait(self)
        try:
            async for c in self._generate_remote(req, skip, wait):
                yield c
        finally:
            wait.end()

    async def _generate_remote(self, req: GenerateRequest, skip: int,
                               wait: _PrefillWait) -> AsyncIterator[ReplicaChunk]:
        """`generate` for a request the prefill pool prefills (`skip`: the leading blocks held here); `wait`
        ends as the engine here takes the request."""
        from opentelemetry import trace

        from affinity_serve.observability.tracing import context_from_carrier, inject_carrier
        ctx = context_from_carrier(req.trace_context)
        span = self.tracer.start_span(SPAN_REMOTE_PREFILL, context=ctx, attributes={
            "replica": self.replica_id, "req_id": req.req_id, "pd.local_blocks": skip,
            "pd.prompt_tokens": len(req.prompt_token_ids)})
        results: list[PrefillResult] | None = None
        pool_down = self._prefill_pool_down()
        suspect = not pool_down and self._prefill_all_suspect(req.req_id)
        try:
            if suspect:
                span.set_attribute("pd.prefill_suspect", True)
                self.disagg.prefill_suspect += 1
            elif not pool_down:
                # the prefill replica's spans (prefill, copy-out) are this span's children
                call = dataclasses.replace(req, trace_context=inject_carrier(trace.set_span_in_context(span, ctx)))
                results = await self._call_prefill(call, skip)
                pool_down = results is None
            if pool_down:
                span.set_attribute("pd.prefill_pool_empty", True)
                self.disagg.prefill_pool_empty += 1
        except asyncio.CancelledError:
            raise
        except APIError as e:
            if e.status_code < 500:      # the request itself is bad: the same answer as unified
                raise
        except PrefillTimeout as e:
            span.set_attribute("pd.prefill_timeout", True)
            logger.warning("%s: recomputing here", e)
        except Exception as e:       # any failure of the prefill pool costs a recompute, not the request
            logger.warning("prefill pool failed (%s: %s): recomputing here", type(e).__name__, e)
        finally:
            if results is not None:
                span.set_attribute("pd.prefill_replica", results[0].chunk.replica_id if results else "")
                span.set_attribute("pd.held_sequences", sum(r.remote is not None for r in results))
            span.set_attribute("pd.fallback", results is None)
            span.end()
        if results is None:
            self.disagg.prefill_failed += 1
            wait.end()                    # the engine counts it from here
            async for c in super().generate(req):
                yield c
            return
        self.disagg.remote += 1
        cont: list[tuple[int, RemotePrefill]] = []
        for r in results:
            c = r.chunk
            c.replica_id = self.replica_id
            if r.remote is not None and c.finish_reason == "length":
                c.finish_reason = c.stop_reason = None        # it goes on here
                cont.append((c.index, r.remote))
            elif c.finish_reason is not None:
                c.timings = {"queue_s": 0.0, "prefill_s": 0.0, "decode_s": 0.0}
            yield c
        if not cont:
            return
        p = req.sampling_params
        # the same seed: each sequence draws its later tokens as on one engine (RemotePrefill.seq_index)
        params = p.copy_with(n=len(cont), prompt_logprobs=None)
        d_req = dataclasses.replace(req, sampling_params=params, kv_transfer=[r for _, r in cont])
        decode = self.tracer.start_span(SPAN_PD_DECODE, context=ctx, attributes={
            "replica": self.replica_id, "req_id": req.req_id, "pd.sequences": len(cont)})
        transfers_ended = False
        num_tokens = 0
        wait.end()                        # no await until the engine has registered the request
        try:
            async for c in super().generate(d_req):
                if not transfers_ended:       # a token: every read of this request has ended (or fell back)
                    transfers_ended = True
                    self._transfer_spans(ctx, req, [r for _, r in cont], skip)
                num_tokens += len(c.token_ids)
                c.index = cont[c.index][0]
                yield c
        finally:
            if not transfers_ended:
                self._transfer_spans(ctx, req, [r for _, r in cont], skip)
            decode.set_attribute("pd.output_tokens", num_tokens)
            decode.end()

    def _transfer_spans(self, ctx: Any, req: GenerateRequest, remotes: list[RemotePrefill], skip: int) -> None:
        """One span per sequence whose blocks the transport read or released, with its size and time (a read
        still in flight, when the request ended first, ends now as "abandoned")."""
        for remote in remotes:
            rec = self.transport.take_record(remote.transfer_id)
            if rec is None:          # the engine never asked the transport (it fell back before a read)
                continue
            if rec.end_ns is None:
                rec.end("abandoned")
            span = self.tracer.start_span(SPAN_PD_TRANSFER, context=ctx, start_time=rec.start_ns, attributes={
                "replica": self.replica_id, "req_id": req.req_id, "pd.transfer_id": remote.transfer_id,
                "pd.prefill_engine": remote.engine_id, "pd.blocks": rec.num_blocks,
                "pd.bytes": rec.num_blocks * self.engine.pd_block_bytes, "pd.seconds": rec.seconds or 0.0,
                "pd.outcome": rec.outcome, "pd.local_blocks": skip})
            span.end(end_time=rec.end_ns)
