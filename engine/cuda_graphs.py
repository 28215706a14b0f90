"""CUDA-graph decode: a decode-only step replays a graph captured for the next larger batch size.

A decode step's launch overhead (hundreds of small kernels for a 1B model) dominates at small batches on a
GPU, so, as vLLM does, the model forward of decode-only steps is captured once per batch size in `sizes`
and replayed: the step's inputs are copied into static buffers, rows past the real batch are padding (token
0 at position 0, one key, block 0: the null block that no request owns, so what they write there is never
read), and the first B rows of the static output are the step's hidden states. Anything else (a prefill
chunk in the step, a batch larger than the largest size, a block table wider than the buffers) runs eager.

Capturing needs CUDA and an attention backend that reads only tensors (`triton`: the torch backend's
decode sizes its gathers from Python-side lengths, which a graph would freeze). Without capture
(`capture=False`) the same padded path runs eagerly, which is how the CPU tests check the padding.

Cascade decode: where the backend reads the shared length on the device (`device_cascade_len`, the Triton
backend) and has it on (`cascade_min_tokens`), each size from 2 up also
gets a cascade graph. A step whose requests share at least that many leading tokens (the same pages) replays
it, with the shared length in a device buffer the kernels read at run time; every other step replays the
plain graph, so batches that share nothing pay nothing for it.
"""
from __future__ import annotations

import bisect
import logging

import torch

from affinity_serve.engine.attention import AttentionBackend, AttentionMetadata
from affinity_serve.engine.attention.base import common_prefix_blocks

logger = logging.getLogger(__name__)

#: the batch sizes captured by default (vLLM's kind of ladder), up to the scheduler's max_num_seqs
DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def graph_sizes(max_num_seqs: int, ladder: tuple[int, ...] = DEFAULT_SIZES) -> list[int]:
    """The ladder's sizes below max_num_seqs, then max_num_seqs itself (capped at the ladder's top)."""
    top = min(max_num_seqs, ladder[-1])
    return [s for s in ladder if s < top] + [top]


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], backend: AttentionBackend,
                 sizes: list[int], max_blocks_per_seq: int, block_size: int, device: torch.device, *,
                 capture: bool = True):
        if not sizes or sorted(sizes) != list(sizes) or sizes[0] < 1:
            raise ValueError(f"sizes must be ascending positive batch sizes, got {sizes}")
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.sizes, self.block_size, self.device = list(sizes), block_size, device
        top = self.sizes[-1]
        self.max_blocks = max_blocks_per_seq
        # A decode step's inputs reach the device in two copies, each of a contiguous pinned host buffer (a
        # strided copy would go through an unpinned temporary): int64 token ids, positions and slots, all of it
        # (a few KiB); int32 the shared-prefix length, lengths, then this step's block tables packed [p, width],
        # whose device copy is `cascade_len`, `seq_lens` and a staging area that one device-side copy spreads
        # into `block_tables`.
        pin = device.type == "cuda"
        self._d64 = torch.zeros(3, top, dtype=torch.long, device=device)
        self._h64 = torch.zeros(3, top, dtype=torch.long, pin_memory=pin)
        self._t0 = 4 + top                         # where the packed tables start (int32 0: the prefix length;
        #                                            1-3 unused, so that the lengths start 16-byte aligned)
        self._dstage = torch.zeros(self._t0 + top * max_blocks_per_seq, dtype=torch.int32, device=device)
        self._hstage = torch.zeros(self._t0 + top * max_blocks_per_seq, dtype=torch.int32, pin_memory=pin)
        self.input_ids, self.positions, self.slot_mapping = self._d64.unbind(0)
        self.cascade_len = self._dstage[:1]
        self.seq_lens = self._dstage[4:self._t0]
        self.block_tables = torch.zeros(top, max_blocks_per_seq, dtype=torch.int32, device=device)
        self._n64, self._nstage = self._h64.numpy(), self._hstage.numpy()
        self.seq_lens.fill_(1)
        #: recorded after each step's copies: the host mirrors are not rewritten while a copy may still read them
        self._copied = torch.cuda.Event() if pin else None
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=device)
        #: (padded size, cascade) -> the captured graph and its output
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_steps = 0                         # decode steps that took this path (graph or padded eager)
        self.num_graph_replays = 0                 # of them, replayed graphs
        self.num_cascade_steps = 0                 # of them, steps whose attention read a shared prefix once
        self._last = (0, 0, 0)                     # the last step's (batch, padded size, block-table width)
        self._cascade = False                      # whether the last `run` found a prefix worth a cascade
        #: per request of the last `run`, the blocks its device block-table row holds
        self.row_blocks: list[int] = []
        if capture:
            self._capture()

    # ------------------------------------------------------------------ use
    def padded_size(self, n: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def covers_step(self, num_scheduled: list[int], block_ids: list[list[int]]) -> bool:
        """A decode-only step (every request computes one token) this object can run."""
        return (0 < len(num_scheduled) <= self.sizes[-1] and all(n == 1 for n in num_scheduled)
                and max(map(len, block_ids)) <= self.max_blocks)

    def run(self, token_ids: list[int], num_computed: list[int], block_ids: list[list[int]]) -> torch.Tensor:
        """One decode step: request i computes token `token_ids[i]` at position `num_computed[i]` over its
        blocks `block_ids[i]`. Returns the step's hidden states, [B, hidden] (a view of a static buffer: use
        it before the next step)."""
        b = len(token_ids)
        p = self.padded_size(b)
        bs = self.block_size
        t0 = self._t0
        h, lens = self._n64, self._nstage[4:t0]
        if self._copied is not None:
            self._copied.synchronize()
        width = max(map(len, block_ids))
        tables = self._nstage[t0:t0 + p * width].reshape(p, width)
        h[0, :b] = token_ids
        h[1, :b] = num_computed
        for i, (blocks, pos) in enumerate(zip(block_ids, num_computed)):
            tables[i, :len(blocks)] = blocks                # columns past a row's blocks are never read
            h[2, i] = blocks[pos // bs] * bs + pos % bs
        lens[:b] = h[1, :b] + 1
        plen = self._shared_prefix(tables, block_ids, h[1, :b])
        self._nstage[0] = plen
        self._cascade = plen > 0
        if p > b:                 # padding rows: token 0 at position 0 of the null block, one key
            h[:, b:p] = 0
            lens[b:p] = 1
            tables[b:p, 0] = 0
        self._d64.copy_(self._h64, non_blocking=True)
        n = t0 + p * width
        self._dstage[:n].copy_(self._hstage[:n], non_blocking=True)
        self.block_tables[:p, :width].copy_(self._dstage[t0:n].view(p, width))
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.device))
        self._last = (b, p, width)
        self.row_blocks = [len(blocks) for blocks in block_ids]
        return self._forward(b, p, width, [c + 1 for c in num_computed])

    def refresh_tables(self, block_ids: list[list[int]]) -> None:
        """Copy the last step's requests' block tables to the device again (they gained blocks since `run`),
        leaving the other buffers as they are; queued behind whatever already reads the old tables."""
        b, p, _ = self._last
        t0 = self._t0
        if self._copied is not None:
            self._copied.synchronize()
        width = max(map(len, block_ids))
        tables = self._nstage[t0:t0 + p * width].reshape(p, width)
        for i, blocks in enumerate(block_ids):
            tables[i, :len(blocks)] = blocks
        if p > b:
            tables[b:p, 0] = 0
        n = t0 + p * width
        self._dstage[t0:n].copy_(self._hstage[t0:n], non_blocking=True)
        self.block_tables[:p, :width].copy_(self._dstage[t0:n].view(p, width))
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.device))
        self._last = (b, p, width)
        self.row_blocks = [len(blocks) for blocks in block_ids]

    def run_next(self, tokens: torch.Tensor, seq_lens_list: list[int]) -> torch.Tensor:
        """The decode step after the last `run` / `run_next`, for the same requests, prepared on the device:
        request i computes `tokens[i]` (its sampled id, still on the device: no host round trip) at the
        position after the last step's, in the block tables already on the device (a shared prefix found by
        `run` stays shared: tables only grow, lengths only rise). The caller checks that
        every next position lies inside the request's blocks and, where they grew, refreshes the tables first
        (`refresh_tables`). `seq_lens_list` (the new lengths, host-side) is read only by an eager run.
        Returns the hidden states as `run` does."""
        b, p, width = self._last
        bs = self.block_size
        pos = self.positions[:b]
        pos.add_(1)
        self.input_ids[:b].copy_(tokens)
        self.seq_lens[:b].copy_(pos + 1)
        blk = self.block_tables[:b].gather(1, torch.div(pos, bs, rounding_mode="floor").unsqueeze(1)).squeeze(1)
        self.slot_mapping[:b].copy_(blk.long() * bs + pos % bs)
        return self._forward(b, p, width, seq_lens_list)

    def _shared_prefix(self, tables, block_ids: list[list[int]], computed) -> int:
        """The tokens of whole blocks every request of the step has in the same pages, before its current
        token, when that is at least the backend's `cascade_min_tokens` and the batch has two or more; else 0.
        `tables`: the step's packed block tables (columns past a row's own blocks hold stale ids)."""
        least = getattr(self.backend, "cascade_min_tokens", None)
        b = len(block_ids)
        if least is None or b < 2 or not getattr(self.backend, "device_cascade_len", False):
            return 0
        bs = self.block_size
        if int(computed.min()) < least:            # cheap exit: not that many tokens before someone's current one
            return 0
        tokens = common_prefix_blocks(tables, computed + 1, bs) * bs
        return tokens if tokens >= least else 0

    def _forward(self, b: int, p: int, width: int, seq_lens_list: list[int]) -> torch.Tensor:
        self.num_steps += 1
        cascade = self._cascade
        self.num_cascade_steps += cascade
        if (p, cascade) in self.graphs:
            graph, out = self.graphs[(p, cascade)]
            graph.replay()
            self.num_graph_replays += 1
            return out[:b]
        meta = self._meta(p, seq_lens_list + [1] * (p - b), cascade)
        meta.block_tables = self.block_tables[:p, :width]
        return self.model(self.input_ids[:p], meta, self.kv_caches, self.backend)[:b]

    # ------------------------------------------------------------------ capture
    def _meta(self, p: int, seq_lens_list: list[int], cascade: bool = False) -> AttentionMetadata:
        """Metadata over the first p rows of the static buffers (its lists only matter to eager backends);
        with `cascade`, the shared-prefix length is the device buffer `cascade_len`."""
        return AttentionMetadata(
            num_tokens=p, num_decodes=p, slot_mapping=self.slot_mapping[:p], positions=self.positions[:p],
            query_start_loc=self.query_start_loc[:p + 1], seq_start_loc=self.query_start_loc[:p + 1],
            seq_lens=self.seq_lens[:p], block_tables=self.block_tables[:p], query_lens_list=[1] * p,
            seq_lens_list=seq_lens_list, max_query_len=1, max_seq_len=max(seq_lens_list),
            block_size=self.block_size, cascade_prefix_len=self.cascade_len if cascade else None)

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        cascades = (getattr(self.backend, "device_cascade_len", False)
                    and getattr(self.backend, "cascade_min_tokens", None) is not None)
        with torch.cuda.stream(stream):
            for p in reversed(self.sizes):                   # largest first: the pool fits the rest
                for cascade in (False, True) if cascades and p > 1 else (False,):
                    meta = self._meta(p, [1] * p, cascade)   # (the prefix buffer holds 0: no key is read twice)
                    self.model(self.input_ids[:p], meta, self.kv_caches, self.backend)   # compile / warm up
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        out = self.model(self.input_ids[:p], meta, self.kv_caches, self.backend)
                    self.graphs[(p, cascade)] = (graph, out)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        logger.info("captured CUDA-graph decode for batch sizes %s%s", self.sizes,
                    " (and cascade graphs from 2)" if cascades else "")
