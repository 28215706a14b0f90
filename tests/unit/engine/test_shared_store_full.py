"""The node-shared store on a full filesystem (ENOSPC): what was written counts, the store still evicts to
its capacity and keeps `.index` right, and the failure is logged once, not a traceback per step."""
from __future__ import annotations

import errno
import logging
import os
import random

import pytest

from affinity_serve.engine import LLM, SamplingParams
from affinity_serve.engine.kv_connector import KVLayout, SharedKVStore
from affinity_serve.engine.kv_connector.shared_store import StoreWriteError

LAYOUT = KVLayout(2, 2, 8, 4, "float32", 4)
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _files(store):
    return sorted(n for n in os.listdir(store.dir) if not n.startswith("."))


@pytest.fixture
def disk_of(monkeypatch):
    """disk_of(n): every store's filesystem holds n block files; a write past that fails with ENOSPC.
    Returns the list of block files written successfully (names)."""
    written: list[str] = []
    real = SharedKVStore._write_file

    def install(limit):
        def write_file(self, name, parts):
            if not name.startswith(".") and len(_files(self)) >= limit:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real(self, name, parts)
            if not name.startswith("."):
                written.append(name)
        monkeypatch.setattr(SharedKVStore, "_write_file", write_file)
        return written
    return install


def _blocks(n, seed=0):
    rng = random.Random(seed)
    return [(rng.randbytes(32), memoryview(rng.randbytes(LAYOUT.block_bytes))) for _ in range(n)]


@pytest.mark.parametrize("capacity,disk", [(8, 10), (20, 10)])
def test_a_full_filesystem_still_evicts_to_capacity_and_keeps_the_index(tmp_path, disk_of, capacity, disk):
    store = SharedKVStore(str(tmp_path / "kv"), LAYOUT.namespace("m"), LAYOUT.block_bytes, capacity)
    written = disk_of(disk)
    with pytest.raises(StoreWriteError) as info:
        store.write_many(_blocks(12))
    err = info.value
    assert err.errno == errno.ENOSPC
    assert len(err.written) == disk == len(written)
    files = _files(store)
    # past the capacity: down to it; below it (the filesystem is smaller): a tenth goes to make room
    assert len(files) <= min(capacity, disk) - 1
    assert len(err.evicted) == disk - len(files)
    assert store.num_blocks() == len(files)              # .index is right
    w, _ = store.write_many(_blocks(1, seed=1))           # room again: the next store succeeds
    assert len(w) == 1


def test_an_engine_on_a_full_filesystem_counts_what_it_wrote_and_logs_once(checkpoints, tmp_path, disk_of, caplog):
    written = disk_of(5)
    llm = LLM(checkpoints["llama"], cache={"num_blocks": 32, "block_size": 8},
              kv_connector={"type": "shared", "capacity_blocks": 4, "shared_dir": str(tmp_path / "kv")})
    store = llm.engine.kv_connector.store
    rng = random.Random(3)
    prompts = [[rng.randrange(10, 700) for _ in range(60)] for _ in range(4)]
    with caplog.at_level(logging.WARNING):
        for p in prompts:
            llm.generate([p], SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)
        for _ in range(20):
            if not llm.engine.scheduler.has_pending_kv_transfers():
                break
            llm.engine.step()
    s = llm.engine.kv_connector.stats
    assert s.stores_failed > 0, "no store hit the full filesystem: the test proves nothing"
    assert s.stored_blocks == len(written)
    assert s.evicted_blocks == len(written) - len(_files(store))
    assert len(_files(store)) <= 4 and store.num_blocks() == len(_files(store))
    failures = [r for r in caplog.records if "writing" in r.getMessage() and "failed" in r.getMessage()]
    assert len(failures) >= 1 and not any(r.exc_info for r in caplog.records)
    assert len(failures) <= s.stores_failed       # once per run of failures, never per step


def test_a_store_that_cannot_write_at_all_logs_one_line_not_a_traceback_per_step(checkpoints, tmp_path, disk_of,
                                                                                  caplog):
    disk_of(0)
    llm = LLM(checkpoints["llama"], cache={"num_blocks": 32, "block_size": 8},
              kv_connector={"type": "shared", "capacity_blocks": 64, "shared_dir": str(tmp_path / "kv")})
    rng = random.Random(4)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            llm.generate([[rng.randrange(10, 700) for _ in range(40)]], SamplingParams(max_tokens=10, **GREEDY),
                         use_tqdm=False)
    s = llm.engine.kv_connector.stats
    assert s.stored_blocks == 0 and s.stores_failed >= 15
    lines = [r for r in caplog.records if r.name.startswith("affinity_serve.engine.kv_connector")
             and r.levelno >= logging.WARNING]         # not the INFO start-up line, captured in a full run
    assert len(lines) == 1 and "No space left on device" in lines[0].getMessage() and not lines[0].exc_info


def test_a_damaged_file_is_still_removed_when_the_filesystem_is_full(tmp_path, monkeypatch):
    from affinity_serve.engine.kv_connector.shared_store import HEADER_BYTES, BlockRead
    store = SharedKVStore(str(tmp_path / "kv"), LAYOUT.namespace("m"), LAYOUT.block_bytes, 8)
    (h, data), = _blocks(1)
    store.write_many([(h, data)])
    path = os.path.join(store.dir, h.hex())
    raw = bytearray(open(path, "rb").read())
    raw[HEADER_BYTES] ^= 1
    open(path, "wb").write(raw)

    def full(self, name, parts):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(SharedKVStore, "_write_file", full)      # not even .index can be written
    assert store.read(h, memoryview(bytearray(LAYOUT.block_bytes))) is BlockRead.DAMAGED
    assert not os.path.exists(path)
