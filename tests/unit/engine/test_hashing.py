"""Prefix-cache block hashes: chaining, salt, and a pinned encoding (the router computes the same hashes)."""
import hashlib
import pathlib
import struct
import subprocess
import sys

from affinity_serve.engine.hashing import NONE_HASH, hash_block_chain, hash_block_tokens

REPO = pathlib.Path(__file__).resolve().parents[3]
# Fixed input: two full blocks of 4 (the 9th token is not a full block), salted, the second chained on the
# first. A change in these values is a change of the hash format: replicas and routers of different
# versions would stop agreeing on prefixes, so bump the format's domain tag (b"AS1") deliberately.
PINNED_INPUT = dict(token_ids=[1, 2, 3, 4, 5, 6, 7, 8, 9], block_size=4, cache_salt="tenant-a")
PINNED = ["5fa6c62459144879324de822e4631f9421532075d0f806b3d5445dc09014ebcd",
          "7bca1e07f333906b3cc77e07004e0b0f96a4c3b269698404ce209e4bcb1710cf"]
PINNED_NONE_HASH = "266d09420b1c11fa1a29ca88c1ee3baaca579202d5d00b49bcddaab8a3d1aeff"


def test_chain_covers_parent_tokens_and_salt():
    a = hash_block_chain([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(a) == 2 and all(len(h) == 32 for h in a)
    assert a[0] == hash_block_tokens(None, [1, 2, 3, 4])
    assert a[1] == hash_block_tokens(a[0], [5, 6, 7, 8])
    # same second block, different first block -> different second hash (chained)
    b = hash_block_chain([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert b[1] != a[1]
    # salt enters block 0 and thereby every later block
    s = hash_block_chain([1, 2, 3, 4, 5, 6, 7, 8], 4, cache_salt="tenant-a")
    t = hash_block_chain([1, 2, 3, 4, 5, 6, 7, 8], 4, cache_salt="tenant-b")
    assert s[0] != a[0] and s[1] != a[1] and s[0] != t[0]
    # the salt only affects the block that starts at token 0
    assert hash_block_tokens(s[0], [5, 6, 7, 8]) == s[1]


def test_incremental_chain_equals_whole_chain():
    toks = list(range(100, 140))
    whole = hash_block_chain(toks, 8, "x")
    part = hash_block_chain(toks[:16], 8, "x")
    part += hash_block_chain(toks, 8, "x", parent=part[-1], start_block=2)
    assert part == whole


def test_pinned_hash_values():
    assert NONE_HASH.hex() == PINNED_NONE_HASH
    assert [h.hex() for h in hash_block_chain(**PINNED_INPUT)] == PINNED
    # the same through the one-block function, given the parent explicitly
    first = hash_block_tokens(None, [1, 2, 3, 4], "tenant-a")
    assert hash_block_tokens(first, [5, 6, 7, 8]).hex() == PINNED[1]


def test_pinned_values_follow_the_documented_encoding():
    """sha256(b"AS1" || parent || u32le(token) * n || extra), extra = b"salt" || u32le(len) || utf-8 salt."""
    salt = b"tenant-a"
    first = hashlib.sha256(b"AS1" + NONE_HASH + struct.pack("<4I", 1, 2, 3, 4)
                           + b"salt" + struct.pack("<I", len(salt)) + salt).digest()
    second = hashlib.sha256(b"AS1" + first + struct.pack("<4I", 5, 6, 7, 8)).digest()
    assert [first.hex(), second.hex()] == PINNED


def test_deterministic_across_processes_and_without_torch():
    """No per-process seed enters the hash (e.g. Python's salted str hash): fresh interpreters agree."""
    code = ("import sys; from affinity_serve.engine.hashing import hash_block_chain; "
            f"print(' '.join(h.hex() for h in hash_block_chain(**{PINNED_INPUT!r}))); "
            "print('torch' in sys.modules)")
    outs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed, "PATH": ""}, cwd=REPO).stdout.splitlines()
            for seed in ("1", "2", "random")]
    for out in outs:
        assert out == [" ".join(PINNED), "False"]
