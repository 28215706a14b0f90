"""The engine-aware scaling rule: per-replica engine signals + the current replica count -> a target count
and a reason. Pure (no Ray, no clock): the caller passes `now` and keeps the returned `PolicyState`.

The rule (docs/autoscaling.md writes it out):
1. Predict the load in replica units: prefill work (recent uncached prompt tokens per second, the refills
   of prefixes the router saw cached on another replica at `refill_weight`, plus the queued backlog that
   must be prefilled within the TTFT SLO) over one replica's prefill rate R,
   plus the sequences decoding over one replica's decode capacity C within the TPOT SLO and the KV target;
   R and C are learned from the replicas' own step costs and sequence lengths where they report them
   (`replica_capacity`, `decode_capacity`), the configured priors otherwise.
   KV usage adds a floor: the fleet's held KV (grown to its sequences' life's mean) over the KV target. A rising load
   is projected
   the replicas' measured start-up time ahead (`trend_lead_s` until one came up; its slope over
   `trend_window_s`), as new replicas serve only after their start-up.
   A jump in the work per request (longer prompts, a cache that stops hitting) is read from the requests
   waiting as soon as they queue (`queued_cost_projection`), not only as the served rate catches up.
2. Scale up when that needs more replicas at `target_utilization` or leaves less spare capacity than
   `headroom_z` standard deviations of the arrivals expected within one TTFT SLO, or fewer replicas than carry a
   prefix cache that stops hitting until new ones serve (`cache_loss_headroom`), or (reactively) when the observed
   TTFT / TPOT p90 passes its SLO (by how far it is past it) or replicas preempt above
   `preemption_rate_threshold` per replica for `preemption_persist_s` (one more replica). Scale down only
   when the load inflated by target / downscale utilization fits in fewer replicas by the up rule and
   nothing breaches its SLO: that inflation is the hysteresis band. Each direction must hold for its delay
   before it acts, except an up step whose load already exceeds the current replicas' capacity
   (`overload_skips_delay`): a new replica's start-up is then the only wait left.
3. Scale to zero only with `min_replicas: 0`, after `downscale_to_zero_delay_s` with nothing in flight and
   no request started within the replicas' signal window.
   From zero, any queued request starts the replicas its load needs at once.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum

from pydantic import BaseModel, ConfigDict, Field, model_validator

from affinity_serve.autoscale.signals import ReplicaSignals


class Reason(str, Enum):
    HOLD = "hold"
    NO_METRICS = "no_metrics"              # no replica reported yet: keep the count
    BOUNDS = "bounds"                      # the count was outside [min_replicas, max_replicas]
    COLD_START = "cold_start"              # zero replicas and requests waiting
    UP_PREDICTED = "up_predicted"          # the predicted load needs more replicas
    UP_SLO = "up_slo"                      # observed TTFT/TPOT past its SLO, or preemptions
    UP_SATURATED = "up_saturated"          # a replica at its batch cap with requests waiting
    UP_PENDING = "up_pending"              # an up condition holds; waiting out upscale_delay_s
    DOWN = "down"
    DOWN_PENDING = "down_pending"
    TO_ZERO = "to_zero"
    TO_ZERO_PENDING = "to_zero_pending"


class PolicyConfig(BaseModel):
    """The rule's knobs, defined once: app/config.py's `autoscaling` section is this model plus Serve's own
    autoscaling options (AutoscalingSection subclasses it), so YAML keys, defaults, limits and descriptions
    are these. Crosses to Serve's controller as `model_dump(mode="json")` (builder.engine_policy_kwargs), the
    one place it travels as a dict: Serve takes a custom policy's kwargs as JSON only."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: int = Field(1, ge=0, description="0 allows scale to zero")
    max_replicas: int = Field(2, ge=1, description="the most model replicas the autoscaler starts")
    upscale_delay_s: float = Field(2.0, ge=0, description="an up condition must hold this long")
    downscale_delay_s: float = Field(30.0, ge=0, description="a down condition must hold this long")
    downscale_to_zero_delay_s: float = Field(60.0, ge=0, description="idle this long before 1 -> 0")
    ttft_slo_s: float = Field(2.0, gt=0, description="p90 time to first token to hold")
    tpot_slo_s: float = Field(0.2, gt=0, description="p90 time per output token to hold")
    prefill_tokens_per_s: float = Field(2000.0, gt=0, description="one replica's uncached prefill rate "
                                        "(calibrate per model and device)")
    decode_seqs_per_replica: float = Field(32.0, gt=0, description="sequences one replica decodes within "
                                           "tpot_slo_s")
    kv_usage_target: float = Field(0.85, gt=0, le=1, description="held KV per replica to stay under")
    target_utilization: float = Field(0.8, gt=0, le=1, description="scale up above this predicted load "
                                      "per replica")
    downscale_utilization: float = Field(0.5, gt=0, lt=1, description="scale down only if fewer replicas "
                                         "stay under this")
    slo_cooldown_s: float = Field(10.0, ge=0, description="after a scale-up, SLO breaches wait this long "
                                  "(they lag)")
    max_upscale_factor: float = Field(2.0, ge=1, description="one SLO-driven step at most multiplies by this")
    preemption_rate_threshold: float = Field(0.02, ge=0, description="preemptions/s per replica above which "
                                             "they ask for one more replica")
    preemption_persist_s: float = Field(0.0, ge=0, description="preemptions must stay above the threshold "
                                        "this long (on top of the look-back mean)")
    headroom_z: float = Field(2.0, ge=0, description="spare capacity for this many standard deviations of "
                              "the arrivals expected within one TTFT SLO (0: off)")
    trend_lead_s: float = Field(10.0, ge=0, description="size the fleet for the load this far ahead on its "
                                "rising trend (about a replica's start-up time; 0: off)")
    trend_window_s: float = Field(30.0, ge=0, description="the trend is the load's slope over this window")
    measured_startup: bool = Field(True, description="project the trend over the replicas' measured start-up "
                                   "time (from a scale-up to the new replica's first report, mean of the last "
                                   "STARTUP_SAMPLES) instead of trend_lead_s, once one has been measured; "
                                   "trend_lead_s 0 still turns the trend off")
    refill_weight: float = Field(1.0, ge=0, le=1, description="how much prefill of prefixes the router saw "
                                 "cached on another replica counts as load (a one-off cost of moving them)")
    online_capacity: bool = Field(True, description="learn each replica's prefill rate and decode capacity from "
                                  "its own step costs and sequence lengths where it reports them (the two priors "
                                  "above stand in until then); false: the priors only")
    queued_cost_projection: bool = Field(True, description="size prefill for the arrivals at the uncached tokens "
                                         "per waiting request where that is more than the recent served rate, "
                                         "so a jump in the work per request (longer prompts, a cache that stops "
                                         "hitting) counts as soon as such requests queue")
    overload_skips_delay: bool = Field(True, description="an up step whose load already exceeds the current "
                                       "replicas' capacity acts without upscale_delay_s")
    cache_loss_headroom: bool = Field(True, description="keep the spare capacity that absorbs, for one replica "
                                      "start-up, the prefill the prefix cache saves now if it stopped hitting: "
                                      "replicas >= (load + saved prefill) / (1 + ttft_slo_s / start-up time)")

    forecast_error_band: bool = Field(False, description="size the scale-down band by the load's measured "
                                      "forecast error instead of target_utilization / downscale_utilization "
                                      "alone: the band is the 90th percentile ratio, over the last "
                                      "forecast_error_window_s, of the mean load within one start-up to the "
                                      "load projected for it, between 1 + downscale_band_floor and "
                                      "target_utilization / downscale_utilization (the widest, used until the "
                                      "errors span half the window)")
    forecast_error_window_s: float = Field(120.0, gt=0, description="forecast errors older than this no longer "
                                           "size the scale-down band")
    downscale_band_floor: float = Field(0.1, ge=0, description="the scale-down band is at least 1 + this (the "
                                        "hysteresis a forecast-error band keeps on a perfectly forecast load)")
    trend_scale_in: bool = Field(True, description="on a falling trend the down rule sizes for the load one "
                                 "start-up ahead (the up rule projects only a rising one); the largest down target "
                                 "of the downscale_delay_s window still holds")
    falling_trend_hold_s: float | None = Field(None, ge=0, description="on a falling trend (trend_scale_in) the "
                                               "fleet goes to the largest down target of this many seconds "
                                               "instead of the downscale_delay_s window (0: today's target); "
                                               "null: the whole window")
    falling_trend_confirm: bool = Field(False, description="the shorter hold (falling_trend_hold_s) applies "
                                        "only while the load also falls over the last start-up (its slope over "
                                        "that time below 0): a load that stepped down to a plateau falls over "
                                        "trend_window_s but not over the last start-up")
    downscale_spare_replicas: int = Field(0, ge=0, description="the down rule keeps at least this many replicas "
                                          "above what the up rule asks for now (a floor beside the band: a small "
                                          "fleet keeps a whole spare replica where the band's share is less)")
    kv_apart: bool = Field(False, description="count KV as its own resource: the decode load is the running "
                           "sequences over the batch the TPOT SLO allows (compute, added to prefill's), and the KV "
                           "they hold sizes the fleet on its own (kv_units, beside the compute need), instead of "
                           "folding a KV-bound batch into the decode load, where the KV (already at "
                           "kv_usage_target) also gets target_utilization and the headroom and adds to prefill. "
                           "The cache-loss floor still counts the folded load (a KV-bound replica has no room to "
                           "absorb a prefix cache's recompute)")
    saturation_scale_out: bool = Field(False, description="a replica at its batch cap (look-back mean of its "
                                       "running sequences at least 95% of max_num_seqs) with requests waiting is "
                                       "short of capacity whatever the fleet's mean load says: ask for one more "
                                       "replica than report, and scale in nothing while one is")
    feedforward_target: bool = Field(False, description="size the fleet in steady state like a planner: the "
                                     "arrivals x each request's work by the replicas' learned costs (its whole "
                                     "prompt's prefill over R, cached tokens included; its output's decode "
                                     "steps at the batch C), over target_utilization, plus the rising trend, "
                                     "the KV floor and the cache-loss headroom; the headroom for arrival noise "
                                     "joins only while evidence fires (an SLO breach, persistent preemptions, "
                                     "a queue, an overload), and without any for downscale_delay_s the fleet "
                                     "goes down to the largest feed-forward target of feedforward_hold_s "
                                     "instead of the scale-down band")
    feedforward_hold_s: float = Field(10.0, ge=0, description="with feedforward_target, scale-in follows the "
                                      "largest feed-forward target of this many seconds (a planner's interval)")
    feedforward_burst_hold_s: float | None = Field(None, ge=0, description="with feedforward_target, after an "
                                                   "evidence episode that was a burst (an SLO breach, persistent "
                                                   "preemptions, a replica at its batch cap or a queue fired in "
                                                   "it, not an overload alone) scale-in follows the largest "
                                                   "target of this many seconds instead of feedforward_hold_s, "
                                                   "the rule's own up target counting while the burst's "
                                                   "evidence fired (null: feedforward_hold_s after every "
                                                   "episode)")
    warm_prefix_headroom: bool = Field(False, description="(off since issue 29's re-measure of 2026-11-29: "
                                       "worse in 2 of 15 cells, better in 1) price the headroom for arrival "
                                       "noise at the prefill "
                                       "the replicas will do once the prefixes now turning warm hit: while the "
                                       "fleet's prefix-cache hit share (cached / whole prompt tokens of the "
                                       "recent first tokens) rises, the share the requests arriving now hit is "
                                       "taken as the window's share plus its slope x half the window the rates "
                                       "cover, and the prompts' tokens between the two (first computations of "
                                       "shared prefixes, a one-off) are left out of the spike's prefill; the "
                                       "load itself still counts them")
    @model_validator(mode="after")
    def _consistent(self) -> PolicyConfig:
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})")
        if self.downscale_utilization >= self.target_utilization:
            raise ValueError(f"downscale_utilization ({self.downscale_utilization}) must be below "
                             f"target_utilization ({self.target_utilization})")
        return self


@dataclass(frozen=True, slots=True)
class FleetLoad:
    """The fleet's load summed over the reporting replicas, in replica units where it says so."""

    prefill_units: float = 0.0     # (prefill rate + backlog / TTFT SLO) / one replica's prefill rate
    refill_units: float = 0.0      # of the prefill rate, refills (prefixes another replica held), in units;
                                   # prefill_units counts them at refill_weight
    decode_units: float = 0.0      # sequences (running + queued at callers) / decode capacity
    #: the same sequences over C = min(C_tpot, C_kv) whatever kv_apart says (the KV-bound batch folded in)
    folded_decode_units: float = 0.0
    kv_units: float = 0.0          # held KV / kv_usage_target
    ttft_p90_s: float = 0.0        # recent p90s, weighted by each replica's recent requests
    tpot_p90_s: float = 0.0
    preemptions_per_s: float = 0.0
    num_in_flight: float = 0.0     # on replicas plus queued at callers
    num_recent_requests: float = 0.0
    num_replicas: int = 0          # reporting
    requests_per_s: float = 0.0    # arrivals (first tokens) per second, fleet-wide
    trend_units: float = 0.0       # the rising trend's extra load at trend_lead_s ahead (>= 0)
    cached_units: float = 0.0      # the prefill the prefix cache saves (all prompt tokens - uncached) / R
    falling_units: float = 0.0     # the falling trend's change at the lead ahead (<= 0)
    num_saturated: int = 0         # replicas at their batch cap with requests waiting (SATURATED_FRACTION)
    #: the planner-style load: arrivals x work per request (whole prompts' prefill / R + outputs' decode / C)
    feedforward_units: float = 0.0
    num_queued_replicas: int = 0   # replicas whose queued prefill holds a new request QUEUE_EVIDENCE_SLO_SHARE
    #: whole prompts' tokens per second (cached ones too) of the replicas that report them, over R
    prompt_units: float = 0.0
    signal_span_s: float = 0.0     # the recent window the replicas' rates cover (recent requests / their rate)
    cold_units: float = 0.0        # warm_prefix_headroom: of prefill_units, prefixes turning warm (one-off)

    @property
    def load_units(self) -> float:
        """Prefill and decode share each replica's step time, so their utilizations add."""
        return self.prefill_units + self.decode_units

    @property
    def projected_units(self) -> float:
        """The load the fleet should be sized for: today's plus its rising trend over the lead time."""
        return self.load_units + self.trend_units


@dataclass(frozen=True, slots=True)
class PolicyState:
    up_since: float | None = None        # when the current up condition started
    down_since: float | None = None      # when the current down condition started
    #: (time, down target) whenever the down target changed while the down condition held, newest last
    down_history: tuple[tuple[float, int], ...] = ()
    idle_since: float | None = None      # nothing in flight since then (scale to zero)
    last_up_time: float | None = None
    num_reporting: int = 0               # replicas that reported at the last call
    ready_time: float | None = None      # when more replicas reported than at the call before (one came up)
    preempt_since: float | None = None   # preemptions above the threshold since then
    #: (time, load units) samples over the last trend_window_s, at most TREND_POINTS of them, oldest first
    load_history: tuple[tuple[float, float], ...] = ()
    #: replicas asked for and not reporting yet: (time asked, how many), oldest first
    starting: tuple[tuple[float, int], ...] = ()
    #: the last STARTUP_SAMPLES measured start-up times (scale-up to first report), oldest first
    startup_samples: tuple[float, ...] = ()
    #: projections still coming due: (due time, projected units, sum and count of the load units seen since),
    #: oldest first
    forecasts: tuple[tuple[float, float, float, int], ...] = ()
    #: (time, mean load within the lead / its projection) of the projections that came due, oldest first
    forecast_errors: tuple[tuple[float, float], ...] = ()
    #: feedforward_target: when evidence for more than it last fired (at first, the first decision)
    evidence_time: float | None = None
    #: feedforward_target: (time, feed-forward target) whenever it changed, newest last
    feedforward_history: tuple[tuple[float, int], ...] = ()
    #: feedforward_target: whether the current (or last) evidence episode had burst evidence in it (an SLO
    #: breach, persistent preemptions, a saturated replica, a queue), not an overload alone
    burst_episode: bool = False
    #: warm_prefix_headroom: (time, fleet prefix-cache hit share) samples over the last signal span, oldest first
    hit_history: tuple[tuple[float, float], ...] = ()

    @property
    def startup_s(self) -> float | None:
        """The measured start-up time of a replica (mean of the recent samples); None before one came up."""
        return sum(self.startup_samples) / len(self.startup_samples) if self.startup_samples else None


@dataclass(frozen=True, slots=True)
class ScalingDecision:
    target_replicas: int
    reason: Reason
    load: FleetLoad
    state: PolicyState
    up_target: int = 0                   # what the up rule wanted (before delays and bounds)
    down_target: int = 0                 # what the down rule would allow
    feedforward_target: int = 0          # the planner-style target (feedforward_target only)

    def describe(self) -> str:
        ld = self.load
        # no sample (nothing finished a first token or a decode step in the window, or a P/D pool that does not
        # measure it): n/a, not a latency of 0
        ttft = f"{ld.ttft_p90_s:.2f} s" if ld.ttft_p90_s > 0 else "n/a"
        tpot = f"{ld.tpot_p90_s * 1e3:.0f} ms" if ld.tpot_p90_s > 0 else "n/a"
        return (f"{self.reason.value} -> {self.target_replicas} (load {ld.load_units:.2f} = prefill "
                f"{ld.prefill_units:.2f} + decode {ld.decode_units:.2f}, trend +{ld.trend_units:.2f}, refills "
                f"{ld.refill_units:.2f}; kv {ld.kv_units:.2f}; TTFT p90 {ttft}, TPOT p90 {tpot}, preempt "
                f"{ld.preemptions_per_s:.2f}/s; {ld.requests_per_s:.1f} req/s; up {self.up_target}, down "
                f"{self.down_target})")


#: fewer running sequences per replica than this say too little about the KV a sequence holds (a shared
#: prefix is most of it): C then comes from the step costs (or the prior) only
MIN_SEQS_FOR_KV = 2.0


@dataclass(frozen=True, slots=True)
class Capacity:
    """One replica's capacity as it measured it: R uncached prompt tokens per second, C_tpot sequences whose
    decode steps fit the TPOT SLO, and how much its running sequences' KV will grow (>= 1: they are younger
    than the sequences it saw finish)."""

    prefill_tokens_per_s: float
    tpot_seqs: float
    kv_growth: float = 1.0


def replica_capacity(s: ReplicaSignals, cfg: PolicyConfig) -> Capacity:
    """R, C_tpot and the KV growth of the replica reporting `s`, from its own step costs and sequence lengths
    where it reports them (`online_capacity`), else the priors.

    - R = 1 / prefill_s_per_token.
    - C_tpot: the batch whose decode step, base + decode cost x context per sequence x batch, fits the TPOT
      SLO, at most the engine's batch cap (the prior `decode_seqs_per_replica` until the replica reports
      step costs).
    - KV growth: what a sequence holds on average over its life (prompt + output / 2 of the sequences that
      finished) over what the running ones hold now (their mean context): after a shift to longer outputs
      the young sequences read small, and the growth says so before the pool fills.
    """
    if not cfg.online_capacity:
        return Capacity(cfg.prefill_tokens_per_s, cfg.decode_seqs_per_replica)
    r = 1.0 / s.prefill_s_per_token if s.prefill_s_per_token > 0 else cfg.prefill_tokens_per_s
    c_tpot = cfg.decode_seqs_per_replica
    if s.decode_s_per_context_token > 0 and s.mean_context_tokens > 0:
        c = (cfg.tpot_slo_s - s.step_base_s) / (s.decode_s_per_context_token * s.mean_context_tokens)
        c_tpot = max(1.0, min(c, s.max_num_seqs) if s.max_num_seqs > 0 else c)
    growth = 1.0
    if s.mean_context_tokens > 0 and s.mean_prompt_tokens > 0:
        growth = max(1.0, (s.mean_prompt_tokens + s.mean_output_tokens / 2) / s.mean_context_tokens)
    return Capacity(r, c_tpot, growth)


def tpot_batch(caps: Sequence[Capacity], cfg: PolicyConfig) -> float:
    """C_tpot of the mean replica: the batch its decode step fits in the TPOT SLO (the prior without replicas)."""
    return sum(x.tpot_seqs for x in caps) / len(caps) if caps else cfg.decode_seqs_per_replica


def decode_capacity(signals: Sequence[ReplicaSignals], caps: Sequence[Capacity], cfg: PolicyConfig) -> float:
    """C, the sequences one (mean) replica decodes: min(C_tpot, C_kv). C_kv (online only) pools the fleet:
    the sequences the KV target holds at the KV a running sequence holds now (usage / running, a shared
    prefix included), grown to its life's mean; pooled because one replica holding a sequence or two reads
    mostly its shared prefix. Fewer than MIN_SEQS_FOR_KV running sequences per replica say too little."""
    c = tpot_batch(caps, cfg)
    running = sum(s.num_running for s in signals)
    held = sum(s.kv_cache_usage * x.kv_growth for s, x in zip(signals, caps))
    if cfg.online_capacity and signals and running >= MIN_SEQS_FOR_KV * len(signals) and held > 0:
        c = min(c, max(1.0, cfg.kv_usage_target * running / held))
    return c


def fleet_load(signals: Sequence[ReplicaSignals], cfg: PolicyConfig, num_queued_at_callers: float = 0.0) -> FleetLoad:
    # A refill is a one-off cost of a prefix moving to a replica (a new replica's first requests), but it is
    # work the new replicas do while a burst lasts: counted in full by default (docs/autoscaling.md).
    refill_rate = sum(min(s.refill_tokens_per_s, s.prefill_tokens_per_s) for s in signals)
    prefill_rate = (sum(incoming_prefill_tokens_per_s(s, cfg) for s in signals)
                    - (1.0 - cfg.refill_weight) * refill_rate)
    backlog = sum(s.num_queued_prefill_tokens for s in signals)
    recent = sum(s.num_recent_requests for s in signals)
    # The fleet's work over the mean replica's capacity: replicas of different speeds (heterogeneous devices,
    # or one sharing its host) each count what they measured, and a replica the fleet adds is taken to be
    # an average one.
    caps = [replica_capacity(s, cfg) for s in signals]
    r = sum(c.prefill_tokens_per_s for c in caps) / len(caps) if caps else cfg.prefill_tokens_per_s
    c_decode = decode_capacity(signals, caps, cfg)

    def weighted(attr: str) -> float:
        return sum(getattr(s, attr) * s.num_recent_requests for s in signals) / recent if recent else 0.0

    # What the prefix cache saves: the whole prompts' tokens of the recent first tokens minus their uncached
    # ones (replicas that do not report whole prompts count none).
    saved = sum(max(0.0, s.prompt_tokens_per_s - s.prefill_tokens_per_s) for s in signals
                if s.prompt_tokens_per_s > 0)
    # the feed-forward prefill prices whole prompts, as a planner's profile of uncached prompts does: what the
    # prefix cache saves now is spare capacity for the moment it stops (served uncached tokens alone: measured
    # on diurnal, 0.9668 attainment where ours holds 0.9974)
    whole = sum(max(s.prompt_tokens_per_s, s.prefill_tokens_per_s) for s in signals)
    served = whole - (1.0 - cfg.refill_weight) * refill_rate
    ff_decode = sum(feedforward_decode_units(s, x, c_decode, cfg) for s, x in zip(signals, caps))
    rps = sum(s.requests_per_s for s in signals)
    seqs = sum(s.num_running for s in signals) + num_queued_at_callers
    return FleetLoad(
        prompt_units=sum(s.prompt_tokens_per_s for s in signals if s.prompt_tokens_per_s > 0) / r,
        signal_span_s=recent / rps if rps > 0 else 0.0,
        feedforward_units=served / r + ff_decode,
        num_queued_replicas=sum(1 for s, x in zip(signals, caps) if queued_past_slo_share(s, x, cfg)),
        prefill_units=(prefill_rate + backlog / cfg.ttft_slo_s) / r, cached_units=saved / r,
        refill_units=refill_rate / r,
        decode_units=seqs / (tpot_batch(caps, cfg) if cfg.kv_apart else c_decode),
        folded_decode_units=seqs / c_decode,
        kv_units=sum(s.kv_cache_usage * c.kv_growth for s, c in zip(signals, caps)) / cfg.kv_usage_target,
        ttft_p90_s=weighted("ttft_p90_s"), tpot_p90_s=weighted("tpot_p90_s"),
        preemptions_per_s=sum(s.preemptions_per_s for s in signals),
        num_in_flight=sum(max(s.num_in_flight, s.num_running + s.num_waiting) for s in signals) + num_queued_at_callers,
        num_recent_requests=recent, num_replicas=len(signals),
        requests_per_s=rps,
        num_saturated=sum(1 for s in signals if saturated(s)))


def feedforward_decode_units(s: ReplicaSignals, cap: Capacity, c: float, cfg: PolicyConfig) -> float:
    """The replica's decode load as a planner sizes it: its arrivals x their outputs' tokens (the mean of the
    sequences that finished in its window) x the time one decode step at the batch `c` gives each sequence,
    over `c` (the step from its learned costs at its running sequences' mean context, at most the TPOT SLO;
    the SLO itself on priors). At least its running sequences over `c`: after a shift to longer outputs the
    running count rises at once, while the finished sequences' mean follows only as the long ones end."""
    running = s.num_running / c
    if s.requests_per_s <= 0 or s.mean_output_tokens <= 0:
        return running
    step = cfg.tpot_slo_s
    if cfg.online_capacity and s.decode_s_per_context_token > 0 and s.mean_context_tokens > 0:
        step = min(step, s.step_base_s + s.decode_s_per_context_token * s.mean_context_tokens * c)
    return max(running, s.requests_per_s * s.mean_output_tokens * step / c)


#: with feedforward_target, a replica whose queued prefill (look-back mean) would hold a new request longer
#: than this share of the TTFT SLO is evidence that the feed-forward target is short
QUEUE_EVIDENCE_SLO_SHARE = 0.5


def queued_past_slo_share(s: ReplicaSignals, cap: Capacity, cfg: PolicyConfig) -> bool:
    """The replica's queued prefill takes it longer than QUEUE_EVIDENCE_SLO_SHARE of the TTFT SLO at its R."""
    return s.num_queued_prefill_tokens > QUEUE_EVIDENCE_SLO_SHARE * cfg.ttft_slo_s * cap.prefill_tokens_per_s


#: a replica whose look-back mean of running sequences is at least this share of its batch cap ran at the
#: cap nearly all of the look-back (a mean cannot reach it otherwise)
SATURATED_FRACTION = 0.95
#: and at least this many requests waiting (look-back mean): new requests there queue behind full slots
MIN_WAITING_SATURATED = 1.0


def saturated(s: ReplicaSignals) -> bool:
    """The replica ran at its batch cap (`max_num_seqs`, when it reports one) with requests waiting: a request
    routed there waits for a sequence to finish, however idle the rest of the fleet is. The fleet's sums
    cannot see it: an affinity router keeps a hot prefix group on its replica, so one replica can be full
    while the fleet's mean load fits fewer replicas than it has."""
    return (s.max_num_seqs > 0 and s.num_running >= SATURATED_FRACTION * s.max_num_seqs
            and s.num_waiting >= MIN_WAITING_SATURATED)


#: fewer requests waiting than this (Serve's look-back mean) say too little about their cost
MIN_QUEUED_FOR_COST = 0.5


def incoming_prefill_tokens_per_s(s: ReplicaSignals, cfg: PolicyConfig) -> float:
    """The replica's prefill work per second: its recent served rate (uncached tokens of first tokens over
    the window), or, with `queued_cost_projection`, its arrival rate x the uncached tokens per waiting
    request if that is more. The served rate lags a jump in the cost per request (longer prompts, a cache
    that stops hitting) by the replica's window; the waiting requests show the new cost as soon as they
    queue. Both queue numbers are look-back means, so their ratio is not diluted by the window."""
    served = s.prefill_tokens_per_s
    if not cfg.queued_cost_projection or s.num_waiting < MIN_QUEUED_FOR_COST:
        return served
    return max(served, s.requests_per_s * s.num_queued_prefill_tokens / s.num_waiting)


TREND_POINTS = 32
#: how many recent start-up times the measured start-up averages
STARTUP_SAMPLES = 8


def _track_startup(state: PolicyState, now: float, reporting: int, current: int) -> PolicyState:
    """Replicas that began reporting since the last call are matched, oldest first, to the scale-ups still
    waiting for theirs (`starting`); each match is one start-up time sample (now - time asked). Replicas no
    scale-up asked for (the first ones, a replacement Serve started) give no sample. A scale-down cancels the
    newest waiting asks first (Serve stops replicas still starting before running ones), so at most
    current - reporting replicas are waiting."""
    starting = list(state.starting)
    samples = list(state.startup_samples)
    came_up = reporting - state.num_reporting
    while came_up > 0 and starting:
        t, k = starting[0]
        took = min(k, came_up)
        samples += [now - t] * took
        came_up -= took
        starting[0] = (t, k - took)
        if starting[0][1] == 0:
            starting.pop(0)
    return replace(state, starting=_trim_starting(tuple(starting), max(0, current - reporting)),
                   startup_samples=tuple(samples[-STARTUP_SAMPLES:]))


def _trim_starting(starting: tuple[tuple[float, int], ...], limit: int) -> tuple[tuple[float, int], ...]:
    """`starting` with its newest asks cut so that at most `limit` replicas are waiting."""
    out = list(starting)
    excess = sum(k for _, k in out) - limit
    while excess > 0 and out:
        t, k = out[-1]
        cut = min(k, excess)
        excess -= cut
        out[-1] = (t, k - cut)
        if out[-1][1] == 0:
            out.pop()
    return tuple(out)


def trend_lead_s(state: PolicyState, cfg: PolicyConfig) -> float:
    """How far ahead the rising trend is projected: the measured start-up time of a replica (a new replica
    serves only after it), or `trend_lead_s` before one was measured, with `measured_startup` off, or with the
    trend off (`trend_lead_s` 0)."""
    if cfg.trend_lead_s <= 0 or not cfg.measured_startup or state.startup_s is None:
        return cfg.trend_lead_s
    return state.startup_s


def _trend(history: tuple[tuple[float, float], ...], now: float, units: float,
           cfg: PolicyConfig) -> tuple[tuple[tuple[float, float], ...], float]:
    """The load history with (now, units) added (one sample per trend_window_s / TREND_POINTS) and the
    load's least-squares slope over it (units per second) once the samples span half the window, else 0."""
    if cfg.trend_window_s <= 0 or cfg.trend_lead_s <= 0:
        return (), 0.0
    if not history or now - history[-1][0] >= cfg.trend_window_s / TREND_POINTS:
        history = history + ((now, units),)
    start = now - cfg.trend_window_s
    history = tuple(p for p in history if p[0] >= start)
    return history, _slope(history, now, cfg.trend_window_s)


def _slope(history: tuple[tuple[float, float], ...], now: float, window_s: float) -> float:
    """The least-squares slope of the samples of the last `window_s` (units per second), once at least 3 of
    them span half of it, else 0."""
    pts = [p for p in history if p[0] >= now - window_s]
    if len(pts) < 3 or pts[-1][0] - pts[0][0] < window_s / 2:
        return 0.0
    n = len(pts)
    mt = sum(t for t, _ in pts) / n
    mu = sum(u for _, u in pts) / n
    var = sum((t - mt) ** 2 for t, _ in pts)
    return sum((t - mt) * (u - mu) for t, u in pts) / var if var > 0 else 0.0


#: projections of less load than this (replica units) give no forecast error: on a fleet near idle a
#: request or two is a large ratio that says nothing about the band a loaded fleet needs
MIN_FORECAST_UNITS = 0.5


def _track_forecasts(state: PolicyState, now: float, load: FleetLoad, lead_s: float,
                     cfg: PolicyConfig) -> PolicyState:
    """Each projection made (one per trend sample, for the load `lead_s` ahead) keeps the mean load seen
    until it comes due; then that mean over the projection is one forecast error. A replica let go now can be
    back only one start-up later, so the load over that whole time, not at its end, is what the band covers;
    its mean, not its peak: a few seconds' spike queues less than the TTFT SLO (with the peak, the diurnal
    trace's 5 s noise held the widest band throughout)."""
    if not cfg.forecast_error_band:
        return state
    pending, errors = [], list(state.forecast_errors)
    for due, projected, total, n in state.forecasts:
        total, n = total + load.load_units, n + 1
        if now + 1e-9 >= due:
            errors.append((now, total / n / projected))
        else:
            pending.append((due, projected, total, n))
    made = state.forecasts[-1][0] - lead_s if state.forecasts else None
    if (load.projected_units >= MIN_FORECAST_UNITS and lead_s > 0
            and (made is None or now - made >= cfg.trend_window_s / TREND_POINTS)):
        pending.append((now + lead_s, load.projected_units, load.load_units, 1))
    start = now - cfg.forecast_error_window_s
    return replace(state, forecasts=tuple(pending), forecast_errors=tuple(e for e in errors if e[0] >= start))


#: the forecast error the band covers: this quantile of the window's errors (one noisy spike of the load
#: signal does not widen the band for a whole window)
FORECAST_ERROR_QUANTILE = 0.9


def downscale_band(state: PolicyState, cfg: PolicyConfig) -> float:
    """How much the down rule inflates the load: target_utilization / downscale_utilization, or with
    `forecast_error_band` the FORECAST_ERROR_QUANTILE of the window's forecast errors (mean load within a
    start-up over its projection), kept between 1 + downscale_band_floor and that ratio. Until the errors
    span half of forecast_error_window_s the widest band holds."""
    widest = cfg.target_utilization / cfg.downscale_utilization
    errors = state.forecast_errors
    if (not cfg.forecast_error_band or len(errors) < 2
            or errors[-1][0] - errors[0][0] < cfg.forecast_error_window_s / 2):
        return widest
    ratios = sorted(r for _, r in errors)
    worst = ratios[min(len(ratios) - 1, int(FORECAST_ERROR_QUANTILE * len(ratios)))]
    return min(widest, max(1.0 + cfg.downscale_band_floor, worst))


def replicas_needed(units: float, cfg: PolicyConfig, requests_per_unit: float = 0.0, *,
                    cold_units: float = 0.0) -> float:
    """Replicas for `units` of load: each at most `target_utilization` busy, and spare capacity for
    `headroom_z` standard deviations of the arrivals within one TTFT SLO. `requests_per_unit` is the fleet's
    arrival rate per unit of load (requests/s): `units` of load bring n = units x requests_per_unit x
    ttft_slo_s requests per SLO window, Poisson with std sqrt(n), i.e. units / sqrt(n) replicas. A spike is a
    larger share of a small load (square-root staffing), so a small fleet keeps a larger share spare; at
    large loads `target_utilization` sizes the fleet. Without arrivals there is no headroom term.

    `cold_units` of the load (warm_prefix_headroom) are first computations of prefixes that later requests
    hit: a spike brings requests that hit them, so the headroom leaves them out.

    Measured and removed (docs/benchmarks/autoscaling.md, rounds 4 and 5): pricing the spike as a batching
    replica meets it (its prefill only, plus batch slots), rounding the headroom's fraction of a replica
    away, and a smaller z at one or two replicas. Each lost attainment in the simulator: the whole-work
    headroom is margin the TTFT SLO uses."""
    linear = units / cfg.target_utilization
    n = units * requests_per_unit * cfg.ttft_slo_s
    if cfg.headroom_z <= 0 or n <= 0:
        return linear
    head = cfg.headroom_z * max(0.0, units - cold_units) / math.sqrt(max(n, 1.0))
    return max(linear, units + head)


def warm_prefix_units(history: tuple[tuple[float, float], ...], now: float,
                      load: FleetLoad) -> tuple[float, tuple[tuple[float, float], ...]]:
    """Of the load's prefill, the units that are first computations of prefixes turning warm
    (warm_prefix_headroom), and the hit-share history with this decision's sample. The fleet's hit share h
    (what the prefix cache saves over the whole prompts) is a mean over the replicas' recent window
    (`signal_span_s`); while it rises, the requests arriving now hit more than that mean: for a steady rise,
    h + its slope x half the window. The prompts' tokens between the two shares are the cold part; 0 where
    the share is flat or falls (a cache that stops hitting), before the samples span half the window, or
    without whole-prompt reports."""
    span = load.signal_span_s
    if load.prompt_units <= 0 or span <= 0:
        return 0.0, ()
    share = min(1.0, load.cached_units / load.prompt_units)
    if not history or now - history[-1][0] >= span / TREND_POINTS:
        history = history + ((now, share),)
    history = tuple(p for p in history if p[0] >= now - span)
    warm = min(1.0, share + max(0.0, _slope(history, now, span)) * span / 2)
    return min(load.prefill_units, load.prompt_units * (warm - share)), history


def cache_loss_replicas(load: FleetLoad, cfg: PolicyConfig, startup_s: float) -> float:
    """Replicas that absorb a prefix cache that stops hitting, for the start-up time of the replicas it then
    asks for: the prefill per request jumps by what the cache saves now (`cached_units`), and until new
    replicas serve (`startup_s`) the x replicas there are must carry load + saved, each queueing at most
    ttft_slo_s of work over the start-up: x + x x ttft_slo_s / startup_s >= load + saved. 0 while the cache
    saves nothing."""
    if load.cached_units <= 0:
        return 0.0
    slack = cfg.ttft_slo_s / startup_s if startup_s > 0 else 0.0
    return (load.projected_units + load.cached_units) / (1.0 + slack)


def preempting(load: FleetLoad, cfg: PolicyConfig) -> bool:
    """Preemptions above `preemption_rate_threshold` per reporting replica. A preemption costs one recompute
    of its sequence, but a rising rate is the earliest sign of a fleet running out of KV
    (docs/benchmarks/autoscaling.md has the measured trade-off of the threshold)."""
    return load.num_replicas > 0 and load.preemptions_per_s > cfg.preemption_rate_threshold * load.num_replicas


def slo_ratio(load: FleetLoad, cfg: PolicyConfig) -> float:
    """How far past its latency SLOs the fleet runs (> 1: breached); 0 without recent requests."""
    if load.num_in_flight <= 0 and load.num_recent_requests <= 0:
        return 0.0
    if load.num_recent_requests > 0:
        return max(load.ttft_p90_s / cfg.ttft_slo_s, load.tpot_p90_s / cfg.tpot_slo_s)
    return 0.0


def decide(signals: Sequence[ReplicaSignals], current: int, now: float, state: PolicyState,
           cfg: PolicyConfig, *, num_queued_at_callers: float = 0.0) -> ScalingDecision:
    """The target replica count for `current` replicas (the count the fleet is heading to) given the
    reporting replicas' `signals` and `num_queued_at_callers` requests waiting for any replica."""
    load = fleet_load(signals, cfg, num_queued_at_callers)
    state = _track_startup(state, now, len(signals), current)
    still_falling = True
    if signals:
        lead = trend_lead_s(state, cfg)
        history, slope = _trend(state.load_history, now, load.load_units, cfg)
        still_falling = _slope(history, now, lead) < 0 if cfg.falling_trend_confirm else True
        load = replace(load, trend_units=max(0.0, slope) * lead,
                       falling_units=max(-load.load_units, min(0.0, slope) * lead) if cfg.trend_scale_in else 0.0)
        state = _track_forecasts(replace(state, load_history=history), now, load, lead, cfg)
        if cfg.warm_prefix_headroom:
            cold, hits = warm_prefix_units(state.hit_history, now, load)
            load, state = replace(load, cold_units=cold), replace(state, hit_history=hits)
    # Idle: nothing in flight and no request started within the replicas' signal window. In-flight counts
    # are sampled (every metrics interval): a request shorter than the interval can fall between two samples,
    # and with in-flight alone a fleet whose requests all did would go to zero under steady traffic.
    idle = load.num_in_flight <= 0 and load.num_recent_requests <= 0
    # The idle clock runs only on what replicas report: a replica still starting has not been seen idle, so
    # a fleet deployed with no traffic goes to zero downscale_to_zero_delay_s after its first replica
    # reports, not the moment it comes up.
    seen_idle = idle and bool(signals)
    state = replace(state, idle_since=(state.idle_since if state.idle_since is not None else now)
                    if seen_idle else None)
    if preempting(load, cfg):
        state = replace(state, preempt_since=state.preempt_since if state.preempt_since is not None else now)
    else:
        state = replace(state, preempt_since=None)
    preempt_persisted = (state.preempt_since is not None
                         and now - state.preempt_since + 1e-9 >= cfg.preemption_persist_s)

    per_unit = load.requests_per_s / load.load_units if load.load_units > 0 else 0.0
    # with kv_apart, the floor takes the folded decode load (a KV-bound replica has no room for the recompute)
    # and the trend measured on the compute-only load: a slope, close enough for the lead it projects
    cache_floor = (cache_loss_replicas(replace(load, decode_units=load.folded_decode_units), cfg,
                                       trend_lead_s(state, cfg)) if cfg.cache_loss_headroom else 0.0)
    up_need = max(replicas_needed(load.projected_units, cfg, per_unit, cold_units=load.cold_units),
                  load.kv_units, cache_floor)
    up_target = math.ceil(up_need - 1e-9)
    ratio = slo_ratio(load, cfg)
    # Persistent preemptions (KV is short: requests keep losing their progress) ask for one more replica;
    # a latency breach scales by how far past its SLO the fleet runs.
    slo_breached = ratio > 1.0 or preempt_persisted
    # The measured latencies are those of the replicas that report (not of those still starting), and they
    # lag a replica that comes up by the replicas' recent window: the reactive step scales the reporting
    # count, and waits slo_cooldown_s after a scale-up and after a replica comes up (the predicted rule
    # still sizes the fleet meanwhile). Scaling the count asked for instead kept doubling the fleet while
    # the first replicas were starting after a cold start (docs/benchmarks/autoscaling.md).
    reporting = len(signals)
    if 0 < state.num_reporting < reporting:
        state = replace(state, ready_time=now)
    state = replace(state, num_reporting=reporting)
    cooling = ((state.last_up_time is not None and now - state.last_up_time < cfg.slo_cooldown_s)
               or (state.ready_time is not None and now - state.ready_time < cfg.slo_cooldown_s))
    slo_target = 0
    if slo_breached and not cooling and reporting > 0:
        slo_target = reporting + 1
        if ratio > 1.0:
            slo_target = max(slo_target, math.ceil(reporting * min(ratio, cfg.max_upscale_factor)))
    # A replica at its batch cap with a queue is short of capacity whatever the fleet's sums say: one more
    # replica (the router moves new requests to it), not a factor: the queue says little about how far short.
    # It lags like the SLO (the capped replica's sequences drain over their outputs), so it shares the cooldown.
    full = cfg.saturation_scale_out and load.num_saturated > 0
    sat_target = reporting + 1 if full and not cooling and reporting > 0 else 0
    # Down: the up rule at the load inflated by target / downscale utilization, so a count the fleet scaled
    # up to is kept until the load has fallen well below what asked for it (the hysteresis band).
    inflate = downscale_band(state, cfg)
    down_need = replicas_needed((load.projected_units + load.falling_units) * inflate, cfg, per_unit,
                                cold_units=load.cold_units * inflate)
    # never below what the up rule wants now: on a falling trend the down rule sizes for the load a start-up
    # ahead, which can be under today's up target, and scaling in to it would scale straight back out (flapping)
    down_target = max(1, math.ceil(max(down_need, load.kv_units * inflate, cache_floor) - 1e-9),
                      up_target + cfg.downscale_spare_replicas)

    # The planner-style target (feedforward_target): the steady state both ways; the rule's headroom and band
    # add capacity only while their evidence fires, and scale-in follows the feed-forward target once none
    # has for downscale_delay_s.
    ff_target, ff_down = 0, None
    if cfg.feedforward_target and signals:
        evidence = (slo_breached or full or num_queued_at_callers > 0 or load.num_queued_replicas > 0
                    or load.load_units > current)
        burst = slo_breached or full or num_queued_at_callers > 0 or load.num_queued_replicas > 0
        ff_target, ff_down, state = _feedforward(load, state, now, cfg, cache_floor, evidence, burst,
                                                 max(up_target, slo_target))
        up_target = max(up_target, ff_target) if evidence else ff_target
        down_target = max(down_target, ff_target) if ff_down is None else ff_down

    def done(target: int, reason: Reason, st: PolicyState) -> ScalingDecision:
        target = max(cfg.min_replicas, min(cfg.max_replicas, target))
        if target > current:                     # the new replicas' start-up is measured when they report
            st = replace(st, starting=st.starting + ((now, target - current),))
        elif target < current:                   # Serve stops the replicas still starting first
            st = replace(st, starting=_trim_starting(st.starting, max(0, target - len(signals))))
        return ScalingDecision(target, reason, load, st, up_target, down_target, ff_target)

    if current == 0:
        if not idle:
            return done(max(1, up_target), Reason.COLD_START, replace(state, last_up_time=now, up_since=None))
        return done(0, Reason.BOUNDS if cfg.min_replicas > 0 else Reason.HOLD, state)
    if current < cfg.min_replicas or current > cfg.max_replicas:
        return done(current, Reason.BOUNDS, replace(state, up_since=None, down_since=None, down_history=()))
    if not signals:
        return done(current, Reason.NO_METRICS, state)

    want_up = max(up_target, slo_target, sat_target)
    if want_up > current and current < cfg.max_replicas:
        up_since = state.up_since if state.up_since is not None else now
        st = replace(state, up_since=up_since, down_since=None, down_history=())
        overloaded = cfg.overload_skips_delay and load.load_units > current
        if now - up_since + 1e-9 < cfg.upscale_delay_s and not overloaded:
            return done(current, Reason.UP_PENDING, st)
        reason = (Reason.UP_SLO if slo_target > up_target else Reason.UP_SATURATED if sat_target > up_target
                  else Reason.UP_PREDICTED)
        return done(want_up, reason, replace(st, up_since=None, last_up_time=now))

    st = replace(state, up_since=None)
    if cfg.min_replicas == 0 and current == 1 and idle:
        if now - state.idle_since + 1e-9 >= cfg.downscale_to_zero_delay_s:
            return done(0, Reason.TO_ZERO, replace(st, down_since=None, down_history=()))
        return done(current, Reason.TO_ZERO_PENDING, st)
    if ff_down is not None:                  # no evidence for downscale_delay_s: the planner's target
        if ff_down < current and not slo_breached and not full and num_queued_at_callers <= 0:
            return done(ff_down, Reason.DOWN, replace(st, down_since=None, down_history=()))
        return done(current, Reason.HOLD, replace(st, down_since=None, down_history=()))
    if down_target < current and not slo_breached and not full and num_queued_at_callers <= 0:
        down_since = state.down_since if state.down_since is not None else now
        history = _down_history(state.down_history, now, down_target, cfg.downscale_delay_s)
        st = replace(st, down_since=down_since, down_history=history)
        if now - down_since + 1e-9 < cfg.downscale_delay_s:
            return done(current, Reason.DOWN_PENDING, st)
        # The largest down target of the last downscale_delay_s: a dip does not take the fleet below what
        # the busier moments of the window needed. The condition stays on, so the count keeps following
        # that window down without a fresh delay per step. On a falling trend the window can be shorter
        # (falling_trend_hold_s): there the window's largest is its oldest, the load of a window ago.
        hold_s = cfg.downscale_delay_s
        if load.falling_units < 0 and cfg.falling_trend_hold_s is not None and still_falling:
            hold_s = min(hold_s, cfg.falling_trend_hold_s)
        floor = _window_max(history, now, hold_s)
        return done(floor, Reason.DOWN if floor < current else Reason.DOWN_PENDING, st)
    return done(current, Reason.HOLD, replace(st, down_since=None, down_history=()))


def _feedforward(load: FleetLoad, state: PolicyState, now: float, cfg: PolicyConfig, cache_floor: float,
                 evidence: bool, burst: bool = False, rule_target: int = 0) -> tuple[int, int | None, PolicyState]:
    """The feed-forward target (the planner-style load plus the rising trend over target_utilization, at least
    the KV floor and the cache-loss headroom), and, once no evidence has fired for downscale_delay_s and its
    history spans the hold, the largest of it over that hold (the scale-in target; else None). The hold is
    feedforward_hold_s, or feedforward_burst_hold_s where the last evidence episode (evidence firing with
    gaps shorter than downscale_delay_s) had `burst` evidence in it. While burst evidence fires the hold's
    history records the rule's own target (`rule_target`: the up rule with its headroom, the SLO step), not
    the feed-forward one: the fleet the burst needed is what the hold keeps, so the evidence ending does not
    take the fleet below the plateau it rose to while the load may still be there."""
    target = math.ceil(max((load.feedforward_units + load.trend_units) / cfg.target_utilization,
                           load.kv_units, cache_floor, 1.0) - 1e-9)
    long_hold = cfg.feedforward_burst_hold_s
    recorded = max(target, rule_target) if long_hold is not None and evidence and burst else target
    history = _down_history(state.feedforward_history, now, recorded,
                            max(cfg.feedforward_hold_s, long_hold or 0.0))
    # an episode starts where evidence fires after downscale_delay_s without any (or at the first decision)
    new_episode = state.evidence_time is None or now - state.evidence_time + 1e-9 >= cfg.downscale_delay_s
    episode = (burst if new_episode else state.burst_episode or burst) if evidence else state.burst_episode
    hold = long_hold if long_hold is not None and episode else cfg.feedforward_hold_s
    # the quiet window counts from the first decision too: a fleet the policy has just begun to see has not
    # been seen without evidence for downscale_delay_s
    last = now if evidence or state.evidence_time is None else state.evidence_time
    state = replace(state, feedforward_history=history, evidence_time=last, burst_episode=episode)
    quiet = now - last + 1e-9 >= cfg.downscale_delay_s
    if not quiet or history[0][0] > now - hold + 1e-9:
        return target, None, state
    return target, _window_max(history, now, hold), state


def _window_max(history: tuple[tuple[float, int], ...], now: float, window_s: float) -> int:
    """The largest down target in force over the last `window_s` of `history` (its newest entry at 0)."""
    start = now - window_s
    i = 0
    while i + 1 < len(history) and history[i + 1][0] <= start:
        i += 1
    return max(t for _, t in history[i:])


def _down_history(history: tuple[tuple[float, int], ...], now: float, down_target: int,
                  window_s: float) -> tuple[tuple[float, int], ...]:
    """`history` plus (now, down_target) if it changed, without entries that stopped mattering: an entry
    counts until the next one starts, so the newest entry older than the window is kept as the window's
    value at its start."""
    if not history or history[-1][1] != down_target:
        history = history + ((now, down_target),)
    start = now - window_s
    i = 0
    while i + 1 < len(history) and history[i + 1][0] <= start:
        i += 1
    return history[i:]
