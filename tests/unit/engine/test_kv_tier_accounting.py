"""KV tier counters under pressure: a lookup counts once per admission, a store counts what was written.

The scheduler re-asks the request at the head of the waiting queue on every step while the pool has no
room for it; those re-asks are not admissions and must not inflate `lookups` / `hit_blocks` / `hit_tokens`.
"""
from __future__ import annotations

import os
import random

import pytest

from affinity_serve.engine import LLM, SamplingParams
from affinity_serve.engine.config import SchedulerConfig
from affinity_serve.engine.hashing import hash_block_chain
from affinity_serve.engine.kv_cache_manager import KVCacheManager
from affinity_serve.engine.kv_connector import KVConnectorOutput, KVLayout, SharedConnectorScheduler, SharedKVStore
from affinity_serve.engine.request import RequestStatus
from affinity_serve.engine.scheduler import Scheduler

from tests.unit.engine.helpers import make_request, runner_output

LAYOUT = KVLayout(2, 2, 8, 4, "float32", 4)
BS = LAYOUT.block_size


def _store(root, capacity=64):
    return SharedKVStore(str(root), LAYOUT.namespace("m"), LAYOUT.block_bytes, capacity)


def test_a_request_waiting_for_blocks_counts_one_lookup_per_admission(tmp_path):
    hog = make_request("hog", 4 * BS + 1, max_tokens=20)              # fills the pool while it decodes
    reader = make_request("reader", 8 * BS + 1, max_tokens=2)
    store = _store(tmp_path / "kv")
    store.write_many([(h, memoryview(bytes(LAYOUT.block_bytes))) for h in reader.block_hashes])
    conn = SharedConnectorScheduler(LAYOUT, store)
    sched = Scheduler(SchedulerConfig(), KVCacheManager(12, BS, 256), 256, kv_connector=conn)
    sched.add_request(hog)
    sched.add_request(reader)
    waited = 0
    for _ in range(200):
        so = sched.schedule()
        if reader.status is RequestStatus.WAITING and "hog" in so.num_scheduled_tokens:
            waited += 1
        out = runner_output(sched, so)
        meta = so.kv_connector_metadata
        if meta is not None:
            out.kv_connector_output = KVConnectorOutput(
                finished_loads={t.req_id: True for t in meta.loads},
                finished_stores=[(t.block_hashes, True) for t in meta.stores])
        sched.update_from_output(so, out)
        if not sched.has_unfinished_requests() and not sched.has_pending_kv_transfers():
            break
    assert waited >= 5, "the reader never waited at the head of the queue: the test proves nothing"
    s = conn.stats
    assert s.loads_ok == 1 and s.loaded_blocks == 8
    # admissions that asked: the hog's, the reader's load, the reader's run after its load
    assert s.lookups == 3
    assert s.hit_blocks == 8 and s.hit_tokens == 8 * BS


# ------------------------------------------------------------------ engine level (tiny llama)
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(10, 700) for _ in range(n)]


PROMPT = _ids(50, 7)          # 6 full blocks of 8, then 2 tokens


def _llm(path, store_dir, capacity=256, num_blocks=32):
    return LLM(path, cache={"num_blocks": num_blocks, "block_size": 8},
               kv_connector={"type": "shared", "capacity_blocks": capacity, "shared_dir": str(store_dir)})


def _gen(llm, prompt, n=6):
    out = llm.generate([prompt], SamplingParams(max_tokens=n, **GREEDY), use_tqdm=False)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def _flush(llm):
    for _ in range(20):
        if not llm.engine.has_unfinished_requests() and not llm.engine.scheduler.has_pending_kv_transfers():
            return
        llm.engine.step()
    raise AssertionError("KV transfers did not finish")


def _block_files(store):
    return {n for n in os.listdir(store.dir) if not n.startswith(".")}


@pytest.mark.parametrize("first_block_gone", [False, True])
def test_stored_blocks_count_only_blocks_written_not_blocks_already_present(checkpoints, tmp_path,
                                                                            first_block_gone):
    path = checkpoints["llama"]
    writer = _llm(path, tmp_path / "kv")
    _gen(writer, PROMPT)
    _flush(writer)
    store = writer.engine.kv_connector.store
    if first_block_gone:      # the reader cannot load: it computes the prefix, which the store mostly holds
        os.unlink(os.path.join(store.dir, hash_block_chain(PROMPT, 8)[0].hex()))
    before = _block_files(store)
    reader = _llm(path, tmp_path / "kv")
    toks, cached = _gen(reader, PROMPT + [5, 6, 7, 8, 9, 10, 11, 12])     # loads 6 blocks, computes more
    _flush(reader)
    s = reader.engine.kv_connector.stats
    assert (s.loaded_blocks, cached) == ((0, 0) if first_block_gone else (6, 48))
    new = _block_files(store) - before
    assert new, "the reader wrote nothing: the test proves nothing"
    # blocks the store holds already (loaded, or computed again) are offered again but not written
    assert s.stored_blocks == len(new)
    assert s.stored_bytes == len(new) * store.block_bytes
