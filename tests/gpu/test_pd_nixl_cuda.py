"""P/D over NIXL on CUDA (engine/kv_connector/nixl.py): the decode engine's NIXL agent reads the prefill engine's
held blocks out of its GPU KV cache (VRAM registered with UCX) into a staging area in GPU memory, then scatters
them into its own pool. Greedy output token-exact against transformers in float32 (a CUDA decode engine on the
torch and triton backends, and a CPU decode engine reading VRAM); both pools empty afterwards, the holds freed by
the readers' notifications. Skipped without CUDA or without NIXL's Python package."""
import time

import pytest

from tests.gpu.test_pd_disagg_cuda import BS, GREEDY, _ids, _run

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def _needs_nixl():
    from affinity_serve.engine.kv_connector.nixl import nixl_available
    if not nixl_available():
        pytest.skip("NIXL's Python package is not installed (pip install 'affinity-serve[nixl]')")


def _engine(path, device, backend="torch"):
    from affinity_serve.engine import LLM
    from affinity_serve.engine.kv_connector.nixl import NixlTransport
    e = LLM(path, device=device, dtype="float32", attention_backend=backend,
            cache={"num_blocks": 64, "block_size": BS}, kv_connector={"type": "pd"}).engine
    t = NixlTransport()
    e.set_kv_transport(t)
    return e, t


@pytest.mark.parametrize("decode", [("cuda", "torch"), ("cuda", "triton"), ("cpu", "torch")],
                         ids=["cuda-torch", "cuda-triton", "cpu"])
def test_pd_over_nixl_on_cuda_is_token_exact(checkpoints, hf_reference, decode):
    from affinity_serve.engine import RemoteDecode, SamplingParams
    path = checkpoints["llama"]
    (p, tp), (d, td) = _engine(path, "cuda"), _engine(path, *decode)
    try:
        for n in (9, 40, 77, 200):
            prompt = _ids(n, n)
            first, fin = _run(p, f"r{n}", prompt, SamplingParams(max_tokens=1, **GREEDY), RemoteDecode())
            assert fin.kv_transfer.address.mem_type == "VRAM"
            rest, _ = _run(d, f"r{n}", prompt, SamplingParams(max_tokens=8, **GREEDY), [fin.kv_transfer], other=p)
            assert first + rest == hf_reference(path, prompt, 8)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (len(p.pd.held) or p.kv_cache_manager.pool.num_free_blocks
                                               != p.num_blocks - 1):
            p.step()
            d.step()
            time.sleep(0.01)
        assert d.pd.stats.loads_ok == 4 and d.pd.stats.loads_failed == 0
        assert td.reads_posted == 4 and p.pd.pd_stats.holds_read == 4 and p.pd.pd_stats.holds_expired == 0
        for e in (p, d):
            assert e.kv_cache_manager.pool.num_free_blocks == e.num_blocks - 1 and len(e.pd.held) == 0
    finally:
        for e, t in ((p, tp), (d, td)):
            t.close()
            e.close()


def test_nixl_transfer_benchmark_runs_on_cuda():
    """benchmarks/kv_transfer.py on the GPU, small: NIXL's VRAM read lands every block bit for bit (it asserts)."""
    from benchmarks.kv_transfer import run
    rows = run("llama3-8b", torch.device("cuda"), [4, 32], reps=1)
    assert {r["path"] for r in rows} == {"nixl", "host copy", "device copy"}
    assert all(r["request_s"] > 0 for r in rows)
