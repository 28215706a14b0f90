"""The Triton kernels of engine/attention/triton_paged.py (see its docstring). A module of its own, imported
on first use: Triton picks compiler or interpreter (TRITON_INTERPRET) when it decorates, and a kernel finds
the jitted helpers it calls among its module's globals. Split and slot counts are run-time arguments, not
constexpr: they vary with the batch size, and each constexpr value is a kernel compiled on first use."""
import triton
import triton.language as tl


@triton.jit
def key_tile(q, k_head, v_head, bt_row, t, t_mask, keep, d, s_kb, s_kt, scale, cap, m_i, l_i, acc,
             D: tl.constexpr, BS: tl.constexpr, PREC: tl.constexpr, SOFTCAP: tl.constexpr,
             SAFE: tl.constexpr):
    """One tile of keys `t` (read through the block table row `bt_row`) into the online softmax:
    scores where `keep`, the running max `m_i`, denominator `l_i` and output `acc` rescaled. SOFTCAP: scores
    become cap * tanh(score / cap) (Gemma 2), before the mask. SAFE: a row may have no key in this tile nor
    before it (a sliding window that starts after the tile's first keys): it stays at max -inf, sum 0."""
    blk = tl.load(bt_row + t // BS, mask=t_mask, other=0).to(tl.int64)
    rows = blk * s_kb + (t % BS) * s_kt
    kv_mask = t_mask[:, None] & (d < D)[None, :]
    k = tl.load(k_head + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
    if SOFTCAP:
        s = cap * (2.0 * tl.sigmoid(2.0 * s / cap) - 1.0)      # cap * tanh(s / cap)
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if SAFE:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)    # exp(-inf - -inf) would be NaN
    else:
        m_use = m_new
    alpha = tl.exp(m_i - m_use)
    p = tl.exp(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_head + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def decode(q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, seq_lens_ptr, s_qt, s_qh, s_ot, s_oh, s_kh, s_kb, s_kt, s_bt,
           scale, window, cap, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
           BS: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, WINDOWED: tl.constexpr,
           SOFTCAP: tl.constexpr):
    """Program (request, KV head). WINDOWED: the keys from seq_len - window on (the query's window; the
    pages before it may be the null block)."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + r)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gd_mask = (g < G)[:, None] & (d < D)[None, :]
    q = tl.load(q_ptr + r * s_qt + (h * G + g)[:, None] * s_qh + d[None, :], mask=gd_mask, other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    k_head = k_ptr + h.to(tl.int64) * s_kh              # a layer's cache can pass 2**31 elements
    v_head = v_ptr + h.to(tl.int64) * s_kh
    if WINDOWED:
        lo = tl.maximum(seq_len - window, 0)
    else:
        lo = 0
    for start in range(lo, seq_len, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        t_mask = t < seq_len
        m_i, l_i, acc = key_tile(q, k_head, v_head, bt_ptr + r * s_bt, t, t_mask, t_mask[None, :], d, s_kb,
                                 s_kt, scale, cap, m_i, l_i, acc, D, BS, PREC, SOFTCAP, False)
    out = acc / l_i[:, None]
    tl.store(o_ptr + r * s_ot + (h * G + g)[:, None] * s_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=gd_mask)


@triton.jit
def prefill(q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, first_req, s_qt, s_qh, s_ot, s_oh,
            s_kh, s_kb, s_kt, s_bt, scale, window, cap, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
            BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
            WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr):
    """Program (request, BLOCK_M query rows, query head). WINDOWED: a row at position p reads keys
    p - window + 1 .. p; the key tiles start at the tile's first row's window."""
    r = first_req + tl.program_id(0)
    tile = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(qsl_ptr + r)
    q_len = tl.load(qsl_ptr + r + 1) - q_start
    if tile * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + r)
        ctx = seq_len - q_len
        i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        qd_mask = (i < q_len)[:, None] & (d < D)[None, :]
        q = tl.load(q_ptr + (q_start + i)[:, None] * s_qt + h * s_qh + d[None, :], mask=qd_mask, other=0.0)
        pos = ctx + i                                    # each query row's position in its sequence
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        kvh = h // G
        k_head = k_ptr + kvh.to(tl.int64) * s_kh
        v_head = v_ptr + kvh.to(tl.int64) * s_kh
        end = tl.minimum(seq_len, ctx + (tile + 1) * BLOCK_M)    # no key after the tile's last row
        if WINDOWED:
            lo = tl.maximum(ctx + tile * BLOCK_M - window + 1, 0)
        else:
            lo = 0
        for start in range(lo, end, BLOCK_N):       # without a window key 0 is in the first tile of every row
            t = start + tl.arange(0, BLOCK_N)
            t_mask = t < end
            keep = t_mask[None, :] & (t[None, :] <= pos[:, None])
            if WINDOWED:
                keep = keep & (t[None, :] > pos[:, None] - window)
            m_i, l_i, acc = key_tile(q, k_head, v_head, bt_ptr + r * s_bt, t, t_mask, keep, d, s_kb, s_kt,
                                     scale, cap, m_i, l_i, acc, D, BS, PREC, SOFTCAP, WINDOWED)
        if WINDOWED:                # a padding row past q_len may see no key in its window (it is not stored)
            l_i = tl.where(l_i > 0, l_i, 1.0)
        out = acc / l_i[:, None]
        tl.store(o_ptr + (q_start + i)[:, None] * s_ot + h * s_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=qd_mask)


@triton.jit
def write_kv(k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, s_kt, s_kh, s_vt, s_vh, s_ch, D: tl.constexpr,
             BLOCK_D: tl.constexpr):
    """One (token, KV head): its K and V rows into the cache row its slot names (block * BS + offset, which
    is the row index in a head's [num_blocks * BS, D] view)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    m = d < D
    slot = tl.load(slots_ptr + t).to(tl.int64)
    dst = h * s_ch + slot * D + d
    tl.store(kc_ptr + dst, tl.load(k_ptr + t * s_kt + h * s_kh + d, mask=m), mask=m)
    tl.store(vc_ptr + dst, tl.load(v_ptr + t * s_vt + h * s_vh + d, mask=m), mask=m)


@triton.jit
def decode_split(q_ptr, k_ptr, v_ptr, m_ptr, l_ptr, acc_ptr, bt_ptr, seq_lens_ptr, first_key_ptr, s_qt, s_qh,
                 s_kh, s_kb, s_kt, s_bt, scale, window, cap, H: tl.constexpr, S, SROW,
                 G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BS: tl.constexpr,
                 BLOCK_N: tl.constexpr, PREC: tl.constexpr, SKIP_PREFIX: tl.constexpr, WINDOWED: tl.constexpr,
                 SOFTCAP: tl.constexpr):
    """Split-K decode (flash-decoding): program (request, KV head, split) runs the online softmax over its
    share of the key tiles and writes the unnormalised partial (running max, denominator, output) to slot
    `split` of the SROW slots of its (request, query head), for `decode_merge`. A split with no tiles writes
    max -inf, denominator 0. With SKIP_PREFIX the keys start at *first_key_ptr (the shared prefix, which
    `decode_prefix` reads once for the whole batch, fills the slots after the first S). WINDOWED (never with
    SKIP_PREFIX): the keys from seq_len - window on."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + r)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gd_mask = (g < G)[:, None] & (d < D)[None, :]
    q = tl.load(q_ptr + r * s_qt + (h * G + g)[:, None] * s_qh + d[None, :], mask=gd_mask, other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    k_head = k_ptr + h.to(tl.int64) * s_kh
    v_head = v_ptr + h.to(tl.int64) * s_kh
    if SKIP_PREFIX:
        first = tl.load(first_key_ptr)
    elif WINDOWED:
        first = tl.maximum(seq_len - window, 0)
    else:
        first = 0
    tiles = tl.cdiv(tl.maximum(seq_len - first, 0), BLOCK_N)   # a padding row of a CUDA graph may have none
    per = tl.cdiv(tiles, S)
    lo = first + sp * per * BLOCK_N
    hi = tl.minimum(seq_len, first + (sp + 1) * per * BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        t_mask = t < hi
        m_i, l_i, acc = key_tile(q, k_head, v_head, bt_ptr + r * s_bt, t, t_mask, t_mask[None, :], d, s_kb,
                                 s_kt, scale, cap, m_i, l_i, acc, D, BS, PREC, SOFTCAP, False)
    row = (r * H + h * G + g) * SROW + sp                # partials laid out [request, query head, slot]
    tl.store(m_ptr + row, m_i, mask=g < G)
    tl.store(l_ptr + row, l_i, mask=g < G)
    tl.store(acc_ptr + row[:, None] * BLOCK_D + d[None, :], acc, mask=gd_mask)


@triton.jit
def decode_merge(m_ptr, l_ptr, acc_ptr, o_ptr, s_ot, s_oh, H: tl.constexpr, S,
                 BLOCK_S: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (request, query head): the splits' partials rescaled to their common max and summed."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    sm = sp < S
    row = (r * H + h) * S + sp
    m = tl.load(m_ptr + row, mask=sm, other=float("-inf"))
    l_s = tl.load(l_ptr + row, mask=sm, other=0.0)
    acc = tl.load(acc_ptr + row[:, None] * BLOCK_D + d[None, :], mask=sm[:, None] & (d < D)[None, :], other=0.0)
    m_all = tl.max(m, 0)          # finite: split 0 has key 0, or the suffix's first key and the prefix split 0
    w = tl.where(sm, tl.exp(m - m_all), 0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)
    tl.store(o_ptr + r * s_ot + h * s_oh + d, out.to(o_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def decode_prefix(q_ptr, k_ptr, v_ptr, m_ptr, l_ptr, acc_ptr, bt_ptr, prefix_len_ptr, n_rows, s_qt, s_qh, s_kh, s_kb,
                  s_kt, scale, H: tl.constexpr, S, P, SROW,
                  G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_R: tl.constexpr, PREC: tl.constexpr):
    """Cascade decode, the shared part: the first *prefix_len_ptr keys, the same pages for every request (block
    table row 0), read once per (KV head, tile of BLOCK_R query rows) instead of once per request. Program
    (KV head, row tile, split): the rows are the batch's (request, query head of this KV head) pairs, n_rows =
    requests x G, so one tile of keys is scored against many requests' queries in one dot. Writes the split's partial
    to slot
    S + split of each row's SROW slots; `decode_split` with SKIP_PREFIX fills slots 0..S-1 with the suffix."""
    h = tl.program_id(0)
    tile = tl.program_id(1)
    sp = tl.program_id(2)
    plen = tl.load(prefix_len_ptr)
    rho = tile * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = rho < n_rows
    req = rho // G
    head = h * G + rho % G
    d = tl.arange(0, BLOCK_D)
    rd_mask = r_mask[:, None] & (d < D)[None, :]
    q = tl.load(q_ptr + req[:, None] * s_qt + head[:, None] * s_qh + d[None, :], mask=rd_mask, other=0.0)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    k_head = k_ptr + h.to(tl.int64) * s_kh
    v_head = v_ptr + h.to(tl.int64) * s_kh
    per = tl.cdiv(tl.cdiv(plen, BLOCK_N), P)
    lo = sp * per * BLOCK_N
    hi = tl.minimum(plen, (sp + 1) * per * BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        t_mask = t < hi
        m_i, l_i, acc = key_tile(q, k_head, v_head, bt_ptr, t, t_mask, t_mask[None, :], d, s_kb, s_kt, scale,
                                 1.0, m_i, l_i, acc, D, BS, PREC, False, False)
    row = (req * H + head) * SROW + S + sp
    tl.store(m_ptr + row, m_i, mask=r_mask)
    tl.store(l_ptr + row, l_i, mask=r_mask)
    tl.store(acc_ptr + row[:, None] * BLOCK_D + d[None, :], acc, mask=rd_mask)
