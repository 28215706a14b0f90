"""A NIXL transport for P/D disaggregation: the decode engine reads the prefill engine's held blocks straight out of
its KV cache with NIXL's one-sided READ (the `nixl` package; its UCX backend picks RDMA, NVLink, CUDA IPC, shared
memory or TCP, whatever joins the two processes), as vLLM's NixlConnector does.

Prefill side. The transport registers the engine's KV tensors with its NIXL agent once, and each held transfer's
`RemotePrefill.address` becomes a `NixlAddress`: the agent's name and metadata, each KV tensor's base address, the
tensors' shape and axis order, the held pool block ids, and the wall-clock time the hold expires unread. Nothing is
copied out: the blocks stay where the prefill wrote them until the reader's notification ("read:<id>", sent by
NIXL when the read has completed) or its "release:<id>" frees them, or the hold's timeout does
(`kv_connector.transfer_timeout_s`). A thread polls the agent's notifications.

Decode side. `start_read` returns a handle whose `poll` first takes room in a staging area registered with the
agent (on the decode engine's device; `staging_bytes`, a larger read gets a buffer of its own), then posts one
READ with one descriptor per block region of each KV tensor (a block of a tensor whose block axis is not the
first is one region per index of the axes before it), and when NIXL reports it done gives the blocks to the
engine, which scatters them into its pool blocks from the staging area (one device copy; the prefill side's axis
order is converted there, so the two sides may run different attention backends). Reading into staging rather
than into the pool is what makes a late read harmless: a read the engine gave up on (`load_timeout_s`) keeps its
staging room until NIXL ends it, while the pool blocks were returned at once. A read that ends after the hold's
expiry (the prefill side may have reused the blocks) is discarded and the request recomputes; one is not started
within `expiry_margin_s` of it (clocks of two hosts are compared: keep them synchronised).

Failures (the prefill process gone, an unreachable agent, an expired hold) are KVTransferErrors; the engine
recomputes the request, counted in its load-failure stats.
"""
from __future__ import annotations

import importlib
import logging
import math
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable

import numpy as np
import torch

from affinity_serve.engine.kv_connector.pd import KVTransferError, ReadRecord, RemotePrefill, TransferRecords

logger = logging.getLogger(__name__)

#: NIXL's Python API, in the order tried: the `nixl` meta package, then its CUDA 13 and CUDA 12 builds
_NIXL_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")
_ALIGN = 256                 # staging regions start on this many bytes (any dtype's alignment, and DMA-friendly)


def load_nixl():
    """NIXL's Python API module (nixl_agent, nixl_agent_config); ImportError saying what to install."""
    errors = []
    for name in _NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
    raise ImportError("the NIXL transport needs NIXL's Python package: pip install 'affinity-serve[nixl]' "
                      "(nixl-cu13; nixl-cu12 for CUDA 12 drivers). Tried " + "; ".join(errors))


def nixl_available() -> bool:
    try:
        load_nixl()
    except ImportError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class NixlAddress:
    """Where a held transfer's blocks are: `RemotePrefill.address` under the NIXL transport (picklable)."""

    agent: str                            # the prefill engine's NIXL agent
    metadata: bytes                       # its metadata (add_remote_agent)
    mem_type: str                         # "VRAM" or "DRAM"
    tensors: tuple[tuple[int, int], ...]  # per KV tensor: (base address, device id)
    shape: tuple[int, ...]                # one KV tensor's shape, in the prefill backend's axis order
    permutation: tuple[int, ...]          # that order -> (block, k/v, head, slot, head_dim)
    dtype: str                            # e.g. "bfloat16"
    block_ids: tuple[int, ...]            # the held pool blocks, in prompt order
    expires_at: float                     # time.time() at which the prefill side frees them unread


class _Geometry:
    """Where one block's bytes lie in a KV tensor of `shape` (contiguous) whose block axis is `permutation[0]`:
    `chunks` regions of `chunk_bytes`, the c-th at (c * num_blocks + block) * chunk_bytes."""

    def __init__(self, shape: tuple[int, ...], permutation: tuple[int, ...], element_size: int):
        d = permutation[0]
        self.shape, self.permutation, self.block_axis = tuple(shape), tuple(permutation), d
        self.chunks = math.prod(shape[:d])
        self.num_blocks = shape[d]
        self.chunk_bytes = math.prod(shape[d + 1:]) * element_size
        self.block_bytes = self.chunks * self.chunk_bytes

    def staged_shape(self, n: int) -> tuple[int, ...]:
        """One tensor's n read blocks as staged: the tensor's shape with n on its block axis."""
        s = list(self.shape)
        s[self.block_axis] = n
        return tuple(s)


def _descriptors(geo: _Geometry, addr: NixlAddress, start: int, n: int, staging: int, staging_dev: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The READ's (local, remote) descriptor rows (address, bytes, device id): for each KV tensor and each of a
    block's chunks, one row per run of consecutive pool block ids (a fresh pool hands out runs, so a request is
    often a few rows per chunk, not one per block). Staged per tensor as the tensor's own shape with n blocks."""
    ids = np.asarray(addr.block_ids[start:start + n], dtype=np.int64)
    brk = np.flatnonzero(np.diff(ids) != 1) + 1
    run_at = np.concatenate(([0], brk))                               # index in the read of each run's first
    run_len = np.diff(np.concatenate((run_at, [n])))
    cb = geo.chunk_bytes
    chunk = np.arange(geo.chunks, dtype=np.int64)[:, None]            # [chunks, 1]
    r_off = ((chunk * geo.num_blocks + ids[run_at][None, :]) * cb).reshape(-1)
    l_off = ((chunk * n + run_at[None, :]) * cb).reshape(-1)
    lens = np.broadcast_to(run_len[None, :] * cb, (geo.chunks, run_len.size)).reshape(-1)
    per = geo.block_bytes * n
    rows = r_off.size
    remote = np.empty((len(addr.tensors) * rows, 3), dtype=np.uint64)
    local = np.empty_like(remote)
    for i, (base, dev) in enumerate(addr.tensors):
        sl = slice(i * rows, (i + 1) * rows)
        remote[sl, 0] = base + r_off
        remote[sl, 1] = lens
        remote[sl, 2] = dev
        local[sl, 0] = staging + i * per + l_off
        local[sl, 1] = lens
        local[sl, 2] = staging_dev
    return local, remote


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise KVTransferError(f"unknown KV dtype {name!r}", "error")
    return dt


# ---------------------------------------------------------------- the decode side's staging area
class _Room:
    """A read's bytes in staging: the arena's [start, start + nbytes), or a buffer of its own."""

    __slots__ = ("buf", "start", "nbytes", "own")

    def __init__(self, buf: torch.Tensor, start: int, nbytes: int, own: bool):
        self.buf, self.start, self.nbytes, self.own = buf, start, nbytes, own

    @property
    def addr(self) -> int:
        return self.buf.data_ptr() + self.start


class _Arena:
    """First-fit allocator over one registered buffer. A region freed on CUDA is reused only once the copies
    that read it (the scatter into the pool) have run: its event is checked first."""

    def __init__(self, buf: torch.Tensor):
        self.buf = buf
        self.size = buf.numel()
        self._free: list[tuple[int, int]] = [(0, self.size)]       # (start, length), sorted, coalesced
        self._deferred: list[tuple[Any, int, int]] = []            # (cuda event, start, length)

    def alloc(self, nbytes: int) -> int | None:
        self._reclaim()
        need = -(-nbytes // _ALIGN) * _ALIGN
        for i, (s, n) in enumerate(self._free):
            if n >= need:
                if n == need:
                    del self._free[i]
                else:
                    self._free[i] = (s + need, n - need)
                return s
        return None

    def free(self, start: int, nbytes: int, event: Any = None) -> None:
        need = -(-nbytes // _ALIGN) * _ALIGN
        if event is not None:
            self._deferred.append((event, start, need))
        else:
            self._put(start, need)

    def _reclaim(self) -> None:
        keep = []
        for ev, s, n in self._deferred:
            if ev.query():
                self._put(s, n)
            else:
                keep.append((ev, s, n))
        self._deferred = keep

    def _put(self, start: int, n: int) -> None:
        self._free.append((start, n))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for s, m in self._free:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + m)
            else:
                merged.append((s, m))
        self._free = merged

    def bytes_free(self) -> int:
        self._reclaim()
        return sum(n for _, n in self._free)


class NixlBlocks:
    """A finished read's blocks, still in staging: `scatter_into` lands them in the reader's pool blocks and gives
    the staging room back. One use."""

    def __init__(self, transport: "NixlTransport", room: _Room, geo: _Geometry, num_tensors: int, dtype: torch.dtype,
                 n: int):
        self._t, self._room, self._geo, self._num_tensors, self._dtype, self.n = transport, room, geo, num_tensors, \
            dtype, n

    def layers(self) -> list[torch.Tensor]:
        """Each KV tensor's n blocks in the canonical order [n, 2, heads, block_size, head_dim] (views of staging)."""
        assert self._room is not None, "these blocks were landed or discarded already"
        per = self._geo.block_bytes * self.n
        raw = self._room.buf[self._room.start:self._room.start + per * self._num_tensors]
        shape = self._geo.staged_shape(self.n)
        return [raw[i * per:(i + 1) * per].view(self._dtype).view(shape).permute(self._geo.permutation)
                for i in range(self._num_tensors)]

    def discard(self) -> None:
        """Give the staging room back without landing the blocks (the reader gave up on them)."""
        room, self._room = self._room, None
        self._t._free_room(room)

    def scatter_into(self, copier: Any, block_ids: list[int]) -> None:
        try:
            layers = self.layers()
            if len(layers) != len(copier.kv_caches):
                raise ValueError(f"read {len(layers)} KV tensors, the pool has {len(copier.kv_caches)}")
            copier.scatter_layers(block_ids, layers)
        finally:
            self.discard()


class _NixlRead:
    """One read (KVReadHandle): waits for staging room, then for NIXL."""

    def __init__(self, transport: "NixlTransport", addr: NixlAddress, agent: str, transfer_id: str, start: int,
                 n: int, record: ReadRecord):
        self._t, self._addr, self._agent, self._tid = transport, addr, agent, transfer_id
        self._start, self._n, self._record = start, n, record
        self._geo = _Geometry(addr.shape, addr.permutation, _dtype(addr.dtype).itemsize)
        self._room: _Room | None = None
        self._xfer: Any = None
        self._ended = False

    def _post(self) -> bool:
        # the hold may have neared its expiry while this read waited for room: do not read blocks being freed
        if time.time() >= self._addr.expires_at - self._t.expiry_margin_s:
            self._end("expired")
            raise KVTransferError(f"the hold of {self._tid!r} expires too soon to read it", "timed_out")
        nbytes = self._geo.block_bytes * self._n * len(self._addr.tensors)
        room = self._t._take_room(nbytes)
        if room is None:
            return False
        self._room = room
        try:
            local, remote = _descriptors(self._geo, self._addr, self._start, self._n, room.addr,
                                         self._t._local_dev)
            self._xfer = self._t._post_read(local, remote, self._addr.mem_type, self._agent,
                                            b"read:" + self._tid.encode())
        except Exception as e:
            self._fail_now(f"could not post the NIXL read from {self._agent}: {e}")
            raise KVTransferError(f"could not post the NIXL read from {self._agent}: {e}", "missing") from e
        self._t._reading(self._agent, +1)
        return True

    def _fail_now(self, why: str, outcome: str = "missing") -> None:
        """Everything this read holds goes back (room, handle, the agent's count); the record ends."""
        room, self._room = self._room, None
        if self._xfer is not None:
            self._t._release_xfer(self._xfer)
            self._t._reading(self._agent, -1)
            self._xfer = None
        self._t._free_room(room)
        logger.warning("NIXL read of %s: %s", self._tid, why)
        self._end(outcome)

    def poll(self) -> Any:
        if self._ended:
            raise KVTransferError("this read has ended", "error")
        if self._xfer is None and not self._post():
            return None                                  # waiting for staging room
        try:
            state = self._t._state(self._xfer)           # NIXL raises on a failed transfer (peer gone)
        except Exception as e:
            state = f"error: {type(e).__name__}: {e}"
        if state in ("PROC", "PEND", "INIT"):
            return None
        if state != "DONE":
            self._fail_now(f"failed ({state})")
            raise KVTransferError(f"the NIXL read from {self._agent} failed ({state})", "missing")
        room, self._room = self._room, None
        self._t._release_xfer(self._xfer)
        self._t._reading(self._agent, -1)
        self._xfer = None
        if time.time() >= self._addr.expires_at:
            self._t._free_room(room)
            self._end("expired")
            raise KVTransferError("the NIXL read ended after the prefill side's hold expired: its blocks may have "
                                  "been reused, discarded", "timed_out")
        self._end("read")
        return NixlBlocks(self._t, room, self._geo, len(self._addr.tensors), _dtype(self._addr.dtype), self._n)

    def cancel(self) -> None:
        if self._ended:
            return
        self._end("cancelled")
        if self._xfer is not None:         # in flight: its staging room stays taken until NIXL ends it
            self._t._drain(self._xfer, self._room, self._agent)
            self._xfer = self._room = None
        else:                              # never started: the prefill side need not hold the blocks any longer
            self._t._send_release(self._agent, self._tid)

    def _end(self, outcome: str) -> None:
        self._ended = True
        self._record.end(outcome)


# ---------------------------------------------------------------- the transport
class NixlTransport(TransferRecords):
    """KVTransport (decode side) and address publisher (prefill side) over one NIXL agent per engine.

    `set_kv_transport` binds it to its engine (`bind`): give each engine its own. `on_hold_freed` is called (on the
    notification thread) when a reader's notification freed a hold, so an idle engine can run the step that
    returns the blocks (the app passes its engine's `wake`)."""

    def __init__(self, name: str | None = None, *, staging_bytes: int = 256 << 20, expiry_margin_s: float = 1.0,
                 notify_poll_s: float = 0.002, backends: tuple[str, ...] = ("UCX",),
                 on_hold_freed: Callable[[], None] | None = None, max_records: int = 4096,
                 register_at_bind: bool = True):
        if staging_bytes <= 0:
            raise ValueError(f"staging_bytes must be positive, got {staging_bytes}")
        if not notify_poll_s > 0:
            raise ValueError(f"notify_poll_s must be positive, got {notify_poll_s}")
        if expiry_margin_s < 0:
            raise ValueError(f"expiry_margin_s must be at least 0, got {expiry_margin_s}")
        if max_records < 1:
            raise ValueError(f"max_records must be at least 1, got {max_records}")
        api = load_nixl()
        super().__init__(max_records)
        self.name = name or f"affinity-{uuid.uuid4().hex[:12]}"
        self.staging_bytes = staging_bytes
        self.expiry_margin_s = expiry_margin_s
        self.notify_poll_s = notify_poll_s
        self.on_hold_freed = on_hold_freed
        #: register the engine's KV cache when bound (a prefill engine: not inside its first hold's step);
        #: False: at its first hold, if any (a decode-only engine never registers its pool)
        self.register_at_bind = register_at_bind
        self._api = api
        self._agent = api.nixl_agent(self.name, api.nixl_agent_config(backends=list(backends)))
        self._lock = threading.RLock()              # every call into the agent, and the staging area
        self._sched: Any = None
        self._worker: Any = None
        # prefill side
        self._source: tuple[str, tuple[tuple[int, int], ...], tuple[int, ...], tuple[int, ...], str] | None = None
        self._metadata: bytes | None = None
        self._notifier: threading.Thread | None = None
        self._stop = threading.Event()
        # decode side
        self._remotes: dict[str, bytes] = {}        # agent name -> the metadata it was added with
        self._arena: _Arena | None = None
        self._local_dev = 0
        self._draining: list[tuple[Any, _Room | None, str]] = []
        self._in_flight: dict[str, int] = {}        # agent name -> its reads in flight
        self._own_buffer_busy = False               # one read larger than the area at a time (memory bound)
        self._registered: list[Any] = []
        self.reads_posted = 0
        self.notifications = 0

    # ------------------------------------------------------------------ binding
    @property
    def closed(self) -> bool:
        return self._agent is None

    def bind(self, sched: Any, worker: Any) -> None:
        """Called by `set_kv_transport`: this transport's engine (its P/D scheduler side and runner side)."""
        if self._worker is not None and self._worker is not worker:
            raise ValueError("a NixlTransport serves one engine: make one per engine")
        self._sched, self._worker = sched, worker
        if self.register_at_bind and getattr(worker, "copier", None) is not None:
            self._register_source()     # at start-up, not inside the first prefill's step

    def _register_source(self) -> None:
        """Prefill side, once: the engine's KV tensors registered with the agent."""
        if self._source is not None:
            return
        copier = getattr(self._worker, "copier", None)
        if copier is None:
            raise RuntimeError("the NIXL transport is not bound to an engine with KV caches (set_kv_transport)")
        caches = copier.kv_caches
        shape = tuple(caches[0].shape)
        for t in caches:
            if tuple(t.shape) != shape or not t.is_contiguous() or t.dtype != caches[0].dtype:
                raise ValueError("the NIXL transport needs the KV tensors contiguous and of one shape and dtype")
        mem_type = "VRAM" if caches[0].device.type == "cuda" else "DRAM"
        with self._lock:
            descs = self._agent.register_memory(list(caches))
            if descs is None:
                raise RuntimeError(f"NIXL could not register the KV cache ({mem_type})")
            try:
                self._metadata = self._agent.get_agent_metadata()
            except Exception:
                self._agent.deregister_memory(descs)
                raise
            self._registered.append(descs)
        tensors = tuple((t.data_ptr(), max(t.get_device(), 0)) for t in caches)
        self._source = (mem_type, tensors, shape, tuple(copier.permutation),
                        str(caches[0].dtype).removeprefix("torch."))

    def _start_notifier(self) -> None:
        """Prefill side, at its first hold: the thread that takes readers' notifications. Not before: on a decode
        engine it would only contend for the agent's lock with its reads (measured: 8-block reads 1 ms -> 6 ms)."""
        if self._notifier is None:
            self._notifier = threading.Thread(target=self._notify_loop, name=f"nixl-notify-{self.name}",
                                              daemon=True)
            self._notifier.start()

    def hold_address(self, transfer_id: str, block_ids: list[int], timeout_s: float) -> NixlAddress:
        """Prefill side (the P/D scheduler, when a request's blocks are held): the held blocks' address."""
        self._register_source()
        self._start_notifier()
        assert self._source is not None and self._metadata is not None
        mem_type, tensors, shape, perm, dtype = self._source
        held = getattr(self._worker, "held", None)
        left = held.seconds_left(transfer_id) if held is not None else None
        return NixlAddress(self.name, self._metadata, mem_type, tensors, shape, perm, dtype, tuple(block_ids),
                           time.time() + (timeout_s if left is None else left))

    def _notify_loop(self) -> None:
        while not self._stop.wait(self.notify_poll_s):
            try:
                with self._lock:
                    notifs = self._agent.get_new_notifs()
            except Exception:
                logger.exception("NIXL notifications")
                continue
            freed = False
            for msgs in notifs.values():
                for msg in msgs:
                    freed |= self._on_notification(bytes(msg))
            if freed and self.on_hold_freed is not None:
                try:
                    self.on_hold_freed()
                except Exception:
                    logger.exception("on_hold_freed")

    def _on_notification(self, msg: bytes) -> bool:
        kind, _, tid = msg.decode("utf-8", "replace").partition(":")
        held = getattr(self._worker, "held", None)
        if held is None or not tid:
            return False
        self.notifications += 1
        if kind == "read":
            held.mark_read(tid)
        elif kind == "release":
            held.release(tid)
        else:
            logger.warning("unknown NIXL notification %r", msg[:64])
            return False
        return True

    # ------------------------------------------------------------------ decode side (KVTransport)
    def start_read(self, remote: RemotePrefill, start_block: int, num_blocks: int) -> _NixlRead:
        record = self._keep(remote.transfer_id, ReadRecord(num_blocks, time.time_ns(), time.monotonic()))
        addr = remote.address
        if not isinstance(addr, NixlAddress):
            record.end("incompatible")
            raise KVTransferError("the prefill side did not publish a NIXL address (it runs another transport)",
                                  "error")
        if start_block < 0 or num_blocks < 0 or start_block + num_blocks > len(addr.block_ids):
            record.end("missing")
            raise KVTransferError(f"{remote.transfer_id!r} holds {len(addr.block_ids)} blocks, not "
                                  f"[{start_block}, {start_block + num_blocks})", "missing")
        if time.time() >= addr.expires_at - self.expiry_margin_s:
            record.end("expired")
            raise KVTransferError(f"the hold of {remote.transfer_id!r} expires too soon to read it", "timed_out")
        self._reap()
        return _NixlRead(self, addr, self._remote_agent(addr), remote.transfer_id, start_block, num_blocks, record)

    def release(self, remote: RemotePrefill, reason: str = "local") -> None:
        self._keep(remote.transfer_id, ReadRecord(0, time.time_ns(), time.monotonic())).end(reason)
        addr = remote.address
        if not isinstance(addr, NixlAddress):
            return
        try:
            self._send_release(self._remote_agent(addr), remote.transfer_id)
        except KVTransferError as e:   # best effort: the hold expires at its timeout
            logger.debug("releasing %s at %s: %s", remote.transfer_id, addr.agent, e)

    def _send_release(self, agent: str, transfer_id: str) -> None:
        try:
            with self._lock:
                self._agent.send_notif(agent, b"release:" + transfer_id.encode())
        except Exception as e:         # best effort: the hold expires at its timeout
            logger.debug("releasing %s at %s: %s", transfer_id, agent, e)

    def _remote_agent(self, addr: NixlAddress) -> str:
        with self._lock:
            if self._remotes.get(addr.agent) != addr.metadata:
                if addr.agent in self._remotes:
                    self._forget_agent(addr.agent)
                try:
                    name = self._agent.add_remote_agent(addr.metadata)
                except Exception as e:
                    raise KVTransferError(f"NIXL agent {addr.agent!r} is unreachable: {e}", "missing") from e
                name = name.decode() if isinstance(name, bytes) else name
                if name != addr.agent:
                    raise KVTransferError(f"NIXL metadata names agent {name!r}, not {addr.agent!r}", "error")
                self._remotes[addr.agent] = addr.metadata
            return addr.agent

    def _reading(self, agent: str, delta: int) -> None:
        with self._lock:
            n = self._in_flight.get(agent, 0) + delta
            if n > 0:
                self._in_flight[agent] = n
            else:
                self._in_flight.pop(agent, None)

    def _forget_agent(self, agent: str) -> None:
        """Drop a remote agent (a new address re-adds it); not while reads from it are in flight."""
        with self._lock:
            if self._in_flight.get(agent):
                return
            if self._remotes.pop(agent, None) is not None:
                try:
                    self._agent.remove_remote_agent(agent)
                except Exception:
                    logger.debug("removing NIXL agent %s", agent, exc_info=True)

    # ------------------------------------------------------------------ staging
    def _staging_device(self) -> torch.device:
        return getattr(self._worker, "device", None) or torch.device("cpu")

    def _take_room(self, nbytes: int) -> _Room | None:
        with self._lock:
            self._reap()
            dev = self._staging_device()
            if self._arena is None:
                buf = torch.empty(self.staging_bytes, dtype=torch.uint8, device=dev)
                self._registered.append(self._agent.register_memory(buf))
                self._arena = _Arena(buf)
                self._local_dev = max(buf.get_device(), 0)
            if nbytes > self._arena.size:       # larger than the whole area: a buffer of its own, for this read
                if self._own_buffer_busy:       # one at a time: device memory beside the area stays bounded
                    return None
                buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
                descs = self._agent.register_memory(buf)
                if descs is None:
                    raise RuntimeError(f"NIXL could not register a {nbytes}-byte staging buffer")
                self._own_buffer_busy = True
                return _Room(buf, 0, nbytes, own=descs)
            start = self._arena.alloc(nbytes)
            return None if start is None else _Room(self._arena.buf, start, nbytes, own=False)

    def _free_room(self, room: _Room | None) -> None:
        if room is None:
            return
        with self._lock:
            if room.own is not False:
                if room.buf.is_cuda:
                    torch.cuda.current_stream(room.buf.device).synchronize()
                self._own_buffer_busy = False
                if self._agent is not None:
                    self._agent.deregister_memory(room.own)
                return
            ev = None
            if room.buf.is_cuda:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(room.buf.device))
            assert self._arena is not None
            self._arena.free(room.start, room.nbytes, ev)

    def _post_read(self, local: np.ndarray, remote: np.ndarray, mem_type: str, agent: str, notif: bytes) -> Any:
        local_type = "VRAM" if self._staging_device().type == "cuda" else "DRAM"
        with self._lock:
            ld = self._agent.get_xfer_descs(local, local_type)
            rd = self._agent.get_xfer_descs(remote, mem_type)
            h = self._agent.initialize_xfer("READ", ld, rd, agent, notif)
            try:
                state = self._agent.transfer(h)
                if state == "ERR":
                    raise RuntimeError("transfer refused")
            except Exception:
                self._agent.release_xfer_handle(h)
                raise
            self.reads_posted += 1
            return h

    def _state(self, xfer: Any) -> str:
        with self._lock:
            return self._agent.check_xfer_state(xfer)

    def _release_xfer(self, xfer: Any) -> None:
        with self._lock:
            try:
                self._agent.release_xfer_handle(xfer)
            except Exception:
                logger.debug("releasing a NIXL transfer handle", exc_info=True)

    def _drain(self, xfer: Any, room: _Room | None, agent: str) -> None:
        with self._lock:
            self._draining.append((xfer, room, agent))

    def _reap(self) -> None:
        """Give back the staging room of cancelled reads NIXL has ended."""
        with self._lock:
            keep = []
            for xfer, room, agent in self._draining:
                try:
                    state = self._agent.check_xfer_state(xfer)
                except Exception:
                    state = "ERR"
                if state in ("PROC", "PEND", "INIT"):
                    keep.append((xfer, room, agent))
                    continue
                self._release_xfer(xfer)
                self._reading(agent, -1)
                self._free_room(room)
            self._draining = keep

    def staging_bytes_free(self) -> int:
        with self._lock:
            self._reap()
            return self.staging_bytes if self._arena is None else self._arena.bytes_free()

    def num_draining(self) -> int:
        with self._lock:
            self._reap()
            return len(self._draining)

    # ------------------------------------------------------------------ end
    def close(self) -> None:
        """Stop the notification thread and drop the agent (its registrations go with it)."""
        self._stop.set()
        if self._notifier is not None:
            self._notifier.join(timeout=2)
        with self._lock:
            if self._agent is None:
                return
            for descs in self._registered:
                try:
                    self._agent.deregister_memory(descs)
                except Exception:
                    logger.debug("deregistering", exc_info=True)
            self._registered.clear()
            self._agent = None         # its destructor ends its backend's connections
