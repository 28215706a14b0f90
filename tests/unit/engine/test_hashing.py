import subprocess
import sys

from engine.hashing import NONE_HASH, hash_block_chain, hash_block_tokens


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


def test_deterministic_across_processes_and_without_torch():
    code = ("import sys; from engine.hashing import hash_block_chain; "
            "print(hash_block_chain([1,2,3,4,5,6,7,8], 4, 's')[1].hex()); "
            "print('torch' in sys.modules)")
    outs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": str(seed), "PATH": ""}, cwd=".").stdout.split()
            for seed in (1, 2)]
    assert outs[0] == outs[1]
    assert outs[0][0] == hash_block_chain([1, 2, 3, 4, 5, 6, 7, 8], 4, "s")[1].hex()
    assert outs[0][1] == "False"
    assert NONE_HASH.hex().startswith(NONE_HASH.hex()[:4])
