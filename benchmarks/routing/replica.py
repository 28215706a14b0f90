"""One simulated replica: the real Scheduler and KVCacheManager driven by a timing-model runner (no torch).

Every constant of the replica model lives here: `ReplicaSpec` (KV pool, batch limits) and `TimingModel`
(what a step costs). The defaults describe an 8B-class model on one H100-class GPU with its KV pool and
prompt lengths scaled down about 8x (so a 128-replica run fits in minutes of CPU), keeping the ratio
that matters for routing: a prompt's prefill costs about as much as its share of the decode steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from affinity_serve.engine.config import SchedulerConfig
from affinity_serve.engine.hashing import BlockHash
from affinity_serve.engine.kv_cache_manager import KVCacheManager
from affinity_serve.engine.kv_events import KVEventLog
from affinity_serve.engine.pacing import modelled_step_time_s
from affinity_serve.engine.request import Request
from affinity_serve.engine.sampling_params import SamplingParams
from affinity_serve.engine.scheduler import Scheduler
from affinity_serve.engine.types import KVCacheSnapshot, KVEventsReply, ModelRunnerOutput, SchedulerOutput


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """The engine each replica runs (the same for every replica and every router)."""

    block_size: int = 16
    num_kv_tokens: int = 16384          # KV pool per replica (1024 blocks of 16)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # chunked prefill: at most this many tokens per step
    max_model_len: int = 16384

    @property
    def num_blocks(self) -> int:
        return self.num_kv_tokens // self.block_size + 1     # + the null block


@dataclass(frozen=True, slots=True)
class TimingModel:
    """Step time = step_base_s + prefill_per_token_s x uncached tokens computed this step
                   + decode_per_context_token_s x context tokens of the sequences decoding this step.

    - step_base_s: one forward pass reads every weight once (an 8B model in bf16 at ~3 TB/s is ~6 ms;
      10 ms with launch and sampling overheads);
    - prefill_per_token_s: ~20k prompt tokens/s of compute-bound prefill (prefix-cache hits skip it);
    - decode_per_context_token_s: reading one token's K and V for every layer (8B with GQA: ~128 KiB
      per token at ~3 TB/s is ~40 ns).
    Attention's quadratic prefill term and sampling costs are left out: at these prompt lengths they are
    a few percent and the same for every router.
    """

    step_base_s: float = 0.010
    prefill_per_token_s: float = 50e-6
    decode_per_context_token_s: float = 40e-9

    def step_time_s(self, so: SchedulerOutput, requests: dict[str, Request]) -> float:
        return modelled_step_time_s(so, requests, self.step_base_s, self.prefill_per_token_s,
                                    self.decode_per_context_token_s)


@dataclass(slots=True)
class StepResult:
    """What one step produced, as the front end would see it."""

    first_token_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    num_cached_tokens: dict[str, int] = field(default_factory=dict)   # for first_token_ids
    kv_wait_s: dict[str, float] = field(default_factory=dict)         # for first_token_ids (Request.kv_wait_s)


class SharedCacheKV(KVCacheManager):
    """The shared-infinite-cache oracle's KV manager: a prefix hit may come from any block that any
    replica ever computed (`shared`, never evicted). Such a block is copied into the local pool at
    lookup, for free: the local pool still bounds what running requests hold."""

    def __init__(self, *args, shared: set[BlockHash], **kwargs):
        super().__init__(*args, **kwargs)
        self.shared = shared

    def get_computed_blocks(self, request: Request):
        if not self.reads_cache(request):
            return [], 0
        pool = self.pool
        hashes = request.block_hashes
        n = min((request.num_tokens - 1) // self.block_size, len(hashes))
        num_hit = 0
        while num_hit < n and (pool.get_cached_block(hashes[num_hit]) is not None
                               or hashes[num_hit] in self.shared):
            num_hit += 1
        self._materialize(hashes[:num_hit])
        return super().get_computed_blocks(request)

    def _materialize(self, hashes: list[BlockHash]) -> None:
        """Register the missing ones of `hashes` in the local pool as free cached blocks (MRU)."""
        pool = self.pool
        local = [b for b in (pool.get_cached_block(h) for h in hashes) if b is not None]
        missing = [h for h in hashes if pool.get_cached_block(h) is None]
        if not missing:
            return
        pool.touch(local)            # pin them: popping free blocks must not recycle these
        fresh = []
        for h in missing:
            if pool.num_free_blocks == 0:
                break
            block = pool.get_new_blocks(1)[0]
            block.block_hash = h
            pool.cached[h] = block
            fresh.append(block)
        pool.free_blocks(reversed(local + fresh))      # tail first: the head stays cached longest

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        super().cache_blocks(request, num_computed_tokens)
        self.shared.update(request.block_hashes[:num_computed_tokens // self.block_size])


class SimReplica:
    """One engine replica: add requests, run steps whose duration the timing model gives, report
    first tokens and finished requests; serve what a router pulls (a stats snapshot, the KV events since
    a number, a snapshot of the cached hashes) the way AsyncLLMEngine does: the pool's events move into a
    numbered, bounded `KVEventLog` after every step."""

    def __init__(self, index: int, spec: ReplicaSpec, timing: TimingModel, *,
                 shared_cache: set[BlockHash] | None = None, enable_caching: bool = True,
                 kv_event_buffer_blocks: int = 100_000):
        self.index = index
        self.spec = spec
        self.timing = timing
        kv_args = (spec.num_blocks, spec.block_size, spec.max_model_len)
        kv_kwargs = dict(enable_caching=enable_caching, enable_kv_cache_events=enable_caching)
        self.kv = (SharedCacheKV(*kv_args, shared=shared_cache, **kv_kwargs) if shared_cache is not None
                   else KVCacheManager(*kv_args, **kv_kwargs))
        #: simulated time, as of the last start_step(now): the scheduler's clock (its requests' KV waits)
        self.now = 0.0
        self.scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=spec.max_num_batched_tokens,
                                                   max_num_seqs=spec.max_num_seqs), self.kv, spec.max_model_len,
                                   clock=lambda: self.now)
        self._outputs: dict[str, list[int]] = {}
        self._started: set[str] = set()
        self._pending: SchedulerOutput | None = None
        self.event_log = KVEventLog(self._epoch(), kv_event_buffer_blocks)

    # ------------------------------------------------------------------ requests
    def add_request(self, req_id: str, prompt_token_ids: list[int], output_token_ids: list[int],
                    block_hashes: list[BlockHash]) -> None:
        """Queue a request whose output (the tokens the runner will "sample") is known in advance."""
        params = SamplingParams(max_tokens=len(output_token_ids), ignore_eos=True, temperature=0.0)
        self.scheduler.add_request(Request(req_id, prompt_token_ids, params, block_size=self.spec.block_size,
                                           block_hashes=block_hashes))
        self._outputs[req_id] = output_token_ids

    @property
    def is_busy(self) -> bool:
        return self._pending is not None

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------------ steps
    def start_step(self, now: float | None = None) -> float | None:
        """Schedule one step (at simulated time `now`); its duration in seconds, or None if there is nothing
        to run."""
        if now is not None:
            self.now = now
        so = self.scheduler.schedule()
        if so.is_empty:
            self.scheduler.update_from_output(so, ModelRunnerOutput([], []))
            return None
        self._pending = so
        return self.timing.step_time_s(so, self.scheduler.requests)

    def end_step(self) -> StepResult:
        so, self._pending = self._pending, None
        assert so is not None, "end_step without start_step"
        requests = self.scheduler.requests
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            req = requests[req_id]
            sampled.append([self._outputs[req_id][req.num_output_tokens]]
                           if req.num_computed_tokens >= req.num_tokens else [])
        waits = {r: requests[r].kv_wait_s for r in req_ids}
        out = self.scheduler.update_from_output(so, self._runner_output(req_ids, sampled))
        result = StepResult()
        for delta in out.outputs:
            if delta.token_ids and delta.req_id not in self._started:
                self._started.add(delta.req_id)
                result.first_token_ids.append(delta.req_id)
                result.num_cached_tokens[delta.req_id] = delta.num_cached_tokens
                result.kv_wait_s[delta.req_id] = waits.get(delta.req_id, 0.0)
            if delta.finished:
                result.finished_ids.append(delta.req_id)
                self._started.discard(delta.req_id)
                del self._outputs[delta.req_id]
        self.event_log.append(self._epoch(), self._take_events())
        return result

    # Hooks a replica with a KV connector overrides (benchmarks/routing/tiers.py).
    def _runner_output(self, req_ids: list[str], sampled: list[list[int]]) -> ModelRunnerOutput:
        return ModelRunnerOutput(req_ids, sampled)

    def _take_events(self) -> list:
        return self.kv.take_events()

    # ------------------------------------------------------------------ what the router may pull
    def load_view(self) -> dict:
        """The routing stats a router reads (app.stats.routing_stats: EngineLoad's names)."""
        st = self.scheduler.make_stats()
        return {"num_running_reqs": st.num_running_reqs, "num_waiting_reqs": st.num_waiting_reqs,
                "kv_cache_usage": st.kv_cache_usage, "num_queued_prefill_tokens": st.num_queued_prefill_tokens,
                "cache_epoch": self._epoch(), "num_blocks": self.kv.pool.num_blocks, "kv_wait_s": st.kv_wait_s}

    def kv_events_since(self, next_seq: int, epoch: str | None = None) -> KVEventsReply:
        return self.event_log.since(next_seq, epoch, 10_000)

    def kv_snapshot(self) -> KVCacheSnapshot:
        log = self.event_log
        return KVCacheSnapshot(log.epoch, log.next_seq, list(self.kv.pool.cached))

    def _epoch(self) -> str:
        return f"sim{self.index}:{self.kv.cache_epoch}"

    def num_held_blocks(self) -> int:
        """KV blocks held by requests (0 once every request finished)."""
        return self.kv.num_usable_blocks - self.kv.pool.num_free_blocks


def measure_saturation_rps(requests: list[tuple[list[int], list[int]]], spec: ReplicaSpec,
                           timing: TimingModel) -> float:
    """Requests/s one replica completes with prefix caching off and every request queued at t=0.

    Rate between the 10th and 90th percentile completions, so the ramp-up and the drain (a shrinking
    batch) do not bias it. `requests` are (prompt_token_ids, output_token_ids) pairs.
    """
    rep = SimReplica(0, spec, timing, enable_caching=False)
    for i, (prompt, out) in enumerate(requests):
        rep.add_request(f"cal{i}", prompt, out, [])
    now, done = 0.0, []
    while rep.has_work:
        dt = rep.start_step()
        if dt is None:
            raise RuntimeError("calibration replica stalled with unfinished requests")
        now += dt
        done.extend(now for _ in rep.end_step().finished_ids)
    lo, hi = int(0.1 * len(done)), int(0.9 * len(done)) - 1
    if hi <= lo or done[hi] <= done[lo]:
        return len(done) / now
    return (hi - lo) / (done[hi] - done[lo])
