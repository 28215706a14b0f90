"""Several damaged block files in one prefix heal in one recompute: a load that finds a damaged file
verifies the rest of the prefix, so every bad file is removed and the recompute rewrites them all."""
from __future__ import annotations

import random

from affinity_serve.engine import LLM, SamplingParams
from affinity_serve.engine.hashing import hash_block_chain
from affinity_serve.engine.kv_connector.shared_store import HEADER_BYTES

BS = 8
GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPT = [random.Random(31).randrange(10, 700) for _ in range(50)]      # 6 loadable blocks


def _llm(path, store_dir):
    return LLM(path, cache={"num_blocks": 32, "block_size": BS},
               kv_connector={"type": "shared", "capacity_blocks": 256, "shared_dir": str(store_dir)})


def _gen(llm, prompt):
    out = llm.generate([prompt], SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)[0]
    for _ in range(10):
        if not llm.engine.scheduler.has_pending_kv_transfers():
            break
        llm.engine.step()
    return out.outputs[0].token_ids, out.num_cached_tokens


def test_a_prefix_with_several_damaged_blocks_heals_in_one_recompute(checkpoints, tmp_path):
    path = checkpoints["llama"]
    writer = _llm(path, tmp_path / "kv")
    expected, _ = _gen(writer, PROMPT)
    store = writer.engine.kv_connector.store
    hashes = hash_block_chain(PROMPT, BS)[:6]
    for h in hashes[1:5]:          # four files of the prefix damaged, sizes unchanged
        f = f"{store.dir}/{h.hex()}"
        raw = bytearray(open(f, "rb").read())
        raw[HEADER_BYTES + 5] ^= 0x10
        open(f, "wb").write(raw)
    first = _llm(path, tmp_path / "kv")
    toks, cached = _gen(first, PROMPT)
    assert toks == expected and cached == 0
    s = first.engine.kv_connector.stats
    assert s.load_failures_damaged == 1
    assert sum(first.engine.kv_connector.store.damaged.values()) == 4     # all found by the one load
    # the recompute rewrote every damaged block: the next replica loads the whole prefix at once
    second = _llm(path, tmp_path / "kv")
    toks, cached = _gen(second, PROMPT)
    assert toks == expected and cached == 6 * BS
    assert second.engine.kv_connector.stats.loads_failed == 0
