"""Checks of the fused Triton ops and the split-K decode against the torch ops they replace, shared by
the CPU tests (Triton's interpreter) and the CUDA tests (compiled). The op checks take `ops`, any object with
the three functions of engine/models/fused.py (default: that module), so the C CPU ops run them too."""
from __future__ import annotations

import torch
import torch.nn.functional as F

BF16_STEP = 2 ** -7          # one bf16 step relative to the value (at most)


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, tol: float = 1e-5) -> None:
    from affinity_serve.engine.attention.triton_paged import interpreting

    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
        return
    # Compiled, a float32 -> bf16 conversion rounds to nearest, as torch does: one step apart at most where an
    # intermediate lands on the other side of a rounding boundary. Triton's interpreter truncates instead
    # (checked: every conversion equals the truncated value), so each rounding point can add a step.
    steps = 2 if interpreting() else 1
    torch.testing.assert_close(got.float(), ref.float(), rtol=steps * BF16_STEP, atol=1e-3)


def _ops(ops):
    if ops is not None:
        return ops
    from affinity_serve.engine.models import fused
    return fused


def check_add_rms_norm(dev, dtype, with_delta: bool, rows: int, hidden: int, ops=None) -> None:
    from affinity_serve.engine.models.llama import RMSNorm
    add_rms_norm = _ops(ops).add_rms_norm

    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, hidden, generator=g).to(dev, dtype)
    d = torch.randn(rows, hidden, generator=g).to(dev, dtype) if with_delta else None
    norm = RMSNorm(hidden, 1e-6).to(dev, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=g) + 0.5)
    ref_x = x.clone()
    if d is not None:
        ref_x.add_(d)
    got = add_rms_norm(x, d, norm.weight.detach(), 1e-6)
    from affinity_serve.engine.attention.triton_paged import interpreting
    if interpreting() and dtype != torch.float32:
        _close(x, ref_x, dtype)                 # the interpreter truncates (see _close)
    else:
        assert torch.equal(x, ref_x)            # the residual sum, rounded as torch rounds it
    with torch.no_grad():
        ref = norm(x.clone())                   # the norm of the sum the kernel stored
    _close(got, ref, dtype)


def check_rope(dev, dtype, tokens: int, heads: int, kv_heads: int, head_dim: int, ops=None,
               partial_rotary: float = 1.0) -> None:
    """q and k as one strided view of a [T, q + 2 kv] projection, as the model passes them."""
    from affinity_serve.engine.models.config import RopeSpec
    rope_ = _ops(ops).rope_
    from affinity_serve.engine.models.rope import apply_rope, cos_sin_table

    g = torch.Generator().manual_seed(1)
    cos, sin = cos_sin_table(RopeSpec(theta=10000.0, params={"partial_rotary_factor": partial_rotary}), head_dim, 512)
    cos, sin = cos.to(dev), sin.to(dev)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dev, dtype)
    positions = torch.randint(0, 512, (tokens,), generator=g).to(dev)
    ref = qkv.clone()
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    c, s = cos[positions].to(torch.float32), sin[positions].to(torch.float32)
    for lo, n in ((0, heads), (q_size, kv_heads)):          # float32 reference on the same inputs
        part = ref[:, lo:lo + n * head_dim].float().view(tokens, n, head_dim)
        ref[:, lo:lo + n * head_dim] = apply_rope(part, c, s).reshape(tokens, -1).to(dtype)
    qk = qkv[:, :q_size + kv_size].view(tokens, heads + kv_heads, head_dim)
    rope_(qk, positions, cos, sin)
    assert torch.equal(qkv[:, q_size + kv_size:], ref[:, q_size + kv_size:])      # v untouched
    _close(qkv, ref, dtype)


def check_silu_mul(dev, dtype, rows: int, inter: int, ops=None, scale: float = 3.0) -> None:
    silu_mul = _ops(ops).silu_mul

    g = torch.Generator().manual_seed(2)
    x = torch.randn(rows, 2 * inter, generator=g).to(dev, dtype) * scale
    gate, up = x.split([inter, inter], dim=-1)
    _close(silu_mul(x), F.silu(gate) * up, dtype)


def check_decode_splits(dev, dtype, lens: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int,
                        tol: float) -> None:
    """A decode-only batch (each request's last token computed now, `lens` its lengths after it) through the
    split-K kernels against the torch backend; asserts the split path is the one taken."""
    from affinity_serve.engine.attention import build_attention_metadata
    from affinity_serve.engine.attention.torch_paged import TorchPagedAttention, _write_kv
    from affinity_serve.engine.attention.triton_paged import TritonPagedAttention, decode_splits

    assert decode_splits(torch.device(dev), len(lens), kv_heads) > 1, "the case must take the split path"
    g = torch.Generator().manual_seed(3)
    need = [-(-n // block_size) for n in lens]
    ids = torch.randperm(sum(need), generator=g).add(1).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n])
        at += n
    shape = TorchPagedAttention.kv_cache_shape(sum(need) + 1, block_size, kv_heads, head_dim)
    caches = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(2)]
    ks = [torch.randn(n, kv_heads, head_dim, generator=g).to(dev, dtype) for n in lens]
    vs = [torch.randn(n, kv_heads, head_dim, generator=g).to(dev, dtype) for n in lens]
    ctx = [i for i, n in enumerate(lens) if n > 1]
    if ctx:
        pre = build_attention_metadata([0] * len(ctx), [lens[i] - 1 for i in ctx], [tables[i] for i in ctx],
                                       block_size, dev)
        for cache in caches:
            _write_kv(torch.cat([ks[i][:-1] for i in ctx]), torch.cat([vs[i][:-1] for i in ctx]), cache,
                      pre.slot_mapping)
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dev, dtype)
    k, v = torch.stack([x[-1] for x in ks]), torch.stack([x[-1] for x in vs])
    computed, sched = [n - 1 for n in lens], [1] * len(lens)
    ref = TorchPagedAttention(cpu_kernels=False).forward(
        q, k, v, caches[0], build_attention_metadata(computed, sched, tables, block_size, dev), 0.3)
    out = TritonPagedAttention().forward(q, k, v, caches[1],
                                         build_attention_metadata(computed, sched, tables, block_size, dev), 0.3)
    assert torch.equal(caches[0], caches[1])
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def check_fused_model_matches_unfused(path: str, dev, dtype, tol: float) -> None:
    """The same checkpoint loaded twice, one with fused ops on the triton backend, one on torch ops and the
    torch backend: a mixed prefill step, then a decode step over the cached context, hidden states close."""
    from affinity_serve.engine.attention import build_attention_metadata
    from affinity_serve.engine.attention.torch_paged import TorchPagedAttention
    from affinity_serve.engine.attention.triton_paged import TritonPagedAttention
    from affinity_serve.engine.models.loader import load_model

    runs = []
    for fused_on, backend in ((False, TorchPagedAttention(cpu_kernels=False)), (True, TritonPagedAttention())):
        model, args = load_model(path, dtype, torch.device(dev), 256)
        if fused_on:
            model.use_fused_ops()
        shape = backend.kv_cache_shape(12, 16, args.num_kv_heads, args.head_dim)
        caches = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(args.num_layers)]
        tables = [[1, 2, 3], [4, 5]]
        prompts = [[11 + (7 * i) % 500 for i in range(37)], [23 + (5 * i) % 400 for i in range(20)]]
        outs = []
        with torch.inference_mode():
            meta = build_attention_metadata([0, 0], [37, 20], tables, 16, dev)
            ids = torch.tensor(prompts[0] + prompts[1], device=dev)
            outs.append(model(ids, meta, caches, backend).clone())
            meta = build_attention_metadata([37, 20], [1, 1], tables, 16, dev)
            outs.append(model(torch.tensor([5, 9], device=dev), meta, caches, backend).clone())
        runs.append(outs)
    for a, b in zip(*runs):
        torch.testing.assert_close(b.float(), a.float(), rtol=tol, atol=tol)
