"""The node-shared store's directory deleted (or replaced) while replicas serve: the next store notices,
logs one line, and reopens the directory with the start-up checks, so sharing resumes without a restart."""
from __future__ import annotations

import logging
import os
import random
import shutil

import pytest

from affinity_serve.engine import LLM, SamplingParams
from affinity_serve.engine.kv_connector import KVLayout, SharedKVStore
from affinity_serve.engine.kv_connector.shared_store import BlockRead

LAYOUT = KVLayout(2, 2, 8, 4, "float32", 4)


def _store(root, capacity=16):
    return SharedKVStore(str(root), LAYOUT.namespace("m"), LAYOUT.block_bytes, capacity)


def _block(i):
    return bytes([i]) * 32, memoryview(bytes([i, 255 - i]) * (LAYOUT.block_bytes // 2))


def _generate_and_store(llm, prompt, sp) -> None:
    """Generate, then step until the connector's store of the prompt's blocks has finished."""
    llm.generate([prompt], sp, use_tqdm=False)
    for _ in range(10):
        if not llm.engine.scheduler.has_pending_kv_transfers():
            break
        llm.engine.step()


def _log_lines(caplog):
    """The store's warnings and errors (its INFO start-up line shows where another test raised the level)."""
    return [r for r in caplog.records if r.name.startswith("affinity_serve.engine.kv_connector")
            and r.levelno >= logging.WARNING]


@pytest.mark.parametrize("replaced", [False, True])
def test_a_deleted_store_directory_is_reopened_by_the_next_write(tmp_path, caplog, replaced):
    root = tmp_path / "kv"
    a = _store(root)
    a.write_many([_block(1)])
    shutil.rmtree(root)
    if replaced:                     # another replica started meanwhile and recreated the store
        b = _store(root)
    with caplog.at_level(logging.WARNING):
        written, _ = a.write_many([_block(2)])
        a.write_many([_block(3)])
    assert len(written) == 1
    lines = _log_lines(caplog)
    assert len(lines) == 1 and ("replaced" if replaced else "removed") in lines[0].getMessage()
    assert not lines[0].exc_info
    if not replaced:
        b = _store(root)
    buf = bytearray(LAYOUT.block_bytes)
    for i in (2, 3):                 # the other replica sees what `a` stored after the deletion
        h, data = _block(i)
        assert b.read(h, memoryview(buf)) is BlockRead.OK and bytes(buf) == bytes(data)
    assert b.read(_block(1)[0], memoryview(buf)) is BlockRead.MISSING
    assert a.num_blocks() == b.num_blocks() == 2
    assert oct(os.stat(root).st_mode & 0o777) == oct(0o700)


def test_an_unsafe_directory_in_the_deleted_ones_place_is_refused_and_logged_once(tmp_path, caplog):
    root = tmp_path / "kv"
    a = _store(root)
    shutil.rmtree(root)
    os.mkdir(root)
    os.chmod(root, 0o777)            # someone else's playground now: never written into
    with caplog.at_level(logging.WARNING):
        for i in range(3):
            with pytest.raises(OSError):
                a.write_many([_block(i)])
    lines = _log_lines(caplog)
    assert len(lines) == 1 and "0777" in lines[0].getMessage()
    assert os.listdir(root) == []


def test_engines_share_again_after_the_store_is_deleted_while_serving(checkpoints, tmp_path, caplog):
    path = checkpoints["llama"]
    kc = {"type": "shared", "shared_dir": str(tmp_path / "kv"), "capacity_blocks": 200}
    a = LLM(path, cache={"num_blocks": 32, "block_size": 8}, kv_connector=kc)
    sp = SamplingParams(max_tokens=2, temperature=0.0)
    a.generate([[11, 12, 13]], sp, use_tqdm=False)
    shutil.rmtree(tmp_path / "kv")
    b = LLM(path, cache={"num_blocks": 32, "block_size": 8}, kv_connector=kc)      # recreates the store
    prompt = [random.Random(5).randrange(10, 700) for _ in range(41)]
    with caplog.at_level(logging.WARNING):
        _generate_and_store(a, prompt, sp)
        out = b.generate([prompt], sp, use_tqdm=False)[0]
    assert out.num_cached_tokens == 40                 # B loads what A computed after the deletion
    assert a.engine.kv_connector.stats.stores_failed == 0
    assert len(_log_lines(caplog)) == 1


def test_a_replica_writes_blocks_again_that_it_had_written_before_the_store_was_deleted(checkpoints, tmp_path):
    path = checkpoints["llama"]
    kc = {"type": "shared", "shared_dir": str(tmp_path / "kv"), "capacity_blocks": 200}
    sp = SamplingParams(max_tokens=2, temperature=0.0)
    prompt = [random.Random(6).randrange(10, 700) for _ in range(41)]
    a = LLM(path, cache={"num_blocks": 32, "block_size": 8}, kv_connector=kc)
    a.generate([prompt], sp, use_tqdm=False)          # stored once, before the deletion
    shutil.rmtree(tmp_path / "kv")
    b = LLM(path, cache={"num_blocks": 32, "block_size": 8}, kv_connector=kc)
    a.engine.reset_prefix_cache()                      # A computes the prompt again...
    _generate_and_store(a, prompt, sp)
    out = b.generate([prompt], sp, use_tqdm=False)[0]
    assert out.num_cached_tokens == 40                 # ...and stores it again, where B finds it
