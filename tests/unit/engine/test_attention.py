"""Shared input preparation and the torch paged backend against a dense reference."""
import pytest
import torch

from affinity_serve.engine.attention import build_attention_metadata, select_backend
from affinity_serve.engine.attention.flash import validate_flash_block_size
from affinity_serve.engine.attention.torch_paged import TorchPagedAttention


def test_metadata_slots_positions_and_lengths():
    # decode (computed 5, 1 new), chunk after context (computed 4, 3 new), fresh prefill (0, 2)
    meta = build_attention_metadata([5, 4, 0], [1, 3, 2], [[7, 3], [2, 9], [5]], block_size=4)
    assert meta.num_decodes == 1 and meta.num_tokens == 6
    assert meta.positions.tolist() == [5, 4, 5, 6, 0, 1]
    assert meta.slot_mapping.tolist() == [3 * 4 + 1, 9 * 4 + 0, 9 * 4 + 1, 9 * 4 + 2, 5 * 4 + 0, 5 * 4 + 1]
    assert meta.query_start_loc.tolist() == [0, 1, 4, 6]
    assert meta.seq_lens.tolist() == [6, 7, 2] and meta.seq_start_loc.tolist() == [0, 6, 13, 15]
    assert meta.block_tables.tolist() == [[7, 3], [2, 9], [5, 0]]
    assert meta.max_query_len == 3 and meta.max_seq_len == 7


def _dense_reference(q_all, k_all, v_all, scale):
    """Causal attention over one request's full sequence; returns the last rows matching q_all."""
    L = k_all.shape[0]
    ql = q_all.shape[0]
    rep = q_all.shape[1] // k_all.shape[1]
    k = k_all.repeat_interleave(rep, dim=1)
    v = v_all.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q_all, k) * scale
    mask = torch.ones(ql, L, dtype=torch.bool).tril(L - ql)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _backend(cpu_kernels: bool) -> TorchPagedAttention:
    backend = TorchPagedAttention(cpu_kernels=cpu_kernels)
    if cpu_kernels and backend.decode_kernel is None:
        pytest.skip("no C compiler here: the C decode kernel cannot be built (pure torch is tested)")
    return backend


@pytest.mark.parametrize("cpu_kernels", [False, True], ids=["torch-decode", "c-kernel-decode"])
def test_torch_backend_matches_dense_attention_on_mixed_batch(cpu_kernels):
    g = torch.Generator().manual_seed(0)
    H, KVH, D, bs = 4, 2, 8, 4
    num_blocks = 32
    backend = _backend(cpu_kernels)
    cache = torch.zeros(backend.kv_cache_shape(num_blocks, bs, KVH, D))
    # decodes with 9 and 3 cached (different lengths: masked), chunk of 5 after 6 cached, fresh prefill of 7
    computed, sched = [9, 3, 6, 0], [1, 1, 5, 7]
    tables = [[3, 8, 1], [30, 0, 0], [4, 12, 20], [5, 6]]
    full_k = [torch.randn(c + n, KVH, D, generator=g) for c, n in zip(computed, sched)]
    full_v = [torch.randn(c + n, KVH, D, generator=g) for c, n in zip(computed, sched)]
    # pre-fill the cached context through the slot mapping
    pre = build_attention_metadata([0, 0, 0], [9, 3, 6], tables[:3], bs)
    from affinity_serve.engine.attention.torch_paged import _write_kv
    _write_kv(torch.cat([full_k[0][:9], full_k[1][:3], full_k[2][:6]]),
              torch.cat([full_v[0][:9], full_v[1][:3], full_v[2][:6]]), cache, pre.slot_mapping)
    meta = build_attention_metadata(computed, sched, tables, bs)
    q = torch.randn(sum(sched), H, D, generator=g)
    k_new = torch.cat([fk[c:] for fk, c in zip(full_k, computed)])
    v_new = torch.cat([fv[c:] for fv, c in zip(full_v, computed)])
    out = backend.forward(q, k_new, v_new, cache, meta, scale=D ** -0.5)
    start = 0
    for i, n in enumerate(sched):
        ref = _dense_reference(q[start:start + n], full_k[i], full_v[i], D ** -0.5)
        torch.testing.assert_close(out[start:start + n], ref, rtol=1e-5, atol=1e-5)
        start += n


def test_backend_selection_and_flash_validation():
    assert select_backend("auto", "cpu", 16).name == "torch"
    assert select_backend("torch", "cpu", 16).name == "torch"
    with pytest.raises(ValueError, match="CUDA"):
        select_backend("flash", "cpu", 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        validate_flash_block_size(16)
    validate_flash_block_size(512)
    with pytest.raises(ValueError, match="unknown attention_backend"):
        select_backend("xformers", "cpu", 16)


def test_cascade_decode_matches_plain_decode():
    """Decodes sharing prefix blocks: the prefix-once path equals the gather-everything path (the switch off, or
    a threshold above the shared length)."""
    import affinity_serve.engine.attention.torch_paged as tp
    g = torch.Generator().manual_seed(1)
    H, KVH, D, bs = 8, 2, 16, 4
    backend = TorchPagedAttention(cpu_kernels=False)
    cache = torch.randn(backend.kv_cache_shape(64, bs, KVH, D), generator=g)
    shared = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26]   # 17 blocks = 68 tokens
    tables = [shared + [40, 41], shared + [42], shared + [43, 44, 45]]
    computed = [68 + 5, 68 + 2, 68 + 9]
    meta = build_attention_metadata(computed, [1, 1, 1], tables, bs)
    assert meta.num_common_prefix_blocks == 17
    q = torch.randn(3, H, D, generator=g)
    k = torch.randn(3, KVH, D, generator=g)
    v = torch.randn(3, KVH, D, generator=g)
    cascades = []
    real = tp._cascade_decode
    tp._cascade_decode = lambda *a: (cascades.append(1), real(*a))[1]
    try:
        out_cascade = backend.forward(q, k, v, cache.clone(), meta, D ** -0.5)
        assert cascades == [1]
        for least in (None, 69):
            backend.cascade_min_tokens = least
            out_plain = backend.forward(q, k, v, cache.clone(), meta, D ** -0.5)
            torch.testing.assert_close(out_cascade, out_plain, rtol=1e-5, atol=1e-5)
    finally:
        tp._cascade_decode = real
    assert cascades == [1]


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (8, 4, 64, 16), (4, 4, 32, 1), (8, 1, 128, 8), (6, 2, 24, 5), (16, 2, 64, 32), (4, 2, 20, 4)])
def test_c_decode_kernel_matches_reference_in_place_over_pages(heads, kv_heads, head_dim, block_size):
    """The C kernel reads scattered pages in place; lengths end mid-block and differ per request."""
    import affinity_serve.engine.attention.torch_paged as tp
    backend = _backend(True)
    g = torch.Generator().manual_seed(heads * 1000 + head_dim + block_size)
    lens = [1, block_size, 37, 3 * block_size + 1, 90]
    max_blocks = -(-max(lens) // block_size)
    num_blocks = len(lens) * max_blocks + 7
    cache = torch.randn(backend.kv_cache_shape(num_blocks, block_size, kv_heads, head_dim), generator=g)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1)[:len(lens) * max_blocks]
    tables = perm.view(len(lens), max_blocks).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    q[-1] *= 40                       # near one-hot softmax: scores far below the max (exp underflow)
    out = backend.decode_kernel(q, cache, tables, seq_lens, head_dim ** -0.5)
    for i, n in enumerate(lens):
        idx = tp._page_index(cache, tables[i:i + 1], n, block_size)
        k, v = tp._gather(cache, idx, 1, n)                           # [KVH, 1, n, D]
        ref = _dense_reference(q[i:i + 1], k[:, 0].transpose(0, 1), v[:, 0].transpose(0, 1), head_dim ** -0.5)
        torch.testing.assert_close(out[i:i + 1], ref, rtol=1e-5, atol=1e-5)


def test_c_kernel_is_cached_and_can_be_switched_off(monkeypatch, tmp_path):
    from affinity_serve.engine.attention import cpu_kernels
    if cpu_kernels._compiler() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("AFFINITY_SERVE_CACHE", str(tmp_path))
    cpu_kernels._library.cache_clear()
    try:
        k = cpu_kernels.load()
        assert k is not None and k.path.parent == tmp_path / "kernels" and k.path.exists()
        cpu_kernels._library.cache_clear()
        assert cpu_kernels.load().path == k.path                     # second load reuses the built library
        monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
        cpu_kernels._library.cache_clear()
        assert cpu_kernels.load() is None
        assert TorchPagedAttention(cpu_kernels=True).decode_kernel is None
    finally:
        cpu_kernels._library.cache_clear()
