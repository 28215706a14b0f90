"""Pre-Ray checks of engine.kv_connector (`check_kv_connector`, called by the CLI before replicas start): an
unsafe namespace directory inside a safe root and an offload tier larger than the machine's memory are one
line naming the key, instead of every replica failing at start-up (a bare MemoryError for the tier)."""
from __future__ import annotations

import os

import pytest

from affinity_serve.engine import LLM, EngineConfig, check_kv_connector, validate_checkpoint
from affinity_serve.engine.kv_connector import machine_memory_bytes


def _config(path, **kc):
    return EngineConfig(model=path, cache={"num_blocks": 32, "block_size": 8}, kv_connector=kc)


def test_an_unsafe_namespace_directory_in_a_safe_root_is_one_line_naming_the_key(checkpoints, tmp_path):
    path = checkpoints["llama"]
    kc = {"type": "shared", "capacity_blocks": 64, "shared_dir": str(tmp_path / "kv")}
    args = validate_checkpoint(path)
    assert check_kv_connector(_config(path, **kc), args) == []          # nothing there yet: fine
    llm = LLM(path, cache={"num_blocks": 32, "block_size": 8}, kv_connector=kc)
    ns_dir = llm.engine.kv_connector.store.dir
    llm.engine.kv_connector.close()
    assert check_kv_connector(_config(path, **kc), args) == []          # the store a replica made: fine
    os.chmod(ns_dir, 0o777)
    problems = check_kv_connector(_config(path, **kc), args)
    assert len(problems) == 1 and "\n" not in problems[0]
    assert problems[0].startswith("engine.kv_connector.shared_dir: ")
    assert ns_dir in problems[0] and "0777" in problems[0]
    with pytest.raises(ValueError, match="0777"):       # what each replica would have said
        LLM(path, cache={"num_blocks": 32, "block_size": 8}, kv_connector=kc)


def test_an_unsafe_root_is_reported_by_the_same_check(checkpoints, tmp_path):
    path = checkpoints["llama"]
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    os.chmod(root, 0o777)
    problems = check_kv_connector(_config(path, type="shared", shared_dir=str(root)), validate_checkpoint(path))
    assert len(problems) == 1 and problems[0].startswith("engine.kv_connector.shared_dir: ") and "0777" in problems[0]


@pytest.mark.parametrize("key", ["capacity_bytes", "capacity_blocks"])
def test_an_offload_tier_larger_than_the_machine_is_one_line_naming_the_key(checkpoints, key):
    path = checkpoints["llama"]
    mem = machine_memory_bytes()
    assert mem
    kc = {"type": "offload", key: 10**15 if key == "capacity_bytes" else 10**12}
    problems = check_kv_connector(_config(path, **kc), validate_checkpoint(path))
    assert len(problems) == 1 and problems[0].startswith(f"engine.kv_connector.{key}: ")
    assert "machine's memory" in problems[0]
    with pytest.raises(ValueError, match=f"engine.kv_connector.{key}"):     # a replica: no bare MemoryError
        LLM(path, cache={"num_blocks": 32, "block_size": 8}, kv_connector=kc)
    ok = {"type": "offload", "capacity_bytes": 1 << 20}
    assert check_kv_connector(_config(path, **ok), validate_checkpoint(path)) == []
