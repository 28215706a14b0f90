"""Pure routing core (no Ray): prefix index, affinity policy, load-only baselines. See api.py for the contract."""
from affinity_serve.app.routing.api import (BlockHash, CandidateScore, CandidateScores, Decision, KVEventBatch,
                                            KVSnapshot, Reason, ReplicaInfo, ReplicaLoadView, RouterCore,
                                            RouterCounters, RouteRequest)
from affinity_serve.app.routing.baselines import PowerOfTwoCore, RoundRobinCore
from affinity_serve.app.routing.config import AffinityConfig, RoutingPolicyName
from affinity_serve.app.routing.core import PrefixAffinityRouterCore, make_core

__all__ = ["AffinityConfig", "BlockHash", "CandidateScore", "CandidateScores", "Decision", "KVEventBatch",
           "KVSnapshot", "PowerOfTwoCore", "PrefixAffinityRouterCore", "Reason", "ReplicaInfo", "ReplicaLoadView",
           "RoundRobinCore", "RouteRequest", "RouterCore", "RouterCounters", "RoutingPolicyName", "make_core"]
