"""Old namespaces of the node-shared store: a replica's start-up removes the namespace directories nothing
has used for kv_connector.shared_namespace_ttl_s (a model no longer served leaves its blocks behind, on
tmpfs: memory), and never one in use, a link, another entry or its own."""
from __future__ import annotations

import os
import time

import pytest

from affinity_serve.engine import LLM, SamplingParams
from affinity_serve.engine.kv_connector import KVLayout, SharedKVStore
from affinity_serve.engine.kv_connector.shared_store import BlockRead, remove_stale_namespaces

LAYOUT = KVLayout(2, 2, 8, 4, "float32", 4)
DAY = 86400.0


def _store(root, identity):
    return SharedKVStore(str(root), LAYOUT.namespace(identity), LAYOUT.block_bytes, 16)


def _block(i):
    return bytes([i]) * 32, memoryview(bytes([i, 255 - i]) * (LAYOUT.block_bytes // 2))


def _age(path, days):
    """Make a namespace directory and its bookkeeping files look unused for `days`."""
    t = time.time() - days * DAY
    for name in (".alive", ".index"):
        if os.path.exists(path / name):
            os.utime(path / name, (t, t))
    os.utime(path, (t, t))


def test_only_namespaces_unused_past_the_ttl_are_removed(tmp_path):
    root = tmp_path / "kv"
    old, recent, own = (_store(root, m) for m in ("old", "recent", "own"))
    for s in (old, recent, own):
        s.write_many([_block(1)])
    _age(root / old.dir.split("/")[-1], 8)
    _age(root / recent.dir.split("/")[-1], 6)
    _age(root / own.dir.split("/")[-1], 30)           # this replica's own: kept whatever its age
    stray = root / ("ab" * 16)                          # a namespace-like file, and a link to a directory
    stray.write_text("x")
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep").write_text("x")
    (root / ("cd" * 16)).symlink_to(target)
    (root / "notes").mkdir()
    _age(root / "notes", 30)
    removed = remove_stale_namespaces(str(root), [own.dir.split("/")[-1]], 7 * DAY)
    assert removed == [old.dir.split("/")[-1]]
    left = set(os.listdir(root))
    assert old.dir.split("/")[-1] not in left
    assert {recent.dir.split("/")[-1], own.dir.split("/")[-1], "ab" * 16, "cd" * 16, "notes"} <= left
    assert (target / "keep").exists()                  # nothing followed the link
    # the replica that still held the removed namespace open reopens a fresh one at its next store
    written, _ = old.write_many([_block(2)])
    assert written and old.generation == 1


def test_a_namespace_in_use_is_marked_alive_by_its_reads(tmp_path):
    root = tmp_path / "kv"
    s = _store(root, "m")
    s.write_many([_block(1)])
    ns = s.dir.split("/")[-1]
    _age(root / ns, 10)
    s._alive_due = 0.0                                  # the refresh interval has passed
    assert s.read(_block(1)[0], memoryview(bytearray(LAYOUT.block_bytes))) is BlockRead.OK
    assert remove_stale_namespaces(str(root), [], 7 * DAY) == []
    assert os.listdir(root) == [ns]


def test_a_removal_interrupted_midway_is_finished_by_the_next_sweep(tmp_path):
    root = tmp_path / "kv"
    root.mkdir()
    half = root / ".removing-0123-dead"
    half.mkdir()
    (half / "block").write_text("x")
    assert remove_stale_namespaces(str(root), [], 7 * DAY) == []
    assert os.listdir(root) == []


@pytest.mark.parametrize("ttl", [7 * DAY, None])
def test_an_engine_start_removes_another_models_stale_namespace(checkpoints, tmp_path, ttl):
    root = tmp_path / "kv"
    gone = _store(root, "a model no longer served")
    gone.write_many([_block(1)])
    gone.close()
    _age(root / gone.dir.split("/")[-1], 8)
    kc = {"type": "shared", "shared_dir": str(root), "capacity_blocks": 200, "shared_namespace_ttl_s": ttl}
    llm = LLM(checkpoints["llama"], cache={"num_blocks": 32, "block_size": 8}, kv_connector=kc)
    llm.generate([[11, 12, 13]], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    left = set(os.listdir(root))
    assert (gone.dir.split("/")[-1] in left) is (ttl is None)
    assert len(left - {gone.dir.split("/")[-1]}) == 1   # the engine's own namespace
