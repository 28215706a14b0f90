"""The field's strongest routers, re-implemented from their public descriptions (../shared/ROUTING_NOTES.md
§1-3) on the simulator's interface, each with the same exact KV-event feed ours gets where the original
uses engine events (so the comparison is between policies, not between index freshness):

- `llmd`: llm-d's precise prefix-cache scorer in its current default shape, "sticky until saturated":
  an index fed by the engines' KV events with token-exact block hashes and speculative entries (2 s TTL)
  written at routing time; the prefix-cache-affinity filter keeps the endpoints whose hit fraction is
  >= 0.8 (no exploration); stickiness breaks when the best warm endpoint's estimated TTFT exceeds the best
  cold one's by more than `max_ttft_penalty_s`, TTFT being in-flight uncached tokens / peak prefill rate;
  then the token-load scorer (in-flight uncached tokens + this prompt's uncached part) picks the lowest.
  The shipped penalty is 18 s on Qwen3-32B; `llmd` uses 18 s and `llmd-2s` a tighter 2 s.
- `sglang`: SGLang's `cache_aware` policy: an approximate per-worker prefix set built only from routing
  history (each worker's routed prompts' blocks, LRU-bounded at the worker's KV pool size), the router's
  own in-flight request counts as load; imbalanced (max - min > 64 and max > 1.5 x min) -> least loaded;
  else a match rate (matched / prompt blocks) > 0.3 -> the longest match (ties: least loaded); else the
  worker with the smallest set (most free cache as the router sees it). CLI defaults 0.3 / 64 / 1.5.
- `dynamo`: Dynamo's KV router cost: an event-fed index plus a predicted side index of routed prompts
  (5 s TTL); per worker, cost = prefill_load_scale x max(active prefill blocks + prompt blocks - overlap
  blocks, 0) + active decode blocks, the active blocks tracked by the router on route, first token and
  completion; lowest cost wins (temperature 0, ties at random).
"""
from __future__ import annotations

from collections import OrderedDict

from affinity_serve.app.routing.prefix_index import PrefixIndex
from benchmarks.routing.replica import ReplicaSpec, SimReplica
from benchmarks.routing.routers import ClusterView, SimRequest, _Base, pull_kv_events


class _EventFed(_Base):
    """An exact index of every replica's pool, pulled like our shell pulls it (events, snapshots on gaps)."""

    speculative_ttl_s = 2.0

    def __init__(self, replica: ReplicaSpec):
        self.block_size = replica.block_size
        self.pool_blocks = replica.num_blocks

    def setup(self, cluster: ClusterView, seed: int) -> None:
        super().setup(cluster, seed)
        self.index = PrefixIndex(10 * self.n * self.pool_blocks, self.speculative_ttl_s)
        self.ids = [f"replica-{i:03d}" for i in range(self.n)]
        for rid in self.ids:
            self.index.add_replica(rid)
        self.next_seq: list[int | None] = [None] * self.n
        self.epoch: list[str | None] = [None] * self.n
        self.prompt_blocks: dict[str, tuple[int, int, int]] = {}   # req -> (replica, prompt blocks, uncached)

    def match(self, req: SimRequest, now: float) -> list[int]:
        """Leading blocks of the prompt each replica holds (the engine's rule: never the last token)."""
        self.index.expire(now)
        m = self.index.match(req.block_hashes, self.ids)
        cap = (len(req.prompt_token_ids) - 1) // self.block_size
        return [min(m.get(rid, 0), cap) for rid in self.ids]

    def on_kv_events(self, replica: int, feed: SimReplica, now: float) -> None:
        pull_kv_events(replica, feed, self.ids, self.next_seq, self.epoch, self.index.replicas_needing_snapshot,
                       self.index.apply_events, self.index.apply_snapshot)

    def pick_lowest(self, cost: list[float], pool: list[int]) -> int:
        best = min(cost[i] for i in pool)
        return self.rng.choice([i for i in pool if cost[i] <= best + 1e-12])


class LlmdPrecise(_EventFed):
    """llm-d's precise prefix-cache scorer, sticky until saturated, with the token-load scorer."""

    affinity_threshold = 0.8

    def __init__(self, replica: ReplicaSpec, peak_prefill_tokens_per_s: float, max_ttft_penalty_s: float = 18.0,
                 name: str | None = None):
        super().__init__(replica)
        self.peak = peak_prefill_tokens_per_s
        self.max_penalty_s = max_ttft_penalty_s
        self.name = name or f"llm-d precise (sticky, penalty {max_ttft_penalty_s:g} s)"

    def setup(self, cluster: ClusterView, seed: int) -> None:
        super().setup(cluster, seed)
        self.in_flight_uncached = [0] * self.n

    def credit(self, req: SimRequest, matched: list[int]) -> tuple[list[float], list[int]]:
        """Per replica: the blocks its affinity score counts and the blocks it would not prefill (here both
        its pool match)."""
        return [float(m) for m in matched], matched

    def route(self, req: SimRequest, now: float) -> int:
        matched = self.match(req, now)
        scored, cached = self.credit(req, matched)
        total = max(1, len(req.block_hashes))
        prompt = len(req.prompt_token_ids)
        uncached = [prompt - c * self.block_size for c in cached]
        load = [self.in_flight_uncached[i] + uncached[i] for i in range(self.n)]
        everyone = list(range(self.n))
        warm = [i for i in everyone if scored[i] / total >= self.affinity_threshold]
        pool = everyone
        if warm:
            cold = [i for i in everyone if i not in set(warm)]
            ttft_warm = min(self.in_flight_uncached[i] for i in warm) / self.peak
            ttft_cold = min(self.in_flight_uncached[i] for i in cold) / self.peak if cold else float("inf")
            if ttft_warm <= ttft_cold + self.max_penalty_s:
                pool = warm
        k = self.pick_lowest(load, pool)
        self.in_flight_uncached[k] += uncached[k]
        self.prompt_blocks[req.req_id] = (k, 0, uncached[k])
        self.index.insert_speculative(self.ids[k], req.block_hashes, now, start=matched[k])
        return k

    def on_first_token(self, req_id: str, replica: int, num_cached_tokens: int, now: float,
                       kv_wait_s: float = 0.0) -> None:
        k, _, uncached = self.prompt_blocks.pop(req_id, (replica, 0, 0))
        self.in_flight_uncached[k] -= uncached


class LlmdTiered(LlmdPrecise):
    """`LlmdPrecise` that also scores its index's tier entries, as llm-d's index keeps a device tier per entry:
    the blocks a replica's node-shared store holds right after its pool match count at `tier_weight` (Dynamo's
    host-tier overlap credit, 0.75) in the affinity score, and as cached in the token load (they are loaded,
    not prefilled). Replicas are placed `replicas_per_node` to a node, so a shared-medium event counts for
    every replica of its node, as the store serves them all."""

    def __init__(self, replica: ReplicaSpec, peak_prefill_tokens_per_s: float, replicas_per_node: int,
                 max_ttft_penalty_s: float = 18.0, tier_weight: float = 0.75, name: str | None = None):
        super().__init__(replica, peak_prefill_tokens_per_s, max_ttft_penalty_s,
                         name=name or f"llm-d precise, tier-aware (store weight {tier_weight:g})")
        self.replicas_per_node = replicas_per_node
        self.tier_weight = tier_weight

    def setup(self, cluster: ClusterView, seed: int) -> None:
        super().setup(cluster, seed)
        for i, rid in enumerate(self.ids):
            self.index.remove_replica(rid)
            self.index.add_replica(rid, f"node-{i // self.replicas_per_node}")

    def credit(self, req: SimRequest, matched: list[int]) -> tuple[list[float], list[int]]:
        cap = (len(req.prompt_token_ids) - 1) // self.block_size
        loadable = self.index.match_tiers(req.block_hashes, self.ids, dict(zip(self.ids, matched)))
        tier = [min(loadable.get(rid, 0), max(0, cap - matched[i])) for i, rid in enumerate(self.ids)]
        return ([m + self.tier_weight * t for m, t in zip(matched, tier)],
                [m + t for m, t in zip(matched, tier)])


class SglangCacheAware(_Base):
    """SGLang's cache_aware policy over an approximate, routing-history-only prefix set per worker."""

    name = "sglang cache_aware"
    cache_threshold, balance_abs, balance_rel = 0.3, 64, 1.5

    def __init__(self, replica: ReplicaSpec):
        self.pool_blocks = replica.num_blocks

    def setup(self, cluster: ClusterView, seed: int) -> None:
        super().setup(cluster, seed)
        self.trees: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(self.n)]

    def route(self, req: SimRequest, now: float) -> int:
        q = self.cluster.ongoing
        lo, hi = min(q), max(q)
        hashes = req.block_hashes
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            k = self.least_loaded()
        else:
            matched = []
            for tree in self.trees:
                n = 0
                while n < len(hashes) and hashes[n] in tree:
                    n += 1
                matched.append(n)
            best = max(matched)
            if hashes and best / len(hashes) > self.cache_threshold:
                tops = [i for i in range(self.n) if matched[i] == best]
                low = min(q[i] for i in tops)
                k = self.rng.choice([i for i in tops if q[i] == low])
            else:
                sizes = [len(t) for t in self.trees]
                small = min(sizes)
                k = self.rng.choice([i for i in range(self.n) if sizes[i] == small])
        tree = self.trees[k]
        for h in reversed(hashes):                    # the head most recent: evicted last
            tree[h] = None
            tree.move_to_end(h)
        while len(tree) > self.pool_blocks:
            tree.popitem(last=False)
        return k


class DynamoKV(_EventFed):
    """Dynamo's KV router: event index + predicted side index, cost = prefill blocks after overlap + decode
    blocks, both tracked by the router."""

    name = "dynamo kv router"
    speculative_ttl_s = 5.0
    prefill_load_scale = 1.0

    def setup(self, cluster: ClusterView, seed: int) -> None:
        super().setup(cluster, seed)
        self.prefill_blocks = [0] * self.n
        self.decode_blocks = [0] * self.n

    def route(self, req: SimRequest, now: float) -> int:
        matched = self.match(req, now)
        blocks = -(-len(req.prompt_token_ids) // self.block_size)
        cost = [self.prefill_load_scale * max(self.prefill_blocks[i] + blocks - matched[i], 0)
                + self.decode_blocks[i] for i in range(self.n)]
        k = self.pick_lowest(cost, list(range(self.n)))
        new = blocks - matched[k]
        self.prefill_blocks[k] += new
        self.decode_blocks[k] += blocks
        self.prompt_blocks[req.req_id] = (k, blocks, new)
        self.index.insert_speculative(self.ids[k], req.block_hashes, now, start=matched[k])
        return k

    def on_first_token(self, req_id: str, replica: int, num_cached_tokens: int, now: float,
                       kv_wait_s: float = 0.0) -> None:
        k, blocks, new = self.prompt_blocks[req_id]
        self.prefill_blocks[k] -= new
        self.prompt_blocks[req_id] = (k, blocks, 0)

    def on_finished(self, req_id: str, replica: int, now: float) -> None:
        k, blocks, new = self.prompt_blocks.pop(req_id, (replica, 0, 0))
        self.prefill_blocks[k] -= new
        self.decode_blocks[k] -= blocks
