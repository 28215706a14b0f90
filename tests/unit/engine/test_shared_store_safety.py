"""The node-shared KV store's file handling (issue 26): content-verified blocks, no link ever followed,
owner and mode checks, group mode, salted requests kept local, and the tier counters.

Every damaged-file case ends the same way: the load is a miss counted by cause, the greedy output equals
an uncached run's, no file outside the store changed, and the next store repairs the block.
"""
from __future__ import annotations

import os
import random
import stat

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from affinity_serve.engine import LLM, SamplingParams
from affinity_serve.engine.hashing import hash_block_chain
from affinity_serve.engine.kv_connector import KVLayout, SharedKVStore, UnsafeSharedStoreError, default_shared_root
from affinity_serve.engine.kv_connector import shared_store
from affinity_serve.engine.kv_connector.shared_store import HEADER_BYTES, BlockRead, check_shared_root

GREEDY = dict(temperature=0.0, ignore_eos=True)
BS = 8
LAYOUT = KVLayout(2, 2, 8, 4, "float32", 4)
FOREIGN_UID = 54321


def _ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(10, 700) for _ in range(n)]


PREFIX = _ids(48, 26)
PROMPT = PREFIX + [3, 4]          # 6 loadable blocks


def _llm(path, store_dir, **connector):
    return LLM(path, cache={"num_blocks": 32, "block_size": BS},
               kv_connector={"type": "shared", "capacity_blocks": 256, "shared_dir": str(store_dir), **connector})


def _gen(llm, prompt, n=6, salt=None):
    if salt is None:
        out = llm.generate([prompt], SamplingParams(max_tokens=n, **GREEDY), use_tqdm=False)[0]
        return out.outputs[0].token_ids, out.num_cached_tokens
    eng = llm.engine
    eng.add_request(eng.make_request(prompt, SamplingParams(max_tokens=n, **GREEDY), cache_salt=salt, req_id="salted"))
    toks, cached = [], None
    while eng.has_unfinished_requests():
        for d in eng.step().deltas:
            toks += d.token_ids
            cached = d.num_cached_tokens if cached is None else cached
    return toks, cached


def _flush(llm):
    for _ in range(10):
        if not llm.engine.has_unfinished_requests():
            return
        llm.engine.step()
    raise AssertionError("KV transfers did not finish")


def _stats(llm):
    return llm.engine.kv_connector.stats


def _store(llm) -> SharedKVStore:
    return llm.engine.kv_connector.store


@pytest.fixture(scope="module")
def uncached(checkpoints):
    """The greedy output of PROMPT without any KV tier."""
    llm = LLM(checkpoints["llama"], cache={"num_blocks": 32, "block_size": BS})
    return llm.generate([PROMPT], SamplingParams(max_tokens=6, **GREEDY), use_tqdm=False)[0].outputs[0].token_ids


@pytest.fixture
def outside(tmp_path):
    """A directory outside the store with one file in it; the test checks it is never touched."""
    d = tmp_path / "outside"
    d.mkdir()
    victim = d / "victim"
    victim.write_bytes(b"x" * 65)
    return victim


def _snapshot(path):
    st_ = os.lstat(path)
    return path.read_bytes(), st_.st_mtime_ns, st_.st_size


# ------------------------------------------------------------------ the store alone
def _small_store(root, capacity=16, **kw):
    return SharedKVStore(str(root), LAYOUT.namespace("m"), LAYOUT.block_bytes, capacity, **kw)


def _block(i):
    return bytes([i]) * 32, memoryview(bytes([i, 255 - i]) * (LAYOUT.block_bytes // 2))


def test_round_trip_modes_and_header(tmp_path):
    root = tmp_path / "kv"
    store = _small_store(root)
    h, data = _block(1)
    assert store.write_many([(h, data)]) == ([h], [])
    ns_dir = root / LAYOUT.namespace("m")
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(ns_dir).st_mode) == 0o700
    files = sorted(os.listdir(ns_dir))
    assert files == sorted([".alive", ".index", ".lock", h.hex()])          # no temporary left behind
    for name in files:
        assert stat.S_IMODE(os.stat(ns_dir / name).st_mode) == 0o600, name
    assert os.path.getsize(ns_dir / h.hex()) == HEADER_BYTES + LAYOUT.block_bytes
    buf = bytearray(LAYOUT.block_bytes)
    assert store.read(h, memoryview(buf)) is BlockRead.OK and bytes(buf) == bytes(data)
    assert store.read(_block(2)[0], memoryview(buf)) is BlockRead.MISSING
    assert not store.damaged


def _corrupt(ns_dir, h, other_h, how, outside_file):
    """Damage the file of block `h` the way `how` says (other_h: another valid block in the store)."""
    path = ns_dir / h.hex()
    raw = bytearray(path.read_bytes())
    if how == "flipped_payload":
        raw[HEADER_BYTES + 17] ^= 0x40
        path.write_bytes(raw)
    elif how == "flipped_header":
        raw[20] ^= 0x01                            # inside the namespace field
        path.write_bytes(raw)
    elif how == "swapped":                         # a valid block file of another key
        path.write_bytes((ns_dir / other_h.hex()).read_bytes())
    elif how == "truncated":
        path.write_bytes(raw[:-100])
    elif how == "older_version":                   # today's headerless format: the payload alone
        path.write_bytes(raw[HEADER_BYTES:])
    elif how == "symlink":                         # to a genuine block file of another key, outside the store
        outside_file.write_bytes((ns_dir / other_h.hex()).read_bytes())
        path.unlink()
        path.symlink_to(outside_file)
    elif how == "fifo":
        path.unlink()
        os.mkfifo(path)
    elif how == "foreign_owner":
        os.chown(path, FOREIGN_UID, -1)
    elif how == "world_writable":
        os.chmod(path, 0o666)
    else:
        raise AssertionError(how)


KINDS = {"flipped_payload": "checksum", "flipped_header": "key", "swapped": "key", "truncated": "truncated",
         "older_version": "version", "symlink": "link", "fifo": "link", "foreign_owner": "owner",
         "world_writable": "owner"}


@pytest.mark.parametrize("how", list(KINDS))
def test_a_damaged_file_is_a_counted_miss_and_the_next_store_repairs_it(tmp_path, outside, how):
    root = tmp_path / "kv"
    store = _small_store(root)
    (h, data), (h2, data2) = _block(1), _block(2)
    store.write_many([(h, data), (h2, data2)])
    ns_dir = root / LAYOUT.namespace("m")
    _corrupt(ns_dir, h, h2, how, outside)
    before = _snapshot(outside)
    buf = bytearray(LAYOUT.block_bytes)
    assert store.contains(h)
    assert store.read(h, memoryview(buf)) is BlockRead.DAMAGED
    assert store.damaged == {KINDS[how]: 1}
    assert not os.path.lexists(ns_dir / h.hex())                   # removed (a link itself, not its target)
    assert _snapshot(outside) == before
    assert store.num_blocks() == len(store.block_hashes()) == 1
    assert store.write_many([(h, data)]) == ([h], [])             # repaired by the next store
    assert store.read(h, memoryview(buf)) is BlockRead.OK and bytes(buf) == bytes(data)
    assert store.num_blocks() == 2


def test_a_damaged_file_is_logged_once(tmp_path, caplog):
    store = _small_store(tmp_path / "kv")
    h, data = _block(1)
    ns_dir = tmp_path / "kv" / LAYOUT.namespace("m")
    buf = memoryview(bytearray(LAYOUT.block_bytes))
    with caplog.at_level("WARNING", logger=shared_store.__name__):
        for _ in range(3):
            store.write_many([(h, data)])
            (ns_dir / h.hex()).write_bytes(b"junk")
            assert store.read(h, buf) is BlockRead.DAMAGED
    assert store.damaged == {"truncated": 3}
    assert sum(h.hex() in r.getMessage() for r in caplog.records) == 1


def test_a_store_replaces_a_link_at_the_block_path_and_never_writes_through_it(tmp_path, outside):
    root = tmp_path / "kv"
    store = _small_store(root)
    h, data = _block(1)
    ns_dir = root / LAYOUT.namespace("m")
    (ns_dir / h.hex()).symlink_to(outside)
    before = _snapshot(outside)
    assert store.write_many([(h, data)]) == ([h], [])
    assert _snapshot(outside) == before
    assert not os.path.islink(ns_dir / h.hex())
    buf = bytearray(LAYOUT.block_bytes)
    assert store.read(h, memoryview(buf)) is BlockRead.OK and bytes(buf) == bytes(data)


def test_links_planted_at_temporary_names_are_never_written_through(tmp_path, outside, monkeypatch):
    root = tmp_path / "kv"
    store = _small_store(root)
    ns_dir = root / LAYOUT.namespace("m")
    h, data = _block(1)
    # the old writer's predictable name, and the first two names the new one will draw
    names = iter(["0" * 16, "0" * 16, "1" * 16] + [f"{i:016x}" for i in range(2, 100)])
    monkeypatch.setattr(shared_store.secrets, "token_hex", lambda n: next(names))
    for planted in (f"{h.hex()}.tmp{os.getpid()}", ".tmp-" + "0" * 16, ".tmp-" + "1" * 16):
        (ns_dir / planted).symlink_to(outside)
    before = _snapshot(outside)
    assert store.write_many([(h, data)]) == ([h], [])
    assert _snapshot(outside) == before
    buf = bytearray(LAYOUT.block_bytes)
    assert store.read(h, memoryview(buf)) is BlockRead.OK and bytes(buf) == bytes(data)


def test_every_single_byte_corruption_is_detected_at_store_level(tmp_path):
    store = _small_store(tmp_path / "kv")
    h, data = _block(7)
    store.write_many([(h, data)])
    path = tmp_path / "kv" / LAYOUT.namespace("m") / h.hex()
    pristine = path.read_bytes()
    buf = memoryview(bytearray(LAYOUT.block_bytes))

    @settings(max_examples=60)
    @given(offset=st.integers(0, len(pristine) - 1), xor=st.integers(1, 255))
    def check(offset, xor):
        raw = bytearray(pristine)
        raw[offset] ^= xor
        path.write_bytes(raw)
        assert store.read(h, buf) is BlockRead.DAMAGED
        store.write_many([(h, data)])                    # repaired for the next example
        assert path.read_bytes() == pristine
    check()


# ------------------------------------------------------------------ roots: owner, mode, links, default
def test_a_foreign_owned_root_is_refused_with_one_clear_error(tmp_path):
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    os.chown(root, FOREIGN_UID, -1)
    with pytest.raises(UnsafeSharedStoreError, match=rf"{root}.*owned by uid {FOREIGN_UID}"):
        _small_store(root)
    with pytest.raises(UnsafeSharedStoreError):
        check_shared_root(str(root))
    assert os.listdir(root) == []                      # nothing created inside


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o720])
def test_a_root_others_may_write_is_refused(tmp_path, mode):
    root = tmp_path / "kv"
    root.mkdir()
    os.chmod(root, mode)
    with pytest.raises(UnsafeSharedStoreError, match=rf"{root}.*mode {mode:04o}"):
        _small_store(root)
    assert os.listdir(root) == []


def test_a_link_as_root_or_namespace_directory_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "kv"
    link.symlink_to(real)
    with pytest.raises(UnsafeSharedStoreError, match="not a directory"):
        _small_store(link)
    root = tmp_path / "kv2"
    root.mkdir(mode=0o700)
    (root / LAYOUT.namespace("m")).symlink_to(real)
    with pytest.raises(UnsafeSharedStoreError, match="without following links"):
        _small_store(root)
    assert os.listdir(real) == []


def test_a_foreign_namespace_directory_or_lock_is_refused(tmp_path):
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    ns = root / LAYOUT.namespace("m")
    ns.mkdir(mode=0o700)
    os.chown(ns, FOREIGN_UID, -1)
    with pytest.raises(UnsafeSharedStoreError, match=f"owned by uid {FOREIGN_UID}"):
        _small_store(root)
    os.chown(ns, os.geteuid(), -1)
    (ns / ".lock").write_bytes(b"")
    os.chown(ns / ".lock", FOREIGN_UID, -1)
    with pytest.raises(UnsafeSharedStoreError, match=".lock"):
        _small_store(root)


def test_an_older_stores_readable_directories_are_tightened(tmp_path):
    root = tmp_path / "kv"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    (root / LAYOUT.namespace("m")).mkdir()
    os.chmod(root / LAYOUT.namespace("m"), 0o755)
    _small_store(root)
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(root / LAYOUT.namespace("m")).st_mode) == 0o700


def test_the_default_root_is_per_user():
    assert default_shared_root().endswith(f"affinity-serve-kv-{os.geteuid()}")


def test_group_mode_shares_with_one_group_only(tmp_path):
    gid = os.getegid()
    root = tmp_path / "kv"
    store = _small_store(root, group=gid)
    h, data = _block(1)
    store.write_many([(h, data)])
    ns_dir = root / LAYOUT.namespace("m")
    for d in (root, ns_dir):
        st_ = os.stat(d)
        assert stat.S_IMODE(st_.st_mode) == 0o2770 and st_.st_gid == gid
    st_ = os.stat(ns_dir / h.hex())
    assert stat.S_IMODE(st_.st_mode) == 0o660 and st_.st_gid == gid
    buf = bytearray(LAYOUT.block_bytes)
    assert store.read(h, memoryview(buf)) is BlockRead.OK
    os.chmod(root, 0o2777)
    with pytest.raises(UnsafeSharedStoreError, match="every user"):
        _small_store(root, group=gid)
    os.chmod(root, 0o2770)
    with pytest.raises(UnsafeSharedStoreError, match="group"):
        _small_store(root, group=gid + 4242)
    with pytest.raises(UnsafeSharedStoreError, match="group sharing is opt-in"):
        _small_store(root)                                 # private mode refuses the group's root


# ------------------------------------------------------------------ through the engine
@pytest.mark.parametrize("how", ["flipped_payload", "swapped", "truncated", "older_version", "symlink",
                                 "foreign_owner"])
def test_a_damaged_block_costs_a_recompute_never_a_wrong_token(checkpoints, tmp_path, outside, uncached, how):
    path = checkpoints["llama"]
    store_dir = tmp_path / "kv"
    writer = _llm(path, store_dir)
    assert _gen(writer, PROMPT)[0] == uncached
    _flush(writer)
    hashes = hash_block_chain(PROMPT, BS)[:6]
    ns_dir = store_dir / _store(writer).dir.rsplit("/", 1)[1]
    _corrupt(ns_dir, hashes[2], hashes[3], how, outside)
    before = _snapshot(outside)

    reader = _llm(path, store_dir)
    toks, cached = _gen(reader, PROMPT)
    assert toks == uncached and cached == 0            # the load failed as a whole: recomputed
    stats = _stats(reader)
    assert stats.loads_failed == stats.load_failures_damaged == 1 and stats.loads_ok == 0
    assert _store(reader).damaged == {KINDS[how]: 1}
    assert _snapshot(outside) == before
    _flush(reader)                                     # the recompute stored the block again

    checker = _llm(path, store_dir)
    toks, cached = _gen(checker, PROMPT)
    assert toks == uncached and cached == 48
    assert _stats(checker).loads_ok == 1 and _stats(checker).loaded_blocks == 6
    assert _stats(checker).loaded_bytes == 6 * _store(checker).block_bytes
    assert not _store(checker).damaged and _snapshot(outside) == before


def test_an_unsafe_root_stops_the_engine_with_the_path_in_the_error(checkpoints, tmp_path):
    root = tmp_path / "kv"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(UnsafeSharedStoreError, match=str(root)):
        _llm(checkpoints["llama"], root)
    os.chmod(root, 0o700)
    os.chown(root, FOREIGN_UID, -1)
    with pytest.raises(UnsafeSharedStoreError, match=str(root)):
        _llm(checkpoints["llama"], root)
    assert os.listdir(root) == []


def test_salted_requests_can_be_kept_off_the_shared_tier(checkpoints, tmp_path, uncached):
    path = checkpoints["llama"]
    store_dir = tmp_path / "kv"
    llm = _llm(path, store_dir, share_salted_requests=False)
    salted, cached = _gen(llm, PROMPT, salt="tenant-a")
    _flush(llm)
    assert salted == uncached and cached == 0
    assert _store(llm).block_hashes() == []                    # nothing of the salted request was written
    assert _stats(llm).lookups == 0
    _gen(llm, PROMPT)                                          # unsalted: shared as before
    _flush(llm)
    assert set(hash_block_chain(PROMPT, BS)[:6]) <= set(_store(llm).block_hashes())
    # the default shares salted requests' blocks (under salted hashes)
    other = _llm(path, tmp_path / "kv2")
    _gen(other, PROMPT, salt="tenant-a")
    _flush(other)
    assert set(hash_block_chain(PROMPT, BS, "tenant-a")[:6]) <= set(_store(other).block_hashes())


def test_tier_counters_cover_hits_stores_and_bytes(checkpoints, tmp_path, uncached):
    path = checkpoints["llama"]
    writer = _llm(path, tmp_path / "kv")
    _gen(writer, PROMPT)
    _flush(writer)
    st_w = _stats(writer)
    block_bytes = _store(writer).block_bytes
    assert st_w.stored_blocks >= 6 and st_w.stored_bytes == st_w.stored_blocks * block_bytes
    reader = _llm(path, tmp_path / "kv")
    _gen(reader, PROMPT)
    st_r = _stats(reader)
    assert st_r.lookups >= 1 and st_r.hit_blocks == 6 and st_r.hit_tokens == 48
    assert st_r.loads_ok == 1 and st_r.loads_failed == 0


# ------------------------------------------------------------------ property: any byte, same output
@pytest.fixture(scope="module")
def corruptible(checkpoints, tmp_path_factory):
    """A store holding PROMPT's blocks (pristine copies kept) and a reader engine."""
    path = checkpoints["llama"]
    store_dir = tmp_path_factory.mktemp("kv-prop") / "kv"
    writer = _llm(path, store_dir)
    _gen(writer, PROMPT)
    _flush(writer)
    ns_dir = store_dir / _store(writer).dir.rsplit("/", 1)[1]
    files = [ns_dir / h.hex() for h in hash_block_chain(PROMPT, BS)[:6]]
    return _llm(path, store_dir), files, [f.read_bytes() for f in files]


@settings(max_examples=12)
@given(which=st.integers(0, 5), offset=st.integers(0, HEADER_BYTES + LAYOUT.block_bytes), xor=st.integers(1, 255))
def test_corrupting_any_byte_of_a_block_file_never_changes_a_greedy_output(corruptible, uncached, which, offset,
                                                                             xor):
    reader, files, pristine = corruptible
    for f, raw in zip(files, pristine):
        f.write_bytes(raw)
    raw = bytearray(pristine[which])
    raw[offset % len(raw)] ^= xor
    files[which].write_bytes(raw)
    reader.engine.reset_prefix_cache()
    failed = _stats(reader).load_failures_damaged
    toks, cached = _gen(reader, PROMPT)
    _flush(reader)
    assert toks == uncached and cached == 0
    assert _stats(reader).load_failures_damaged == failed + 1


# ------------------------------------------------------------------ timeouts (scheduler, no model)
def _sched_with_store(tmp_path, req):
    from affinity_serve.engine.kv_cache_manager import KVCacheManager
    from affinity_serve.engine.kv_connector import SharedConnectorScheduler
    from affinity_serve.engine.scheduler import Scheduler
    from affinity_serve.engine.config import SchedulerConfig

    store = _small_store(tmp_path / "kv", capacity=64)
    store.write_many([(h, memoryview(bytes(LAYOUT.block_bytes))) for h in req.block_hashes])
    conn = SharedConnectorScheduler(LAYOUT, store, load_timeout_s=0.0)
    kv = KVCacheManager(64, LAYOUT.block_size, 256)
    return Scheduler(SchedulerConfig(), kv, 256, kv_connector=conn), conn


@pytest.mark.parametrize("abort", [False, True])
def test_a_timed_out_load_counts_once_as_timed_out_and_an_aborted_one_not_at_all(tmp_path, abort):
    from affinity_serve.engine.kv_connector import KVConnectorOutput
    from affinity_serve.engine.request import RequestStatus

    from tests.unit.engine.helpers import make_request, runner_output

    req = make_request("r", 21, block_size=LAYOUT.block_size)
    sched, conn = _sched_with_store(tmp_path, req)
    sched.add_request(req)
    so = sched.schedule()
    assert req.status is RequestStatus.WAITING_FOR_KV and len(so.kv_connector_metadata.loads) == 1
    sched.update_from_output(so, runner_output(sched, so))          # the runner reports nothing yet
    if abort:
        sched.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    so = sched.schedule()                                           # past the deadline: recompute
    out = runner_output(sched, so)
    out.kv_connector_output = KVConnectorOutput(finished_loads={"r": True})     # the late report
    sched.update_from_output(so, out)
    s = conn.stats
    assert s.loads_ok == 0 and s.loaded_blocks == 0
    assert (s.loads_failed, s.load_failures_timed_out) == ((0, 0) if abort else (1, 1))
