"""Hand-built hashes, events and stats for routing-core tests."""
from __future__ import annotations

import hashlib
import random

from affinity_serve.engine.types import BlockStored

BS = 16


def h(*parts: object) -> bytes:
    """A 32-byte stand-in for a block hash, named by its parts."""
    return hashlib.sha256(repr(parts).encode()).digest()


def chain(name: str, n: int, start: int = 0) -> list[bytes]:
    """n block hashes of prefix `name` (blocks start..start+n-1)."""
    return [h(name, i) for i in range(start, start + n)]


def stored(hashes: list[bytes]) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=BS)


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def synced_core(n: int, prefill_tokens_per_s: float, **cfg):
    """A PrefixAffinityRouterCore over replicas r0..r{n-1}, each synced to an empty cache (epoch "e0"), not
    calibrating; (core, clock, replica ids)."""
    from affinity_serve.app.routing import AffinityConfig, KVEventBatch, PrefixAffinityRouterCore, ReplicaInfo
    cfg.setdefault("calibrate", False)
    clock = Clock()
    core = PrefixAffinityRouterCore(AffinityConfig(prefill_tokens_per_s=prefill_tokens_per_s, **cfg), BS,
                                    clock=clock, rng=random.Random(0))
    ids = [f"r{i}" for i in range(n)]
    core.set_replicas([ReplicaInfo(r) for r in ids])
    for r in ids:
        assert core.on_kv_events(KVEventBatch(r, "e0", 0, []))
    return core, clock, ids
