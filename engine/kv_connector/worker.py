"""Runner side of the KV connectors: whole-block copies between the paged KV tensors and a tier.

`BlockCopier` sees every layer's paged tensor through a permuted view `[num_blocks, 2, heads, block_size,
head_dim]` (whatever the attention backend's layout) and moves a step's blocks with one gather or scatter
per layer. On CPU the copies run inline, before the forward pass. On CUDA they run on a side stream into or
out of pinned host memory; the forward pass waits for the stores (they read blocks it may overwrite) and a
load is reported once its event completed.
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod

import torch

from affinity_serve.engine.kv_connector.base import KVConnectorMetadata, KVConnectorOutput, KVLayout, KVTransfer
from affinity_serve.engine.kv_connector.shared_store import (BlockRead, GroupedSharedStore, SharedKVStore,
                                                             StoreWriteError)

logger = logging.getLogger(__name__)


def block_view_permutation(kv_cache_shape) -> tuple[int, ...]:
    """The permutation of a backend's KV tensor axes into (block, k/v, head, slot, head_dim).

    `kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)` is probed with distinct sizes, so
    any backend layout is understood without the backend naming its axes.
    """
    nb, bs, h, d = 1009, 1013, 1019, 1021
    shape = list(kv_cache_shape(nb, bs, h, d))
    return (shape.index(nb), shape.index(2), shape.index(h), shape.index(bs), shape.index(d))


class BlockCopier:
    """Gathers and scatters whole blocks; a block's canonical form is [num_layers, 2, heads, block_size, head_dim].

    One index_select / index_copy_ along each layer tensor's own block axis (the fast, contiguous path),
    permuted to or from the canonical order on the small per-step tensor.
    """

    def __init__(self, kv_caches: list[torch.Tensor], permutation: tuple[int, ...]):
        self.kv_caches = kv_caches
        self.block_dim = permutation[0]
        self.permutation = permutation                                # backend order -> canonical
        self.inverse = tuple(permutation.index(i) for i in range(len(permutation)))
        self.device = kv_caches[0].device

    def _ids(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.long, device=self.device)

    def gather(self, block_ids: list[int], out: torch.Tensor) -> None:
        """out: [n, num_layers, 2, H, bs, D] (host or device) <- the pool blocks `block_ids`."""
        ids = self._ids(block_ids)
        for layer, kv in enumerate(self.kv_caches):
            out[:, layer] = kv.index_select(self.block_dim, ids).permute(self.permutation)

    def scatter(self, block_ids: list[int], src: torch.Tensor) -> None:
        """The pool blocks `block_ids` <- src: [n, num_layers, 2, H, bs, D] on the pool's device."""
        ids = self._ids(block_ids)
        for layer, kv in enumerate(self.kv_caches):
            kv.index_copy_(self.block_dim, ids, src[:, layer].permute(self.inverse))

    def scatter_layers(self, block_ids: list[int], layers: list[torch.Tensor]) -> None:
        """The pool blocks `block_ids` <- one [n, 2, H, bs, D] tensor (any strides) per KV tensor."""
        ids = self._ids(block_ids)
        for kv, src in zip(self.kv_caches, layers, strict=True):
            kv.index_copy_(self.block_dim, ids, src.to(kv.device).permute(self.inverse))


def _block_shape(layout: KVLayout) -> tuple[int, ...]:
    return (layout.num_layers, 2, layout.num_kv_heads, layout.block_size, layout.head_dim)


class _Worker(ABC):
    """What both connectors' runner sides share: the copier, and deferred reports on CUDA."""

    def __init__(self, layout: KVLayout, device: torch.device, dtype: torch.dtype):
        self.layout = layout
        self.device = device
        self.dtype = dtype
        self.copier: BlockCopier | None = None
        self.is_cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self.is_cuda else None
        self._in_flight: list[tuple[object, KVConnectorOutput]] = []     # (cuda event, report when done)
        self._staging = torch.empty(0, dtype=torch.uint8)

    def _host_blocks(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A host buffer for n blocks: (raw bytes [n, block_bytes], typed [n, L, 2, H, bs, D]).

        On CPU one buffer is reused (grown as needed): a fresh multi-MiB tensor each step would page-fault
        its way in. On CUDA each transfer gets its own pinned buffer, as copies may still be in flight.
        """
        nbytes = n * self.layout.block_bytes
        if self.is_cuda:
            raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        else:
            if self._staging.numel() < nbytes:
                self._staging = torch.empty(max(nbytes, 2 * self._staging.numel()), dtype=torch.uint8)
            raw = self._staging[:nbytes]
        raw = raw.view(n, self.layout.block_bytes)
        return raw, raw.view(self.dtype).view(n, *_block_shape(self.layout))

    def register_kv_caches(self, kv_caches: list[torch.Tensor], permutation: tuple[int, ...]) -> None:
        """kv_caches: the distinct KV tensors, `layout.num_layers` of them (a hybrid model's groups share them)."""
        if len(kv_caches) != self.layout.num_layers:
            raise ValueError(f"the KV layout has {self.layout.num_layers} KV tensors, the runner {len(kv_caches)}")
        self.copier = BlockCopier(kv_caches, permutation)

    def execute(self, metadata: KVConnectorMetadata) -> KVConnectorOutput:
        out = KVConnectorOutput()
        if self.is_cuda:
            self._poll(out)
        if metadata.is_empty:
            return out
        assert self.copier is not None, "register_kv_caches first"
        if not self.is_cuda:
            self._run(metadata, out)
            return out
        return self._run_cuda(metadata, out)

    def _run(self, metadata: KVConnectorMetadata, out: KVConnectorOutput) -> None:
        for t in metadata.stores:
            ok = self._guarded(self._store, t, out)
            out.finished_stores.append((t.block_hashes, ok))
        for t in metadata.loads:
            out.finished_loads[t.req_id] = self._guarded(self._load, t, out)

    def _guarded(self, fn, t: KVTransfer, out: KVConnectorOutput) -> bool:
        try:
            return fn(t, out)
        except Exception:     # a tier failure costs a recompute, never the step
            logger.exception("KV connector transfer of %d blocks failed", len(t.block_ids))
            return False

    # --------------------------------------------------------- CUDA: side stream, pinned memory
    def _run_cuda(self, metadata: KVConnectorMetadata, out: KVConnectorOutput) -> KVConnectorOutput:
        stream = self._stream
        assert stream is not None
        stream.wait_stream(torch.cuda.current_stream(self.device))     # the KV the last forward wrote
        report = KVConnectorOutput()
        with torch.cuda.stream(stream):
            self._run(metadata, report)
            event = torch.cuda.Event()
            event.record(stream)
        if metadata.stores:       # the forward pass may overwrite evicted blocks: it waits for their save
            torch.cuda.current_stream(self.device).wait_event(event)
        self._in_flight.append((event, report))
        return out

    def _poll(self, out: KVConnectorOutput) -> None:
        keep = []
        for event, report in self._in_flight:
            if event.query():
                out.finished_loads.update(report.finished_loads)
                out.finished_stores.extend(report.finished_stores)
                out.tier_evicted.extend(report.tier_evicted)
                if report.tier_written is not None:
                    out.tier_written = (out.tier_written or []) + report.tier_written
                out.load_failure_causes.update(report.load_failure_causes)
            else:
                keep.append((event, report))
        self._in_flight = keep

    @abstractmethod
    def _store(self, t: KVTransfer, out: KVConnectorOutput) -> bool:
        raise NotImplementedError

    @abstractmethod
    def _load(self, t: KVTransfer, out: KVConnectorOutput) -> bool:
        raise NotImplementedError


class OffloadWorker(_Worker):
    """The offload tier's bytes: [capacity_blocks, num_layers, 2, H, bs, D] in host memory (pinned on CUDA)."""

    def __init__(self, layout: KVLayout, capacity_blocks: int, device: torch.device, dtype: torch.dtype):
        super().__init__(layout, device, dtype)
        # torch.empty commits no pages until written: an unused tier costs address space, not memory
        self.tier = torch.empty((capacity_blocks, *_block_shape(layout)), dtype=dtype, pin_memory=self.is_cuda)

    def _store(self, t: KVTransfer, out: KVConnectorOutput) -> bool:
        assert self.copier is not None
        if not self.is_cuda:
            _, staged = self._host_blocks(len(t.block_ids))
            self.copier.gather(t.block_ids, staged)
            for i, slot in enumerate(t.tier_slots):     # one memcpy per block: index_copy_ is far slower here
                self.tier[slot].copy_(staged[i])
            return True
        staged = torch.empty((len(t.block_ids), *_block_shape(self.layout)), dtype=self.dtype, device=self.device)
        self.copier.gather(t.block_ids, staged)
        for i, slot in enumerate(t.tier_slots):        # device -> pinned host, asynchronous per block
            self.tier[slot].copy_(staged[i], non_blocking=True)
        return True

    def _load(self, t: KVTransfer, out: KVConnectorOutput) -> bool:
        assert self.copier is not None
        if not self.is_cuda:
            _, staged = self._host_blocks(len(t.block_ids))
            torch.index_select(self.tier, 0, torch.tensor(t.tier_slots, dtype=torch.long), out=staged)
            self.copier.scatter(t.block_ids, staged)
            return True
        staged = torch.empty((len(t.block_ids), *_block_shape(self.layout)), dtype=self.dtype, device=self.device)
        for i, slot in enumerate(t.tier_slots):        # pinned host -> device, asynchronous per block
            staged[i].copy_(self.tier[slot], non_blocking=True)
        self.copier.scatter(t.block_ids, staged)
        return True


class SharedStoreWorker(_Worker):
    """Copies between the pool and the node's SharedKVStore through a host staging buffer."""

    def __init__(self, layout: KVLayout, store: SharedKVStore | GroupedSharedStore, device: torch.device,
                 dtype: torch.dtype):
        super().__init__(layout, device, dtype)
        self.store = store
        self._write_error: int | None = None        # the errno of the last failed store, logged once

    def _store(self, t: KVTransfer, out: KVConnectorOutput) -> bool:
        assert self.copier is not None
        raw, typed = self._host_blocks(len(t.block_ids))
        if self.is_cuda:
            staged = torch.empty_like(typed, device=self.device)
            self.copier.gather(t.block_ids, staged)
            typed.copy_(staged)        # synchronous: the files are written right after
        else:
            self.copier.gather(t.block_ids, typed)
        mem = raw.numpy()
        try:
            written, evicted = self.store.write_many([(h, memoryview(mem[i])) for i, h in enumerate(t.block_hashes)])
        except StoreWriteError as e:      # a full filesystem: what was written counts, the rest failed
            out.tier_evicted.extend(e.evicted)
            out.tier_written = (out.tier_written or []) + e.written
            if self._write_error is None:
                self._write_error = e.errno
                logger.warning("shared KV store: writing %d blocks failed (%s); %d written, %d evicted to make "
                               "room. Failed stores are counted in stores_failed; this is logged again only "
                               "after a store succeeds", len(t.block_hashes), e.strerror, len(e.written),
                               len(e.evicted))
            return False
        self._write_error = None
        out.tier_evicted.extend(evicted)
        out.tier_written = (out.tier_written or []) + written      # blocks already there are not written
        return True

    def _load(self, t: KVTransfer, out: KVConnectorOutput) -> bool:
        assert self.copier is not None
        raw, typed = self._host_blocks(len(t.block_ids))
        mem = raw.numpy()
        for i, h in enumerate(t.block_hashes):
            result = self.store.read(h, memoryview(mem[i]))
            if result is not BlockRead.OK:      # evicted since the lookup, or damaged: the request recomputes
                assert t.req_id is not None
                out.load_failure_causes[t.req_id] = result.value
                if result is BlockRead.DAMAGED:
                    # whatever damaged one file (a bad copy, a full disk) may have damaged its neighbours:
                    # verify the rest of the prefix now, so every bad file goes and the recompute rewrites
                    # them all at once, not one per request
                    for j in range(i + 1, len(t.block_hashes)):
                        self.store.read(t.block_hashes[j], memoryview(mem[i]))
                return False
        self.copier.scatter(t.block_ids, typed.to(self.device, non_blocking=self.is_cuda))
        return True
