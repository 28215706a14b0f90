"""P/D routing (issue 28): the ingress picks a request's prefill replica first, then a decode replica near it.

The decode pool's router in the ingress process (`PDDecodeRouter`) decides in this order:

1. the decode pool's usual decision (prefix affinity on the decode replicas' caches, against load and KV room).
   When the replica it chose is predicted to hold all but fewer than `min_remote_prefill_tokens` of the prompt
   (a later turn of a conversation it served, a short prompt), that replica prefills the rest itself (the rule
   DecodeReplica applies on its own cache): the prefill pool is not involved and nothing else changes;
2. otherwise the prefill replica, by prefix affinity on the prefill pool: the prefill pool's router core in this
   process (`PrefillPoolRouter`, on a handle the ingress opens; it follows the prefill replicas' KV events and
   stats like any router) routes the prefill part (one token per sequence) and records it as in flight until
   the request's first token;
   Conditional disaggregation (`local_prefill_slack_s`, off by default): when that prefill replica is predicted
   to give the first token more than the slack later than step 1's decode replica would prefilling the request
   itself, the pick is dropped and that decode replica prefills it (`GenerateRequest.local_prefill`). A request
   the prefill pool does prefill counts on its decode replica as decode load only (`prefill_elsewhere`);
3. the decode replica again: the best candidate on the prefill replica's node goes first when it is predicted
   to hold at least as much of the prompt as step 1's choice (so a replica holding earlier turns keeps its
   request) and to be at most `same_node_slack_s` slower (its decode load and KV room are in that prediction);
   the KV copy then stays in that node's object store instead of crossing nodes;
4. the request carries the prefill replica's id (`GenerateRequest.prefill_replica`); the decode replica's call to
   the prefill pool goes through `PrefillPoolRouter` there too, which ranks that replica first (Serve walks down
   the ranks when it is full or gone).

Load-only routing policies (power_of_two, round_robin) predict neither cached tokens nor TTFT. Step 1's rule then
sees nothing cached (the decode replica still applies it on its own cache), and step 3 compares ongoing requests
instead (`same_node_choice_by_load`): the decode replica on the prefill replica's node with the fewest goes first
when, with this request counted there, it has at most `same_node_slack_requests` more than the policy's choice.

Each ingress process (`serve.ingress_replicas`) builds its own pair of routers over both pools and decides on its
own view: its own sends, both pools' stats and KV events; none sees another ingress's in-flight requests.

Serve pickles a router class's module by value into every process that routes: this module keeps no state of
its own at module level (routers find each other through app/routing/debug.py, imported by reference).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RunningReplica

from affinity_serve.app.disagg_config import DisaggregationSection
from affinity_serve.app.protocol import GenerateRequest
from affinity_serve.app.routing import debug
from affinity_serve.app.routing.api import Decision, RouteRequest
from affinity_serve.app.routing.serve_router import AffinityRequestRouter, _generate_request, _replica_key

logger = logging.getLogger("affinity.router")

#: the prefill pool's deployment name (app/builder.py: disagg_deployments)
PREFILL_DEPLOYMENT = "PrefillReplica"
#: routing policies whose decisions carry loads but no predictions (app/routing/baselines.py)
LOAD_ONLY_POLICIES = frozenset({"power_of_two", "round_robin"})
#: calls a decode replica's prefill router remembers the replica of until the caller takes it (the oldest go)
MAX_ROUTED_CALLS = 4096


def same_node_choice(decision: Decision, node_of: dict[str, str | None], node: str | None,
                     slack_s: float) -> str | None:
    """The decode replica to put first instead of `decision.chosen` so that it runs on `node` (the prefill
    replica's), or None to keep the decision: the candidate on `node` with the lowest predicted TTFT among
    those predicted to hold at least as many of the prompt's tokens as the chosen one and to be at most
    `slack_s` slower. None also when the chosen one is on `node` already, or without scores."""
    sc = decision.scores
    if node is None or not len(sc) or node_of.get(decision.chosen) == node or decision.chosen not in sc.replica_ids:
        return None
    i0 = sc.replica_ids.index(decision.chosen)
    best: int | None = None
    for i, rid in enumerate(sc.replica_ids):
        if node_of.get(rid) != node or sc.predicted_cached_tokens[i] < sc.predicted_cached_tokens[i0]:
            continue
        if sc.predicted_ttft_s[i] > sc.predicted_ttft_s[i0] + slack_s:
            continue
        if best is None or sc.predicted_ttft_s[i] < sc.predicted_ttft_s[best]:
            best = i
    return sc.replica_ids[best] if best is not None else None


def same_node_choice_by_load(decision: Decision, node_of: dict[str, str | None], node: str | None,
                             slack_requests: int) -> str | None:
    """`same_node_choice` for a load-only policy's decision (its scores carry loads, no predictions): the
    candidate on `node` with the fewest ongoing requests (`decode_load`: running at the replica's last stats
    plus this router's sends since; then fewer queued prompt tokens) when, with this request counted there, it
    has at most `slack_requests` more than the chosen one has with it. The load-only cores record the request
    on their choice before they take the scores, so the chosen one's count includes it already. None to keep
    the decision: the chosen one is on `node` already, no candidate there is within the slack, or no scores."""
    sc = decision.scores
    if node is None or not len(sc) or node_of.get(decision.chosen) == node or decision.chosen not in sc.replica_ids:
        return None
    limit = sc.decode_load[sc.replica_ids.index(decision.chosen)] + slack_requests
    on_node = [i for i, rid in enumerate(sc.replica_ids)
               if node_of.get(rid) == node and sc.decode_load[i] + 1 <= limit]
    if not on_node:
        return None
    best = min(on_node, key=lambda i: (sc.decode_load[i], sc.queued_prefill_tokens[i]))
    return sc.replica_ids[best]


def _remember(calls: dict[str, Any], req_id: str, value: Any) -> None:
    """calls[req_id] = value, the oldest entries dropped past MAX_ROUTED_CALLS (the decode replica pops entries
    from its own loop meanwhile: a drop that races one is given up)."""
    while len(calls) >= MAX_ROUTED_CALLS:
        try:
            calls.pop(next(iter(calls)), None)
        except (StopIteration, RuntimeError):
            break
    calls[req_id] = value


def _first(ranks: list[list[RunningReplica]], key: str) -> list[list[RunningReplica]]:
    """`ranks` with the replica whose key is `key` alone in front (unchanged if it is not among them)."""
    chosen = next((r for rank in ranks for r in rank if _replica_key(r.replica_id) == key), None)
    if chosen is None:
        return ranks
    rest = [[r for r in rank if r is not chosen] for rank in ranks]
    return [[chosen]] + [rank for rank in rest if rank]


class PrefillPoolRouter(AffinityRequestRouter):
    """The prefill pool's router. In a decode replica: the replica the ingress chose for the request goes first,
    and replicas the decode replica's breaker holds back (app/disagg.py PrefillBreaker: a recent prefill timeout)
    are left out while another replica can take the call; each call's replica is kept in `routed_to` for the
    decode replica to take. In the ingress: `pick` routes a request's prefill part for PDDecodeRouter (nothing
    is sent through it)."""

    def initialize_state(self, routing: dict[str, Any], block_size: int, warmup_timeout_s: float = 30.0) -> None:
        super().initialize_state(routing, block_size, warmup_timeout_s)
        self.node_of: dict[str, str | None] = {}
        self.num_pinned = 0
        #: set by the decode replica whose handle this router serves (DecodeReplica._prefill_routers)
        self.breaker: Any = None
        #: req_id -> the replica key its call was sent to, and the replicas last offered to Serve for it (a call
        #: Serve could not send: none took it, or none answered Serve's queue-length probe); the decode replica
        #: takes both when the call ends (DecodeReplica._settle_prefill_call)
        self.routed_to: dict[str, str] = {}
        self.offered: dict[str, list[str]] = {}
        self.num_held_back = 0          # decisions that left a replica in its back-off out

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        try:
            candidates = self._callable(candidate_replicas, pending_request)
        except Exception:
            logger.exception("routing: the prefill breaker's filter failed; every replica is a candidate")
            candidates = candidate_replicas
        return await super().choose_replicas(candidates, pending_request)

    def _callable(self, candidates: list[RunningReplica],
                  pending_request: PendingRequest | None) -> list[RunningReplica]:
        """`candidates` less those the breaker holds back from this request, unless that leaves none (the decode
        replica prefills such a request itself before calling; one that raced a new timeout still goes)."""
        req = _generate_request(pending_request)
        if req is None:
            return candidates
        out = candidates
        breaker = self.breaker
        if breaker is not None:
            now = time.monotonic()
            ok = [r for r in candidates if not breaker.blocked(_replica_key(r.replica_id), req.req_id, now)]
            if ok and len(ok) < len(candidates):
                self.num_held_back += 1
                out = ok
        _remember(self.offered, req.req_id, [_replica_key(r.replica_id) for r in out])
        return out

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        try:
            req = _generate_request(pending_request)
            if req is None:
                return
            key = _replica_key(replica_id)
            _remember(self.routed_to, req.req_id, key)
            if self.breaker is not None:
                self.breaker.on_routed(key, req.req_id, time.monotonic())
        except Exception:
            logger.exception("routing: recording the prefill call's replica failed")

    def _sync_members(self, replicas: list[RunningReplica]) -> None:
        self.node_of = {_replica_key(r.replica_id): r.node_id for r in replicas}
        super()._sync_members(replicas)

    def _rank(self, candidates: list[RunningReplica],
              pending_request: PendingRequest | None) -> list[list[RunningReplica]]:
        ranks = super()._rank(candidates, pending_request)
        req = _generate_request(pending_request)
        pin = req.prefill_replica if req is not None else None
        if pin is None:
            return ranks
        out = _first(ranks, pin)
        if out is not ranks:
            self.num_pinned += 1
        return out

    def pick(self, req: GenerateRequest) -> tuple[str, str | None, float | None] | None:
        """The prefill replica for `req`, its node and its predicted TTFT (None where the policy predicts none),
        or None (no replica known); recorded in this router's core as in flight (`release` ends it). Run on the
        router loop."""
        self.last_active = time.monotonic()        # routing through the core directly: the feed must not idle
        ids = [k for k in self._clients if k in self.node_of]
        if not ids:
            return None
        p = req.sampling_params
        route = RouteRequest(req.req_id, list(req.block_hashes or []), len(req.prompt_token_ids), max(1, p.n),
                             None)
        decision = self.core.route(route, ids)
        if not decision.chosen:
            return None
        chosen = decision.chosen
        return chosen, self.node_of.get(chosen), _predicted_ttft(self.policy, decision, chosen)

    def unpick(self, req_id: str) -> None:
        """The pick of `req_id` was dropped before any call (conditional disaggregation): forget it as load, as
        if it had never been routed here."""
        self.core.loads.cancel(req_id)

    def release(self, req_id: str, first_token: bool) -> None:
        """The prefill part of `req_id` is over (its first token came: the TTFT model learns from it)."""
        if first_token:
            self.core.on_first_token(req_id)
        self.core.on_finished(req_id)


class PDDecodeRouter(AffinityRequestRouter):
    """The decode pool's router (the ingress's handle): decides the prefill replica and the decode replica
    together, in the order the module docstring gives. kwargs: AffinityRequestRouter's plus the
    `disaggregation` section as JSON."""

    def initialize_state(self, routing: dict[str, Any], block_size: int, disaggregation: dict[str, Any] | None = None,
                         warmup_timeout_s: float = 30.0) -> None:
        super().initialize_state(routing, block_size, warmup_timeout_s)
        d = DisaggregationSection.model_validate(disaggregation or {})
        self.min_remote_prefill_tokens = d.min_remote_prefill_tokens
        self.local_prefill_slack_s = d.local_prefill_slack_s
        self.same_node_slack_s = d.same_node_slack_s
        self.same_node_slack_requests = d.same_node_slack_requests
        self.node_of: dict[str, str | None] = {}
        self._picks: dict[str, PrefillPoolRouter] = {}
        self.pd_counters = {"prefill_picked": 0, "local": 0, "same_node": 0, "moved_to_prefill_node": 0,
                            "other_node": 0, "no_prefill_view": 0, "local_backlog": 0}

    def _sync_members(self, replicas: list[RunningReplica]) -> None:
        self.node_of = {_replica_key(r.replica_id): r.node_id for r in replicas}
        super()._sync_members(replicas)

    def _prefill_router(self) -> PrefillPoolRouter | None:
        """The prefill pool's router in this process (the ingress opens a handle on that pool), if it runs
        on this router's loop and knows some replica."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return None
        for r in reversed(debug.routers_for(self._deployment_id.app_name, PREFILL_DEPLOYMENT)):
            # Serve runs every router of a process on one loop (its router thread, or the replica's loop)
            if hasattr(r, "pick") and r._clients and getattr(r, "_lazily_fetched_loop", None) in (None, loop):
                return r
        return None

    def _remote_prefill(self, req: GenerateRequest, decision: Decision | None) -> bool:
        """Whether the decode replica of `decision` will call the prefill pool (DecodeReplica._route's rule
        on the router's prediction of its cache)."""
        if req.sampling_params.max_tokens <= 1:
            return False
        score = decision.score_of(decision.chosen) if decision is not None else None
        cached = score.predicted_cached_tokens if score is not None else 0
        return len(req.prompt_token_ids) - cached >= self.min_remote_prefill_tokens

    def _rank(self, candidates: list[RunningReplica],
              pending_request: PendingRequest | None) -> list[list[RunningReplica]]:
        ranks = super()._rank(candidates, pending_request)
        req = _generate_request(pending_request)
        if req is None:
            return ranks
        self._release(req.req_id, first_token=False)          # a re-route decides again
        req.prefill_replica, req.local_prefill = None, False
        decision = req.routing.value
        if not self._remote_prefill(req, decision):
            self.pd_counters["local"] += 1
            return ranks
        prefill = self._prefill_router()
        picked = prefill.pick(req) if prefill is not None else None
        if picked is None:
            self.pd_counters["no_prefill_view"] += 1
            return ranks
        key, node, remote_ttft = picked
        if self._prefill_here(req, decision, remote_ttft, prefill.core):
            prefill.unpick(req.req_id)
            req.local_prefill = True
            self.pd_counters["local_backlog"] += 1
            return ranks
        req.prefill_replica = key
        self._picks[req.req_id] = prefill
        self.core.loads.prefill_elsewhere(req.req_id)      # its prefill is the prefill pool's load, not ours
        self.pd_counters["prefill_picked"] += 1
        move = self._same_node(decision, node) if decision is not None else None
        if move is not None:
            ranks = _first(ranks, move)
            decision.chosen = move
            decision.ranked = [move] + [k for k in decision.ranked if k != move]
            self.pd_counters["moved_to_prefill_node"] += 1
        first = ranks[0][0] if ranks and len(ranks[0]) == 1 else None
        if first is not None and node is not None:
            self.pd_counters["same_node" if first.node_id == node else "other_node"] += 1
        return ranks

    def _prefill_here(self, req: GenerateRequest, decision: Decision | None, remote_ttft: float | None,
                      prefill_core: Any) -> bool:
        """Conditional disaggregation (`local_prefill_slack_s`): whether the decode replica of `decision` is
        predicted to give the first token more than the slack sooner than the prefill pool's best replica."""
        if self.local_prefill_slack_s is None or remote_ttft is None or decision is None:
            return False
        local = self._local_ttft(req, decision, prefill_core)
        return local is not None and remote_ttft > local + self.local_prefill_slack_s

    def _local_ttft(self, req: GenerateRequest, decision: Decision, prefill_core: Any) -> float | None:
        """The first token's predicted time if the decode replica of `decision` prefilled `req` itself: its
        queued prefill and the prompt's uncached part at the prefill rate the prefill pool's router measured
        (this router's own rate learns only from the few requests decode replicas prefill, so it stays near
        its prior), plus its running requests' steps. The policy's own prediction where no rate is measured."""
        score = decision.score_of(decision.chosen) if self.policy not in LOAD_ONLY_POLICIES else None
        if score is None:
            return None
        rate = getattr(getattr(prefill_core, "model", None), "prefill_tokens_per_s", None)
        step = getattr(getattr(self.core, "model", None), "decode_step_s", None)
        if not rate or step is None:
            return score.predicted_ttft_s
        uncached = max(0, len(req.prompt_token_ids) - score.predicted_cached_tokens)
        return (score.queued_prefill_tokens + uncached) / rate + score.decode_load * step

    def _same_node(self, decision: Decision, node: str | None) -> str | None:
        """Step 3: the decode replica to put first so that the request decodes on `node` (None: keep)."""
        if self.policy in LOAD_ONLY_POLICIES:
            return same_node_choice_by_load(decision, self.node_of, node, self.same_node_slack_requests)
        return same_node_choice(decision, self.node_of, node, self.same_node_slack_s)

    def _release(self, req_id: str, first_token: bool) -> None:
        prefill = self._picks.pop(req_id, None)
        if prefill is not None:
            try:
                prefill.release(req_id, first_token)
            except Exception:
                logger.exception("routing: releasing the prefill pick of %s failed", req_id)

    def on_first_token(self, req_id: str, num_cached_tokens: int, kv_wait_s: float = 0.0) -> None:
        super().on_first_token(req_id, num_cached_tokens, kv_wait_s)
        self._release(req_id, first_token=True)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        ids = self._calls.get((internal_request_id, _replica_key(replica_id))) or []
        done = ids[0] if ids else None
        super().on_request_completed(replica_id, internal_request_id)
        if done is not None:
            self._release(done, first_token=False)

    def state(self, num_decisions: int) -> dict[str, Any]:
        return {**super().state(num_decisions), "disaggregation": dict(self.pd_counters)}


def _predicted_ttft(policy: str, decision: Decision, replica_id: str) -> float | None:
    """The policy's predicted TTFT of `replica_id` in `decision`; None under the load-only policies (which
    predict none) or for a replica not scored."""
    if policy in LOAD_ONLY_POLICIES:
        return None
    score = decision.score_of(replica_id)
    return score.predicted_ttft_s if score is not None else None


def open_prefill_view(app_name: str) -> Any:
    """In the ingress: a handle on the prefill pool, initialised so that its router (PrefillPoolRouter) runs in
    this process and follows that pool (PDDecodeRouter asks it for each request's prefill replica). Keep the
    returned handle: the router lives as long as it. Nothing is ever sent through it. None (logged) if Serve
    gives no handle."""
    from ray import serve
    try:
        handle = serve.get_deployment_handle(PREFILL_DEPLOYMENT, app_name=app_name)
        handle._init()
    except Exception:        # the decode replicas' own prefill routers decide (no node preference)
        logger.exception("P/D: no view of the prefill pool in this ingress; the decode replicas pick prefill "
                         "replicas themselves")
        return None
    return handle


__all__ = ["LOAD_ONLY_POLICIES", "PDDecodeRouter", "PrefillPoolRouter", "PREFILL_DEPLOYMENT", "open_prefill_view",
           "same_node_choice", "same_node_choice_by_load"]
