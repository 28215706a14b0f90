"""LLMEngine: model + tokenizer + KV cache + scheduler + runner; add_request / abort_request / step()."""
from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any


from affinity_serve.engine.build import EngineParts, build_engine_parts
from affinity_serve.engine.config import EngineConfig
from affinity_serve.engine.errors import DuplicateRequestError, EngineError, InvalidRequestError
from affinity_serve.engine.hashing import BlockHash, check_block_hashes
from affinity_serve.engine.kv_connector.base import KVConnectorStats
from affinity_serve.engine.kv_connector import (KVTransport, PDConnectorScheduler, RemoteDecode, RemotePrefill,
                                                default_local_transport, set_pd_transport)
from affinity_serve.engine.limits import EngineLimits
from affinity_serve.engine.outputs import EngineStepOutput
from affinity_serve.engine.pacing import step_work
from affinity_serve.engine.request import Request, RequestStatus
from affinity_serve.engine.sampling_params import SamplingParams
from affinity_serve.engine.structured_output.grammar import GrammarState
from affinity_serve.engine.tokenizer import IncrementalDetokenizer, apply_chat_template, token_ids_only_error
from affinity_serve.engine.types import (EngineLoad, EngineRequest, KVCacheSnapshot, KVEvent, RequestDelta,
                                        SchedulerStats, StepCost)

logger = logging.getLogger(__name__)

#: steps kept in EngineLoad.recent_steps: a reader polling at least every RECENT_STEPS steps sees them all
RECENT_STEPS = 256

Prompt = str | list[int] | list[dict[str, Any]]


class StepError(EngineError):
    """A step failed; `req_ids` are the parent requests that were in it (they have been failed)."""

    def __init__(self, cause: BaseException, req_ids: set[str]):
        super().__init__(f"engine step failed: {type(cause).__name__}: {cause}")
        self.cause = cause
        self.req_ids = req_ids


@dataclass(slots=True)
class _SeqState:
    parent_id: str
    index: int
    detok: IncrementalDetokenizer | None
    grammar: GrammarState | None = None


@dataclass(slots=True)
class _ParentState:
    num_seqs: int
    num_finished: int = 0


class LLMEngine:
    """One engine per replica. Not thread-safe: call add/abort/step from one thread at a time."""

    def __init__(self, parts: EngineParts):
        """Run the collaborators `parts` holds (`engine.build.build_engine_parts`); see `from_config`."""
        self.config = parts.config
        self.device, self.dtype = parts.device, parts.dtype
        self.model_path, self.model_args = parts.model_path, parts.model_args
        self.max_model_len = parts.max_model_len
        self.tokenizer = parts.tokenizer
        self.generation_config = parts.generation_config
        #: every EOS id, the primary (the Request's eos_token_id) first; the others stop as stop token ids
        self.eos_token_ids = parts.eos_token_ids
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        self.linear_backend = parts.linear_backend
        self.num_blocks = parts.num_blocks
        self.kv_cache_manager = parts.kv_cache_manager
        self.kv_connector = parts.kv_connector
        self._kv_connector_worker = parts.kv_connector_worker
        #: P/D disaggregation's scheduler side (kv_connector.type pd), else None
        self.pd = self.kv_connector if isinstance(self.kv_connector, PDConnectorScheduler) else None
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.structured_output = parts.structured_output
        self._seqs: dict[str, _SeqState] = {}
        self._parents: dict[str, _ParentState] = {}
        self.last_stats = SchedulerStats()
        #: names this engine's life in cache epochs: a restarted engine's events never pass for this one's
        self.boot_id = uuid.uuid4().hex[:8]
        self.num_steps = 0                          # steps run (a failed one not counted)
        self._recent_steps: deque[StepCost] = deque(maxlen=RECENT_STEPS)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        """Load the model and build every part (`engine.build`), then the engine over them."""
        return cls(build_engine_parts(config))

    @property
    def limits(self) -> EngineLimits:
        """The limits requests are checked against (`check_request`), after the KV cap."""
        return EngineLimits(self.max_model_len, self.model_args.vocab_size,
                            self.kv_cache_manager.max_tokens_capacity(), self.config.cache.block_size)

    # ------------------------------------------------------------------ requests
    def tokenize_prompt(self, prompt: Prompt) -> list[int]:
        """A string, a token id list, or chat messages (rendered with the model's chat template).

        With skip_tokenizer_init only token id lists are accepted.
        """
        is_chat = isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) for m in prompt)
        if self.tokenizer is None and (isinstance(prompt, str) or is_chat):
            raise token_ids_only_error("messages" if is_chat else "prompt")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty", param="prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if is_chat:
            return apply_chat_template(self.tokenizer, prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt                     # taken as it is: EngineRequest's contract, not copied
        raise InvalidRequestError("prompt must be a string, a list of token ids, or a list of chat messages",
                                  param="prompt")

    def resolve_params(self, params: SamplingParams) -> SamplingParams:
        """The request's parameters with the model's part filled in: generation_config.json's defaults where
        it left a field unset (engine.generation_config auto), every EOS id for min_tokens to mask, and the
        EOS ids after the primary one as stop token ids (unless ignore_eos), as vLLM does."""
        if self.config.generation_config == "auto":
            params = params.with_defaults(self.generation_config.sampling_defaults)
        if not self.eos_token_ids or params.eos_token_ids == self.eos_token_ids:
            return params
        stop_ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids += [t for t in self.eos_token_ids[1:] if t not in stop_ids]
        return dataclasses.replace(params, eos_token_ids=self.eos_token_ids, stop_token_ids=stop_ids)

    def _check_stop_strings(self, params: SamplingParams) -> None:
        """Stop strings match text: without a tokenizer (skip_tokenizer_init) they cannot be honoured."""
        if self.tokenizer is None and params.stop:
            raise token_ids_only_error("stop")

    def _check_logit_bias(self, params: SamplingParams) -> None:
        """A logit_bias key outside the vocabulary biases no token: refused rather than dropped."""
        vocab = self.limits.vocab_size
        if params.logit_bias and vocab is not None:
            bad = next((t for t in params.logit_bias if t >= vocab), None)
            if bad is not None:
                raise InvalidRequestError(f"logit_bias key {bad} is outside this model's vocabulary (token ids "
                                          f"0..{vocab - 1})", param="logit_bias", code="invalid_value")

    def _check_structured_output(self, params: SamplingParams) -> None:
        """A grammar needs the tokenizer (its token strings) and must parse; raises InvalidRequestError."""
        spec = params.structured_output
        if spec is None:
            return
        if self.tokenizer is None:
            raise token_ids_only_error(spec.param)
        if params.min_tokens:
            # a grammar that is done allows only a stop token, which min_tokens would mask: no token left
            raise InvalidRequestError(f"min_tokens cannot be combined with {spec.param}: a finished grammar "
                                      "allows only the end of the sequence", param="min_tokens")
        spec.check()

    def _new_detokenizer(self, p: SamplingParams) -> IncrementalDetokenizer | None:
        if not p.detokenize or self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, skip_special_tokens=p.skip_special_tokens, stop=p.stop,
                                      include_stop_str_in_output=p.include_stop_str_in_output)

    def make_request(self, prompt: Prompt, params: SamplingParams | None = None, *, req_id: str | None = None,
                     **fields: Any) -> EngineRequest:
        """An EngineRequest for a text prompt, token ids or chat messages (tokenized here); `fields` are
        EngineRequest's (priority, cache_salt, ...). `req_id` None draws a fresh one."""
        return EngineRequest(req_id or f"req-{uuid.uuid4().hex}", self.tokenize_prompt(prompt),
                             params or SamplingParams(), **fields)

    def check_request(self, request: EngineRequest) -> SamplingParams:
        """Everything `add_request` refuses except an id in flight, as InvalidRequestError; pure, so a caller
        may check before it queues the request. Returns the parameters the engine runs (`resolve_params`).

        The limits are checked here, once per request, unless the caller checked them against these very
        limits (`request.checked_limits`): its n sequences share prompt and max_tokens."""
        params = self.resolve_params(request.sampling_params)
        limits = self.limits
        if request.checked_limits != limits:
            limits.check(request.prompt_token_ids, params.max_tokens)
        self._check_stop_strings(params)
        self._check_logit_bias(params)
        self._check_structured_output(params)
        self._check_kv_transfer(request.kv_transfer, request.prompt_token_ids, params)
        return params

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request (n sequences if params.n > 1). Raises InvalidRequestError (DuplicateRequestError
        for an id in flight), changing nothing.

        `request.kv_transfer` (P/D disaggregation, kv_connector.type pd): `RemoteDecode()` makes this a prefill
        for a decode engine (max_tokens must be 1; each sequence's finishing delta carries its RemotePrefill),
        and a list of RemotePrefill, one per sequence, continues those prefills here after their first tokens.

        `request.block_hashes` are used instead of hashing the prompt again when they pass
        `check_block_hashes`, else recomputed (logged at debug).
        """
        self.add_checked_request(request, self.check_request(request))

    def add_checked_request(self, request: EngineRequest, params: SamplingParams) -> None:
        """`add_request` for a request `check_request` passed (`params`: what it returned), checked only for
        its id: the engine's one duplicate-id check (between steps: it reads what the step changes)."""
        req_id, ids = request.req_id, request.prompt_token_ids
        seq_ids = [req_id] if params.n == 1 else [f"{req_id}#{i}" for i in range(params.n)]
        if req_id in self._parents or any(sid in self._seqs for sid in seq_ids):
            raise DuplicateRequestError(req_id)
        block_hashes = request.block_hashes
        if block_hashes is not None:
            problem = check_block_hashes(block_hashes, ids, self.config.cache.block_size, request.cache_salt)
            if problem is not None:
                logger.debug("request %s: rehashing its prompt, the block hashes it brought are wrong: %s",
                             req_id, problem)
                block_hashes = None
        reqs = self._sequences(request, params, seq_ids, block_hashes)
        for i, req in enumerate(reqs):
            self.scheduler.add_request(req)
            detok = self._new_detokenizer(req.sampling_params)
            if detok is not None and req.num_output_tokens:
                detok.skip(req.output_token_ids)     # the prefill engine sent the first token's text
            self._seqs[req.req_id] = _SeqState(req_id, i, detok, req.structured_output)
        self._parents[req_id] = _ParentState(len(seq_ids))

    def _sequences(self, request: EngineRequest, params: SamplingParams, seq_ids: list[str],
                   block_hashes: list[BlockHash] | None) -> list[Request]:
        """The scheduler's Request of each sequence: one prompt list and one hashing shared by all."""
        arrival = time.monotonic() if request.arrival_time is None else request.arrival_time
        kv_transfer = request.kv_transfer
        reqs: list[Request] = []
        for i, sid in enumerate(seq_ids):
            # siblings share the prompt: only the first computes its logprobs, the others may hit the cache.
            # Sequence i draws from seed + i; one continuing a prefill (P/D) from seed + the index it had there.
            k = kv_transfer[i].seq_index if isinstance(kv_transfer, list) else i
            p = params if params.n == 1 and k == 0 else dataclasses.replace(
                params, n=1, seed=None if params.seed is None else params.seed + k,
                prompt_logprobs=params.prompt_logprobs if i == 0 else None)
            req = Request(sid, request.prompt_token_ids, p, eos_token_id=self.eos_token_id, arrival_time=arrival,
                          priority=request.priority, cache_salt=request.cache_salt,
                          block_size=self.config.cache.block_size, trace_context=request.trace_context,
                          block_hashes=reqs[0].block_hashes if reqs else block_hashes)
            if isinstance(kv_transfer, list):        # continues after the prefill's first token
                req.kv_transfer = kv_transfer[i]
                req.append_output_token(kv_transfer[i].first_token_id)
            else:
                req.kv_transfer = kv_transfer
            if params.structured_output is not None:     # each sequence its own matcher over one (cached) compile
                # a continued prefill's matcher starts past the first token, which the prefill engine's masked
                first = (kv_transfer[i].first_token_id,) if isinstance(kv_transfer, list) else ()
                req.structured_output = self.structured_output.new_state(params.structured_output, first)
            reqs.append(req)
        return reqs

    def _check_kv_transfer(self, kv_transfer, ids: list[int], params: SamplingParams) -> None:
        if kv_transfer is None:
            return
        if self.pd is None:
            raise InvalidRequestError("kv_transfer needs kv_connector.type pd on this engine",
                                      param="kv_transfer_params")
        if isinstance(kv_transfer, RemoteDecode):
            if params.max_tokens != 1:
                raise InvalidRequestError(f"a prefill for a decode engine samples exactly one token; got "
                                          f"max_tokens {params.max_tokens}", param="max_tokens")
            return
        if not isinstance(kv_transfer, list) or not all(isinstance(r, RemotePrefill) for r in kv_transfer):
            raise InvalidRequestError("kv_transfer must be RemoteDecode() or a list of RemotePrefill",
                                      param="kv_transfer_params")
        if len(kv_transfer) != params.n:
            raise InvalidRequestError(f"{len(kv_transfer)} prefilled sequences for n={params.n}",
                                      param="kv_transfer_params")
        if any(r.num_tokens != len(ids) for r in kv_transfer):
            raise InvalidRequestError("the prefill was of a prompt of another length than this one",
                                      param="kv_transfer_params")
        if params.max_tokens < 2:
            raise InvalidRequestError("the prefill produced the only token max_tokens allows: nothing to decode",
                                      param="max_tokens")
        if params.prompt_logprobs is not None:
            raise InvalidRequestError("prompt_logprobs come from the prefill engine; drop them from the decode "
                                      "request", param="prompt_logprobs")

    def set_kv_transport(self, transport: KVTransport) -> None:
        """P/D: read other engines' KV through `transport` (the default reaches engines in this process)."""
        if self.pd is None:
            raise ValueError("set_kv_transport needs kv_connector.type pd")
        set_pd_transport(self.pd, self._kv_connector_worker, transport)

    @property
    def kv_source(self):
        """P/D: what a transport calls to read this engine's held KV (`read_held_blocks`, `release_held`)."""
        if self.pd is None:
            raise ValueError("kv_source needs kv_connector.type pd")
        return self._kv_connector_worker

    def abort_request(self, req_ids: str | list[str]) -> None:
        if isinstance(req_ids, str):
            req_ids = [req_ids]
        self.scheduler.abort_requests([sid for rid in req_ids for sid in self._seq_ids(rid)])

    def _seq_ids(self, req_id: str) -> list[str]:
        parent = self._parents.get(req_id)
        if parent is None:
            return []
        return [req_id] if parent.num_seqs == 1 else [f"{req_id}#{i}" for i in range(parent.num_seqs)]

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents) or self.scheduler.has_unfinished_requests()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._parents)

    # ------------------------------------------------------------------ step
    def step(self) -> EngineStepOutput:
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        # filled while the forward runs (see GrammarBitmask); the sampler reads it
        so.grammar_bitmask = self.structured_output.grammar_bitmask(so, self.scheduler.requests)
        if so.is_empty and (compiling := self.scheduler.awaiting_grammar()):
            # nothing else to run: wait (briefly, so adds and aborts are not held up) instead of spinning
            self.structured_output.wait_for_compile([r.structured_output for r in compiling], 0.02)
        elif so.is_empty and self.pd is not None and self._kv_connector_worker.has_reads_in_flight():
            time.sleep(0.001)                 # only KV reads to wait for (P/D): poll them, do not spin
        # the step's work before the scheduler updates (SchedulerStats' regressors of the step cost)
        work = step_work(so, self.scheduler.requests)
        try:
            ro = self.runner.execute_model(so)
        except Exception as e:
            affected = {self._seqs[s].parent_id for s in so.num_scheduled_tokens if s in self._seqs}
            # Every sibling of an affected n > 1 request fails too, scheduled in this step or not:
            # once its parent is dropped nobody would read it, and an abort could not find it.
            failed = set(so.num_scheduled_tokens).union(*(self._seq_ids(rid) for rid in affected))
            self.scheduler.finish_requests(failed, RequestStatus.FINISHED_ERROR)
            self.scheduler.fail_kv_transfers(so)
            for rid in affected:
                self._drop_parent(rid)
            raise StepError(e, affected) from e
        finally:
            if so.grammar_bitmask is not None:     # the fill reads the matchers: done before any advances
                so.grammar_bitmask.wait()
        out = self.scheduler.update_from_output(so, ro)
        out.stats.step_time_s = time.perf_counter() - t0
        out.stats.num_prefill_tokens, out.stats.num_decode_seqs, out.stats.num_decode_context_tokens = work
        self.last_stats = out.stats
        self._count_step(out.stats)
        return self._process(out.outputs, out.stats)

    def _process(self, outputs: list[RequestDelta], stats: SchedulerStats) -> EngineStepOutput:
        """The scheduler's deltas, filled in for the caller in place: keyed by request and sequence index,
        with their text, and ended by a stop string or a finished grammar."""
        deltas: list[RequestDelta] = []
        finished_parents: set[str] = set()
        for d in outputs:
            seq_id = d.req_id
            seq = self._seqs.get(seq_id)
            if seq is None:
                continue            # already reported finished (stop string) or dropped
            if seq.grammar is not None and d.token_ids and not d.finished:
                d.finish_reason = self._advance_grammar(seq_id, seq.grammar, d.token_ids)
            remote = self.pd.take_transfer_params(seq_id) if d.finished and self.pd is not None else None
            if seq.detok is not None:
                # a prefill whose sequence goes on in a decode engine (P/D) has not ended its text: a character
                # its first token only began, and the tail a stop string could start with, are held back as in
                # a stream; the decode engine's detokenizer takes the same first token the same way (`skip`)
                # and sends them when they are complete
                going_on = remote is not None and d.finish_reason == "length"
                d.text = seq.detok.update(d.token_ids, d.finished and not going_on)
                if seq.detok.stop_hit is not None:
                    if not d.finished:
                        self.scheduler.finish_requests(seq_id, RequestStatus.FINISHED_STOPPED)
                    d.finish_reason, d.stop_reason = "stop", seq.detok.stop_hit
            d.req_id, d.index = seq.parent_id, seq.index
            deltas.append(d)
            if not d.finished:
                continue
            if self.pd is not None:
                if remote is not None and d.finish_reason != "length":     # a stop string on the first token
                    self._kv_connector_worker.release_held(remote.transfer_id)
                    remote = None
                if remote is not None and seq.index:
                    remote = dataclasses.replace(remote, seq_index=seq.index)
                d.kv_transfer = remote
            del self._seqs[seq_id]
            parent = self._parents[seq.parent_id]
            parent.num_finished += 1
            if parent.num_finished == parent.num_seqs:
                del self._parents[seq.parent_id]
                finished_parents.add(seq.parent_id)
        return EngineStepOutput(deltas, finished_parents, stats)

    def _advance_grammar(self, req_id: str, grammar: GrammarState, token_ids: list[int]) -> str | None:
        """Feed a sequence's new tokens to its matcher; the finish reason it ends with, if any: a grammar that
        has ended ends the sequence ("stop", as when ignore_eos kept it going), a token outside it (a bug: the
        mask allows none) fails it ("error")."""
        if not grammar.accept(token_ids):
            logger.error("request %s: sampled token(s) %s outside its grammar", req_id, token_ids)
            self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ERROR)
            return "error"
        if grammar.is_terminated:
            self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_STOPPED)
            return "stop"
        return None

    def _drop_parent(self, req_id: str) -> None:
        for sid in self._seq_ids(req_id):
            self._seqs.pop(sid, None)
        self._parents.pop(req_id, None)

    def _count_step(self, st: SchedulerStats) -> None:
        self.num_steps += 1
        if st.num_scheduled_tokens:         # what a replica's capacity model learns from (EngineLoad.recent_steps)
            self._recent_steps.append(StepCost(self.num_steps, time.monotonic(), st.step_time_s,
                                               st.num_prefill_tokens, st.num_decode_seqs,
                                               st.num_decode_context_tokens))

    # ------------------------------------------------------------------ state, read between steps
    def has_work(self) -> bool:
        """Requests to run, transfers a step advances, or outputs the next step reports (aborts, finished ids):
        step() has work. Blocks held for a P/D reader are not work (`next_wakeup_s` says when they time out)."""
        sched = self.scheduler
        return (bool(self._parents) or bool(sched.requests) or sched.has_pending_kv_transfers(for_steps=True)
                or sched.has_pending_output())

    def next_wakeup_s(self) -> float | None:
        """Seconds until an idle engine must step anyway (a P/D hold's timeout), None: not until woken."""
        conn = self.scheduler.connector
        return conn.next_wakeup_s() if conn is not None else None

    @property
    def cache_epoch(self) -> str:
        """`<boot id>:<resets>`: changes on restart and on every prefix-cache reset."""
        return f"{self.boot_id}:{self.kv_cache_manager.cache_epoch}"

    def load(self, background_req_ids: Collection[str] = ()) -> EngineLoad:
        """The load now (reads the scheduler and the KV pool: not while a step runs). The requests in
        `background_req_ids` are also counted apart (num_background_*)."""
        st = self.scheduler.make_stats()
        pool = self.kv_cache_manager.pool
        # usually no background requests: only a warm-up's
        bg_running, bg_waiting, bg_tokens = self.scheduler.load_of(background_req_ids)
        return EngineLoad(
            num_running_reqs=st.num_running_reqs, num_waiting_reqs=st.num_waiting_reqs,
            kv_cache_usage=st.kv_cache_usage, num_queued_prefill_tokens=st.num_queued_prefill_tokens,
            num_free_blocks=pool.num_free_blocks, num_blocks=pool.num_blocks,
            num_requests=len(self.scheduler.requests),
            prefix_cache_queries_total=st.prefix_cache_queries_total,
            prefix_cache_hits_total=st.prefix_cache_hits_total,
            recent_prefix_cache_queries=st.recent_prefix_cache_queries,
            recent_prefix_cache_hits=st.recent_prefix_cache_hits,
            num_preemptions_total=st.num_preemptions_total,
            cache_epoch=self.cache_epoch, timestamp=time.monotonic(),
            num_background_running=bg_running, num_background_waiting=bg_waiting,
            num_background_queued_prefill_tokens=bg_tokens, recent_steps=tuple(self._recent_steps),
            num_steps_total=self.num_steps, kv_wait_s=st.kv_wait_s)

    def kv_snapshot(self, next_seq: int) -> KVCacheSnapshot:
        """Every block hash in the prefix cache, and the KV connector's tier's by medium (not while a step
        runs); `next_seq`: the number the caller gives the next KV event (see KVCacheSnapshot)."""
        conn = self.kv_connector
        tiers = {conn.medium: conn.block_hashes()} if conn is not None else {}
        return KVCacheSnapshot(self.cache_epoch, next_seq, list(self.kv_cache_manager.pool.cached), tiers)

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        return self.config.cache.block_size

    @property
    def pd_block_bytes(self) -> int:
        """Bytes one KV block moves in a P/D transfer (0 without the `pd` connector)."""
        return self.pd.layout.block_bytes if self.pd is not None else 0

    def num_cached_prefix_blocks(self, block_hashes) -> int:
        """Leading blocks of `block_hashes` this engine's pool holds now (a hint: admission decides)."""
        pool = self.kv_cache_manager.pool
        n = 0
        for h in block_hashes:
            if pool.get_cached_block(h) is None:
                break
            n += 1
        return n

    def kv_connector_stats(self) -> KVConnectorStats | None:
        """A copy of the KV connector's cumulative counters (None without a connector)."""
        conn = self.kv_connector
        return dataclasses.replace(conn.stats) if conn is not None else None

    def take_pd_transfer_stats(self):
        """P/D only (else None): the connector's transfer counters, the blocks held for decode engines now, and
        the read and hold times since the last call (`PDConnectorScheduler.take_transfer_stats`; one reader)."""
        return self.pd.take_transfer_stats() if self.pd is not None else None

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def take_kv_events(self) -> list[KVEvent]:
        """KV cache events since the last call (cache.enable_kv_cache_events; else always []): the pool's,
        then the KV connector's tier (`medium` "offload" or "shared")."""
        events = self.kv_cache_manager.take_events()
        if self.kv_connector is not None:
            events.extend(self.kv_connector.take_events())
        return events

    def close(self) -> None:
        """Release what lives outside this process's memory (the KV connector's shared-store handle)."""
        if self.kv_connector is not None:
            self.kv_connector.close()
        if self.pd is not None:
            default_local_transport().unregister(self.pd.engine_id)
            close = getattr(self.pd.transport, "close", None)
            if close is not None:          # a transport of this engine's own (NIXL: its agent and thread)
                close()
        self.structured_output.close()
