"""Runner side of P/D disaggregation: serves reads of held blocks (prefill side) and lands reads (decode side).

Prefill side: `read_held_blocks` runs on the transport's thread, beside the engine's steps: it gathers the held
blocks (which nothing writes: a held block belongs to a finished request, or is a full prefix block that is
never rewritten) into one host buffer in the KVLayout form. On CUDA it does so on its own stream.

Decode side: `execute` starts this step's reads through the transport and, on every step, polls the reads
in flight; a read that arrived is scattered into its pool blocks (before the step's forward pass) and
reported as a finished load. A read not done within `read_timeout_s` is cancelled and reported failed, so
its blocks are always returned.
"""
from __future__ import annotations

import logging
import time
import warnings

import numpy as np
import torch

from affinity_serve.engine.kv_connector.base import KVConnectorMetadata, KVConnectorOutput, KVLayout
from affinity_serve.engine.kv_connector.pd import HeldTransfers, KVReadHandle, KVTransferError, KVTransport, RemoteRead
from affinity_serve.engine.kv_connector.worker import BlockCopier, _block_shape

logger = logging.getLogger(__name__)


class PDWorker:
    def __init__(self, layout: KVLayout, held: HeldTransfers, transport: KVTransport, device: torch.device,
                 dtype: torch.dtype, *, read_timeout_s: float):
        self.layout = layout
        self.held = held
        self.transport = transport
        self.device = device
        self.dtype = dtype
        self.read_timeout_s = read_timeout_s
        self.copier: BlockCopier | None = None
        self._read_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._reads: dict[str, tuple[RemoteRead, KVReadHandle, float]] = {}

    def register_kv_caches(self, kv_caches: list[torch.Tensor], permutation: tuple[int, ...]) -> None:
        self.copier = BlockCopier(kv_caches, permutation)

    # ------------------------------------------------------------------ prefill side (KVSource)
    def read_held_blocks(self, transfer_id: str, start_block: int, num_blocks: int):
        """The held blocks as a uint8 numpy array [num_blocks, block_bytes]; any thread."""
        assert self.copier is not None, "register_kv_caches first"
        block_ids = self.held.begin_read(transfer_id, start_block, num_blocks)
        ok = False
        try:
            shape = (len(block_ids), *_block_shape(self.layout))
            if self._read_stream is None:
                out = torch.empty(shape, dtype=self.dtype)
                self.copier.gather(block_ids, out)
            else:
                with torch.cuda.stream(self._read_stream):
                    staged = torch.empty(shape, dtype=self.dtype, device=self.device)
                    self.copier.gather(block_ids, staged)
                    out = staged.to("cpu")        # synchronous on this stream
            ok = True
            return out.view(torch.uint8).reshape(len(block_ids), self.layout.block_bytes).numpy()
        finally:
            self.held.end_read(transfer_id, ok)

    def release_held(self, transfer_id: str) -> None:
        self.held.release(transfer_id)

    # ------------------------------------------------------------------ decode side
    def execute(self, metadata: KVConnectorMetadata) -> KVConnectorOutput:
        out = KVConnectorOutput()
        now = time.monotonic()
        for t in metadata.loads:
            assert isinstance(t, RemoteRead) and t.remote is not None and t.req_id is not None
            try:
                handle = self.transport.start_read(t.remote, t.start_block, len(t.block_ids))
            except Exception:
                logger.exception("could not start the KV read of %s from %s", t.req_id, t.remote.engine_id)
                out.finished_loads[t.req_id] = False
                continue
            self._reads[t.req_id] = (t, handle, now + self.read_timeout_s)
        if self._reads:
            self._poll(out, time.monotonic())
        return out

    def _poll(self, out: KVConnectorOutput, now: float) -> None:
        for req_id, (t, handle, deadline) in list(self._reads.items()):
            try:
                data = handle.poll()
            except KVTransferError as e:
                logger.warning("KV read of %s from %s failed (%s): it recomputes", req_id, t.remote.engine_id, e)
                self._fail(req_id, out, e.cause)
                continue
            except Exception:
                logger.exception("KV read of %s from %s failed: it recomputes", req_id, t.remote.engine_id)
                self._fail(req_id, out, "error")
                continue
            if data is None:
                if now >= deadline:
                    handle.cancel()
                    self._fail(req_id, out, "timed_out")
                continue
            del self._reads[req_id]
            try:
                self._land(t, data)
            except Exception:
                logger.exception("landing the KV read of %s failed: it recomputes", req_id)
                out.finished_loads[req_id] = False
                out.load_failure_causes[req_id] = "damaged"
                continue
            out.finished_loads[req_id] = True

    def _fail(self, req_id: str, out: KVConnectorOutput, cause: str) -> None:
        del self._reads[req_id]
        out.finished_loads[req_id] = False
        out.load_failure_causes[req_id] = cause

    def _land(self, t: RemoteRead, data) -> None:
        assert self.copier is not None
        if hasattr(data, "scatter_into"):     # blocks in a transport's own staging (NIXL), in its axis order
            if data.n != len(t.block_ids):
                data.discard()
                raise ValueError(f"read {data.n} blocks, expected {len(t.block_ids)}")
            data.scatter_into(self.copier, t.block_ids)     # gives the staging back, landed or not
            return
        arr = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1)
        with warnings.catch_warnings():       # read-only (Ray's zero-copy objects): only read here
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(arr)
        expected = len(t.block_ids) * self.layout.block_bytes
        if raw.numel() != expected:
            raise ValueError(f"read {raw.numel()} bytes, expected {expected}")
        blocks = raw.view(self.dtype).view(len(t.block_ids), *_block_shape(self.layout))
        self.copier.scatter(t.block_ids, blocks.to(self.device))

    def has_reads_in_flight(self) -> bool:
        return bool(self._reads)
