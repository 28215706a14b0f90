"""KV tier counters under pressure: a lookup counts once per admission, a store counts what was written.

The scheduler re-asks the request at the head of the waiting queue on every step while the pool has no
room for it; those re-asks are not admissions and must not inflate `lookups` / `hit_blocks` / `hit_tokens`.
"""
from __future__ import annotations

from affinity_serve.engine.config import SchedulerConfig
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
