"""P/D disaggregation on CUDA: a prefill engine serves reads of its held blocks on its own stream while it
steps, a decode engine lands them into its GPU pool; greedy output token-exact against transformers in
float32, a CPU decode engine reading a CUDA prefill engine's blocks (the shared KVLayout), and both pools
empty afterwards. Skipped cleanly without CUDA."""
import random
import time

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GREEDY = dict(temperature=0.0, ignore_eos=True)
BS = 8


def _ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(10, 700) for _ in range(n)]


def _engine(path, device, backend="torch"):
    from affinity_serve.engine import LLM
    return LLM(path, device=device, dtype="float32", attention_backend=backend,
               cache={"num_blocks": 64, "block_size": BS}, kv_connector={"type": "pd"}).engine


def _run(engine, rid, prompt, params, kv, other=None):
    """Step `engine` (and `other` beside it: a prefill engine freeing holds) until `rid` finishes."""
    engine.add_request(engine.make_request(prompt, params, kv_transfer=kv, req_id=rid))
    toks, final = [], None
    deadline = time.monotonic() + 60
    while final is None and time.monotonic() < deadline:
        for d in engine.step().deltas:
            toks += d.token_ids
            if d.finished:
                final = d
        if other is not None:
            other.step()
    assert final is not None
    return toks, final


@pytest.mark.parametrize("decode_device", ["cuda", "cpu"])
def test_pd_on_cuda_is_token_exact(checkpoints, hf_reference, decode_device):
    from affinity_serve.engine import RemoteDecode, SamplingParams
    path = checkpoints["llama"]
    p, d = _engine(path, "cuda"), _engine(path, decode_device)
    for n in (9, 40, 77):
        prompt = _ids(n, n)
        first, fin = _run(p, f"r{n}", prompt, SamplingParams(max_tokens=1, **GREEDY), RemoteDecode())
        rest, _ = _run(d, f"r{n}", prompt, SamplingParams(max_tokens=8, **GREEDY), [fin.kv_transfer])
        assert first + rest == hf_reference(path, prompt, 8)
    for _ in range(5):
        p.step()
        d.step()
    assert d.pd.stats.loads_ok == 3 and d.pd.stats.loads_failed == 0
    for e in (p, d):
        assert e.kv_cache_manager.pool.num_free_blocks == e.num_blocks - 1 and len(e.pd.held) == 0
