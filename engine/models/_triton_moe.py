"""Triton kernel of the fused MoE path (see engine/models/fused_moe.py). A module of its own, imported on
first use: Triton picks compiler or interpreter (TRITON_INTERPRET) when it decorates."""
import triton
import triton.language as tl


@triton.jit
def grouped_gemm(a_ptr, w_ptr, c_ptr, sorted_ptr, block_expert_ptr, weight_ptr, num_pairs, n, k,
                 s_am, s_we, s_wn, s_cm, A_ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, PREC: tl.constexpr,
                 UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of C = A[rows] @ W[e]^T over a block of (token, expert) pairs that all
    belong to expert e. `sorted_ptr` lists pair ids grouped by expert, each group padded to BLOCK_M with
    `num_pairs` (skipped); A's row for pair p is p // A_ROW_DIV (the token, for the first GEMM, whose A is
    the hidden states; the pair itself for the second). C's row is the pair. With MUL_WEIGHT each row is
    scaled by its pair's routing weight (float32) before the store. W: [E, n, k] (k contiguous). UPCAST
    multiplies half types in float32 (Triton's interpreter returned garbage for bf16 dots here)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e < 0:
        return                                          # a block past the padded pairs
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows).to(tl.int64)
    valid = pair < num_pairs
    a_row = pair // A_ROW_DIV
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < k
        a = tl.load(a_ptr + a_row[:, None] * s_am + kk[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + e * s_we + cols[None, :] * s_wn + kk[:, None], mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=PREC)
    if MUL_WEIGHT:
        acc = acc * tl.load(weight_ptr + pair, mask=valid, other=0.0)[:, None]
    tl.store(c_ptr + pair[:, None] * s_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & col_ok[None, :])
