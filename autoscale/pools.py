"""Per-pool autoscaling for P/D disaggregation (app/disagg.py): each pool scales on its own signals with the
engine-aware rule (`policy.decide`), given only the signals that measure its work.

- **prefill** pool: prefill backlog and rate against the TTFT SLO. Its replicas run prompts and first tokens
  only, so their running requests are prefills (not decodes), their held KV waits for decode replicas to read
  it (freed on read or at the transfer timeout: not a decode batch growing), and they have no TPOT. The
  requests queued at its callers (decode replicas waiting for a prefill replica) are prefill backlog: each at
  the pool's recent uncached tokens per request.
- **decode** pool: running sequences, KV usage and TPOT against the TPOT SLO. Its replicas' first tokens
  come from the prefill pool, so the TTFT they measure (their own first step, after the KV read) is not the
  client's and is left out; the prompts they prefill themselves (short uncached parts, fallbacks) still
  count as prefill work there.

A request counts in flight once, in the pool whose work it is: while the prefill pool prefills it, there
(the prefill replica's engine, or queued at that pool's callers); from the moment the decode replica's engine
holds it, in the decode pool. The decode replica reports the requests it holds that wait on the prefill pool
apart (`NUM_WAITING_ON_PREFILL`), not in flight: the decode pool's idle rule alone takes them, so that pool does
not scale to zero under a request whose stream it holds (they add no decode load).

`PoolPolicy` is the Serve adapter: `EngineAwarePolicy` with the pool's view of the context.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from enum import Enum
from typing import Any

from affinity_serve.autoscale.policy import PolicyConfig, PolicyState, ScalingDecision, decide
from affinity_serve.autoscale.serve_policy import EngineAwarePolicy
from affinity_serve.autoscale.signals import ReplicaSignals


#: a decode replica's autoscaling stat (app/disagg.py, DecodeReplica): its requests waiting on the prefill pool
NUM_WAITING_ON_PREFILL = "num_waiting_on_prefill"


class Pool(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"


def pool_signals(signals: Sequence[ReplicaSignals], pool: Pool, num_queued_at_callers: float = 0.0,
                 num_waiting_on_prefill: float = 0.0) -> tuple[list[ReplicaSignals], float]:
    """The signals `decide` should see for `pool`, and the requests queued at its callers it should count as
    decodes (see the module docstring): for the prefill pool those become prefill backlog instead.
    `num_waiting_on_prefill` (decode pool): its replicas' requests waiting on the prefill pool, which keep it
    from idling (its in-flight count, read only by the idle rule) and add no load."""
    if pool is Pool.DECODE:
        hold = num_waiting_on_prefill / len(signals) if signals else 0.0
        return [replace(s, ttft_p90_s=0.0, num_in_flight=s.num_in_flight + hold) for s in signals], \
            num_queued_at_callers
    out = [replace(s, num_running=0.0, kv_cache_usage=0.0, tpot_p90_s=0.0, decode_s_per_context_token=0.0,
                   mean_context_tokens=0.0) for s in signals]
    if not out:
        return out, num_queued_at_callers       # nothing reports: the queue is what starts the pool
    per_request = _uncached_tokens_per_request(signals)
    if num_queued_at_callers > 0 and per_request > 0:
        share = num_queued_at_callers * per_request / len(out)
        out = [replace(s, num_queued_prefill_tokens=s.num_queued_prefill_tokens + share) for s in out]
    return out, 0.0


def _uncached_tokens_per_request(signals: Sequence[ReplicaSignals]) -> float:
    """The pool's recent uncached prompt tokens per request (served rate over arrival rate), else what its
    waiting requests hold each; 0 if neither is known."""
    rate = sum(s.requests_per_s for s in signals)
    if rate > 0:
        return sum(s.prefill_tokens_per_s for s in signals) / rate
    waiting = sum(s.num_waiting for s in signals)
    return sum(s.num_queued_prefill_tokens for s in signals) / waiting if waiting > 0 else 0.0


def decide_pool(signals: Sequence[ReplicaSignals], current: int, now: float, state: PolicyState, cfg: PolicyConfig,
                pool: Pool, *, num_queued_at_callers: float = 0.0) -> ScalingDecision:
    """`policy.decide` for one pool of a P/D deployment, on that pool's signals."""
    sig, queued = pool_signals(signals, pool, num_queued_at_callers)
    return decide(sig, current, now, state, cfg, num_queued_at_callers=queued)


class PoolPolicy(EngineAwarePolicy):
    """Serve's custom policy for one pool: `policy_kwargs` are PolicyConfig's fields plus `pool`."""

    def __init__(self, pool: str, **policy_kwargs: Any):
        super().__init__(**policy_kwargs)
        self.pool = Pool(pool)

    def decision_inputs(self, ctx: Any) -> tuple[list[ReplicaSignals], float]:
        signals, queued = super().decision_inputs(ctx)
        waiting = num_waiting_on_prefill(ctx) if self.pool is Pool.DECODE else 0.0
        return pool_signals(signals, self.pool, queued, waiting)


def num_waiting_on_prefill(ctx: Any) -> float:
    """The running replicas' requests waiting on the prefill pool (NUM_WAITING_ON_PREFILL, Serve's average over
    its look-back window)."""
    per = (ctx.aggregated_metrics or {}).get(NUM_WAITING_ON_PREFILL) or {}
    running = set(ctx.running_replicas or ())
    return sum(float(v) for rid, v in per.items() if rid in running and v is not None)
