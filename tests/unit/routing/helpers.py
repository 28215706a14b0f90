"""Hand-built hashes, events and stats for routing-core tests."""
from __future__ import annotations

import hashlib

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
