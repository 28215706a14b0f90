"""PrefixIndex: event replay, drop-out match lengths, gaps/epochs/resets and snapshots, speculative TTL, bound."""
from __future__ import annotations


from hypothesis import given
from hypothesis import strategies as st

from affinity_serve.app.routing.api import KVEventBatch, KVSnapshot
from affinity_serve.app.routing.prefix_index import PrefixIndex
from affinity_serve.engine.types import AllBlocksCleared, BlockRemoved

from .helpers import chain, stored


def index(*replicas: str, max_blocks: int = 10_000, ttl: float = 10.0) -> PrefixIndex:
    ix = PrefixIndex(max_blocks, ttl)
    for r in replicas:
        ix.add_replica(r)
    return ix


def feed(ix: PrefixIndex, rid: str, first_seq: int, events, epoch: str = "e0") -> bool:
    return ix.apply_events(KVEventBatch(rid, epoch, first_seq, list(events)))


def test_match_records_each_replicas_length_as_it_drops_out():
    ix = index("a", "b", "c")
    p = chain("p", 10)
    assert feed(ix, "a", 0, [stored(p[:10])])
    assert feed(ix, "b", 0, [stored(p[:4])])
    assert feed(ix, "c", 0, [stored(chain("q", 3))])
    assert ix.match(p, ["a", "b", "c"]) == {"a": 10, "b": 4}
    assert ix.match(p + chain("x", 2), ["a", "b"]) == {"a": 10, "b": 4}
    assert ix.match(p, ["b"]) == {"b": 4}
    assert ix.match(chain("zzz", 3), ["a", "b", "c"]) == {}
    assert ix.match(p, []) == {}


def test_a_missing_middle_block_ends_the_match():
    ix = index("a")
    p = chain("p", 6)
    feed(ix, "a", 0, [stored(p), BlockRemoved([p[3]])])
    assert ix.match(p, ["a"]) == {"a": 3}
    feed(ix, "a", 2, [BlockRemoved(p)])
    assert ix.match(p, ["a"]) == {}
    assert ix.num_entries == 0 and ix.num_held("a") == 0


def test_a_new_replica_needs_a_snapshot_unless_its_stream_starts_at_zero():
    ix = index("a", "b")
    assert sorted(ix.replicas_needing_snapshot()) == ["a", "b"]
    assert feed(ix, "a", 0, [stored(chain("p", 2))])
    assert not feed(ix, "b", 5, [stored(chain("p", 2))])
    assert ix.replicas_needing_snapshot() == ["b"]
    assert ix.match(chain("p", 2), ["a", "b"]) == {"a": 2}


def test_a_gap_drops_the_replica_until_a_snapshot_rebuilds_it():
    ix = index("a")
    p, q = chain("p", 4), chain("q", 4)
    assert feed(ix, "a", 0, [stored(p)])
    assert not feed(ix, "a", 2, [stored(q)])              # seq 1 never arrived
    assert ix.match(p, ["a"]) == {} and ix.replicas_needing_snapshot() == ["a"]
    assert ix.num_resyncs == 1
    assert not feed(ix, "a", 3, [stored(q)])              # still waiting for the snapshot
    ix.apply_snapshot(KVSnapshot("a", "e0", 3, p + q[:2]))
    assert ix.replicas_needing_snapshot() == []
    assert ix.match(q, ["a"]) == {"a": 2}
    assert feed(ix, "a", 3, [stored(q[2:])])
    assert ix.match(q, ["a"]) == {"a": 4}


def test_overlapping_batches_apply_each_event_once():
    ix = index("a")
    p = chain("p", 4)
    feed(ix, "a", 0, [stored(p), BlockRemoved(p[2:])])
    assert feed(ix, "a", 0, [stored(p), BlockRemoved(p[2:]), BlockRemoved(p[1:2])])   # seqs 0-1 again
    assert ix.match(p, ["a"]) == {"a": 1}


def test_an_epoch_change_needs_a_snapshot_unless_it_starts_with_a_clear():
    ix = index("a", "b")
    p = chain("p", 3)
    for r in ("a", "b"):
        feed(ix, r, 0, [stored(p)])
    # restart/reset seen mid-stream: what happened before the batch is unknown
    assert not feed(ix, "a", 7, [stored(chain("q", 1))], epoch="e1")
    assert ix.match(p, ["a"]) == {}
    # a reset whose batch begins with the clear: the cache is known empty there
    assert feed(ix, "b", 1, [AllBlocksCleared(), stored(chain("q", 1))], epoch="e1")
    assert ix.match(p, ["b"]) == {} and ix.match(chain("q", 1), ["b"]) == {"b": 1}
    assert ix.replicas_needing_snapshot() == ["a"]


def test_all_blocks_cleared_mid_stream_empties_the_replica_and_keeps_following():
    ix = index("a", "b")
    p = chain("p", 3)
    feed(ix, "a", 0, [stored(p)])
    feed(ix, "b", 0, [stored(p)])
    assert feed(ix, "a", 1, [AllBlocksCleared(), stored(p[:1])])
    assert ix.match(p, ["a", "b"]) == {"a": 1, "b": 3}
    assert ix.replicas_needing_snapshot() == []


def test_events_of_unknown_replicas_are_ignored():
    ix = index("a")
    assert feed(ix, "ghost", 3, [stored(chain("p", 2))])
    assert ix.num_entries == 0


def test_speculative_entries_count_until_their_ttl_unless_confirmed():
    ix = index("a", "b", ttl=5.0)
    p, q = chain("p", 4), chain("q", 4)
    feed(ix, "a", 0, [])
    ix.insert_speculative("a", p, now=100.0)
    ix.insert_speculative("b", q, now=100.0)
    assert ix.match(p, ["a", "b"]) == {"a": 4}
    feed(ix, "a", 0, [stored(p[:2])])                         # the engine confirmed the first two
    ix.expire(104.9)
    assert ix.match(p, ["a"]) == {"a": 4}
    ix.expire(105.0)
    assert ix.match(p, ["a"]) == {"a": 2}
    assert ix.match(q, ["b"]) == {}
    assert ix.num_held("a") == 2 and ix.num_held("b") == 0 and ix.num_entries == 2


def test_a_later_speculative_insert_extends_the_ttl():
    ix = index("a", ttl=5.0)
    p = chain("p", 3)
    ix.insert_speculative("a", p, now=100.0)
    ix.insert_speculative("a", p, now=103.0)
    ix.expire(106.0)
    assert ix.match(p, ["a"]) == {"a": 3}
    ix.expire(108.0)
    assert ix.match(p, ["a"]) == {}


def test_a_removed_block_keeps_a_newer_speculative_hold():
    """A speculative hold predicts a store still to come: an eviction event does not cancel it."""
    ix = index("a")
    p = chain("p", 2)
    feed(ix, "a", 0, [stored(p)])
    ix.insert_speculative("a", chain("p", 3), now=0.0, start=2)   # only the third block is speculative
    feed(ix, "a", 1, [BlockRemoved(p[1:])])
    assert ix.match(chain("p", 3), ["a"]) == {"a": 3}
    ix.expire(100.0)
    assert ix.match(chain("p", 3), ["a"]) == {"a": 1}


def test_speculative_holds_write_checkpoints_not_every_block():
    """A 32k-token prompt (2,048 blocks) costs ~130 dict writes, and matches to within a stride."""
    from affinity_serve.app.routing.prefix_index import SPEC_STRIDE
    ix = index("a", "b")
    p = chain("long", 2048)
    ix.insert_speculative("a", p, now=0.0)
    assert ix.num_spec_entries <= 2048 // SPEC_STRIDE + 4 + 1
    assert ix.num_entries == 0                                     # nothing confirmed, nothing evicted
    assert ix.match(p, ["a", "b"]) == {"a": 2048}                  # the same prompt: the exact depth
    sibling = p[:1000] + chain("other", 50, start=1000)
    got = ix.match(sibling, ["a", "b"])["a"]
    assert 1000 - SPEC_STRIDE < got <= 1000                        # a shared prefix: within one stride
    assert ix.match(p[:3] + chain("x", 5, start=3), ["a"]) == {"a": 2}   # short prefixes: powers of two
    ix.insert_speculative("b", p, now=0.0, start=1500)             # b holds 1,500 already
    assert ix.num_spec_entries <= 2048 // SPEC_STRIDE + 5 + 548 // SPEC_STRIDE + 2


def test_removing_a_replica_frees_its_slot_without_leaking_entries():
    ix = index("a", "b")
    p = chain("p", 3)
    feed(ix, "a", 0, [stored(p)])
    ix.insert_speculative("a", chain("s", 2), now=0.0)
    ix.remove_replica("a")
    assert ix.num_entries == 0
    ix.add_replica("c")                                          # reuses a's slot
    assert ix.match(p, ["b", "c"]) == {} and ix.match(chain("s", 2), ["c"]) == {}
    ix.expire(1e9)


def test_the_bound_evicts_the_oldest_stored_hashes_exactly_as_many_as_exceed_it():
    ix = index("a", "b", max_blocks=100)
    old, new = chain("old", 60), chain("new", 42)
    feed(ix, "a", 0, [stored(old)])
    feed(ix, "b", 0, [stored(old[:30])])                         # re-stores old[0:30]: they are newest now
    assert ix.match(old[:30], ["a"]) == {"a": 30}
    feed(ix, "a", 1, [stored(new)])                              # 102 > 100: evict 2, no bulk margin
    assert ix.num_entries == 100 and ix.num_evictions == 2
    assert ix.match(old, ["a"]) == {"a": 58}                     # a chain loses its tail first
    assert ix.match(new, ["a"]) == {"a": 42}
    assert ix.num_held("a") == 100 and ix.num_held("b") == 30
    for i in range(5):                                           # one more hash, one eviction: O(1) each
        feed(ix, "a", 2 + i, [stored(chain("more", 1, start=i))])
        assert ix.num_evictions == 3 + i and ix.num_entries == 100
    ix.apply_snapshot(KVSnapshot("b", "e0", 1, chain("snap", 200)))
    assert ix.num_entries <= 100 and ix.num_held("b") <= 100


def test_decisions_never_evict_and_set_capacity_sizes_the_bound():
    ix = index("a", max_blocks=1_000)
    ix.set_capacity(50)
    feed(ix, "a", 0, [stored(chain("p", 50))])
    for i in range(20):                                          # speculative holds of long new prompts
        ix.insert_speculative("a", chain(f"q{i}", 500), now=float(i))
        assert ix.match(chain(f"q{i}", 500), ["a"]) == {"a": 500}
    assert ix.num_entries == 50 and ix.num_evictions == 0        # the confirmed entries are untouched
    assert ix.num_spec_entries <= 50 // 4 + 40                   # their own bound: oldest records first
    ix.set_capacity(10_000)
    assert ix.bound == 1_000                                     # max_blocks stays an upper limit
    ix.set_capacity(20)
    assert ix.num_entries == 20 and ix.num_evictions == 30


_MEMORY_PROBE = """
import gc, tracemalloc
from tests.unit.routing.helpers import chain, stored
from tests.unit.routing.test_prefix_index import feed, index

def measure(build):
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    keep = build()
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del keep
    return used

n = 20_000
hashes = chain("m", n)                                           # the keys exist anyway (the request's)

def one_holder():
    ix = index("a")
    feed(ix, "a", 0, [stored(hashes)])
    return ix

def four_holders():
    ix = index("a", "b", "c", "d")
    for r in "abcd":
        feed(ix, r, 0, [stored(hashes)])
    return ix

hash_bytes = 33 + 32                                             # bytes object header + 32-byte digest
per_entry = measure(one_holder) / n + hash_bytes
per_extra = (measure(four_holders) / n + hash_bytes - per_entry) / 3
print(per_entry, per_extra)
"""


def test_memory_per_entry():
    """The bound the module docstring states: <= 175 B per hash for one holder, <= 75 B per further one.

    Measured in a fresh interpreter: tracemalloc start/stop races with other threads' allocations in
    CPython 3.11 (in the full suite, Ray's background threads from the integration tests) and can crash."""
    import pathlib
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", _MEMORY_PROBE], capture_output=True, text=True, cwd=root,
                         check=True)
    per_entry, per_extra = map(float, out.stdout.split())
    assert per_entry < 175, per_entry
    assert per_extra < 75, per_extra


# -------------------------------------------------------------------- replay property
OPS = st.lists(st.tuples(st.sampled_from(["store", "remove", "clear", "spec"]),
                         st.sampled_from("ab"), st.lists(st.integers(0, 11), min_size=1, max_size=6)),
               max_size=40)


@given(OPS)
def test_replaying_events_matches_a_set_per_replica(ops):
    """Confirmed state equals a plain per-replica set; match() equals the longest held prefix."""
    ix = index("a", "b", ttl=1.0)
    model: dict[str, set[bytes]] = {"a": set(), "b": set()}
    seq = {"a": 0, "b": 0}
    pool = chain("u", 12)
    for t, (op, rid, idx) in enumerate(ops):
        hs = [pool[i] for i in idx]
        if op == "spec":
            ix.insert_speculative(rid, hs, now=float(t))
            continue
        ev = stored(hs) if op == "store" else BlockRemoved(hs) if op == "remove" else AllBlocksCleared()
        assert feed(ix, rid, seq[rid], [ev])
        seq[rid] += 1
        if op == "store":
            model[rid] |= set(hs)
        elif op == "remove":
            model[rid] -= set(hs)
        else:
            model[rid].clear()
    ix.expire(float(len(ops) + 10))                              # every speculative hold has ended
    for rid in "ab":
        expect = 0
        while expect < len(pool) and pool[expect] in model[rid]:
            expect += 1
        assert ix.match(pool, [rid]).get(rid, 0) == expect
        assert ix.num_held(rid) == len(model[rid])
    assert ix.num_entries == len(model["a"] | model["b"])


def test_two_routers_fed_differently_converge_on_the_same_index():
    """Two ingress replicas: one pulls every event, the other pulls in overlapping chunks, misses some and
    resyncs from a snapshot; both end with the same view."""
    events = [stored(chain("p", 8)), stored(chain("q", 5)), BlockRemoved(chain("p", 8)[6:]),
              stored(chain("r", 3)), BlockRemoved(chain("q", 5)[:1]), stored(chain("p", 8)[6:7])]
    one, two = index("a"), index("a")
    assert feed(one, "a", 0, events)
    assert feed(two, "a", 0, events[:2]) and feed(two, "a", 1, events[1:3])
    assert not feed(two, "a", 4, events[4:])                      # missed seq 3
    truth = set()
    for e in events:
        truth = truth | set(e.block_hashes) if isinstance(e, type(events[0])) else truth - set(e.block_hashes)
    two.apply_snapshot(KVSnapshot("a", "e0", len(events), sorted(truth)))
    for prompt in (chain("p", 8), chain("q", 5), chain("r", 3)):
        assert one.match(prompt, ["a"]) == two.match(prompt, ["a"])
    assert one.num_held("a") == two.num_held("a") == len(truth)


@given(st.lists(st.integers(0, 300), min_size=1, max_size=8), st.integers(0, 300))
def test_deep_matches_bisect_to_each_replicas_exact_depth(depths, diverge):
    """Past EXACT_BLOCKS the match bisects on the depth: with prefix-closed pools (what an engine's LRU
    keeps) every replica's length is exact, for prompts that leave the held chain at any block."""
    ids = [f"r{i}" for i in range(len(depths))]
    ix = index(*ids)
    p = chain("deep", 300)
    for rid, d in zip(ids, depths):
        assert feed(ix, rid, 0, [stored(p[:d])])
    query = p[:diverge] + chain("other", 20, start=diverge)
    want = {rid: min(d, diverge) for rid, d in zip(ids, depths) if min(d, diverge)}
    assert ix.match(query, ids) == want
