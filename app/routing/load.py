"""Per-replica load as the router sees it (stats snapshot + its own in-flight requests) and the TTFT model.

`LoadTracker` answers "how much uncached prefill is queued on replica r, and how many requests decode
there" between stats polls: the replica's latest snapshot, minus this router's requests that the snapshot
counted and that have since started (or finished), plus this router's requests sent after it. A snapshot
carries its age (`ReplicaLoadView.age_s`), so "after it" means after it was *taken*, not delivered: a
request routed while the snapshot was on its way stays counted. Both sides count the same thing for a
queued prompt: the engine its uncached part as its prefix cache stands (engine Scheduler), the router
its predicted uncached part. Applying a snapshot costs O(the replica's in-flight requests); every other
update is O(1).

`TTFTModel` predicts TTFT = work / prefill_rate + tier tokens / load_rate + running x step_cost + KV-pressure
penalty, and fits the first three online from observed TTFTs (ridge regression towards the configured
priors, exponentially forgetting old samples), so the rates are measured, not assumed. For admission control
it also predicts the wait for KV room (`kv_wait_many`): a backlog bound by the pool, not by prefill, from the
block demand ahead and the sequence lifetimes it observes (first token to finish).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from affinity_serve.app.routing.api import BlockHash, ReplicaLoadView
from affinity_serve.app.routing.config import AffinityConfig


@dataclass(slots=True)
class InFlight:
    """One request this router sent and has not seen finish."""

    replica_id: str
    uncached_tokens: int
    predicted_cached_tokens: int
    num_prompt_tokens: int
    block_hashes: list[BlockHash]
    routed_at: float
    work_ahead_tokens: int     # queued prefill tokens ahead of it when sent (for calibration)
    running_ahead: int
    started: bool = False
    tier_tokens: int = 0       # of predicted_cached_tokens, those to load from a KV tier
    started_at: float = 0.0
    kv_blocks: int = 0         # KV blocks it will hold there (prompt + expected output)
    out_tokens: int = 0        # output tokens it is expected to generate (for the KV-wait model)
    held: bool = False         # an admission hold: never reaches the replica, so no snapshot includes it
    remote: bool = False       # P/D: prefilled by another pool (prefill_elsewhere): no queued prefill here

    def pending_at(self, taken: float) -> bool:
        """Whether a snapshot taken at `taken` leaves this request out (it is added on top)."""
        return self.held or self.routed_at >= taken


@dataclass(slots=True)
class ReplicaLoad:
    """One replica's load as this router sees it; `queued_prefill_tokens` and `decode_load` are kept
    current on every change (the policy reads them per candidate per request, so they are plain fields)."""

    replica_id: str
    node_id: str | None = None
    stats: ReplicaLoadView = field(default_factory=ReplicaLoadView)
    taken_at: float = float("-inf")   # when the snapshot was taken (the tracker's clock)
    pending_tokens: int = 0    # uncached tokens of requests sent since the snapshot, not started
    num_pending: int = 0       # requests sent since the snapshot, not finished
    retired_tokens: int = 0    # tokens counted in the snapshot's queue that have started since
    num_retired: int = 0       # requests counted running in the snapshot that have finished since
    pending_blocks: int = 0    # KV blocks of requests sent since the snapshot, not finished
    retired_blocks: int = 0    # KV blocks of requests counted running in the snapshot, finished since
    queued_prefill_tokens: int = 0
    decode_load: int = 0
    kv_usage: float = 0.0
    in_flight: dict[str, InFlight] = field(default_factory=dict)     # this router's, in routing order
    in_flight_out_tokens: int = 0     # expected output tokens of `in_flight`, summed
    #: (finished_at, routed_at, started_at or None, uncached tokens) of requests finished since the
    #: snapshot was taken: a later snapshot taken before they finished still counts them
    finished: deque = field(default_factory=deque)

    def refresh(self) -> None:
        s = self.stats
        self.queued_prefill_tokens = max(0, s.num_queued_prefill_tokens - self.retired_tokens) + self.pending_tokens
        self.decode_load = max(0, s.num_running - self.num_retired) + self.num_pending
        # KV usage as of now: the snapshot's, plus the blocks this router's requests sent since will hold,
        # minus those of its requests that held blocks in it and finished since (a burst sent between two
        # snapshots must not find every replica's pool looking as empty as it was)
        if s.num_blocks and (self.pending_blocks or self.retired_blocks):
            self.kv_usage = min(1.0, max(0.0, s.kv_cache_usage
                                         + (self.pending_blocks - self.retired_blocks) / s.num_blocks))
        else:
            self.kv_usage = s.kv_cache_usage


_MAX_FINISHED = 4096      # per replica: finishes remembered for a snapshot taken before them
#: seconds per output token a sequence holds its KV blocks (decode time per token at load) until finished
#: requests were observed: a typical GPU decode step of a mid-size model in a busy batch
SEQ_TOKEN_S_PRIOR = 0.02
#: weight of each replica stats report in the mean reported decode step (`TTFTModel.observe_step_time`)
STEP_REPORT_WEIGHT = 0.1
#: an idle replica's TTFT for less prefill work than this is mostly fixed per-request overhead (scheduling,
#: calls): read as a per-token rate it made the prefill rate 20x too slow after a few short prompts, and
#: admission then refused long prompts on an idle server, for good (a refused request teaches nothing)
MIN_CALIBRATION_WORK_TOKENS = 512


class LoadTracker:
    """Replica loads plus the router's in-flight requests. Unknown ids are ignored, never errors."""

    def __init__(self, max_in_flight_age_s: float) -> None:
        self.max_in_flight_age_s = max_in_flight_age_s
        self._loads: dict[str, ReplicaLoad] = {}
        self._in_flight: dict[str, InFlight] = {}
        self._by_age: deque[tuple[float, str]] = deque()

    def add_replica(self, replica_id: str, node_id: str | None = None) -> None:
        load = self._loads.get(replica_id)
        if load is None:
            self._loads[replica_id] = ReplicaLoad(replica_id, node_id)
        else:
            load.node_id = node_id

    def remove_replica(self, replica_id: str) -> None:
        load = self._loads.pop(replica_id, None)
        if load is not None:
            for req_id in load.in_flight:
                self._in_flight.pop(req_id, None)

    def set_stats(self, replica_id: str, stats: ReplicaLoadView, now: float) -> None:
        """Apply a snapshot taken `stats.age_s` before `now`: this router's requests routed after that
        instant are added on top; those routed before it and started (or finished) after it are taken off.
        Re-applying a snapshot gives the same load (it is recomputed, never decremented twice)."""
        load = self._loads.get(replica_id)
        if load is None:
            return
        taken = now - max(0.0, stats.age_s)
        load.stats, load.taken_at = stats, taken
        pending_tokens = num_pending = retired_tokens = num_retired = pending_blocks = retired_blocks = 0
        for f in load.in_flight.values():
            if f.pending_at(taken):
                num_pending += 1
                pending_blocks += f.kv_blocks
                if not f.started:
                    pending_tokens += f.uncached_tokens
            elif f.started and f.started_at > taken:
                retired_tokens += f.uncached_tokens
        finished = load.finished
        while finished and finished[0][0] <= taken:
            finished.popleft()                                # finished before the snapshot: not in it
        for _, routed_at, started_at, uncached, kv_blocks in finished:
            if routed_at >= taken:
                continue
            if started_at is not None and started_at <= taken:
                num_retired += 1                              # counted running, gone since
                retired_blocks += kv_blocks
            else:
                retired_tokens += uncached                    # counted queued, gone since
        load.pending_tokens, load.num_pending = pending_tokens, num_pending
        load.retired_tokens, load.num_retired = retired_tokens, num_retired
        load.pending_blocks, load.retired_blocks = pending_blocks, retired_blocks
        load.refresh()

    # ------------------------------------------------------------ reads
    def get(self, replica_id: str) -> ReplicaLoad:
        """The replica's load (an idle placeholder for an unknown id)."""
        load = self._loads.get(replica_id)
        return load if load is not None else ReplicaLoad(replica_id)

    def in_flight(self, req_id: str) -> InFlight | None:
        return self._in_flight.get(req_id)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    # ------------------------------------------------------------ request lifecycle
    def add(self, req_id: str, replica_id: str, *, uncached_tokens: int, predicted_cached_tokens: int,
            num_prompt_tokens: int, block_hashes: list[BlockHash], now: float, tier_tokens: int = 0,
            kv_blocks: int = 0, out_tokens: int = 0, held: bool = False) -> None:
        if req_id in self._in_flight:
            self._cancel(req_id)
        load = self._loads.get(replica_id)
        if load is None:
            return
        f = self._in_flight[req_id] = InFlight(
            replica_id, uncached_tokens, predicted_cached_tokens, num_prompt_tokens, block_hashes, now,
            load.queued_prefill_tokens, load.decode_load, tier_tokens=tier_tokens, kv_blocks=kv_blocks,
            out_tokens=out_tokens, held=held)
        load.in_flight[req_id] = f
        load.in_flight_out_tokens += out_tokens
        if now >= load.taken_at:
            load.pending_tokens += uncached_tokens
            load.num_pending += 1
            load.pending_blocks += kv_blocks
            load.refresh()
        self._by_age.append((now, req_id))

    def move(self, req_id: str, replica_id: str, *, uncached_tokens: int, predicted_cached_tokens: int,
             now: float, tier_tokens: int = 0) -> InFlight | None:
        """The request went to another replica than recorded: re-account it there (not yet started)."""
        f = self._in_flight.get(req_id)
        if f is None or f.replica_id == replica_id:
            return f
        self._cancel(req_id)
        self.add(req_id, replica_id, uncached_tokens=uncached_tokens, predicted_cached_tokens=predicted_cached_tokens,
                 num_prompt_tokens=f.num_prompt_tokens, block_hashes=f.block_hashes, now=now,
                 tier_tokens=tier_tokens, kv_blocks=f.kv_blocks, out_tokens=f.out_tokens)
        if f.remote:
            self.prefill_elsewhere(req_id)
        return self._in_flight.get(req_id)

    def start(self, req_id: str, now: float) -> InFlight | None:
        """First token seen: the request's prefill left the replica's queue."""
        f = self._in_flight.get(req_id)
        if f is None or f.started:
            return None
        f.started, f.started_at = True, now
        load = self._loads.get(f.replica_id)
        if load is not None:
            if f.pending_at(load.taken_at):
                load.pending_tokens -= f.uncached_tokens
            else:
                load.retired_tokens += f.uncached_tokens
            load.refresh()
        return f

    def prefill_elsewhere(self, req_id: str) -> None:
        """P/D: the request's prompt is prefilled by another pool and its replica here only reads the KV: its
        uncached part stops counting as prefill queued there (and its TTFT, the other pool's, is not this
        replica's to learn from: `remote`)."""
        f = self._in_flight.get(req_id)
        if f is None or f.started or f.remote:
            return
        load = self._loads.get(f.replica_id)
        if load is not None and f.pending_at(load.taken_at):
            load.pending_tokens -= f.uncached_tokens
            load.refresh()
        f.uncached_tokens = f.tier_tokens = 0
        f.remote = True

    def cancel(self, req_id: str) -> None:
        """Forget a request that never reached a replica (an admission hold that was routed or expired)."""
        if req_id in self._in_flight:
            self._cancel(req_id)

    @staticmethod
    def _unpend(load: ReplicaLoad, f: InFlight) -> None:
        """Take a request sent after the snapshot off the load added on top of it."""
        load.num_pending -= 1
        load.pending_blocks -= f.kv_blocks
        if not f.started:
            load.pending_tokens -= f.uncached_tokens

    def _cancel(self, req_id: str) -> None:
        """Forget a request that never reached its recorded replica (moved, or re-added)."""
        f = self._in_flight.pop(req_id)
        load = self._loads.get(f.replica_id)
        if load is None:
            return
        if load.in_flight.pop(req_id, None) is not None:
            load.in_flight_out_tokens -= f.out_tokens
        if f.pending_at(load.taken_at):
            self._unpend(load, f)
            load.refresh()

    def finish(self, req_id: str, now: float) -> InFlight | None:
        f = self._in_flight.pop(req_id, None)
        if f is None:
            return None
        load = self._loads.get(f.replica_id)
        if load is not None:
            if load.in_flight.pop(req_id, None) is not None:
                load.in_flight_out_tokens -= f.out_tokens
            if f.pending_at(load.taken_at):
                self._unpend(load, f)
            elif not f.started:
                load.retired_tokens += f.uncached_tokens      # counted queued, never ran
            elif f.started_at <= load.taken_at:
                load.num_retired += 1                         # counted running
                load.retired_blocks += f.kv_blocks
            load.refresh()
            load.finished.append((now, f.routed_at, f.started_at if f.started else None, f.uncached_tokens,
                                  f.kv_blocks))
            while len(load.finished) > _MAX_FINISHED and load.finished:
                load.finished.popleft()
        return f

    def expire(self, now: float) -> None:
        """Forget requests older than max_in_flight_age_s (a lost on_finished must not be load forever)."""
        by_age, cutoff = self._by_age, now - self.max_in_flight_age_s
        while by_age and by_age[0][0] <= cutoff:
            routed_at, req_id = by_age.popleft()
            f = self._in_flight.get(req_id)
            if f is not None and f.routed_at == routed_at:
                self.finish(req_id, now)


class TTFTModel:
    """TTFT(work, load, running, kv) = work/rate + load/load_rate + running*step + kv_penalty, with rate,
    load_rate and step fitted online.

    `work`: uncached prefill tokens (queued ahead + the request's own); `load`: the request's tokens loaded
    from a KV tier (offload or node-shared store: a copy, not a recompute). The fit is in prior-normalised
    units: z1 = work/rate0, z2 = running*step0, z3 = load/load_rate0 (all seconds), y = observed TTFT ~
    a*z1 + b*z2 + c*z3, ridge towards a = b = c = 1 with the prior worth `prior_weight` average samples,
    old samples halving in weight every `half_life` samples. rate = rate0/a, step = step0*b,
    load_rate = load_rate0/c, each clamped to [1/20, 20] x its prior so one odd sample cannot zero or
    explode it. Until a sample with tier tokens arrives, the load rate stays at its prior.
    """

    def __init__(self, config: AffinityConfig) -> None:
        self.rate0 = config.prefill_tokens_per_s
        self.step0 = config.decode_step_s
        self.load_rate0 = config.tier_load_tokens_per_s
        self.calibrate = config.calibrate
        self.decay = 0.5 ** (1.0 / config.calibration_half_life)
        self.prior_weight = config.calibration_prior_weight
        self.kv_threshold = config.kv_pressure_threshold
        self.kv_penalty_s = config.kv_pressure_penalty_s
        self.measured_kv_wait_weight = config.measured_kv_wait_weight
        self.prefill_tokens_per_s = self.rate0
        self.decode_step_s = self.step0
        self.tier_load_tokens_per_s = self.load_rate0
        self.num_samples = 0
        #: seconds a sequence stays in its replica's pool per expected output token (first token to finish,
        #: over the tokens the router expected it to generate): the KV-wait model's pool turnover
        self.seq_token_s = SEQ_TOKEN_S_PRIOR
        self.num_lifetimes = 0
        #: the replicas' reported mean decode step (a decayed mean over their stats), which stands in for
        #: SEQ_TOKEN_S_PRIOR as the lifetime estimate's prior: right for the hardware from the first stats
        self.reported_step_s: float | None = None
        self._life_w = 0.0
        self._life_sum = 0.0
        self._w = 0.0
        self._s = [[0.0] * 3 for _ in range(3)]     # decayed sums of z_i * z_j
        self._sy = [0.0] * 3                          # decayed sums of z_i * y

    def predict_many(self, loads: list[ReplicaLoad], own_tokens: list[int],
                     tier_tokens: list[int] | None = None, own_blocks: list[int] | None = None,
                     kv_penalty: bool = True) -> list[float]:
        """Predicted TTFT per replica, for a request with `own_tokens[i]` uncached tokens on `loads[i]` and
        `tier_tokens[i]` to load from a KV tier there.

        KV pressure is judged on the pool as it would be with the request in it: `own_blocks[i]` (the new
        blocks it needs there, uncached prompt + expected output) over the replica's pool size joins its
        usage. The penalty rises linearly from 0 at `kv_pressure_threshold` by `kv_pressure_penalty_s` per
        pool's worth of usage above it (over 1 - threshold when the threshold is below 1), at most twice the
        penalty. At threshold 1 (the default) only a request that does not fit pays, in proportion to its
        overage: a full small pool must not shed the requests of the prefixes it caches. `kv_penalty` False:
        no penalty (admission control, which predicts the wait for KV room itself: kv_wait_many)."""
        rate, step, thr, pen = self.prefill_tokens_per_s, self.decode_step_s, self.kv_threshold, self.kv_penalty_s
        if not kv_penalty:
            pen = 0.0
        span = 1.0 - thr if thr < 1.0 else 1.0
        if own_blocks is None:
            usage = [c.kv_usage for c in loads]
        else:
            usage = [c.kv_usage + b / c.stats.num_blocks if c.stats.num_blocks else c.kv_usage
                     for c, b in zip(loads, own_blocks)]
        w = self.measured_kv_wait_weight       # x the engine's reported wait for KV blocks (0 where none)
        out = [(c.queued_prefill_tokens + u) / rate + c.decode_load * step + w * c.stats.kv_wait_s
               + (pen * min(2.0, (k - thr) / span) if k > thr else 0.0)
               for c, u, k in zip(loads, own_tokens, usage)]
        if tier_tokens:
            load_rate = self.tier_load_tokens_per_s
            out = [t + n / load_rate for t, n in zip(out, tier_tokens)]
        return out

    def kv_wait_many(self, loads: list[ReplicaLoad], own_blocks: list[int], own_out_tokens: int,
                     block_size: int) -> list[float]:
        """Predicted wait for KV room per replica: how long until enough of `loads[i]`'s pool frees for the
        requests queued ahead and this one (`own_blocks[i]` new blocks, `own_out_tokens` expected output).

        Demand ahead, in blocks: the snapshot's held blocks, its queue's uncached prompt tokens plus an
        expected output for each waiting request, and the blocks (prompt + expected output) of this router's
        requests sent since the snapshot, less those of its requests that held blocks then and finished
        since. The excess over the pool has to free first; a full pool frees about its size once per sequence
        lifetime, so the wait is excess / pool x lifetime, where the lifetime is the mean expected output of
        this router's in-flight requests there (this request's without any) x `seq_token_s`. 0 while the
        demand fits, or without a reported pool size. O(1) per replica."""
        rate = self.seq_token_s
        out: list[float] = []
        for c, own in zip(loads, own_blocks):
            s = c.stats
            pool = s.num_blocks
            if not pool:
                out.append(0.0)
                continue
            n = len(c.in_flight)
            per_req = c.in_flight_out_tokens / n if n else float(own_out_tokens)
            queued = max(0, s.num_queued_prefill_tokens - c.retired_tokens)
            demand = (s.kv_cache_usage * pool + (queued + s.num_waiting * per_req) / block_size
                      + c.pending_blocks - c.retired_blocks + own)
            excess = demand - pool
            out.append(excess / pool * per_req * rate if excess > 0 else 0.0)
        return out

    def admission_waits(self, loads: list[ReplicaLoad], matched: list[int], tier: list[int] | None,
                        prompt: int, out_tokens: int, block_size: int) -> list[float]:
        """Per replica, the wait admission control predicts for a request of `prompt` tokens whose first
        `matched[i]` blocks `loads[i]` holds in its pool and `tier[i]` more in a KV tier: `predict_many`'s
        TTFT, where the pool size is known with `kv_wait_many`'s wait for KV room in place of the KV-pressure
        penalty (both would count the same overage). One pass, for what admission adds to every request's
        routing (at 128 replicas it took more CPU than the decision itself as three passes)."""
        rate, step, thr, pen = self.prefill_tokens_per_s, self.decode_step_s, self.kv_threshold, self.kv_penalty_s
        span = 1.0 - thr if thr < 1.0 else 1.0
        load_rate, seq_rate = self.tier_load_tokens_per_s, self.seq_token_s
        cap = max(0, prompt - 1) // block_size
        out: list[float] = []
        for i, c in enumerate(loads):
            m = matched[i]
            n_tier = tier[i] if tier is not None else 0
            cached = min(m + n_tier, cap) * block_size
            own = prompt - cached
            t = (c.queued_prefill_tokens + own) / rate + c.decode_load * step
            if tier is not None:
                t += (cached - min(m, cap) * block_size) / load_rate
            s = c.stats
            pool = s.num_blocks
            if pool:
                own_blocks = -(-(own + out_tokens) // block_size)
                k = len(c.in_flight)
                per_req = c.in_flight_out_tokens / k if k else float(out_tokens)
                queued = max(0, s.num_queued_prefill_tokens - c.retired_tokens)
                excess = (s.kv_cache_usage * pool + (queued + s.num_waiting * per_req) / block_size
                          + c.pending_blocks - c.retired_blocks + own_blocks) - pool
                if excess > 0:
                    t += excess / pool * per_req * seq_rate
            elif c.kv_usage > thr:
                t += pen * min(2.0, (c.kv_usage - thr) / span)
            out.append(t)
        return out

    def observe_lifetime(self, out_tokens: int, seconds: float) -> None:
        """A finished request's time from first token to finish and the output it was expected to produce
        (seconds per expected token: a request that stops early counts as a faster one, consistently with
        the expected outputs the wait is computed from). A weighted mean, forgetting as the TTFT fit does,
        pulled towards the prior by `calibration_prior_weight` samples; clamped to [1/20, 20] x the prior."""
        if not self.calibrate or out_tokens <= 0 or seconds <= 0:
            return
        d = self.decay
        self._life_w = self._life_w * d + 1.0
        self._life_sum = self._life_sum * d + seconds / out_tokens
        self.num_lifetimes += 1
        self._update_seq_token_s()

    def observe_step_time(self, step_s: float) -> None:
        """A replica's reported mean decode step (its stats' `step_time_s`): a sequence that runs gets a token
        per step, so until lifetimes are observed this is the seconds per token a sequence holds its blocks,
        on this fleet's hardware (the fixed prior is a mid-size model's GPU step: 4x too long on a fast GPU,
        too short on a CPU or a slow device, so admission mispredicted the first dozen requests' KV wait)."""
        if not self.calibrate or not step_s > 0:
            return
        old = self.reported_step_s
        self.reported_step_s = step_s if old is None else old + STEP_REPORT_WEIGHT * (step_s - old)
        self._update_seq_token_s()

    def _update_seq_token_s(self) -> None:
        """The lifetime estimate: observed seconds per expected token (decayed mean) pulled towards the prior
        (the reported step, else SEQ_TOKEN_S_PRIOR) by `calibration_prior_weight` samples; clamped to 1/20 of
        the smaller and 20 x the larger of the two priors."""
        prior = self.reported_step_s if self.reported_step_s is not None else SEQ_TOKEN_S_PRIOR
        w0 = self.prior_weight
        est = (prior * w0 + self._life_sum) / (w0 + self._life_w)
        self.seq_token_s = min(20.0 * max(prior, SEQ_TOKEN_S_PRIOR), max(min(prior, SEQ_TOKEN_S_PRIOR) / 20.0, est))

    def observe(self, work_tokens: int, running: int, ttft_s: float, tier_tokens: int = 0) -> None:
        """One request's TTFT with the prefill work (queued ahead + its own uncached), running load and
        the tokens it loaded from a tier."""
        if not self.calibrate or ttft_s <= 0:
            return
        if running == 0 and tier_tokens == 0 and work_tokens < MIN_CALIBRATION_WORK_TOKENS:
            return                       # overhead, not rate (MIN_CALIBRATION_WORK_TOKENS)
        z = (work_tokens / self.rate0, running * self.step0, tier_tokens / self.load_rate0)
        if sum(z) <= 1e-6:
            return                       # nothing to learn from a free request (fully cached, idle)
        d = self.decay
        self._w = self._w * d + 1.0
        for i in range(3):
            row = self._s[i]
            for j in range(3):
                row[j] = row[j] * d + z[i] * z[j]
            self._sy[i] = self._sy[i] * d + z[i] * ttft_s
        self.num_samples += 1
        self._solve()

    def _solve(self) -> None:
        # Unknowns whose regressor never varied (no tier loads yet) stay at their prior (coefficient 1).
        active = [i for i in range(3) if self._s[i][i] > 0.0]
        a = [[self._s[i][j] for j in active] for i in active]
        b = [self._sy[i] for i in active]
        for k, i in enumerate(active):
            lam = self.prior_weight * self._s[i][i] / self._w + 1e-12
            a[k][k] += lam
            b[k] += lam
        coef = _solve_spd(a, b)
        if coef is None:
            return
        out = [1.0, 1.0, 1.0]
        for k, i in enumerate(active):
            out[i] = min(20.0, max(0.05, coef[k]))
        self.prefill_tokens_per_s = self.rate0 / out[0]
        self.decode_step_s = self.step0 * out[1]
        self.tier_load_tokens_per_s = self.load_rate0 / out[2]


def _solve_spd(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Solve a x = b for a small symmetric positive definite `a` (Gaussian elimination); None if singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for k in range(n):
        if m[k][k] <= 1e-300:
            return None
        for i in range(k + 1, n):
            f = m[i][k] / m[k][k]
            for j in range(k, n + 1):
                m[i][j] -= f * m[k][j]
    x = [0.0] * n
    for i in range(n - 1, -1, -1):
        x[i] = (m[i][n] - sum(m[i][j] * x[j] for j in range(i + 1, n))) / m[i][i]
    return x
