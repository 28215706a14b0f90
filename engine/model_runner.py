"""ModelRunner: SchedulerOutput -> flat tensors -> model forward over the paged KV cache -> sampled tokens.

Holds the per-request state the runner needs between steps (token ids, block table, sampling
parameters, prompt logprobs gathered so far) and the KV cache tensors. Never imports the scheduler;
reads only the SchedulerOutput.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from affinity_serve.engine.attention import AttentionBackend, build_attention_metadata
from affinity_serve.engine.cuda_graphs import DecodeGraphs
from affinity_serve.engine.kv_connector.base import KVConnectorWorker
from affinity_serve.engine.kv_groups import kv_cache_groups, kv_tensor_of_layer, num_kv_tensors
from affinity_serve.engine.models.config import ModelArgs
from affinity_serve.engine.sampler import DeviceLogprobs, Sampler, SamplingInfo, device_logprobs, gather_logprobs
from affinity_serve.engine.sampling_params import SamplingParams
from affinity_serve.engine.types import Logprobs, ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

#: prompt-logprob rows turned into logits at a time: bounds the [rows, vocab] float32 buffer
_PROMPT_LOGPROBS_ROWS = 512


@dataclass(slots=True)
class RunnerRequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    #: while a request that asked for prompt logprobs computes its prompt: entry p for prompt position
    #: p (entry 0 None), filled chunk by chunk. None otherwise, and once handed out.
    prompt_logprobs: list[Logprobs | None] | None = None


@dataclass(slots=True)
class _Ahead:
    """A decode step launched by the step before it, on that step's sampled ids (overlap_decode)."""

    order: tuple[str, ...]           # its requests, in the runner's row order
    positions: list[int]             # the position each computes (the scheduler's num_computed_tokens)
    ids: list[int]                   # the ids it computes (the previous step's samples, once on the host)
    tokens: torch.Tensor             # its own samples, on the device
    logprobs: DeviceLogprobs | None  # theirs, for the rows that ask, on the device too

    def is_step(self, so: SchedulerOutput, order: list[str], computed: list[int], ids: list[int]) -> bool:
        """Is this scheduled step the one launched ahead? (Same requests, positions and input ids, and nobody
        preempted or (re)admitted in between, so the block tables it used are this step's too.)"""
        return (not so.scheduled_new_reqs and not so.preempted_req_ids and self.order == tuple(order)
                and self.positions == computed and self.ids == ids)


def kv_bytes_per_block(args: ModelArgs, block_size: int, dtype: torch.dtype) -> int:
    """One block id's bytes: a page in each KV tensor (every layer's, or one per layer of a KV-cache group
    when sliding-window groups share the tensors)."""
    elem = torch.empty((), dtype=dtype).element_size()
    num_tensors = num_kv_tensors(kv_cache_groups(args.layer_windows))
    return 2 * num_tensors * block_size * args.num_kv_heads * args.head_dim * elem


class ModelRunner:
    def __init__(self, model: torch.nn.Module, args: ModelArgs, backend: AttentionBackend,
                 num_blocks: int, block_size: int, *, device: torch.device, dtype: torch.dtype, seed: int = 0,
                 kv_connector: KVConnectorWorker | None = None):
        self.model = model
        self.args = args
        self.backend = backend
        self.block_size = block_size
        self.device = device
        shape = backend.kv_cache_shape(num_blocks, block_size, args.num_kv_heads, args.head_dim)
        #: KV-cache groups (engine/kv_groups.py): one of every layer, or full and sliding-window ones whose
        #: j-th layers share tensor j; a sliding group's tables come whole each step (kv_group_block_ids)
        self.kv_groups = kv_cache_groups(args.layer_windows)
        self.windowed = any(g.window is not None for g in self.kv_groups)
        tensors = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_kv_tensors(self.kv_groups))]
        self._layer_group = [g for g, _ in kv_tensor_of_layer(self.kv_groups, args.num_layers)]
        self.kv_caches = [tensors[j] for _, j in kv_tensor_of_layer(self.kv_groups, args.num_layers)]
        self.requests: dict[str, RunnerRequestState] = {}
        self.sampler = Sampler(seed, device)
        self.kv_connector = kv_connector
        #: set by the engine on CUDA (engine/cuda_graphs.py): decode-only steps replay a captured graph
        self.decode_graphs: DecodeGraphs | None = None
        #: with decode_graphs: a decode step launches the next one on its sampled ids, still on the
        #: device, before it hands its own ids out; the next call uses it if it is that step (`_Ahead`)
        self.overlap_decode = False
        self._ahead: _Ahead | None = None
        self.num_overlapped_steps = 0              # decode steps finished through _finish_overlapped
        self.num_ahead_used = 0                    # of them, steps launched by the step before
        self.num_launched_ahead = 0                # steps launched ahead, used or thrown away
        self.max_model_len = 1 << 62               # set by the engine with overlap_decode
        self._tokens_host: torch.Tensor | None = None          # CUDA: pinned, for the sampled ids
        self._tokens_copied = torch.cuda.Event() if device.type == "cuda" else None
        if kv_connector is not None:
            from affinity_serve.engine.kv_connector.worker import block_view_permutation
            # the distinct tensors: a connector copies a block id's page in each (one per layer, or per
            # layer of a KV-cache group when sliding-window groups share them)
            kv_connector.register_kv_caches(tensors, block_view_permutation(backend.kv_cache_shape))

    # ------------------------------------------------------------------ state
    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for req_id in so.preempted_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            st = self.requests[new.req_id] = RunnerRequestState(
                new.req_id, list(new.token_ids), new.num_prompt_tokens, new.sampling_params,
                list(new.block_ids), new.num_computed_tokens)
            # Admitted, or resumed before its first token: (re)compute the whole prompt's logprobs.
            # Resumed later, they were handed out already.
            if new.sampling_params.prompt_logprobs is not None and len(new.token_ids) == new.num_prompt_tokens:
                assert new.num_computed_tokens == 0, "prompt logprobs need every position computed (no cache hit)"
                st.prompt_logprobs = []
        c = so.scheduled_cached_reqs
        for req_id, new_blocks, computed in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens):
            st = self.requests[req_id]
            if new_blocks:
                st.block_ids.extend(new_blocks)
            st.num_computed_tokens = computed

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if so.kv_connector_metadata is None or self.kv_connector is None:
            return self._execute(so)
        # stores, then loads, then the forward pass (see KVConnectorMetadata)
        kv_output = self.kv_connector.execute(so.kv_connector_metadata)
        out = self._execute(so)
        out.kv_connector_output = kv_output
        return out

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.is_empty:
            self._ahead = None
            return ModelRunnerOutput([], [])
        sched = so.num_scheduled_tokens
        order = sorted(sched, key=lambda r: sched[r] != 1)            # decodes first (stable)
        states = [self.requests[r] for r in order]
        num_sched = [sched[r] for r in order]
        computed = [s.num_computed_tokens for s in states]
        blocks = [s.block_ids for s in states]
        graphs = self.decode_graphs
        graphed = graphs is not None and graphs.covers_step(num_sched, blocks)
        ids: list[int] = []
        sample_rows: list[int] = []
        sampling: list[RunnerRequestState] = []
        prompt_chunks: list[tuple[RunnerRequestState, int, int, int]] = []    # (state, first row, start, n)
        offset = 0
        for st, start, n in zip(states, computed, num_sched):
            ids.extend(st.token_ids[start:start + n])
            if st.prompt_logprobs is not None:
                prompt_chunks.append((st, offset, start, n))
            offset += n
            if start + n >= len(st.token_ids):          # reached the end of its known tokens: sample
                sample_rows.append(offset - 1)
                sampling.append(st)
        # A step launched ahead samples before the previous ids reach the host, so before any grammar could see
        # them: batches with constrained rows (structured output) launch none and use none.
        constrained = so.grammar_bitmask is not None
        if graphed:                         # decode-only: static buffers, a captured graph where there is one
            ahead, self._ahead = self._ahead, None
            if ahead is not None and not constrained and ahead.is_step(so, order, computed, ids):
                self.num_ahead_used += 1
                return self._finish_overlapped(order, states, computed, None, ahead.tokens, ahead.logprobs, so)
            hidden = graphs.run(ids, computed, blocks)
            if self.overlap_decode and not constrained and not prompt_chunks and len(sampling) == len(states):
                infos = [SamplingInfo(st.params, st.token_ids, st.num_prompt_tokens) for st in states]
                logits = self.model.compute_logits(hidden)
                tokens = self.sampler.sample(logits, infos)
                return self._finish_overlapped(order, states, computed, infos, tokens,
                                               device_logprobs(logits, tokens, infos), so)
        else:
            self._ahead = None
            meta = (self._group_metadata(so, order, computed, num_sched) if self.windowed else
                    build_attention_metadata(computed, num_sched, blocks, self.block_size, self.device))
            input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
            hidden = self.model(input_ids, meta, self.kv_caches, self.backend)
        for st, start, n in zip(states, computed, num_sched):
            st.num_computed_tokens = start + n
        prompt_logprobs = self._gather_prompt_logprobs(hidden, prompt_chunks) if prompt_chunks else None
        if not sampling:
            return ModelRunnerOutput(order, [[] for _ in order], None, prompt_logprobs)
        # every row samples (a decode step): the rows as they are, no gather
        logits = self.model.compute_logits(hidden if len(sample_rows) == hidden.shape[0] else hidden[sample_rows])
        infos = [SamplingInfo(st.params, st.token_ids, st.num_prompt_tokens) for st in sampling]
        allowed = (so.grammar_bitmask.sampler_mask([st.req_id for st in sampling], logits.shape[-1], self.device)
                   if constrained else None)
        tokens, lps = self.sampler(logits, infos, allowed)
        by_req: dict[str, list[int]] = {}
        logprobs: dict[str, list[Logprobs]] | None = None
        for st, tok, lp in zip(sampling, tokens, lps):
            st.token_ids.append(tok)
            by_req[st.req_id] = [tok]
            if lp is not None:
                if logprobs is None:
                    logprobs = {}
                logprobs[st.req_id] = [lp]
        return ModelRunnerOutput(order, [by_req.get(r, []) for r in order], logprobs, prompt_logprobs)

    def _group_metadata(self, so: SchedulerOutput, order: list[str], computed: list[int],
                        num_sched: list[int]):
        """One metadata per KV-cache group (its whole tables from the scheduler, its window); layer i reads its
        group's (`layer_metas`). Returned: group 0's."""
        tables = so.kv_group_block_ids
        assert tables is not None, "a model with sliding-window groups needs kv_group_block_ids every step"
        metas = [build_attention_metadata(computed, num_sched, [tables[r][g] for r in order], self.block_size,
                                          self.device, spec.window)
                 for g, spec in enumerate(self.kv_groups)]
        for m in metas[1:]:                  # every group's positions are the same: share one tensor
            m.positions = metas[0].positions
        metas[0].layer_metas = [metas[g] for g in self._layer_group]
        return metas[0]

    def _finish_overlapped(self, order: list[str], states: list[RunnerRequestState], computed: list[int],
                           infos: list[SamplingInfo] | None, tokens: torch.Tensor, lps: DeviceLogprobs | None,
                           so: SchedulerOutput) -> ModelRunnerOutput:
        """Finish a decode step whose sampled ids (`tokens`, on the device) and logprobs (`lps`, for the rows
        that ask) may still be computing: queue their copy to the host, launch the next decode step on them
        before waiting for it (see `overlap_decode`), then hand this step's ids and logprobs out."""
        b = len(states)
        graphs = self.decode_graphs
        if self._tokens_copied is not None and self._tokens_host is None:
            self._tokens_host = torch.zeros(graphs.sizes[-1], dtype=torch.long, pin_memory=True)
        host = self._tokens_host
        if host is not None:                       # CUDA: a pinned copy queued ahead of the next step
            host[:b].copy_(tokens, non_blocking=True)
        if lps is not None:
            lps = lps.to_host()                    # queued too, before the next step
        if host is not None:
            self._tokens_copied.record()
        bs, cap = self.block_size, self.max_model_len
        # Launch the next step only where it is likely to be the next step: no request ends at max_tokens or
        # the model's length with this token, each next position lies in a block it holds (the scheduler
        # allocates the next block a step early when one is free), and no waiting request can join (the
        # scheduler said so). A stop token, an abort or an admitted arrival wastes it.
        if not so.admits_waiting and all(
                c + 1 < len(st.block_ids) * bs and c + 2 < cap
                and len(st.token_ids) + 1 - st.num_prompt_tokens < st.params.max_tokens
                for st, c in zip(states, computed)):
            if any(len(st.block_ids) != held for st, held in zip(states, graphs.row_blocks)):
                graphs.refresh_tables([st.block_ids for st in states])
            hidden = graphs.run_next(tokens, [c + 2 for c in computed])
            self.num_launched_ahead += 1
            if infos is None:
                infos = [SamplingInfo(st.params, st.token_ids, st.num_prompt_tokens) for st in states]
            # sampled as if this step's ids were appended (penalties count them, seeded rows draw what they
            # would in order)
            logits = self.model.compute_logits(hidden)
            ahead_tokens = self.sampler.sample(logits, infos, pending=tokens)
            self._ahead = _Ahead(tuple(order), [c + 1 for c in computed], [], ahead_tokens,
                                 device_logprobs(logits, ahead_tokens, infos))
        if host is not None:
            self._tokens_copied.synchronize()
            token_list = host[:b].tolist()
        else:
            token_list = tokens.tolist()
        if self._ahead is not None:
            self._ahead.ids = token_list
        for st, c, tok in zip(states, computed, token_list):
            st.num_computed_tokens = c + 1
            st.token_ids.append(tok)
        self.num_overlapped_steps += 1
        logprobs = None
        if lps is not None:
            logprobs = {order[row]: [lp] for row, lp in lps.build(token_list).items()}
        return ModelRunnerOutput(order, [[t] for t in token_list], logprobs)

    def _gather_prompt_logprobs(self, hidden: torch.Tensor, chunks: list[tuple[RunnerRequestState, int, int, int]]
                                ) -> dict[str, list[Logprobs | None]] | None:
        """Extend each request's prompt logprobs with this step's chunk; return the completed prompts'.

        hidden: [num_tokens, hidden_size]. The chunk's row for position p predicts token p + 1, so a
        chunk's last row predicts the next chunk's first token, and the prompt's last row is the sampling
        row (the first output token's, not a prompt logprob). log_softmax in float32 over the raw logits,
        as the sampler's logprobs.
        """
        done: dict[str, list[Logprobs | None]] = {}
        for st, row0, start, n in chunks:
            lps = st.prompt_logprobs
            assert lps is not None and len(lps) == (start + 1 if start else 0), "prompt chunks arrive in order"
            if start == 0:
                lps.append(None)                   # the first prompt token has no context
            end = min(start + n + 1, st.num_prompt_tokens)
            for a in range(start + 1, end, _PROMPT_LOGPROBS_ROWS):        # target positions [a, b)
                b = min(a + _PROMPT_LOGPROBS_ROWS, end)
                rows = hidden[row0 + a - 1 - start:row0 + b - 1 - start]            # [b - a, hidden_size]
                logprobs = torch.log_softmax(self.model.compute_logits(rows), dim=-1)   # [b - a, vocab]
                targets = torch.tensor(st.token_ids[a:b], dtype=torch.long, device=self.device)
                lps.extend(gather_logprobs(logprobs, targets, st.params.prompt_logprobs))
            if start + n == st.num_prompt_tokens:
                done[st.req_id] = lps
                st.prompt_logprobs = None
        return done or None
