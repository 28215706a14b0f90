"""P/D routing (app/disagg_router.py) with stand-in replicas carrying node ids, no Ray started: the ingress's
decode-pool router picks the prefill replica by prefix affinity first, then puts a decode replica on that
replica's node first unless a decode replica holding earlier turns (or a much less loaded one) should win;
the decode replica's prefill router sends the prefill to the replica the ingress picked."""
from __future__ import annotations

import itertools
from types import SimpleNamespace

from affinity_serve.app.builder import router_kwargs
from affinity_serve.app.config import AppConfig
from affinity_serve.app.disagg_router import (PDDecodeRouter, PrefillPoolRouter, same_node_choice,
                                              same_node_choice_by_load)
from affinity_serve.app.protocol import GenerateRequest
from affinity_serve.app.routing import KVSnapshot
from affinity_serve.app.routing.api import CandidateScores, Decision, Reason
from affinity_serve.engine import SamplingParams

BS = 4
MIN_REMOTE = 16
_apps = itertools.count()


def _hashes(seed: int, n: int) -> list[bytes]:
    return [bytes([seed, i]) * 4 for i in range(n)]


def _kwargs(policy: str = "prefix_affinity") -> dict:
    return router_kwargs(AppConfig.model_validate({"engine": {"cache": {"block_size": BS}},
                                                   "routing": {"policy": policy}}))


def _replica(app: str, dep: str, key: str, node: str, stats: dict | None = None):
    from ray.serve._private.common import DeploymentID, ReplicaID
    return SimpleNamespace(replica_id=ReplicaID(key, DeploymentID(name=dep, app_name=app)), node_id=node,
                           routing_stats={"cache_epoch": "e", **(stats or {})}, _actor_handle=None)


def _routers(decode_nodes: dict[str, str], prefill_nodes: dict[str, str], decode_stats: dict | None = None,
             slack_s: float = 0.05, policy: str = "prefix_affinity", slack_requests: int = 2,
             prefill_stats: dict | None = None, local_prefill_slack_s: float | None = None):
    """The ingress's two routers (decode pool, prefill pool) over stand-ins; caller node 'head'."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID
    app = f"pd{next(_apps)}"
    dec = PDDecodeRouter(deployment_id=DeploymentID(name="LLMReplica", app_name=app),
                         handle_source=DeploymentHandleSource.REPLICA, self_node_id="head")
    dec.initialize_state(**_kwargs(policy), disaggregation={"min_remote_prefill_tokens": MIN_REMOTE,
                                                            "same_node_slack_s": slack_s,
                                                            "same_node_slack_requests": slack_requests,
                                                            "local_prefill_slack_s": local_prefill_slack_s})
    pre = PrefillPoolRouter(deployment_id=DeploymentID(name="PrefillReplica", app_name=app),
                            handle_source=DeploymentHandleSource.REPLICA, self_node_id="head")
    pre.initialize_state(**_kwargs(policy))
    decs = [_replica(app, "LLMReplica", k, n, (decode_stats or {}).get(k)) for k, n in decode_nodes.items()]
    pres = [_replica(app, "PrefillReplica", k, n, (prefill_stats or {}).get(k)) for k, n in prefill_nodes.items()]
    dec._sync_members(decs)
    pre._sync_members(pres)
    return dec, pre, decs, pres


def _pending(req_id: str, hashes: list[bytes], extra_tokens: int = 1, max_tokens: int = 8):
    req = GenerateRequest(req_id, list(range(BS * len(hashes) + extra_tokens)), SamplingParams(max_tokens=max_tokens),
                          block_hashes=hashes)
    return SimpleNamespace(args=[req], kwargs={}, metadata=SimpleNamespace(internal_request_id="int-" + req_id))


def _first(ranks) -> str:
    return ranks[0][0].replica_id.unique_id


async def test_the_decode_replica_goes_where_the_prefill_replica_holding_the_prefix_is():
    """Two nodes, one prefill and one decode replica on each, all idle: each request's prefill goes to the
    prefill replica holding its prefix, and its decode to the decode replica on that replica's node (by
    chance, half of them would cross nodes)."""
    dec, pre, decs, _ = _routers({"dA": "A", "dB": "B"}, {"pA": "A", "pB": "B"})
    for i in range(12):
        holder, node = ("pA", "A") if i % 2 else ("pB", "B")
        hashes = _hashes(i, 6)
        pre.core.on_snapshot(KVSnapshot(holder, "e", i, hashes[:4]))
        pending = _pending(f"r{i}", hashes)
        ranks = await dec.choose_replicas(decs, pending)
        req = pending.args[0]
        assert req.prefill_replica == holder
        assert ranks[0][0].node_id == node and len(ranks[0]) == 1
        assert req.routing.value.chosen == _first(ranks)              # the span says where it went
    c = dec.state(0)["disaggregation"]
    assert c["prefill_picked"] == 12 and c["same_node"] == 12 and c["other_node"] == 0
    assert pre.core.counters().num_decisions == 12


async def test_a_decode_replica_holding_earlier_turns_keeps_the_request_and_skips_the_prefill_pool():
    """The multi-turn rule: dA holds the conversation so far, so fewer than min_remote_prefill_tokens are new
    and dA prefills them itself; no prefill replica is picked, whatever the prefill pool holds."""
    dec, pre, decs, _ = _routers({"dA": "A", "dB": "B"}, {"pB": "B"})
    hashes = _hashes(50, 10)
    dec.core.on_snapshot(KVSnapshot("dA", "e", 0, hashes[:8]))       # 32 of 41 prompt tokens cached
    pre.core.on_snapshot(KVSnapshot("pB", "e", 0, hashes))
    pending = _pending("turn2", hashes)
    ranks = await dec.choose_replicas(decs, pending)
    assert _first(ranks) == "dA" and pending.args[0].prefill_replica is None
    assert dec.state(0)["disaggregation"]["local"] == 1 and pre.core.counters().num_decisions == 0


async def test_a_holder_of_part_of_the_prompt_is_not_given_up_for_the_prefill_node():
    """dA holds part of a long prompt (the rest still goes to the prefill pool, on node B): dB holds less,
    so dA keeps it and reads the rest across nodes."""
    dec, pre, decs, _ = _routers({"dA": "A", "dB": "B"}, {"pB": "B"})
    hashes = _hashes(60, 12)
    dec.core.on_snapshot(KVSnapshot("dA", "e", 0, hashes[:3]))
    pending = _pending("long", hashes)
    ranks = await dec.choose_replicas(decs, pending)
    assert _first(ranks) == "dA" and pending.args[0].prefill_replica == "pB"
    assert dec.state(0)["disaggregation"]["other_node"] == 1


async def test_a_much_busier_decode_replica_on_the_prefill_node_is_not_preferred():
    """The node's decode replica would be predicted 0.5 s slower (a queue of 5,000 prompt tokens), beyond
    same_node_slack_s: the other node's idle one wins; with a slack above that, the node's one."""
    busy = {"dB": {"num_queued_prefill_tokens": 5000}}
    for slack, want in ((0.05, "dA"), (5.0, "dB")):
        dec, pre, decs, _ = _routers({"dA": "A", "dB": "B"}, {"pB": "B"}, decode_stats=busy, slack_s=slack)
        pending = _pending(f"busy-{slack}", _hashes(70, 6))
        ranks = await dec.choose_replicas(decs, pending)
        assert _first(ranks) == want and pending.args[0].prefill_replica == "pB"


async def test_short_prompts_and_single_tokens_never_pick_a_prefill_replica():
    dec, pre, decs, _ = _routers({"dA": "A"}, {"pA": "A"})
    for pending in (_pending("short", _hashes(80, 2)), _pending("one", _hashes(81, 8), max_tokens=1)):
        await dec.choose_replicas(decs, pending)
        assert pending.args[0].prefill_replica is None
    assert pre.core.counters().num_decisions == 0


async def test_the_prefill_pick_is_in_flight_until_the_first_token_or_the_end_of_the_call():
    dec, pre, decs, _ = _routers({"dA": "A"}, {"pA": "A"})
    p1, p2 = _pending("q1", _hashes(90, 6)), _pending("q2", _hashes(91, 6))
    for p in (p1, p2):
        ranks = await dec.choose_replicas(decs, p)
        dec.on_request_routed(p, ranks[0][0].replica_id, None)
    assert pre.core.loads.in_flight("q1") is not None and pre.core.loads.in_flight("q2") is not None
    dec.on_first_token("q1", 0)
    assert pre.core.loads.in_flight("q1") is None
    dec.on_request_completed(decs[0].replica_id, "int-q2")           # failed before its first token
    assert pre.core.loads.in_flight("q2") is None and dec.core.loads.in_flight("q2") is None
    # a re-route (Serve asks again when every replica was full) picks again, without leaving the first pick
    p3 = _pending("q3", _hashes(92, 6))
    await dec.choose_replicas(decs, p3)
    await dec.choose_replicas(decs, p3)
    dec.on_first_token("q3", 0)
    assert pre.core.loads.in_flight("q3") is None


async def test_a_backlogged_prefill_pool_has_the_decode_replica_prefill_itself_past_the_slack():
    """Conditional disaggregation: the only prefill replica has 50,000 prompt tokens queued (about 5 s at
    the 10k tokens/s prior), the decode replicas none. With local_prefill_slack_s 1 s the chosen decode
    replica prefills the request itself: no prefill replica is pinned, the pick is not left in flight in the
    prefill pool's load, and the decode replica is told (`local_prefill`). With a slack above the gap, with
    none set (the default), or with an idle prefill pool, the prefill pool prefills it."""
    backlog = {"pA": {"num_queued_prefill_tokens": 50_000}}
    cases = [(backlog, 1.0, True), (backlog, 30.0, False), (backlog, None, False), (None, 1.0, False)]
    for i, (stats, slack, local) in enumerate(cases):
        dec, pre, decs, _ = _routers({"dA": "A", "dB": "B"}, {"pA": "A"}, prefill_stats=stats,
                                     local_prefill_slack_s=slack)
        pending = _pending(f"c{i}", _hashes(100 + i, 8))
        ranks = await dec.choose_replicas(decs, pending)
        req = pending.args[0]
        assert ranks and req.local_prefill is local, (stats, slack)
        assert (req.prefill_replica is None) is local
        c = dec.state(0)["disaggregation"]
        assert (c["local_backlog"], c["prefill_picked"]) == ((1, 0) if local else (0, 1))
        assert (pre.core.loads.in_flight(req.req_id) is None) is local
        assert pre.core.counters().num_decisions == 1             # the prefill pool was asked either way
        if local:
            assert pre.core.loads.get("pA").queued_prefill_tokens == 50_000  # the dropped pick added nothing
            dec.local_prefill_slack_s = None                      # a re-route decides again, from scratch
            await dec.choose_replicas(decs, pending)              # (the first route's speculative blocks now
            assert not req.local_prefill                          # make it short: served there, not flagged)


async def test_the_decode_replicas_prefill_is_priced_at_the_prefill_pools_measured_rate():
    """The prefill pool's router has measured 1,000 tokens/s; the decode pool's router, which learns only
    from the few requests decode replicas prefill, still holds its 10,000 prior. The decode replica has
    5,000 prompt tokens queued, the prefill replica 5,500: at the measured rate prefilling here saves 0.5 s,
    under the 1 s slack, so the prefill pool keeps the request (at the prior the decode replica would have
    looked 4.5 s sooner and taken it)."""
    for queued, local in ((5500, False), (7000, True)):          # 7,000: 2 s behind, past the slack
        dec, pre, decs, _ = _routers({"dA": "A"}, {"pA": "A"}, local_prefill_slack_s=1.0,
                                     decode_stats={"dA": {"num_queued_prefill_tokens": 5000}},
                                     prefill_stats={"pA": {"num_queued_prefill_tokens": queued}})
        pre.core.model.prefill_tokens_per_s = 1000.0
        pending = _pending(f"rate{queued}", _hashes(130, 8))
        await dec.choose_replicas(decs, pending)
        assert pending.args[0].local_prefill is local, queued
        assert (pending.args[0].prefill_replica == "pA") is not local


async def test_a_remote_prefill_is_not_counted_as_prefill_queued_on_its_decode_replica():
    """The decode replica of a request the prefill pool prefills only reads its KV: the decode pool's router
    counts none of its prompt as queued prefill there (it did: a phantom queue as long as the prefill pool's
    wait), nor learns its prefill rate from that request's TTFT (the prefill pool's time); the prefill pool's
    router does. So with one decode replica and slack 0, the second request of a burst sees the prefill
    replica one prompt behind and the decode replica idle, and is prefilled on the decode replica."""
    dec, pre, decs, _ = _routers({"dA": "A"}, {"pA": "A"}, local_prefill_slack_s=0.0)
    first, second = _pending("b1", _hashes(120, 8), extra_tokens=600), _pending("b2", _hashes(121, 8))
    await dec.choose_replicas(decs, first)
    dec.on_request_routed(first, decs[0].replica_id, None)
    assert first.args[0].prefill_replica == "pA"
    assert dec.core.loads.get("dA").queued_prefill_tokens == 0
    assert pre.core.loads.get("pA").queued_prefill_tokens == len(first.args[0].prompt_token_ids)
    await dec.choose_replicas(decs, second)
    assert second.args[0].local_prefill and second.args[0].prefill_replica is None
    dec_rate, pre_rate = dec.core.model.prefill_tokens_per_s, pre.core.model.prefill_tokens_per_s
    dec.core.clock = pre.core.clock = lambda: 1e9        # a first token very late: a sample that would move a rate
    dec.on_first_token("b1", 0)
    assert dec.core.model.prefill_tokens_per_s == dec_rate
    assert pre.core.model.prefill_tokens_per_s != pre_rate


async def test_load_only_policies_never_prefill_on_the_decode_replica_for_a_backlog():
    """power_of_two predicts no TTFT: local_prefill_slack_s cannot apply, the prefill pool prefills."""
    dec, pre, decs, _ = _routers({"dA": "A"}, {"pA": "A"}, policy="power_of_two",
                                 prefill_stats={"pA": {"num_queued_prefill_tokens": 500_000}},
                                 local_prefill_slack_s=0.0)
    pending = _pending("p2", _hashes(110, 8))
    await dec.choose_replicas(decs, pending)
    assert not pending.args[0].local_prefill and pending.args[0].prefill_replica == "pA"


async def test_without_a_prefill_view_the_decode_pool_routes_as_usual():
    """Before the ingress's prefill router knows any replica (start-up), requests route as in unified mode
    and the decode replica's own prefill router decides."""
    dec, pre, decs, _ = _routers({"dA": "A", "dB": "B"}, {})
    pending = _pending("early", _hashes(95, 6))
    ranks = await dec.choose_replicas(decs, pending)
    assert ranks and pending.args[0].prefill_replica is None
    assert dec.state(0)["disaggregation"]["no_prefill_view"] == 1


async def test_the_decode_replicas_prefill_router_sends_to_the_pinned_replica():
    """In a decode replica: the prefill router ranks the replica the ingress picked first, though its own
    index says another holds the prefix; without a pin, its own choice."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID
    app = f"pd{next(_apps)}"
    r = PrefillPoolRouter(deployment_id=DeploymentID(name="PrefillReplica", app_name=app),
                          handle_source=DeploymentHandleSource.REPLICA, self_node_id="A")
    r.initialize_state(**_kwargs())
    reps = [_replica(app, "PrefillReplica", k, n) for k, n in (("pA", "A"), ("pB", "B"))]
    r._sync_members(reps)
    hashes = _hashes(99, 6)
    r.core.on_snapshot(KVSnapshot("pA", "e", 0, hashes))
    pinned = _pending("x", hashes)
    pinned.args[0].prefill_replica = "pB"
    assert _first(await r.choose_replicas(reps, pinned)) == "pB" and r.num_pinned == 1
    assert _first(await r.choose_replicas(reps, _pending("y", hashes))) == "pA"
    gone = _pending("z", hashes)
    gone.args[0].prefill_replica = "pC"                              # left the pool: routed as usual
    assert _first(await r.choose_replicas(reps, gone)) == "pA"


def test_same_node_choice_rules():
    def decision(chosen, cached, ttft):
        ids = list(cached)
        return Decision("r", ids, chosen, Reason.AFFINITY,
                        CandidateScores(ids, [cached[i] for i in ids], [ttft[i] for i in ids], [0] * len(ids),
                                        [0] * len(ids), [0.0] * len(ids)), 0.0)
    nodes = {"a": "A", "b": "B", "c": "B"}
    d = decision("a", {"a": 0, "b": 0, "c": 0}, {"a": 0.10, "b": 0.14, "c": 0.12})
    assert same_node_choice(d, nodes, "B", 0.05) == "c"               # the node's best within the slack
    assert same_node_choice(d, nodes, "B", 0.01) is None
    assert same_node_choice(d, nodes, "A", 0.05) is None              # already there
    assert same_node_choice(d, nodes, None, 0.05) is None
    held = decision("a", {"a": 8, "b": 4, "c": 8}, {"a": 0.10, "b": 0.10, "c": 0.15})
    assert same_node_choice(held, nodes, "B", 0.05) == "c"            # c holds as much: b does not
    assert same_node_choice(held, nodes, "B", 0.01) is None
    assert same_node_choice(Decision("r", ["a"], "a", Reason.LOAD, CandidateScores.empty(), 0.0),
                            nodes, "B", 1.0) is None                  # load-only policies: no scores


# ------------------------------------------------------------ load-only policies: node preference by ongoing requests

LOAD_ONLY = ("power_of_two", "round_robin")


async def test_load_only_policies_decode_each_request_on_its_prefill_replicas_node():
    """power_of_two and round_robin, two nodes with one prefill and two decode replicas each, requests that
    never finish (each one's decode load stays): every request decodes on its prefill replica's node, and the
    four decode replicas' loads stay balanced (the prefill picks alternate nodes by load)."""
    for policy in LOAD_ONLY:
        dec, pre, decs, _ = _routers({"dA1": "A", "dA2": "A", "dB1": "B", "dB2": "B"}, {"pA": "A", "pB": "B"},
                                     policy=policy)
        prefill_node = {"pA": "A", "pB": "B"}
        for i in range(16):
            pending = _pending(f"{policy}-{i}", _hashes(i, 6))
            ranks = await dec.choose_replicas(decs, pending)
            dec.on_request_routed(pending, ranks[0][0].replica_id, None)
            req = pending.args[0]
            assert req.prefill_replica in prefill_node, policy
            assert len(ranks[0]) == 1 and ranks[0][0].node_id == prefill_node[req.prefill_replica], (policy, i)
            assert req.routing.value.chosen == _first(ranks)
        c = dec.state(0)["disaggregation"]
        assert c["prefill_picked"] == 16 and c["same_node"] == 16 and c["other_node"] == 0, (policy, c)
        loads = [dec.core.loads.get(k).decode_load for k in ("dA1", "dA2", "dB1", "dB2")]
        assert max(loads) - min(loads) <= 1 and sum(loads) == 16, (policy, loads)


async def test_load_only_policies_keep_their_choice_when_the_prefill_nodes_replica_is_busier_than_the_slack():
    """dB (node B, where the only prefill replica is) runs 3 requests, dA none; the policy's choice is dA.
    With the request counted, dB would have 4 against dA's 1: kept on dA with same_node_slack_requests 2,
    moved to dB with 3 (the bound is inclusive). (round_robin's first turn is the first candidate, dA.)"""
    busy = {"dB": {"num_running_reqs": 3}}
    for policy in LOAD_ONLY:
        for slack, want in ((2, "dA"), (3, "dB")):
            dec, pre, decs, _ = _routers({"dA": "A", "dB": "B"}, {"pB": "B"}, decode_stats=busy, policy=policy,
                                         slack_requests=slack)
            pending = _pending(f"{policy}-{slack}", _hashes(40 + slack, 6))
            ranks = await dec.choose_replicas(decs, pending)
            assert pending.args[0].prefill_replica == "pB"
            assert _first(ranks) == want, (policy, slack)
            c = dec.state(0)["disaggregation"]
            assert c["moved_to_prefill_node"] == (want == "dB") and c["same_node" if want == "dB" else
                                                                       "other_node"] == 1, (policy, slack, c)


def test_same_node_choice_by_load_rules():
    """The chosen one's decode_load counts the request already (the load-only cores record it first)."""
    def decision(chosen, load, queued=None):
        ids = list(load)
        q = queued or {}
        return Decision("r", ids, chosen, Reason.LOAD,
                        CandidateScores(ids, [0] * len(ids), [0.0] * len(ids), [q.get(i, 0) for i in ids],
                                        [load[i] for i in ids], [0.0] * len(ids)), 0.0)
    nodes = {"a": "A", "b": "B", "c": "B"}
    d = decision("a", {"a": 3, "b": 4, "c": 5})                     # a: 2 running + this request
    assert same_node_choice_by_load(d, nodes, "B", 2) == "b"          # b would have 5 <= 3 + 2
    assert same_node_choice_by_load(d, nodes, "B", 1) is None         # 5 > 4
    assert same_node_choice_by_load(decision("a", {"a": 1, "b": 0, "c": 0}), nodes, "B", 0) == "b"   # a tie moves
    tie = decision("a", {"a": 3, "b": 2, "c": 2}, queued={"b": 50, "c": 10})
    assert same_node_choice_by_load(tie, nodes, "B", 0) == "c"        # fewer queued prompt tokens breaks ties
    assert same_node_choice_by_load(d, nodes, "A", 5) is None         # already on the node
    assert same_node_choice_by_load(d, nodes, None, 5) is None
    assert same_node_choice_by_load(d, {"a": "A"}, "B", 5) is None    # no candidate known on the node
    assert same_node_choice_by_load(Decision("r", ["a"], "a", Reason.FALLBACK, CandidateScores.empty(), 0.0),
                                    nodes, "B", 5) is None


async def test_the_prefill_routers_feed_counts_a_pick_as_routing():
    """The decode router picks the prefill replica through the prefill router's core (no Serve call when the
    request then prefills locally): the pick keeps the prefill router's feed from pausing as idle."""
    dec, pre, decs, _ = _routers({"dA": "A"}, {"pA": "A"})
    pre.last_active = 0.0
    assert pre.feed is None or pre.feed.last_active() == 0.0
    await dec.choose_replicas(decs, _pending("q1", _hashes(93, 6)))
    assert pre.last_active > 0.0
