"""What a replica tells the autoscaler: `ReplicaSignals` (the policy's input, one per replica) and the
`SignalRecorder` a replica keeps to turn its request timings into recent TTFT / TPOT / prefill-rate
numbers for `record_autoscaling_stats()`. No Ray imports; the metric names here are the wire format.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

import numpy as np

#: record_autoscaling_stats() keys (Serve carries them as ctx.aggregated_metrics[key][replica_id])
METRIC_KEYS = ("num_running", "num_waiting", "num_in_flight", "kv_cache_usage", "num_queued_prefill_tokens",
               "preemptions_per_s", "prefill_tokens_per_s", "refill_tokens_per_s", "ttft_p90_s", "tpot_p90_s",
               "num_recent_requests", "requests_per_s", "step_base_s", "prefill_s_per_token",
               "decode_s_per_context_token", "mean_context_tokens", "mean_prompt_tokens", "mean_output_tokens",
               "max_num_seqs", "prompt_tokens_per_s")


@dataclass(frozen=True, slots=True)
class ReplicaSignals:
    """One replica's load as the policy sees it (Serve averages each over its look-back window).

    `ttft_p90_s` / `tpot_p90_s` are over the replica's recent window and mean nothing when
    `num_recent_requests` is 0 (no first token in the window)."""

    num_running: float = 0.0               # sequences decoding or prefilling
    num_waiting: float = 0.0               # admitted to the engine, not yet scheduled
    num_in_flight: float = 0.0             # streams open on the replica (running + waiting + finishing)
    kv_cache_usage: float = 0.0            # 0-1, blocks held by requests
    num_queued_prefill_tokens: float = 0.0  # uncached prompt tokens not computed yet
    preemptions_per_s: float = 0.0
    prefill_tokens_per_s: float = 0.0      # uncached prompt tokens served per second, recent window
    #: of prefill_tokens_per_s, the tokens the router predicted another replica held (a prefix moving here)
    refill_tokens_per_s: float = 0.0
    ttft_p90_s: float = 0.0
    tpot_p90_s: float = 0.0
    num_recent_requests: float = 0.0       # first tokens in the recent window
    requests_per_s: float = 0.0            # first tokens per second over the recent window
    # The replica's own capacity model (0: not known; the policy then uses its priors). A step costs
    # step_base_s + prefill_s_per_token x prefill tokens + decode_s_per_context_token x the context tokens of
    # the sequences decoding in it: least squares over the replica's recent steps (`StepCostModel`).
    step_base_s: float = 0.0
    prefill_s_per_token: float = 0.0
    decode_s_per_context_token: float = 0.0
    mean_context_tokens: float = 0.0       # context per decoding sequence, recent steps
    mean_prompt_tokens: float = 0.0        # prompt and output lengths of the sequences finished in the window
    mean_output_tokens: float = 0.0
    max_num_seqs: float = 0.0              # the engine's batch cap
    #: all prompt tokens (the cached ones too) of the first tokens in the recent window, per second: what the
    #: prefill would be if the prefix cache stopped hitting (0: not reported)
    prompt_tokens_per_s: float = 0.0

    @classmethod
    def from_metrics(cls, m: Mapping[str, float]) -> ReplicaSignals:
        """From a record_autoscaling_stats() dict; unknown keys are ignored, missing ones are 0."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: float(v) for k, v in m.items() if k in known})

    def to_metrics(self) -> dict[str, float]:
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}


class StepCostModel:
    """A replica's step cost learned from its own steps: step_s = base + prefill_s_per_token x prefill tokens
    + decode_s_per_context_token x decoding context tokens, by least squares over the last `max_steps` steps.

    The steps are kept by count, not by time: the device's cost per token changes with the device, not with
    the traffic, and a quiet spell must not forget it. A coefficient whose regressor did not vary over the
    kept steps (no prefill in them, say) keeps its last fitted value: it is not observable from them."""

    MIN_STEPS = 8
    TRIM = 0.1

    def __init__(self, max_steps: int = 2048):
        self._steps: deque[tuple[float, float, float]] = deque(maxlen=max_steps)   # (prefill, context, step_s)
        self._ctx: deque[tuple[float, float]] = deque(maxlen=max_steps)            # (t, context per decode seq)
        self.coef: tuple[float, float, float] = (0.0, 0.0, 0.0)                    # (base, prefill, decode)

    def add(self, now: float, step_s: float, num_prefill_tokens: int, num_decode_seqs: int,
            num_context_tokens: int) -> None:
        self._steps.append((float(num_prefill_tokens), float(num_context_tokens), float(step_s)))
        if num_decode_seqs > 0:
            self._ctx.append((now, num_context_tokens / num_decode_seqs))

    def fit(self) -> tuple[float, float, float]:
        """Least squares, refitted without the steps it fits worst (`TRIM` of them, above the fit): a real
        replica's step stalls now and then (a GC pause, a busy host), and a stall only ever adds time."""
        if len(self._steps) < self.MIN_STEPS:
            return self.coef
        a = np.asarray(self._steps)
        cols = [np.ones(len(a))]
        which = [j for j in (0, 1) if np.ptp(a[:, j]) > 0]
        cols += [a[:, j] for j in which]
        x = np.stack(cols, axis=1)
        sol, *_ = np.linalg.lstsq(x, a[:, 2], rcond=None)
        resid = a[:, 2] - x @ sol
        keep = resid <= np.quantile(resid, 1.0 - self.TRIM)
        if keep.sum() >= self.MIN_STEPS:
            sol, *_ = np.linalg.lstsq(x[keep], a[keep, 2], rcond=None)
        coef = list(self.coef)
        coef[0] = max(0.0, float(sol[0]))
        for j, v in zip(which, sol[1:]):
            coef[1 + j] = max(0.0, float(v))
        self.coef = (coef[0], coef[1], coef[2])
        return self.coef

    def mean_context_tokens(self, since: float) -> float:
        recent = [c for t, c in self._ctx if t >= since]
        return float(np.mean(recent)) if recent else 0.0


class SignalRecorder:
    """A replica's recent request timings (a sliding window of `window_s` seconds).

    The replica calls `on_first_token` and `on_finished` from its streams and `snapshot` from
    record_autoscaling_stats(); times are `time.monotonic()` seconds. Not thread-safe: call from the
    replica's event loop only.
    """

    def __init__(self, window_s: float = 10.0, max_samples: int = 4096):
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0 (got {window_s})")
        self.window_s = window_s
        #: (t, ttft, uncached tokens, of them refilled: cached on another replica, all prompt tokens)
        self._first: deque[tuple[float, float, int, int, int]] = deque(maxlen=max_samples)
        self._tpot: deque[tuple[float, float]] = deque(maxlen=max_samples)          # (t, time per output token)
        #: (t, prompt tokens, output tokens) of finished sequences whose prompt length was given
        self._lengths: deque[tuple[float, int, int]] = deque(maxlen=max_samples)
        self.steps = StepCostModel()
        self._preempt: deque[tuple[float, int]] = deque(maxlen=max_samples)         # (t, preemptions total)
        #: lifetime sums of what on_first_token saw (for inspection: debug_state, tests), never windowed
        self.totals = {"num_first_tokens": 0, "uncached_prompt_tokens": 0, "refilled_tokens": 0}

    def on_first_token(self, now: float, ttft_s: float, num_uncached_prompt_tokens: int,
                       num_refilled_tokens: int = 0, num_prompt_tokens: int = 0) -> None:
        """`num_refilled_tokens`: of the uncached tokens, those the router predicted another replica held
        (`refilled_tokens`). `num_prompt_tokens`: the whole prompt, cached part included (0: not given, taken
        as the uncached tokens)."""
        refilled = max(0, min(num_refilled_tokens, num_uncached_prompt_tokens))
        prompt = max(num_prompt_tokens, num_uncached_prompt_tokens)
        self._first.append((now, ttft_s, num_uncached_prompt_tokens, refilled, prompt))
        self.totals["num_first_tokens"] += 1
        self.totals["uncached_prompt_tokens"] += num_uncached_prompt_tokens
        self.totals["refilled_tokens"] += refilled

    def on_finished(self, now: float, decode_s: float, num_output_tokens: int, num_prompt_tokens: int = 0) -> None:
        """A sequence ended: `decode_s` from its first to its last token over `num_output_tokens` tokens
        (`num_prompt_tokens`, when given, feeds the observed sequence lengths)."""
        if num_output_tokens > 1:
            self._tpot.append((now, decode_s / (num_output_tokens - 1)))
        if num_prompt_tokens > 0:
            self._lengths.append((now, num_prompt_tokens, num_output_tokens))

    def on_step(self, now: float, step_s: float, num_prefill_tokens: int, num_decode_seqs: int,
                num_context_tokens: int) -> None:
        """One engine step took `step_s`: `num_prefill_tokens` prompt tokens computed, `num_decode_seqs`
        sequences decoding one token each over `num_context_tokens` context tokens in all."""
        self.steps.add(now, step_s, num_prefill_tokens, num_decode_seqs, num_context_tokens)

    def snapshot(self, now: float, *, num_running: int, num_waiting: int, num_in_flight: int,
                 kv_cache_usage: float, num_queued_prefill_tokens: int,
                 num_preemptions_total: int, max_num_seqs: int = 0) -> ReplicaSignals:
        cut = now - self.window_s
        for q in (self._first, self._tpot, self._preempt, self._lengths):
            while q and q[0][0] < cut:
                q.popleft()
        self._preempt.append((now, num_preemptions_total))
        # Rates over the time the window's first tokens cover, and at least half the window: a replica's
        # first requests (new, or after an idle spell) must not read as a burst, and a stream that started a
        # few seconds ago must not read as half its rate either. Over the whole window, the first seconds
        # after an idle spell read as a small request rate beside the instantaneous load (queued prefill,
        # running sequences): a large load per request, which the policy's arrival headroom then multiplied
        # (the real-replica run went to 2 replicas 10 s after an idle start). n arrivals spread over a span
        # put the oldest at about n / (n + 1) of it: the span is the oldest's age x (n + 1) / n, so a steady
        # stream reads its rate rather than (n + 1) / n of it.
        span = self.window_s
        if self._first:
            n = len(self._first)
            span = max(self.window_s / 2, min(self.window_s, (now - self._first[0][0]) * (n + 1) / n))
        p0 = self._preempt[0][1]
        preempt_rate = (num_preemptions_total - p0) / self.window_s
        ttfts = [x[1] for x in self._first]
        tpots = [x[1] for x in self._tpot]
        return ReplicaSignals(
            num_running=num_running, num_waiting=num_waiting, num_in_flight=num_in_flight,
            kv_cache_usage=kv_cache_usage, num_queued_prefill_tokens=num_queued_prefill_tokens,
            preemptions_per_s=preempt_rate, prefill_tokens_per_s=sum(x[2] for x in self._first) / span,
            refill_tokens_per_s=sum(x[3] for x in self._first) / span,
            prompt_tokens_per_s=sum(x[4] for x in self._first) / span,
            ttft_p90_s=float(np.percentile(ttfts, 90)) if ttfts else 0.0,
            tpot_p90_s=float(np.percentile(tpots, 90)) if tpots else 0.0,
            num_recent_requests=len(ttfts), requests_per_s=len(ttfts) / span,
            **self._capacity(cut), max_num_seqs=max_num_seqs)

    def _capacity(self, since: float) -> dict[str, float]:
        base, prefill, decode = self.steps.fit()
        lengths = np.asarray([(p, o) for _, p, o in self._lengths], dtype=float).reshape(-1, 2)
        mean_prompt, mean_output = lengths.mean(axis=0).tolist() if len(lengths) else (0.0, 0.0)
        return dict(step_base_s=base, prefill_s_per_token=prefill, decode_s_per_context_token=decode,
                    mean_context_tokens=self.steps.mean_context_tokens(since), mean_prompt_tokens=mean_prompt,
                    mean_output_tokens=mean_output)


def refilled_tokens(num_prompt_tokens: int, num_cached_tokens: int,
                    cached_on: Sequence[tuple[str, int]] | None, replica_id: str) -> int:
    """Of a request's recomputed prompt tokens on `replica_id`, those the router predicted *another* replica
    held (`cached_on`, GenerateRequest's (replica, cached tokens) pairs): the prefix moved here (a new
    replica's first requests, a hot group spread to one more replica) rather than arrived new. What the
    router thought this replica held itself is not a refill: recomputing it means the replica evicted it,
    which is lasting load. 0 without a prediction."""
    elsewhere = max((n for rid, n in cached_on or () if rid != replica_id), default=0)
    return max(0, min(elsewhere, num_prompt_tokens) - num_cached_tokens)
