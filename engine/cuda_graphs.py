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
"""
from __future__ import annotations

import bisect
import logging

import torch

from engine.attention import AttentionBackend, AttentionMetadata

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
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(top, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(top, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(top, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_steps = 0                         # decode steps that took this path (graph or padded eager)
        self.num_graph_replays = 0                 # of them, replayed graphs
        if capture:
            self._capture()

    # ------------------------------------------------------------------ use
    def covers(self, meta: AttentionMetadata) -> bool:
        return (0 < meta.num_tokens == meta.num_decodes and meta.num_tokens <= self.sizes[-1]
                and meta.block_tables.shape[1] <= self.max_blocks)

    def padded_size(self, n: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The step's hidden states, [B, hidden] (a view of a static buffer: use it before the next step)."""
        b = meta.num_tokens
        p = self.padded_size(b)
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(meta.positions)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        self.seq_lens[:b].copy_(meta.seq_lens)
        self.block_tables[:b, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        if p > b:
            for buf in (self.input_ids, self.positions, self.slot_mapping):
                buf[b:p].zero_()
            self.seq_lens[b:p].fill_(1)
            self.block_tables[b:p, 0] = 0
        self.num_steps += 1
        if p in self.graphs:
            graph, out = self.graphs[p]
            graph.replay()
            self.num_graph_replays += 1
            return out[:b]
        lens = meta.seq_lens_list + [1] * (p - b)
        return self.model(self.input_ids[:p], self._meta(p, lens), self.kv_caches, self.backend)[:b]

    # ------------------------------------------------------------------ capture
    def _meta(self, p: int, seq_lens_list: list[int]) -> AttentionMetadata:
        """Metadata over the first p rows of the static buffers (its lists only matter to eager backends)."""
        return AttentionMetadata(
            num_tokens=p, num_decodes=p, slot_mapping=self.slot_mapping[:p], positions=self.positions[:p],
            query_start_loc=self.query_start_loc[:p + 1], seq_start_loc=self.query_start_loc[:p + 1],
            seq_lens=self.seq_lens[:p], block_tables=self.block_tables[:p], query_lens_list=[1] * p,
            seq_lens_list=seq_lens_list, max_query_len=1, max_seq_len=max(seq_lens_list),
            block_size=self.block_size)

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for p in reversed(self.sizes):                   # largest first: the pool fits the rest
                meta = self._meta(p, [1] * p)
                self.model(self.input_ids[:p], meta, self.kv_caches, self.backend)   # compile / warm up
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = self.model(self.input_ids[:p], meta, self.kv_caches, self.backend)
                self.graphs[p] = (graph, out)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        logger.info("captured CUDA-graph decode for batch sizes %s", self.sizes)
