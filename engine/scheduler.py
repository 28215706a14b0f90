"""Scheduler: the token-budget loop (running first, then waiting), preemption, stop conditions, stats.

One scheduling model (vLLM v1): each step, every scheduled request's `num_computed_tokens` catches up
with its `num_tokens` under a shared token budget. Chunked prefill, prefix hits, decoding and
resumption after preemption are all the same rule. No torch here.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from affinity_serve.engine.block_pool import KVCacheBlock
from affinity_serve.engine.config import SchedulerConfig
from affinity_serve.engine.kv_cache_manager import KVCacheManager
from affinity_serve.engine.kv_connector.base import KVConnectorOutput, KVConnectorScheduler, PoolChanges
from affinity_serve.engine.request import Request, RequestStatus
from affinity_serve.engine.request_queue import make_queue
from affinity_serve.engine.types import (CachedRequestData, Logprobs, ModelRunnerOutput, NewRequestData, RequestDelta,
                          RemotePrefill, SchedulerOutput, SchedulerStats, StepOutput)

#: weight of each admission's KV wait in the scheduler's decayed mean of them (SchedulerStats.kv_wait_s)
KV_WAIT_MEAN_WEIGHT = 0.25


@dataclass(slots=True)
class _Load:
    """A request in WAITING_FOR_KV: its blocks up to `num_tokens_after` are being filled by the connector."""

    request: Request
    num_tokens_after: int
    deadline: float
    prior_status: RequestStatus
    num_loaded: int = 0          # of num_tokens_after, the tokens the connector fills (the rest were local hits)


class Scheduler:
    """Decides what each step computes and where its KV lives.

    Deviations from vLLM v1, on purpose:
    - prefix-cache blocks are registered after the runner computed them (see KVCacheManager);
    - a request that could never fit in the KV pool (prompt + max_tokens, capped at the model length)
      is rejected at `add_request` instead of livelocking in preemption later;
    - prefix-cache stats are recorded once per admission (resumptions after preemption included);
    - a waiting request whose next uncached block is being computed by a running request (same
      prefix, admitted earlier) waits for it instead of computing it twice (in-batch prefix sharing,
      as SGLang does); the requests behind it are admitted meanwhile (they may use the step's budget),
      and it keeps its place at the head of the queue.

    `schedule()` may run again before the previous output arrived (to overlap scheduling with the model):
    requests whose tokens are all in flight are skipped, a token that arrives for a request preempted
    in between is kept (vLLM semantics), and a preempted request resumes only once its output is in.

    With a KV connector (engine/kv_connector): at admission, after the local prefix hit, the connector may
    offer more prompt blocks from its tier. The request then takes blocks for them and waits in
    WAITING_FOR_KV (outside the waiting queue, no token budget) until the runner reports the load. A
    loaded request's blocks are registered in the prefix cache and released, and the request goes back to
    the front of the queue, where it is admitted as a prefix hit on them. A failed or timed-out load sends
    it back to recompute (it asks the connector no more). A connector with `early_loads` (P/D) has its
    loads started when the request is queued, wherever it stands, if the running requests can spare the
    blocks. Blocks a transfer still uses (an aborted or
    timed-out load, a save the connector waits for) stay held until the runner reports that transfer.

    A request whose grammar (structured output) is still compiling waits in WAITING_FOR_GRAMMAR, outside the
    queue and the token budget, and joins the back of the queue once compiled (a failed compile finishes it).
    Preemption needs no grammar rollback: the tokens a matcher accepted are kept and recomputed as context.
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, max_model_len: int,
                 kv_connector: KVConnectorScheduler | None = None, clock: Callable[[], float] = time.monotonic):
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"with chunked prefill disabled, max_num_batched_tokens ({config.max_num_batched_tokens}) "
                f"must be >= max_model_len ({max_model_len}) or long prompts could never be scheduled; "
                "raise max_num_batched_tokens or enable chunked prefill")
        self.config = config
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        self.block_size = kv_cache_manager.block_size
        self.requests: dict[str, Request] = {}
        self.waiting = make_queue(config.policy)
        self.running: list[Request] = []
        self._finished_for_runner: set[str] = set()
        self._finished_for_output: set[str] = set()
        self._pending_deltas: list[RequestDelta] = []    # aborts since the last step
        self._num_preemptions = 0
        self._waiting_prefill_tokens = 0      # every waiting request's tokens
        self._waiting_hit_tokens = 0          # of those, the prefix-cache hits each had when it started waiting
        self._waiting_hits: dict[str, int] = {}
        self._running_prefill_tokens = 0
        self._last_num_scheduled = 0
        self._refund = 0
        #: outputs of schedule() whose update_from_output has not come yet, oldest first
        self._awaiting_output: list[SchedulerOutput] = []
        self.connector = kv_connector
        #: decodes also get a KV slot for this many tokens past this step's when a block is free (the runner's
        #: overlap_decode launches the next step before this one's tokens are known; it needs that slot)
        self.num_lookahead_tokens = 0
        self._lookahead: list[Request] = []                  # this schedule()'s decodes that may get one
        self._loading: dict[str, _Load] = {}                  # WAITING_FOR_KV requests
        self._orphans: dict[str, list[KVCacheBlock]] = {}     # loads whose request left before the report
        self._saving: dict[str, list[KVCacheBlock]] = {}      # finished requests whose saves are in flight
        self._no_load: set[str] = set()                       # a load failed: these recompute
        self._awaiting_grammar: dict[str, Request] = {}       # WAITING_FOR_GRAMMAR requests
        #: the KV-blocked clock: seconds during which the waiting queue could not move for want of KV blocks (a
        #: running request was preempted, or a waiting one found no blocks while no prompt tokens ran), from one
        #: schedule() to the next; a request's `kv_wait_s` is this clock's reading at admission less its
        #: reading when the request joined the queue
        self.clock = clock
        self._now = clock()
        self._kv_blocked_total = 0.0
        self._kv_blocked_from: float | None = None     # when the current blocked stretch began (None: not blocked)
        self._kv_blocked_step = False
        self._kv_wait_mean = 0.0                        # decayed mean of admissions' KV waits
        if kv_connector is not None:
            if not kv_cache_manager.enable_caching:
                raise ValueError("a KV connector needs prefix caching: loaded blocks are reused as prefix hits")
            if kv_cache_manager.windowed and not kv_connector.supports_kv_groups:
                raise ValueError(f"the {kv_connector.medium} KV connector moves one block table per request; this "
                                 "model has sliding-window layers (a table per KV-cache group): use "
                                 "kv_connector.type offload, shared or none")
            kv_cache_manager.pool.track_changes(cached=kv_connector.wants_cached, evicted=kv_connector.wants_evicted)

    # ================================================================== requests in
    def add_request(self, request: Request) -> None:
        """Queue a request the engine has checked (`EngineLimits.check`, its id unique)."""
        if request.block_size != self.block_size:
            # its block hashes would never match a cached block: a silent 0% prefix-cache hit rate
            raise ValueError(f"request {request.req_id!r} has block_size {request.block_size} but the KV "
                             f"cache's block size is {self.block_size}; build requests with the cache's")
        # the engine checked the request (limits, a unique id) before it built it: LLMEngine.add_request
        assert request.req_id not in self.requests, f"request id {request.req_id!r} is already scheduled"
        self.requests[request.req_id] = request
        grammar = request.structured_output
        if grammar is not None and (not grammar.is_ready or grammar.error is not None):
            request.status = RequestStatus.WAITING_FOR_GRAMMAR      # queued once compiled (_admit_compiled)
            self._awaiting_grammar[request.req_id] = request
            return
        request.status = RequestStatus.WAITING
        self.waiting.add(request)
        self._enter_waiting(request)

    def _admit_compiled(self) -> None:
        """Requests whose grammar compiled join the waiting queue (at its back, as new arrivals); a failed
        compile finishes its request with an error."""
        for req in [r for r in self._awaiting_grammar.values() if r.structured_output.is_ready]:
            if req.structured_output.error is not None:
                self.finish_requests(req.req_id, RequestStatus.FINISHED_ERROR)
                continue
            del self._awaiting_grammar[req.req_id]
            req.status = RequestStatus.WAITING
            self.waiting.add(req)
            self._enter_waiting(req)

    def _enter_waiting(self, req: Request, now: float | None = None) -> None:
        """Count a request joining the waiting queue: all its tokens, and apart the prefix-cache hit it
        has now (a pure lookup), so the queued-prefill stat is the uncached work a router predicts too."""
        req.kv_wait_mark = self._kv_blocked_clock(self.clock() if now is None else now)
        hit = self.kv.get_computed_blocks(req)[1] if req.block_hashes else 0
        self._waiting_prefill_tokens += req.num_tokens
        self._waiting_hit_tokens += hit
        self._waiting_hits[req.req_id] = hit

    def _kv_blocked_clock(self, now: float) -> float:
        since = self._kv_blocked_from
        return self._kv_blocked_total + (now - since if since is not None and now > since else 0.0)

    def kv_blocked_s(self, now: float | None = None) -> float:
        """How long the waiting queue has been blocked for want of KV blocks, without a break (0: not now)."""
        since = self._kv_blocked_from
        if since is None:
            return 0.0
        return max(0.0, (self.clock() if now is None else now) - since)

    def _expected_kv_wait(self) -> float:
        """SchedulerStats.kv_wait_s: while the queue is blocked for KV blocks, the larger of the recent
        admissions' waits (decayed mean) and the current blocked stretch; 0 while it is not."""
        if self._kv_blocked_from is None:
            return 0.0
        return max(self._kv_wait_mean, self._now - self._kv_blocked_from)

    def _admitted_after_wait(self, req: Request) -> None:
        wait = max(0.0, self._kv_blocked_clock(self._now) - req.kv_wait_mark)
        req.kv_wait_s += wait
        self._kv_wait_mean += KV_WAIT_MEAN_WEIGHT * (wait - self._kv_wait_mean)

    def _leave_waiting(self, req: Request) -> None:
        self._waiting_prefill_tokens -= req.num_tokens
        self._waiting_hit_tokens -= self._waiting_hits.pop(req.req_id, 0)

    # ================================================================== schedule
    def schedule(self) -> SchedulerOutput:
        self._now = now = self.clock()
        self._kv_blocked_step = False
        if self._loading:
            self._expire_loads()
        if self._awaiting_grammar:
            self._admit_compiled()
        if self.connector is not None and self.connector.early_loads and len(self.waiting):
            self._start_early_loads()
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        preempted: set[str] = set()
        budget = self._schedule_running(budget, num_scheduled, new_reqs, cached, preempted)
        if not preempted:
            budget = self._schedule_waiting(budget, num_scheduled, new_reqs)
        if preempted or (self._kv_blocked_step and not any(n > 1 for n in num_scheduled.values())):
            # blocked: a request was preempted for blocks, or the queue's head found none while no prompt
            # tokens ran in this step (with some running, the queue is behind prefill work, not waiting for KV)
            if self._kv_blocked_from is None:
                self._kv_blocked_from = now
        elif self._kv_blocked_from is not None:
            self._kv_blocked_total += max(0.0, now - self._kv_blocked_from)
            self._kv_blocked_from = None
        if self._lookahead:
            self._allocate_lookahead(num_scheduled, cached)
        total = self.config.max_num_batched_tokens - budget
        self._last_num_scheduled = total
        finished, self._finished_for_runner = self._finished_for_runner, set()
        so = SchedulerOutput(new_reqs, cached, num_scheduled, total, finished, preempted)
        if self.kv.windowed:          # sliding-window groups drop blocks mid-table: the runner gets whole tables
            so.kv_group_block_ids = {r: self.kv.group_block_ids(r) for r in num_scheduled}
        so.admits_waiting = (bool(len(self.waiting)) and len(self.running) < self.config.max_num_seqs
                             and self.kv.pool.num_free_blocks > 0)
        if self.connector is not None:
            so.kv_connector_metadata = self.connector.build_connector_meta(
                so, PoolChanges(*self.kv.pool.take_changes()))
        self._awaiting_output.append(so)
        return so

    def _chunk(self, request: Request, budget: int) -> int:
        n = request.num_tokens - request.num_computed_tokens
        cap = self.config.long_prefill_token_threshold
        if cap is not None and n > cap:
            n = cap
        return n if n < budget else budget

    def _schedule_running(self, budget: int, num_scheduled: dict[str, int],
                          new_reqs: list[NewRequestData], cached: CachedRequestData,
                          preempted: set[str]) -> int:
        running = self.running
        block_size = self.block_size
        req_to_blocks = self.kv.req_to_blocks
        c_ids, c_blocks, c_computed = cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        prefill_left = 0
        lookahead = self._lookahead = []
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            computed = req.num_computed_tokens
            n = req.num_tokens - computed
            held = len(req_to_blocks[req.req_id]) * block_size
            if n == 1 and computed < held:
                block_ids: list[int] = []    # decode fast path: the last block has room
                if computed + self.num_lookahead_tokens >= held:
                    lookahead.append(req)    # its next token starts a block: see _allocate_lookahead
            elif n == 0:
                i += 1        # its token is in flight (schedule() again before update_from_output)
                continue
            else:
                n = self._chunk(req, budget)
                new_blocks = self._allocate_or_preempt(req, n, i, num_scheduled, cached, preempted)
                budget += self._refund      # victims' tokens, even when `req` ends up preempting itself
                if new_blocks is None:
                    continue      # `req` preempted itself; running[i] is now the next request
                if len(running) <= i or running[i] is not req:
                    i = running.index(req)       # a victim ahead of it left the list
                block_ids = [b.block_id for b in new_blocks]
                rem = req.num_tokens - computed - n
                if rem > 0:
                    prefill_left += rem
            num_scheduled[req.req_id] = n
            c_ids.append(req.req_id)
            c_blocks.append(block_ids)
            c_computed.append(computed)
            req.num_computed_tokens = computed + n
            budget -= n
            i += 1
        self._running_prefill_tokens = prefill_left
        return budget

    def _allocate_lookahead(self, num_scheduled: dict[str, int], cached: CachedRequestData) -> None:
        """num_lookahead_tokens: a decode whose next token starts a new block gets that block now, once
        everyone scheduled and admitted in this step has theirs, and only from free blocks (never by
        preempting), so the runner can launch the next step before this one's tokens are known. Not on a
        request's last step (max_tokens or the model's length), where the block would never be used."""
        for req in self._lookahead:
            if num_scheduled.get(req.req_id) != 1 or req.status is not RequestStatus.RUNNING:
                continue               # preempted later in this step (priority policy)
            p = req.sampling_params
            if req.num_output_tokens + 1 >= p.max_tokens or req.num_tokens + 1 >= self.max_model_len:
                continue
            if not self.kv.pool.num_free_blocks:
                break
            new = self.kv.allocate_slots(req, self.num_lookahead_tokens)
            if new:
                cached.new_block_ids[cached.req_ids.index(req.req_id)].extend(b.block_id for b in new)
        self._lookahead = []

    def _allocate_or_preempt(self, req: Request, n: int, i: int, num_scheduled: dict[str, int],
                             cached: CachedRequestData, preempted: set[str]):
        """allocate_slots for `req`, preempting others until it fits; None if `req` itself was preempted.

        Sets self._refund to the budget given back by victims already scheduled in this step.
        """
        self._refund = 0
        while True:
            new_blocks = self.kv.allocate_slots(req, n)
            if new_blocks is not None:
                return new_blocks
            victim = self._pick_victim()
            self._refund += self._preempt(victim, num_scheduled, cached, preempted)
            if victim is req:
                return None

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, victim: Request, num_scheduled: dict[str, int], cached: CachedRequestData,
                 preempted: set[str]) -> int:
        """Recompute-preemption: drop the victim's KV and put it back at the front of the queue.

        Returns the token budget the victim had been given earlier in this step (0 if none).
        """
        if self.running and self.running[-1] is victim:
            self.running.pop()
        else:
            self.running.remove(victim)
        refund = num_scheduled.pop(victim.req_id, 0)
        if refund:     # priority policy may pick a request already scheduled this step
            idx = cached.req_ids.index(victim.req_id)
            del cached.req_ids[idx], cached.new_block_ids[idx], cached.num_computed_tokens[idx]
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self._num_preemptions += 1
        preempted.add(victim.req_id)
        self.waiting.add_front(victim)
        self._enter_waiting(victim, self._now)
        return refund

    def _schedule_waiting(self, budget: int, num_scheduled: dict[str, int],
                          new_reqs: list[NewRequestData]) -> int:
        deferred: list[Request] = []      # waiting on blocks another request is computing, in queue order
        try:
            return self._schedule_waiting_loop(budget, num_scheduled, new_reqs, deferred)
        finally:
            for req in reversed(deferred):      # back at the head, in their order: they keep their turn
                self.waiting.add_front(req)

    def _schedule_waiting_loop(self, budget: int, num_scheduled: dict[str, int], new_reqs: list[NewRequestData],
                               deferred: list[Request]) -> int:
        cfg = self.config
        inflight: set | None = None
        while len(self.waiting) and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting.peek()
            if self._awaiting_output and req.status is RequestStatus.PREEMPTED and self._output_due(req):
                break     # resuming now would lose the token in flight; FCFS: the rest waits too
            hits, num_hit_tokens = self.kv.get_computed_blocks(req)
            if self.kv.reads_cache(req) and len(hits) < (req.num_tokens - 1) // self.block_size:
                if inflight is None:
                    inflight = self._inflight_block_hashes()
                if req.block_hashes[len(hits)] in inflight:
                    # Its next block is being computed by another request: it waits to hit it, without
                    # holding up the requests behind it (they may use this step's budget).
                    deferred.append(self.waiting.pop())
                    continue
            if self.connector is not None:
                started = self._start_load(req, hits, num_hit_tokens)
                if started is None:
                    break     # the connector's lookup is pending, or no room for its blocks: FCFS waits
                if started:
                    if inflight is not None:
                        inflight.update(req.block_hashes[len(hits):])
                    continue
            n = req.num_tokens - num_hit_tokens
            if not cfg.enable_chunked_prefill and n > budget:
                break     # head-of-line: without chunking the whole prompt must fit the budget
            cap = cfg.long_prefill_token_threshold
            if cap is not None and n > cap:
                n = cap
            n = min(n, budget)
            if self.kv.allocate_slots(req, n, hits) is None:
                self._kv_blocked_step = True
                break
            self.waiting.pop()
            self._leave_waiting(req)
            self._admitted_after_wait(req)
            if req.num_cached_tokens is None:
                # a P/D read is admitted as local hits; what the prefill engine computed for it is no cache hit
                req.num_cached_tokens = max(0, num_hit_tokens - req.num_transferred_tokens)
                req.first_scheduled_time = time.monotonic()
                self.kv.record_admission(req, req.num_cached_tokens)
            else:
                self.kv.record_admission(req, num_hit_tokens)
            req.num_computed_tokens = num_hit_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if inflight is not None:
                inflight.update(req.block_hashes[len(hits):])
            new_reqs.append(NewRequestData(req.req_id, list(req.all_token_ids), req.num_prompt_tokens,
                                           req.sampling_params, self.kv.get_block_ids(req.req_id),
                                           num_hit_tokens))
            num_scheduled[req.req_id] = n
            req.num_computed_tokens += n
            self._running_prefill_tokens += req.num_tokens - req.num_computed_tokens
            budget -= n
        return budget

    def _output_due(self, req: Request) -> bool:
        return any(req.req_id in so.num_scheduled_tokens for so in self._awaiting_output)

    def _inflight_block_hashes(self) -> set:
        """Hashes of full blocks that running requests hold but have not computed (cached) yet."""
        out: set = set()
        cached = self.kv.num_cached_block
        for r in self.running:
            c = cached.get(r.req_id, 0)
            if c < len(r.block_hashes):
                out.update(r.block_hashes[c:])
        for load in self._loading.values():       # a prefix being loaded: others wait and hit it
            r = load.request
            out.update(r.block_hashes[cached.get(r.req_id, 0):load.num_tokens_after // self.block_size])
        return out

    # ================================================================== KV connector
    def _start_early_loads(self) -> None:
        """Start the loads of queued requests the connector serves early (P/D: a prefilled request's read)
        now, wherever they stand in the queue: their KV arrives while they wait and while the running requests
        decode, instead of after they reach the head (outside the token budget and max_num_seqs, as in
        WAITING_FOR_KV). A load takes only blocks the running requests can spare (one each for their next
        token); one that does not fit waits for its turn at admission."""
        reserve = len(self.running)
        inflight: set | None = None
        for req in [r for r in self.waiting if r.status is RequestStatus.WAITING and self.connector.loads_early(r)]:
            if req.req_id in self._no_load or req.req_id in self._orphans:
                continue
            hits, num_hit_tokens = self.kv.get_computed_blocks(req)
            if len(hits) < len(req.block_hashes):
                if inflight is None:
                    inflight = self._inflight_block_hashes()
                if req.block_hashes[len(hits)] in inflight:
                    continue      # another load brings its next block (n > 1 siblings): it hits that one
            started = self._start_load(req, hits, num_hit_tokens, reserve=reserve)
            if started is None:
                break
            if started and inflight is not None:
                inflight.update(req.block_hashes[len(hits):])

    def _start_load(self, req: Request, hits: list[KVCacheBlock], num_hit_tokens: int,
                    reserve: int | None = None) -> bool | None:
        """Ask the connector for blocks beyond the local hit; True if `req` left the queue to load them,
        False to go on admitting it normally, None to stop admitting this step. `reserve`: an early load
        (`req` anywhere in the queue) that must leave this many blocks free."""
        if req.req_id in self._no_load or req.req_id in self._orphans or not self.kv.reads_cache(req):
            return False
        num_ext, is_async = self.connector.get_num_new_matched_tokens(req, num_hit_tokens)
        if num_ext is None:
            return None
        bs = self.block_size
        num_ext = min(num_ext, (req.num_tokens - 1) // bs * bs - num_hit_tokens)   # never the last token
        if num_ext <= 0:
            return False
        if num_ext % bs:
            raise ValueError(f"a KV connector offered {num_ext} tokens for {req.req_id!r}: whole blocks only")
        if not is_async:
            raise ValueError("this scheduler supports asynchronous KV loads only (the request waits in "
                             "WAITING_FOR_KV); a synchronous load could not fall back to recomputing")
        if reserve is not None and self.kv.pool.num_free_blocks < num_ext // bs + len(hits) + reserve:
            return None
        new_blocks = self.kv.allocate_slots(req, num_ext, hits, external=True)
        if new_blocks is None:
            self._kv_blocked_step = True
            return None
        if reserve is None:
            self.waiting.pop()
        else:
            self.waiting.remove(req)
        self._leave_waiting(req)
        self._admitted_after_wait(req)
        self._loading[req.req_id] = _Load(req, num_hit_tokens + num_ext,
                                          time.monotonic() + self.connector.load_timeout_s, req.status, num_ext)
        req.status = RequestStatus.WAITING_FOR_KV
        req.num_computed_tokens = num_hit_tokens
        if self.kv.windowed:      # every group's blocks, a sliding group's only from its window at the end
            first = num_hit_tokens // bs
            self.connector.update_state_after_alloc_keyed(req, self.kv.block_keys(req, first, first + num_ext // bs),
                                                          num_ext)
        else:
            self.connector.update_state_after_alloc(req, [b.block_id for b in new_blocks], num_ext)
        return True

    def _end_load(self, load: _Load, ok: bool) -> None:
        """Back to the front of the queue; a loaded prefix is cached (and hit at admission), else recomputed."""
        req = load.request
        if ok:
            self.kv.cache_blocks(req, load.num_tokens_after)
            self.kv.free(req)
            remote = req.kv_transfer
            if isinstance(remote, RemotePrefill):    # P/D: computed by the prefill engine, except its own hits
                start = load.num_tokens_after - load.num_loaded
                credited = max(0, min(remote.num_cached_tokens, load.num_tokens_after) - start)
                req.num_transferred_tokens += load.num_loaded - credited
        else:
            self._no_load.add(req.req_id)
            self.kv.free(req)
        self._requeue(req, load.prior_status)

    def _requeue(self, req: Request, status: RequestStatus) -> None:
        req.num_computed_tokens = 0
        req.status = status
        self.waiting.add_front(req)
        self._enter_waiting(req)

    def _expire_loads(self) -> None:
        """Loads past their deadline fail: the request recomputes, its blocks wait for the late report."""
        now = time.monotonic()
        for req_id in [r for r, load in self._loading.items() if now >= load.deadline]:
            load = self._loading.pop(req_id)
            self._orphans[req_id] = self.kv.detach(load.request)
            self._no_load.add(req_id)
            self._requeue(load.request, load.prior_status)

    def _update_connector(self, output: KVConnectorOutput) -> None:
        update = self.connector.update_connector_output(output)
        for req_id, ok in update.finished_loads.items():
            orphan = self._orphans.pop(req_id, None)
            if orphan is not None:
                self.kv.free_blocks(orphan)
                continue
            load = self._loading.pop(req_id, None)
            if load is not None:
                self._end_load(load, ok)
        for req_id in update.finished_saving_req_ids:
            blocks = self._saving.pop(req_id, None)
            if blocks is not None:
                self.kv.free_blocks(blocks)

    def fail_kv_transfers(self, scheduler_output: SchedulerOutput) -> None:
        """The step that carried `scheduler_output` failed: its transfers count as failed (recompute)."""
        meta = scheduler_output.kv_connector_metadata
        if self.connector is None or meta is None or meta.is_empty:
            return
        self._update_connector(KVConnectorOutput(
            finished_loads={t.req_id: False for t in meta.loads if t.req_id is not None},
            finished_stores=[(t.block_hashes, False) for t in meta.stores]))

    def held_blocks(self) -> list[list[KVCacheBlock]]:
        """Blocks held for transfers on behalf of requests that are gone (for accounting checks)."""
        return list(self._orphans.values()) + list(self._saving.values())

    def has_pending_kv_transfers(self, for_steps: bool = False) -> bool:
        """Transfers still to plan or to hear back from. `for_steps`: only those a step would advance (P/D's
        holds for a reader are not: the engine may idle while it holds them)."""
        if self.connector is None:
            return False
        saving = bool(self._saving) and (not for_steps or self.connector.held_blocks_need_steps)
        return bool(self._loading or self._orphans or saving or self.kv.pool.has_changes()
                    or self.connector.has_pending_work())

    # ================================================================== update
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> StepOutput:
        """Append sampled tokens, apply stop conditions, free finished requests, build the step output.

        Outputs must arrive in the order their schedule() calls ran.
        """
        deltas, self._pending_deltas = self._pending_deltas, []
        if runner_output.kv_connector_output is not None and self.connector is not None:
            self._update_connector(runner_output.kv_connector_output)
        # overlapped: a later schedule() has moved num_computed_tokens on, past what this output computed
        ends = _computed_ends(scheduler_output) if self._retire(scheduler_output) else None
        logprobs = runner_output.logprobs
        prompt_logprobs = runner_output.prompt_logprobs    # only in the step that sampled a first token
        requests = self.requests
        kv = self.kv
        block_size = self.block_size
        num_scheduled = scheduler_output.num_scheduled_tokens
        running_status = RequestStatus.RUNNING
        for req_id, sampled in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            req = requests.get(req_id)
            if req is None:
                continue      # aborted after it was scheduled: drop its tokens
            if req.status is not running_status:
                if sampled:   # preempted after it was scheduled (see _update_preempted)
                    deltas.append(self._update_preempted(req, sampled, logprobs))
                    if prompt_logprobs is not None:     # its first token is kept: so are these
                        deltas[-1].prompt_logprobs = prompt_logprobs.get(req_id)
                continue
            end = req.num_computed_tokens if ends is None else ends[req_id]
            if end % block_size < num_scheduled[req_id]:
                kv.cache_blocks(req, end)     # this step completed a block
            if not sampled:
                continue      # a partial prefill chunk
            if len(sampled) == 1:      # the common case, inlined: one token, no stop
                tok = sampled[0]
                params = req.sampling_params
                n_out = req.num_output_tokens + 1
                if (n_out < params.max_tokens and tok != req.eos_token_id and not params.stop_token_ids
                        and req.num_tokens + 1 < self.max_model_len):
                    req.all_token_ids.append(tok)
                    req.num_output_tokens = n_out
                    req.num_tokens += 1
                    if req.num_tokens % block_size == 0:
                        req.hash_new_full_blocks()
                    deltas.append(RequestDelta(req_id, 0, "", sampled, None, None, None, None, req.num_prompt_tokens,
                                               req.num_cached_tokens or 0, req.first_scheduled_time, None,
                                               req.kv_wait_s))
                    if logprobs is not None and req_id in logprobs:
                        deltas[-1].logprobs = logprobs[req_id][:1]
                    if prompt_logprobs is not None:
                        deltas[-1].prompt_logprobs = prompt_logprobs.get(req_id)
                    continue
            new_tokens = self._append_and_check_stop(req, sampled)
            finished = req.status is not running_status
            delta = RequestDelta(req_id, 0, "", new_tokens, None, None, None, None, req.num_prompt_tokens,
                                 req.num_cached_tokens or 0, req.first_scheduled_time, None, req.kv_wait_s)
            if logprobs is not None and req_id in logprobs:
                delta.logprobs = logprobs[req_id][:len(new_tokens)]
            if prompt_logprobs is not None:
                delta.prompt_logprobs = prompt_logprobs.get(req_id)
            if finished:
                delta.finish_reason = req.status.finish_reason.value
                delta.stop_reason = req.stop_reason
                self._finish(req, was_running=True)
            deltas.append(delta)
        finished_ids, self._finished_for_output = self._finished_for_output, set()
        return StepOutput(deltas, finished_ids, self.make_stats())

    def _retire(self, scheduler_output: SchedulerOutput) -> bool:
        """Forget an output that arrived (and older ones a failed step abandoned); True if later ones are out."""
        q = self._awaiting_output
        for i, so in enumerate(q):
            if so is scheduler_output:
                del q[:i + 1]
                break
        return bool(q)

    def _update_preempted(self, req: Request, sampled: list[int],
                          logprobs: dict[str, list[Logprobs]] | None) -> RequestDelta:
        """Tokens sampled for a request that a later schedule() preempted before they arrived.

        Kept, as vLLM does: they came from valid KV, and they join the tokens the request recomputes
        when it resumes (the runner dropped its state on the preemption and gets all tokens back then).
        """
        num_before = req.num_tokens
        new_tokens = self._append_and_check_stop(req, sampled)
        self._waiting_prefill_tokens += req.num_tokens - num_before
        delta = RequestDelta(req.req_id, 0, "", new_tokens, None, None, None, None, req.num_prompt_tokens,
                             req.num_cached_tokens or 0, req.first_scheduled_time)
        if logprobs is not None and req.req_id in logprobs:
            delta.logprobs = logprobs[req.req_id][:len(new_tokens)]
        if req.status.is_finished:
            delta.finish_reason = req.status.finish_reason.value
            delta.stop_reason = req.stop_reason
            self.waiting.remove(req)
            self._leave_waiting(req)
            self._finish(req, was_running=False)
        return delta

    def _append_and_check_stop(self, req: Request, sampled: list[int]) -> list[int]:
        params = req.sampling_params
        new_tokens: list[int] = []
        for tok in sampled:
            req.append_output_token(tok)
            new_tokens.append(tok)
            n_out = req.num_output_tokens
            if n_out >= params.min_tokens:
                if tok == req.eos_token_id and not params.ignore_eos:
                    req.status = RequestStatus.FINISHED_STOPPED
                    break
                if params.stop_token_ids and tok in params.stop_token_ids:
                    req.status = RequestStatus.FINISHED_STOPPED
                    req.stop_reason = tok
                    break
            if n_out >= params.max_tokens or req.num_tokens >= self.max_model_len:
                req.status = RequestStatus.FINISHED_LENGTH_CAPPED
                break
        return new_tokens

    def _finish(self, req: Request, was_running: bool) -> None:
        """Release a finished request's blocks and state; report it to the runner and the front end."""
        if was_running:
            self.running.remove(req)
        if self.connector is None:
            self.kv.free(req)
        else:
            self._no_load.discard(req.req_id)
            if (self.connector.request_finished_keyed(req, self.kv.computed_block_keys(req)) if self.kv.windowed
                    else self.connector.request_finished(req, self.kv.computed_block_ids(req.req_id))):
                self._saving[req.req_id] = self.kv.detach(req)
            else:
                self.kv.free(req)
        del self.requests[req.req_id]
        self._finished_for_runner.add(req.req_id)
        self._finished_for_output.add(req.req_id)

    # ================================================================== abort
    def finish_requests(self, req_ids: str | list[str] | set[str],
                        status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Finish requests in any state (waiting, running, preempted). Unknown ids are ignored."""
        if isinstance(req_ids, str):
            req_ids = [req_ids]
        assert status.is_finished
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is None:
                continue
            was_running = req.status is RequestStatus.RUNNING
            if req.status is RequestStatus.WAITING_FOR_KV:      # the load keeps its blocks until reported
                load = self._loading.pop(req_id)
                self._orphans[req_id] = self.kv.detach(load.request)
            elif req.status is RequestStatus.WAITING_FOR_GRAMMAR:    # holds no blocks, not queued
                del self._awaiting_grammar[req_id]
            elif not was_running:     # waiting or preempted
                self.waiting.remove(req)
                self._leave_waiting(req)
            req.status = status
            self._pending_deltas.append(RequestDelta(
                req_id, 0, "", [], finish_reason=status.finish_reason.value,
                num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=req.num_cached_tokens or 0))
            self._finish(req, was_running)

    def abort_requests(self, req_ids: str | list[str] | set[str]) -> None:
        self.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    # ================================================================== state
    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        """Requests, or (with a KV connector) transfers still to plan or to hear back from."""
        return bool(self.requests) or (self.connector is not None and self.has_pending_kv_transfers())

    def awaiting_grammar(self) -> list[Request]:
        """Requests waiting for their grammar to compile (WAITING_FOR_GRAMMAR)."""
        return list(self._awaiting_grammar.values())

    def has_pending_output(self) -> bool:
        """Abort deltas or finished ids that the next update_from_output would report."""
        return bool(self._pending_deltas or self._finished_for_output)

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def load_of(self, req_ids: Iterable[str]) -> tuple[int, int, int]:
        """(running, waiting, queued prefill tokens) of the requests `req_ids`, counted as make_stats counts
        them for all requests: a waiting or preempted prompt whole, a running one's prompt tokens not computed
        yet, one whose KV is loading from a tier as waiting without tokens. Ids not queued here are skipped."""
        running = waiting = tokens = 0
        for rid in req_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                waiting += 1
                tokens += req.num_tokens - self._waiting_hits.get(rid, 0)
            elif req.status in (RequestStatus.WAITING_FOR_KV, RequestStatus.WAITING_FOR_GRAMMAR):
                waiting += 1
            elif req.status is RequestStatus.RUNNING:
                running += 1
                if req.num_output_tokens == 0:
                    tokens += max(0, req.num_tokens - req.num_computed_tokens)
        return running, waiting, tokens

    def make_stats(self) -> SchedulerStats:
        pc = self.kv.stats
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self._loading) + len(self._awaiting_grammar),
            kv_cache_usage=self.kv.usage,
            num_queued_prefill_tokens=(self._waiting_prefill_tokens - self._waiting_hit_tokens
                                       + self._running_prefill_tokens),
            num_scheduled_tokens=self._last_num_scheduled,
            prefix_cache_queries_total=pc.queries,
            prefix_cache_hits_total=pc.hits,
            recent_prefix_cache_queries=self.kv.recent.queries,
            recent_prefix_cache_hits=self.kv.recent.hits,
            num_preemptions_total=self._num_preemptions,
            kv_wait_s=self._expected_kv_wait(),
        )


def _computed_ends(so: SchedulerOutput) -> dict[str, int]:
    """Each scheduled request's num_computed_tokens as it stands once `so` has run."""
    n = so.num_scheduled_tokens
    ends = {r.req_id: r.num_computed_tokens + n[r.req_id] for r in so.scheduled_new_reqs}
    c = so.scheduled_cached_reqs
    ends.update((rid, computed + n[rid]) for rid, computed in zip(c.req_ids, c.num_computed_tokens))
    return ends
