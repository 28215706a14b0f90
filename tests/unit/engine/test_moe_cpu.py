"""The CPU MoE path (engine/models/moe.py): both its forms (every expert in one padded batched GEMM pair; a GEMM
pair per active expert) equal a per-token reference that adds each token's experts in expert order, as
transformers does; which form a batch takes."""
import pytest
import torch
import torch.nn.functional as F

from affinity_serve.engine.models import moe
from affinity_serve.engine.models.moe import grouped_experts, route

E, H, I, K = 8, 32, 16, 2


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * I, H, generator=g) * 0.2, torch.randn(E, H, I, generator=g) * 0.2


def _reference(x, gate_up, down, ids, weights):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in torch.argsort(ids[t]).tolist():          # expert order, as transformers adds them
            e = int(ids[t, j])
            h = F.linear(x[t:t + 1], gate_up[e])
            y = F.linear(F.silu(h[:, :I]) * h[:, I:], down[e])
            out[t:t + 1] += y * weights[t, j]
    return out


@pytest.mark.parametrize("num_tokens", [1, 3, 32, 300])
def test_grouped_experts_match_a_per_token_reference(num_tokens, monkeypatch):
    gate_up, down = _weights()
    g = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, H, generator=g)
    weights, ids = route(torch.randn(num_tokens, E, generator=g), K, renormalize=True)
    taken = []
    for name in ("_padded_experts", "_looped_experts"):
        fn = getattr(moe, name)
        monkeypatch.setattr(moe, name, lambda *a, fn=fn, name=name: taken.append(name) or fn(*a))
    got = grouped_experts(x, gate_up, down, ids, weights)
    torch.testing.assert_close(got, _reference(x, gate_up, down, ids, weights), rtol=1e-5, atol=1e-6)
    # one token leaves most experts idle: a GEMM pair each for its few; a batch pads them all
    if num_tokens == 1:
        assert taken == ["_looped_experts"]
    elif num_tokens >= 32:
        assert taken == ["_padded_experts"]
    # and the other form gives the same numbers
    counts = torch.bincount(torch.sort(ids, 1)[0].reshape(-1), minlength=E)
    flat = torch.sort(ids, 1)[0].reshape(-1)
    padded = moe._padded_experts(x, gate_up, down, flat, counts, int(counts.max()), K)
    looped = moe._looped_experts(x, gate_up, down, flat, counts.tolist(), K)
    torch.testing.assert_close(padded, looped, rtol=1e-5, atol=1e-6)


def _cpu_experts():
    from affinity_serve.engine.attention.cpu_kernels import load_ops
    ops = load_ops()
    if ops is None:
        pytest.skip("no C compiler: the C experts kernel cannot be built")
    return ops.experts


@pytest.mark.parametrize("num_tokens", [0, 1, 3, 32, 300, 1500])   # 1500: groups of 256+ rows (panels)
@pytest.mark.parametrize("hidden", [H, 36])            # 36: not a multiple of the 16-float vector
def test_c_experts_match_the_per_token_reference(num_tokens, hidden):
    g = torch.Generator().manual_seed(num_tokens + hidden)
    gate_up, down = torch.randn(E, 2 * I, hidden, generator=g) * 0.2, torch.randn(E, hidden, I, generator=g) * 0.2
    x = torch.randn(num_tokens, hidden, generator=g)
    weights, ids = route(torch.randn(num_tokens, E, generator=g), K, renormalize=num_tokens % 2 == 1)
    got = _cpu_experts()(x, gate_up, down, ids, weights)
    assert got.shape == (num_tokens, hidden)
    torch.testing.assert_close(got, _reference(x, gate_up, down, ids, weights), rtol=1e-5, atol=1e-5)


def test_c_experts_take_a_strided_x_and_refuse_other_dtypes():
    gate_up, down = _weights()
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(5, 2 * H, generator=g)
    x = wide[:, :H]                                     # rows of stride 2H, as a view of a fused projection
    weights, ids = route(torch.randn(5, E, generator=g), K, renormalize=True)
    fn = _cpu_experts()
    torch.testing.assert_close(fn(x, gate_up, down, ids, weights), _reference(x, gate_up, down, ids, weights),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="float32"):
        fn(x.bfloat16(), gate_up.bfloat16(), down.bfloat16(), ids, weights)
