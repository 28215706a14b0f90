"""AffinityConfig: the prefix-affinity core's knobs, with the defaults the README documents."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

RoutingPolicyName = Literal["prefix_affinity", "power_of_two", "round_robin", "llm_d_precise"]
#: the policies that need the replicas' KV events (the shell runs the event feed for them)
KV_EVENT_POLICIES = ("prefix_affinity", "llm_d_precise")


class AffinityConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # -- index
    max_index_entries: int = Field(8_000_000, ge=1, description="upper limit on the block hashes indexed (the "
                                   "index is sized from the replicas' reported pool sizes; 125-175 bytes per "
                                   "hash with one holder)")
    index_capacity_margin: float = Field(1.25, ge=1.0, description="index bound = this x the sum of the "
                                         "replicas' reported KV pool blocks")
    index_blocks_per_unknown_replica: int = Field(32_768, ge=1, description="pool blocks assumed for a "
                                                  "replica that has not reported its size yet")
    speculative_ttl_s: float = Field(10.0, gt=0, description="a routed prompt's blocks count as held this long "
                                     "unless a BlockStored confirms them")
    max_tier_index_entries: int = Field(500_000, ge=1, description="block hashes indexed in replicas' KV "
                                        "tiers (offload, node-shared store); LRU beyond")
    # -- TTFT model (seeds; calibrated online from observed TTFTs)
    prefill_tokens_per_s: float = Field(10_000.0, gt=0, description="prefill rate prior")
    decode_step_s: float = Field(0.002, ge=0, description="TTFT added per running request (prior)")
    tier_load_tokens_per_s: float = Field(100_000.0, gt=0, description="rate a replica loads KV-tier hits "
                                          "(offload, shared store) into its pool (prior, calibrated)")
    calibrate: bool = Field(True, description="fit the two above from observed TTFTs")
    calibration_half_life: float = Field(200.0, gt=0, description="samples for a sample's weight to halve")
    calibration_prior_weight: float = Field(1.0, gt=0, description="pull towards the priors, in samples")
    kv_pressure_threshold: float = Field(1.0, ge=0, le=1, description="projected KV usage (the request's own "
                                         "blocks counted in) where the penalty starts; 1: only a request that "
                                         "does not fit pays")
    kv_pressure_penalty_s: float = Field(1.0, ge=0, description="TTFT penalty per pool's worth of projected "
                                         "usage above the threshold (over 1 - threshold below 1), at most "
                                         "twice this")
    kv_wait_weight: float = Field(
        0.0, ge=0, description="0: routing prices KV pressure with kv_pressure_threshold and kv_pressure_penalty_s; "
        "above 0: with this times the predicted wait for KV room (the pool's excess demand over its turnover, as "
        "admission control predicts it) instead. 0.25 cut the tail on small pools (docs: Routing benchmark)")
    kv_wait_calibration: bool = Field(True, description="the TTFT fit leaves out the time each request "
                                      "waited in its engine's queue for KV blocks (the engine measures it and "
                                      "reports it with the first token): a KV-bound backlog is not prefill work")
    measured_kv_wait_weight: float = Field(3.0, ge=0, description="routing adds this x each replica's "
                                           "reported KV wait (its engine's measure: while its queue is blocked "
                                           "for KV blocks, how long requests admitted lately waited for them) to "
                                           "its predicted TTFT; such a wait releases a request from its prefix's "
                                           "holder only to a replica with KV room. 0: off. 3 took the short-prompt "
                                           "suite's TTFT p99 from 1.13x to 0.97x llm-d's (docs: Routing benchmark)")
    # -- affinity release
    release_slack: float = Field(0.6, ge=0, description="stay while TTFT(affinity) <= best*(1+slack)+abs")
    release_slack_abs_s: float = Field(0.3, ge=0, description="the absolute part of that bound, seconds")
    release_recompute_weight: float = Field(1.0, ge=0, description="a release must also beat this x fleet "
                                            "saturation x the time to recompute the prefix it gives up")
    release_busy_horizon_s: float = Field(0.25, ge=0, description="the least queued replica's prefill "
                                          "backlog at which the fleet counts as fully saturated")
    release_cache_weight: float = Field(0.5, ge=0, description="a release must also beat this x the cache "
                                        "fill of the replica it moves to x the time to recompute the prefix it "
                                        "gives up (a full pool evicts as many cached tokens of other prefixes, "
                                        "which their next requests recompute); 0: off. 0.5 raised the fleet "
                                        "benchmark's hit rate by 0.006 of the bound over 19 traces at TTFT p99 "
                                        "1.01x of 0 (1: +0.007 at 1.03x; docs/benchmarks/routing.md)")
    evict_cost_weight: float = Field(0.0, ge=0, description="new groups, spills and releases also pay this x "
                                     "the predicted later recompute of the long prefixes their new blocks "
                                     "would evict on a candidate (app/routing/eviction.py); 0: off (1 and 0.3 "
                                     "did not lower the fleet benchmark's TTFT p99 beyond noise: "
                                     "docs/benchmarks/routing.md)")
    evict_tail_tokens: int = Field(4096, ge=0, description="an evicted prefix costs only its recompute beyond "
                                   "this many tokens (shorter recomputes stay out of the TTFT tail)")
    evict_key_blocks: int = Field(64, ge=1, description="the eviction estimate tracks a replica's prefixes "
                                  "keyed by the block hash at this depth")
    min_affinity_blocks: int = Field(1, ge=1, description="fewer matched blocks count as no affinity")
    # -- hot prefix groups
    group_blocks: int = Field(4, ge=1, description="a prefix group is the first K block hashes")
    hot_window_s: float = Field(10.0, gt=0, description="sliding window for per-group demand")
    hot_target_utilization: float = Field(0.6, gt=0, le=1, description="share of one replica a group may use "
                                          "before it is spread over more replicas")
    hot_share_min_requests: int = Field(4, ge=1, description="a group with this many requests per candidate in "
                                        "the window is spread over at least share x N replicas")
    decode_token_weight: float = Field(2.0, ge=0, description="prefill-token equivalents per output token in "
                                       "a group's demand")
    output_tokens_prior: float = Field(256.0, ge=0, description="output tokens a request is expected to "
                                       "produce until finished requests were observed (a group's demand "
                                       "uses the observed lengths, capped by max_tokens)")
    # -- new groups and ties
    new_group_room_tolerance: float = Field(0.0, ge=0, le=1, description="a new group goes to the replica "
                                            "with the most cache room among the TTFT near-ties; occupancies "
                                            "this close count as equal")
    tie_tolerance_s: float = Field(0.01, ge=0, description="scores this close count as tied (random pick, "
                                   "caller's node first)")
    # -- bookkeeping
    max_in_flight_age_s: float = Field(600.0, gt=0, description="in-flight entries older than this are "
                                       "dropped (a lost on_finished must not count as load forever)")
    recent_decisions: int = Field(256, ge=0, description="decision records kept for recent_decisions()")
