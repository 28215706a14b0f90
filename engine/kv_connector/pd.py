"""Prefill/decode disaggregation: the P/D connector's scheduler side, its hand-off values and the transport
interface (torch-free).

A prefill engine (P) runs a request marked `RemoteDecode`: its prefill and first token, as usual. When it
ends after that token, its blocks stay held (`HeldTransfers`) and its final output carries a `RemotePrefill`
(the `kv_transfer_params` of vLLM's NixlConnector): P's engine id, the transfer id, the number of full
prompt blocks held, the layout key and the first token. P frees the blocks when a reader has copied them
out, when the decode side says it needs none of them, or `transfer_timeout_s` after the finish; never
later. An aborted, failed or stopped request holds nothing.

A decode engine (D) takes a request with its `RemotePrefill`: the prompt plus the first token as its first
output token. As soon as the request is queued (wherever it stands in the queue: `early_loads`), the
connector offers the held full blocks beyond D's own prefix hit (local hits are never transferred again);
the request waits in WAITING_FOR_KV (outside the token budget and max_num_seqs) while the runner side reads
them through a `KVTransport`, beside the steps that decode the others; then it is admitted as a prefix hit
on them and computes
the rest of its prompt's last block and the first token (fewer than `block_size + 1` tokens) before it
decodes. A read that fails, times out (`load_timeout_s`) or meets an incompatible layout falls back to
recomputing the prompt locally, counted in `KVConnectorStats` (`load_failures_*`).

Whole blocks move in the `KVLayout` form shared by all tiers, so P and D may run different attention
backends. One engine may play both parts (a request chooses by the value it brings).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from affinity_serve.engine.kv_connector.base import (KVConnectorMetadata, KVConnectorOutput, KVConnectorScheduler,
                                      KVConnectorUpdate, KVLayout, KVTransfer, PoolChanges)
from affinity_serve.engine.request import RequestStatus
from affinity_serve.engine.types import RemoteDecode as RemoteDecode  # re-exported: P/D callers name them here
from affinity_serve.engine.types import RemotePrefill as RemotePrefill

if TYPE_CHECKING:
    from affinity_serve.engine.request import Request
    from affinity_serve.engine.types import SchedulerOutput

logger = logging.getLogger(__name__)


class KVTransferError(RuntimeError):
    """A read of held KV failed; `cause` is one of base.LOAD_FAILURE_CAUSES."""

    def __init__(self, message: str, cause: str = "error"):
        super().__init__(message)
        self.cause = cause


# ---------------------------------------------------------------- transport
class KVReadHandle(Protocol):
    def poll(self) -> Any:
        """The blocks once read (a buffer of `num_blocks * block_bytes` bytes: bytes, memoryview or a uint8
        numpy array, blocks in order, each in the KVLayout form), None while in flight; raises
        KVTransferError when the read failed."""

    def cancel(self) -> None:
        """Give up (the reader timed out); the holder frees its blocks at its own timeout if need be."""


class KVTransport(Protocol):
    """How a decode engine reads a prefill engine's held blocks. The default (`LocalTransport`) reaches
    engines in this process; the app's Ray transport calls the prefill replica (its object store carries the
    bytes); the NIXL transport (kv_connector/nixl.py) reads the prefill engine's KV cache where it lies.
    A transport may also define `bind(sched, worker)` (called by set_kv_transport) and
    `hold_address(transfer_id, block_ids, timeout_s)` (the prefill side: the `RemotePrefill.address` of held
    blocks)."""

    def start_read(self, remote: RemotePrefill, start_block: int, num_blocks: int) -> KVReadHandle:
        """Begin reading blocks [start_block, start_block + num_blocks) of `remote`; never blocks on the read.
        A successful read also frees the held transfer on the prefill side."""

    def release(self, remote: RemotePrefill, reason: str = "local") -> None:
        """The decode side reads none of `remote`'s blocks: free them now. `reason`: "local" (it holds them
        already) or "incompatible" (another model or KV layout: it recomputes). Best effort, never raises."""


class KVSource(Protocol):
    """A prefill engine's side of a transport: serves reads of its held transfers (from any thread)."""

    def read_held_blocks(self, transfer_id: str, start_block: int, num_blocks: int) -> Any:
        """The blocks as one uint8 buffer; raises KVTransferError ("missing": unknown, expired or freed)."""

    def release_held(self, transfer_id: str) -> None:
        """Free a held transfer without reading it."""


@dataclass(slots=True)
class ReadRecord:
    """One transfer as a decode side's transport saw it, for its span: `outcome` "reading" until it ends, then
    "read", "missing" (the blocks are gone or were never copied out), "cancelled" (the engine gave up: timeout,
    abort), "expired" (the hold expired before or during the read: discarded), "local" (released unread: the
    decode replica held every block) or "incompatible" (released unread: another model, KV layout or transport,
    recomputed)."""

    num_blocks: int
    start_ns: int                 # wall clock (a span's time base)
    started: float                # monotonic
    end_ns: int | None = None
    seconds: float | None = None
    outcome: str = "reading"

    def end(self, outcome: str) -> None:
        if self.end_ns is None:
            self.end_ns, self.seconds, self.outcome = time.time_ns(), time.monotonic() - self.started, outcome


class TransferRecords:
    """A decode-side transport's record of each transfer, by the prefill side's transfer id, for its span: the
    engine's thread writes them, the replica takes each once; the most recent `max_records` are kept."""

    def __init__(self, max_records: int = 4096):
        from collections import OrderedDict
        self._records: OrderedDict[str, ReadRecord] = OrderedDict()
        self._records_lock = threading.Lock()
        self.max_records = max_records

    def _keep(self, transfer_id: str, record: ReadRecord) -> ReadRecord:
        with self._records_lock:
            self._records[transfer_id] = record
            while len(self._records) > self.max_records:
                self._records.popitem(last=False)
        return record

    def take_record(self, transfer_id: str) -> ReadRecord | None:
        """The transfer's record (once), None if no read or release of it was seen (the engine fell back first)."""
        with self._records_lock:
            return self._records.pop(transfer_id, None)


# ---------------------------------------------------------------- the prefill side's holds
@dataclass(slots=True)
class _Hold:
    block_ids: list[int]
    held_since: float
    deadline: float
    num_readers: int = 0
    done: bool = False            # read or released: free at the next report
    was_read: bool = False


class HeldTransfers:
    """The prefill engine's held transfers, shared by its scheduler side (adds, frees) and its runner side
    (serves reads on a transport's thread). Thread-safe. A hold being read never expires mid-read: its
    blocks cannot be reallocated while a reader copies them."""

    def __init__(self, timeout_s: float, clock=time.monotonic):
        self.timeout_s = timeout_s
        #: called (from any thread) when a hold is done (read or released), so that an idle engine steps to free
        #: it (AsyncLLMEngine sets its thread-safe wake)
        self.on_done: Any = None
        self._clock = clock
        self._lock = threading.Lock()
        self._holds: dict[str, _Hold] = {}

    def hold(self, transfer_id: str, block_ids: list[int]) -> None:
        now = self._clock()
        with self._lock:
            self._holds[transfer_id] = _Hold(list(block_ids), now, now + self.timeout_s)

    def begin_read(self, transfer_id: str, start_block: int, num_blocks: int) -> list[int]:
        """The pool block ids to copy; the hold stays pinned until `end_read`."""
        with self._lock:
            h = self._holds.get(transfer_id)
            if h is None or h.done or self._clock() >= h.deadline:
                raise KVTransferError(f"transfer {transfer_id!r} is not held here (expired, freed or unknown)",
                                      "missing")
            if start_block < 0 or num_blocks < 0 or start_block + num_blocks > len(h.block_ids):
                raise KVTransferError(f"transfer {transfer_id!r} holds {len(h.block_ids)} blocks, not "
                                      f"[{start_block}, {start_block + num_blocks})", "missing")
            h.num_readers += 1
            return h.block_ids[start_block:start_block + num_blocks]

    def end_read(self, transfer_id: str, ok: bool) -> None:
        with self._lock:
            h = self._holds[transfer_id]
            h.num_readers -= 1
            if ok:
                h.done = h.was_read = True
        self._changed()

    def release(self, transfer_id: str) -> None:
        with self._lock:
            h = self._holds.get(transfer_id)
            if h is None:
                return
            h.done = True
        self._changed()

    def mark_read(self, transfer_id: str) -> None:
        """A reader that read the blocks without pinning them (a one-sided read, e.g. NIXL's) is done: free them.
        Unknown or already freed ids are ignored."""
        with self._lock:
            h = self._holds.get(transfer_id)
            if h is None or h.done:
                return
            h.done = h.was_read = True
        self._changed()

    def take_finished(self) -> tuple[dict[str, tuple[float, bool]], dict[str, tuple[float, bool]]]:
        """Holds to free now, by id with (seconds held, was read): (read or released, expired unread)."""
        now = self._clock()
        done: dict[str, tuple[float, bool]] = {}
        expired: dict[str, tuple[float, bool]] = {}
        with self._lock:
            for tid, h in list(self._holds.items()):
                if h.num_readers:
                    continue
                if h.done:
                    done[tid] = (now - h.held_since, h.was_read)
                elif now >= h.deadline:
                    expired[tid] = (now - h.held_since, False)
                else:
                    continue
                del self._holds[tid]
        return done, expired

    def seconds_to_next_expiry(self) -> float | None:
        """Seconds until the earliest live hold's timeout (0 when one has passed), None without one. A hold being
        read is left out (it cannot expire mid-read; its reader's end wakes the engine)."""
        now = self._clock()
        with self._lock:
            live = [h.deadline for h in self._holds.values() if not h.done and not h.num_readers]
        return max(0.0, min(live) - now) if live else None

    def seconds_left(self, transfer_id: str) -> float | None:
        """Seconds until `transfer_id`'s hold expires unread; None if it is not held."""
        with self._lock:
            h = self._holds.get(transfer_id)
            return None if h is None else h.deadline - self._clock()

    def _changed(self) -> None:
        cb = self.on_done
        if cb is not None:
            try:
                cb()
            except Exception:
                logger.exception("HeldTransfers.on_done")

    def has_finished(self) -> bool:
        now = self._clock()
        with self._lock:
            return any(not h.num_readers and (h.done or now >= h.deadline) for h in self._holds.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._holds)

    def num_blocks(self) -> int:
        """Pool blocks held now for readers (freed ones included until the next report frees them)."""
        with self._lock:
            return sum(len(h.block_ids) for h in self._holds.values())


# ---------------------------------------------------------------- stats
@dataclass(slots=True)
class PDStats:
    """P/D counters beyond KVConnectorStats (which counts the decode side's reads as loads)."""

    holds: int = 0                 # prefill side: transfers held for a decode engine
    holds_read: int = 0            # ... freed after a read
    holds_released: int = 0        # ... freed because the decode side needed no block
    holds_expired: int = 0         # ... freed unread at transfer_timeout_s
    held_seconds_total: float = 0.0
    remote_requests: int = 0       # decode side: requests that arrived with a RemotePrefill
    remote_local_blocks: int = 0   # ... blocks they found in the local prefix cache (not transferred)
    remote_released: int = 0       # ... transfers they needed nothing from
    incompatible: int = 0          # ... whose layout key did not match (they recompute; counted as failed loads)
    read_seconds_total: float = 0.0     # ... from the read's start to its report, reads that succeeded


#: the most transfer and hold times kept for a metrics reader between two `take_transfer_stats` calls
MAX_TIME_SAMPLES = 4096


@dataclass(slots=True)
class PDTransferStats:
    """What the P/D metrics export (observability: affinity_pd_*), from `take_transfer_stats`."""

    pd: PDStats                    # cumulative counters (a copy)
    num_held_blocks: int           # prefill side: pool blocks held for decode engines now
    #: decode side: seconds from a read's start to its report, reads that succeeded since the last take
    read_times_s: list[float] = field(default_factory=list)
    #: prefill side: (seconds held, "read" | "released" | "expired"), holds freed since the last take
    hold_times_s: list[tuple[float, str]] = field(default_factory=list)


@dataclass(slots=True)
class RemoteRead(KVTransfer):
    """A decode-side load: read blocks [start_block, ...) of `remote` into `block_ids`."""

    remote: RemotePrefill | None = None
    start_block: int = 0


# ---------------------------------------------------------------- the scheduler side
class PDConnectorScheduler(KVConnectorScheduler):
    """Both parts of P/D disaggregation (see the module docstring); a request's `kv_transfer` picks one."""

    medium = "remote"
    early_loads = True

    def __init__(self, layout: KVLayout, layout_key: str, engine_id: str, held: HeldTransfers, *,
                 load_timeout_s: float = 30.0, transport: KVTransport | None = None):
        super().__init__()
        self.layout = layout
        self.layout_key = layout_key
        self.engine_id = engine_id
        self.block_size = layout.block_size
        self.held = held
        self.load_timeout_s = load_timeout_s
        self.transport = transport
        self.pd_stats = PDStats()
        self._pending_loads: list[RemoteRead] = []
        self._reading: dict[str, tuple[int, float]] = {}    # req_id -> (blocks being read, since)
        self._settled: set[str] = set()                     # decode requests whose transfer was read or released
        self._finished_params: dict[str, RemotePrefill] = {}
        # times for a metrics reader on another thread (deque appends and pops are atomic); oldest dropped
        self._read_times: deque[float] = deque(maxlen=MAX_TIME_SAMPLES)
        self._hold_times: deque[tuple[float, str]] = deque(maxlen=MAX_TIME_SAMPLES)

    # ------------------------------------------------------------------ decode side
    def loads_early(self, request: "Request") -> bool:
        # the read starts when the request arrives, not when it is admitted: it overlaps the queueing
        return isinstance(request.kv_transfer, RemotePrefill) and request.req_id not in self._settled

    def get_num_new_matched_tokens(self, request: "Request", num_local_tokens: int) -> tuple[int | None, bool]:
        # may be asked again for the same request while no blocks are free for its read: counts only once
        # the answer is acted on (a read started, or the transfer released)
        remote = request.kv_transfer
        if not isinstance(remote, RemotePrefill) or request.req_id in self._settled:
            return 0, False
        bs = self.block_size
        if remote.layout_key != self.layout_key:
            self._count_remote()
            self.pd_stats.incompatible += 1
            self.stats.loads_failed += 1
            self.stats.load_failures_error += 1
            self._settle(request, remote, release=True, reason="incompatible")
            return 0, False
        # never the block of the token that must be computed here (the first output token's position)
        num_remote = min(remote.num_blocks, (request.num_tokens - 1) // bs)
        num_local = num_local_tokens // bs
        if num_local >= num_remote:
            self._count_remote()
            self.pd_stats.remote_local_blocks += num_remote
            self.pd_stats.remote_released += 1
            self._settle(request, remote, release=True)
            return 0, False
        return (num_remote - num_local) * bs, True

    def _count_remote(self) -> None:
        self.stats.lookups += 1
        self.pd_stats.remote_requests += 1

    def _settle(self, request: "Request", remote: RemotePrefill, *, release: bool, reason: str = "local") -> None:
        self._settled.add(request.req_id)
        if release and self.transport is not None:
            self.transport.release(remote, reason)

    def update_state_after_alloc(self, request: "Request", block_ids: list[int], num_external_tokens: int) -> None:
        remote = request.kv_transfer
        assert isinstance(remote, RemotePrefill)
        start = request.num_computed_tokens // self.block_size
        self._count_remote()
        self.stats.hit_blocks += len(block_ids)
        self.stats.hit_tokens += len(block_ids) * self.block_size
        self.pd_stats.remote_local_blocks += start
        self._settled.add(request.req_id)      # one read per request: a failure recomputes
        self._reading[request.req_id] = (len(block_ids), time.monotonic())
        self._load_started(request)
        hashes = request.block_hashes[start:start + len(block_ids)]
        self._pending_loads.append(RemoteRead(request.req_id, list(block_ids), list(hashes),
                                              remote=remote, start_block=start))

    # ------------------------------------------------------------------ prefill side
    def request_finished(self, request: "Request", block_ids: list[int]) -> bool:
        remote = request.kv_transfer
        if isinstance(remote, RemotePrefill):        # decode side: nothing held here
            if request.req_id not in self._settled:  # left before it asked for its blocks: free them there
                self._settle(request, remote, release=True)
            self._settled.discard(request.req_id)
            return False
        if not isinstance(remote, RemoteDecode):
            return False
        # only a prefill that ended after its first token for the sake of the decode side holds its blocks:
        # an aborted, failed, stopped (EOS, stop token or string) or preempted request is done with them
        if request.status is not RequestStatus.FINISHED_LENGTH_CAPPED or request.num_output_tokens != 1:
            return False
        n = min(len(block_ids), request.num_prompt_tokens // self.block_size)
        address = None
        if n:
            self.held.hold(request.req_id, block_ids[:n])
            self.pd_stats.holds += 1
            # a transport whose reader reads the blocks where they are (NIXL) says where
            hold_address = getattr(self.transport, "hold_address", None)
            if hold_address is not None:
                try:
                    address = hold_address(request.req_id, block_ids[:n], self.held.timeout_s)
                except Exception:      # the reader cannot reach them: free them now, it recomputes
                    logger.exception("no transport address for the blocks of %s: freed", request.req_id)
                    self.held.release(request.req_id)
        self._finished_params[request.req_id] = RemotePrefill(
            self.engine_id, request.req_id, self.layout_key, request.num_prompt_tokens, n,
            request.all_token_ids[request.num_prompt_tokens], address=address,
            num_cached_tokens=request.num_cached_tokens or 0)
        return n > 0

    def take_transfer_params(self, req_id: str) -> RemotePrefill | None:
        """The RemotePrefill of a prefill request that just finished (once)."""
        return self._finished_params.pop(req_id, None)

    # ------------------------------------------------------------------ every step
    def build_connector_meta(self, scheduler_output: "SchedulerOutput", changes: PoolChanges) -> KVConnectorMetadata:
        self._note_abandoned_loads()
        meta = KVConnectorMetadata(loads=list(self._pending_loads))
        self._pending_loads = []
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> KVConnectorUpdate:
        for req_id, ok in output.finished_loads.items():
            num_blocks, started = self._reading.pop(req_id, (0, None))
            if ok and started is not None and req_id not in self._abandoned_loads:
                secs = time.monotonic() - started
                self.pd_stats.read_seconds_total += secs
                self._read_times.append(secs)
            self._load_finished(req_id, ok, num_blocks, output.load_failure_causes.get(req_id),
                                self.layout.block_bytes)
        done, expired = self.held.take_finished()
        st = self.pd_stats
        for secs, was_read in done.values():
            if was_read:
                st.holds_read += 1
            else:
                st.holds_released += 1
            st.held_seconds_total += secs
            self._hold_times.append((secs, "read" if was_read else "released"))
        for secs, _ in expired.values():
            st.holds_expired += 1
            st.held_seconds_total += secs
            self._hold_times.append((secs, "expired"))
        return KVConnectorUpdate(dict(output.finished_loads), set(done) | set(expired))

    def take_transfer_stats(self) -> PDTransferStats:
        """The counters, the blocks held now, and the read and hold times since the last call (taken: one
        reader). Safe from another thread while the engine steps (the counters may be a step apart)."""
        return PDTransferStats(dataclasses.replace(self.pd_stats), self.held.num_blocks(), _drain(self._read_times),
                               _drain(self._hold_times))

    held_blocks_need_steps = False

    def has_pending_work(self) -> bool:
        # held blocks waiting for a reader need no steps; finished holds do (to free them)
        return bool(self._pending_loads or self._reading or self.held.has_finished())

    def next_wakeup_s(self) -> float | None:
        # an idle prefill engine steps when its earliest hold times out (a read or release wakes it before)
        return self.held.seconds_to_next_expiry()


def _drain(q: deque) -> list:
    out = []
    while True:
        try:
            out.append(q.popleft())
        except IndexError:        # empty (another reader may have taken the rest)
            return out


# ---------------------------------------------------------------- the in-process transport
class _FutureRead:
    def __init__(self, future):
        self._future = future

    def poll(self) -> Any:
        if not self._future.done():
            return None
        return self._future.result()       # raises the read's KVTransferError

    def cancel(self) -> None:
        self._future.cancel()


class LocalTransport:
    """Reaches prefill engines in this process by engine id (engines register themselves): the default
    transport, and the one engine-level tests use. Reads run on a small thread pool, as a remote read runs
    beside the decode engine's steps. `delay_s` holds every read that long first (tests: a slow transfer)."""

    def __init__(self, *, delay_s: float = 0.0, max_workers: int = 4):
        from concurrent.futures import ThreadPoolExecutor
        self.delay_s = delay_s
        self._sources: dict[str, KVSource] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="kv-local-read")

    def register(self, engine_id: str, source: KVSource) -> None:
        with self._lock:
            self._sources[engine_id] = source

    def unregister(self, engine_id: str) -> None:
        """The engine is gone (tests: a prefill engine that died): reads of its transfers fail."""
        with self._lock:
            self._sources.pop(engine_id, None)

    def _source(self, engine_id: str) -> KVSource:
        with self._lock:
            src = self._sources.get(engine_id)
        if src is None:
            raise KVTransferError(f"prefill engine {engine_id!r} is not reachable", "missing")
        return src

    def _read(self, remote: RemotePrefill, start_block: int, num_blocks: int) -> Any:
        if self.delay_s:
            time.sleep(self.delay_s)
        return self._source(remote.engine_id).read_held_blocks(remote.transfer_id, start_block, num_blocks)

    def start_read(self, remote: RemotePrefill, start_block: int, num_blocks: int) -> KVReadHandle:
        return _FutureRead(self._pool.submit(self._read, remote, start_block, num_blocks))

    def release(self, remote: RemotePrefill, reason: str = "local") -> None:
        try:
            self._source(remote.engine_id).release_held(remote.transfer_id)
        except KVTransferError:     # the prefill engine is gone: its holds went with it (best effort, per the API)
            logger.debug("releasing %s: prefill engine %s is gone", remote.transfer_id, remote.engine_id)


_default_local: LocalTransport | None = None


def default_local_transport() -> LocalTransport:
    """The process-wide LocalTransport that P/D engines built without a transport join."""
    global _default_local
    if _default_local is None:
        _default_local = LocalTransport()
    return _default_local
