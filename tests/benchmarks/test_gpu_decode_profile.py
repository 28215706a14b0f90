"""benchmarks/gpu_decode_profile.py --sweep (cascade decode at each prefix split count against plain decode)
runs on CPU through Triton's interpreter, so a GPU session does not find it broken; and what it times is
the right attention: every cascade variant equals plain decode."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="needs the triton package (pip install -e '.[test]')")
from affinity_serve.engine.attention.triton_paged import interpreting  # noqa: E402

if not torch.cuda.is_available() and not interpreting():
    pytest.skip("without CUDA the kernels need TRITON_INTERPRET=1 set before triton is imported",
                allow_module_level=True)


def test_attention_sweep_times_cascade_at_each_split_count_and_it_matches_plain(capsys):
    from benchmarks.gpu_decode_profile import attention_sweep
    from affinity_serve.engine.attention import triton_paged

    real = triton_paged.prefix_splits
    rows = attention_sweep(torch.device("cpu"), batches=(3,), prefixes=(64, 96), tail=8, splits=(1, 2, 4),
                           heads=4, kv_heads=2, head_dim=16, dtype=torch.float32, iters=1)
    assert triton_paged.prefix_splits is real                               # the forced counts are undone
    assert [(r["batch"], r["prefix"]) for r in rows] == [(3, 64), (3, 96)]
    for r in rows:
        assert r["plain_us"] > 0 and sorted(r["cascade_us"]) == [1, 2, 4]
        assert all(t > 0 for t in r["cascade_us"].values())
        assert max(r["max_abs_diff"].values()) < 1e-5                       # fp32: the same attention
    out = capsys.readouterr().out
    assert "P=1" in out and "P=4" in out and "best/plain" in out
