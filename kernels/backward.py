"""Backward kernels: delta preprocess, dQ over q-major tile lists, dK/dV over kv-major (transposed) lists.

Notation (docs/design.md): T total tokens, B block size, GROUP = Hq // Hkv. Scores in the exp2 domain:
s2 = qk_scale * q.k with qk_scale = scale * log2 e, lse2 = LSE * log2 e, so P = exp2(s2 - lse2).
delta = rowsum(O * dO); dS = P * (dP - delta) with dP = dO.V^T; dQ = scale * dS.K, dK = scale * dS^T.Q,
dV = P^T.dO. SOFTCAP (kernels/mask_tile.py): s2 = cap * tanh(qk_scale * q.k), and dS is taken through
the tanh (times 1 - t^2) before it meets K or Q. Rows with LSE = -inf (no unmasked key) use lse2 = +inf so that P = 0 (no NaN).
dK/dV programs own one kv head and loop over its GROUP q heads, so every gradient tile has one program:
deterministic (ACCUMULATE's adds are atomics, but no two programs meet at an address).
All gradients are written in fp32; rows past T are neither read nor written, nor are the columns of
the BLOCK_D-wide head-dim tiles past HEAD_DIM (kernels/tile_io.py: they read as 0). ACCUMULATE adds
them to the fp32 rows already in DQ / DK / DV (``store_grad``): a distributed backward sums its stages
in place.
"""
import triton
import triton.language as tl

from .tile_io import load_partner, load_rows, locate_work_rows, row_col_mask, store_grad
from .mask_tile import LOG2E, bits_mask, interval_mask, interval_mask_t, load_intervals, mma, scores2, through_cap


@triton.jit
def _load_lse2(Lse, row0, offs, valid):
    """LSE of rows row0 + offs in the exp2 domain, +inf for empty rows and rows past T (so P = 0 there)."""
    lse = tl.load(Lse + row0 + offs, mask=valid, other=float("-inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)


@triton.jit
def attention_bwd_preprocess_kernel(
    Out, DOut, Delta, R, stride_ot, stride_oh, stride_dt, stride_dh, stride_lh,
    BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    h = tl.program_id(1)
    valid = rows < R
    rows64 = rows.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    keep = row_col_mask(valid, offs_d, HEAD_DIM, HEAD_DIM == BLOCK_D)
    o = tl.load(Out + rows64[:, None] * stride_ot + h * stride_oh + offs_d[None, :], mask=keep, other=0.0)
    do = tl.load(DOut + rows64[:, None] * stride_dt + h * stride_dh + offs_d[None, :], mask=keep, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + h.to(tl.int64) * stride_lh + rows64, delta, mask=valid)


@triton.jit
def add_grad_rows_kernel(
    Dst, Rows, Src, R, stride_dt, stride_dh, stride_st, stride_sh,
    BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Dst[Rows[i]] += Src[i] in fp32: a received dQ / dK / dV partial (in the plan's grad_comm_dtype) summed
    into a home's or relay's buffer, its conversion and its add in one pass (rows distinct: no atomics)."""
    i = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    h = tl.program_id(1)
    valid = i < R
    offs_d = tl.arange(0, BLOCK_D)
    keep = row_col_mask(valid, offs_d, HEAD_DIM, HEAD_DIM == BLOCK_D)
    rows = tl.load(Rows + i, mask=valid, other=0).to(tl.int64)
    src = tl.load(Src + i.to(tl.int64)[:, None] * stride_st + h * stride_sh + offs_d[None, :], mask=keep, other=0.0)
    ptrs = Dst + rows[:, None] * stride_dt + h * stride_dh + offs_d[None, :]
    tl.store(ptrs, tl.load(ptrs, mask=keep, other=0.0) + src.to(tl.float32), mask=keep)


@triton.jit
def attention_bwd_dq_kernel(
    Q, K, V, DOut, Lse, Delta, DQ,
    WorkOrder, WorkRow, WorkGlob, FullPtr, FullRow, FullGlob, PartPtr, PartRow, PartGlob, PartBits,
    Intervals, Bits,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stride_lh,
    T, num_heads, qk_scale, sm_scale, cap,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_T: tl.constexpr, HAS_INTERVALS: tl.constexpr,
    HAS_BITS: tl.constexpr, DOT_PREC: tl.constexpr, SOFTCAP: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    M_SPLIT: tl.constexpr = BLOCK // BLOCK_M
    N_SPLIT: tl.constexpr = BLOCK // BLOCK_N
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    # heads vary fastest across programs (shared K/V tiles in L2)
    hq, hk, w, m_rel, offs_m, q_glob, q_row0, q_valid = locate_work_rows(
        WorkOrder, WorkGlob, WorkRow, T, num_heads, GROUP, M_SPLIT, BLOCK_M
    )
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    q = load_rows(Q, q_row0, offs_m, stride_qt, hq * stride_qh, offs_d, q_valid, EVEN_T, HEAD_DIM, EVEN_D)
    do = load_rows(DOut, q_row0, offs_m, stride_dot, hq * stride_doh, offs_d, q_valid, EVEN_T, HEAD_DIM, EVEN_D)
    lse2 = _load_lse2(Lse + hq.to(tl.int64) * stride_lh, q_row0, offs_m, q_valid)
    delta = tl.load(Delta + hq.to(tl.int64) * stride_lh + q_row0 + offs_m, mask=q_valid, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # FULL tiles: keys past T are loaded as zero rows, so they add nothing to dQ = dS.K
    start = tl.load(FullPtr + w)
    end = tl.load(FullPtr + w + 1)
    for it in range(start * N_SPLIT, end * N_SPLIT):
        j = it // N_SPLIT
        n0 = (it % N_SPLIT) * BLOCK_N
        k_glob, k_valid, k, v = load_partner(
            K, V, FullGlob, FullRow, j, n0, offs_n, stride_kt, hk * stride_kh, stride_vt, hk * stride_vh, offs_d, T, EVEN_T,
            HEAD_DIM, EVEN_D,
        )
        s2 = scores2(mma(q, tl.trans(k), None, DOT_PREC), qk_scale, cap, SOFTCAP)
        p = tl.math.exp2(s2 - lse2[:, None])
        dp = mma(do, tl.trans(v), None, DOT_PREC)
        ds = through_cap(p * (dp - delta[:, None]), s2, cap, SOFTCAP)
        dq = mma(ds.to(k.dtype), k, dq, DOT_PREC)

    if HAS_INTERVALS:
        lo1, hi1, lo2, hi2 = load_intervals(Intervals, T, q_glob, q_valid)
    start = tl.load(PartPtr + w)
    end = tl.load(PartPtr + w + 1)
    for it in range(start * N_SPLIT, end * N_SPLIT):
        j = it // N_SPLIT
        n0 = (it % N_SPLIT) * BLOCK_N
        k_glob, k_valid, k, v = load_partner(
            K, V, PartGlob, PartRow, j, n0, offs_n, stride_kt, hk * stride_kh, stride_vt, hk * stride_vh, offs_d, T, EVEN_T,
            HEAD_DIM, EVEN_D,
        )
        if HAS_BITS:
            tile_bits = tl.load(PartBits + j)
            keep = bits_mask(Bits, tile_bits, m_rel, n0 + offs_n, BLOCK, False)
            if HAS_INTERVALS:
                keep = tl.where(tile_bits >= 0, keep, interval_mask(lo1, hi1, lo2, hi2, k_glob))
        else:
            keep = interval_mask(lo1, hi1, lo2, hi2, k_glob)
        s2 = scores2(mma(q, tl.trans(k), None, DOT_PREC), qk_scale, cap, SOFTCAP)
        p = tl.where(keep, tl.math.exp2(s2 - lse2[:, None]), 0.0)
        dp = mma(do, tl.trans(v), None, DOT_PREC)
        ds = through_cap(p * (dp - delta[:, None]), s2, cap, SOFTCAP)
        dq = mma(ds.to(k.dtype), k, dq, DOT_PREC)

    dq_ptrs = DQ + q_row0 * stride_dqt + hq * stride_dqh + (offs_m[:, None] * stride_dqt + offs_d[None, :])
    store_grad(dq_ptrs, dq * sm_scale, row_col_mask(q_valid, offs_d, HEAD_DIM, EVEN_D), ACCUMULATE)


@triton.jit
def attention_bwd_dkdv_kernel(
    Q, K, V, DOut, Lse, Delta, DK, DV,
    WorkOrder, WorkRow, WorkGlob, FullPtr, FullRow, FullGlob, PartPtr, PartRow, PartGlob, PartBits,
    Intervals, Bits,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lh,
    T, num_heads, qk_scale, sm_scale, cap,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_T: tl.constexpr, HAS_INTERVALS: tl.constexpr,
    HAS_BITS: tl.constexpr, DOT_PREC: tl.constexpr, SOFTCAP: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    # here the work block is a kv-block (BLOCK_N rows per program) and partners are q-blocks (BLOCK_M)
    N_SPLIT: tl.constexpr = BLOCK // BLOCK_N
    M_SPLIT: tl.constexpr = BLOCK // BLOCK_M
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    pid = tl.program_id(0) // num_heads
    hk = tl.program_id(0) % num_heads
    w = tl.load(WorkOrder + pid // N_SPLIT)
    n_rel = (pid % N_SPLIT) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_glob = tl.load(WorkGlob + w) + n_rel
    offs_n = tl.arange(0, BLOCK_N)
    kv_row0 = (tl.load(WorkRow + w) + (pid % N_SPLIT) * BLOCK_N).to(tl.int64)
    k_valid = k_glob < T
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)

    k = load_rows(K, kv_row0, offs_n, stride_kt, hk * stride_kh, offs_d, k_valid, EVEN_T, HEAD_DIM, EVEN_D)
    v = load_rows(V, kv_row0, offs_n, stride_vt, hk * stride_vh, offs_d, k_valid, EVEN_T, HEAD_DIM, EVEN_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    full_start = tl.load(FullPtr + w)
    full_end = tl.load(FullPtr + w + 1)
    part_start = tl.load(PartPtr + w)
    part_end = tl.load(PartPtr + w + 1)

    for g in range(GROUP):
        hq = hk * GROUP + g
        lse_h = Lse + hq.to(tl.int64) * stride_lh
        delta_h = Delta + hq.to(tl.int64) * stride_lh
        # FULL tiles: queries past T have dO = 0 and P = 0, so they add nothing
        for it in range(full_start * M_SPLIT, full_end * M_SPLIT):
            j = it // M_SPLIT
            m0 = (it % M_SPLIT) * BLOCK_M
            q_row0 = (tl.load(FullRow + j) + m0).to(tl.int64)
            q_glob, q_valid, q, do = load_partner(
                Q, DOut, FullGlob, FullRow, j, m0, offs_m, stride_qt, hq * stride_qh, stride_dot, hq * stride_doh, offs_d, T, EVEN_T,
                HEAD_DIM, EVEN_D,
            )
            lse2 = _load_lse2(lse_h, q_row0, offs_m, q_valid)
            delta = tl.load(delta_h + q_row0 + offs_m, mask=q_valid, other=0.0)
            s2 = scores2(mma(k, tl.trans(q), None, DOT_PREC), qk_scale, cap, SOFTCAP)
            pt = tl.math.exp2(s2 - lse2[None, :])
            dv = mma(pt.to(do.dtype), do, dv, DOT_PREC)
            dpt = mma(v, tl.trans(do), None, DOT_PREC)
            dst = through_cap(pt * (dpt - delta[None, :]), s2, cap, SOFTCAP)
            dk = mma(dst.to(q.dtype), q, dk, DOT_PREC)
        for it in range(part_start * M_SPLIT, part_end * M_SPLIT):
            j = it // M_SPLIT
            m0 = (it % M_SPLIT) * BLOCK_M
            q_row0 = (tl.load(PartRow + j) + m0).to(tl.int64)
            q_glob, q_valid, q, do = load_partner(
                Q, DOut, PartGlob, PartRow, j, m0, offs_m, stride_qt, hq * stride_qh, stride_dot, hq * stride_doh, offs_d, T, EVEN_T,
                HEAD_DIM, EVEN_D,
            )
            lse2 = _load_lse2(lse_h, q_row0, offs_m, q_valid)
            delta = tl.load(delta_h + q_row0 + offs_m, mask=q_valid, other=0.0)
            if HAS_BITS:
                tile_bits = tl.load(PartBits + j)
                keep = bits_mask(Bits, tile_bits, m0 + offs_m, n_rel, BLOCK, True)
                if HAS_INTERVALS:
                    lo1, hi1, lo2, hi2 = load_intervals(Intervals, T, q_glob, q_valid)
                    keep = tl.where(tile_bits >= 0, keep, interval_mask_t(k_glob, lo1, hi1, lo2, hi2))
            else:
                lo1, hi1, lo2, hi2 = load_intervals(Intervals, T, q_glob, q_valid)
                keep = interval_mask_t(k_glob, lo1, hi1, lo2, hi2)
            s2 = scores2(mma(k, tl.trans(q), None, DOT_PREC), qk_scale, cap, SOFTCAP)
            pt = tl.where(keep, tl.math.exp2(s2 - lse2[None, :]), 0.0)
            dv = mma(pt.to(do.dtype), do, dv, DOT_PREC)
            dpt = mma(v, tl.trans(do), None, DOT_PREC)
            dst = through_cap(pt * (dpt - delta[None, :]), s2, cap, SOFTCAP)
            dk = mma(dst.to(q.dtype), q, dk, DOT_PREC)

    dk_ptrs = DK + kv_row0 * stride_dkt + hk * stride_dkh + (offs_n[:, None] * stride_dkt + offs_d[None, :])
    dv_ptrs = DV + kv_row0 * stride_dvt + hk * stride_dvh + (offs_n[:, None] * stride_dvt + offs_d[None, :])
    kv_keep = row_col_mask(k_valid, offs_d, HEAD_DIM, EVEN_D)
    store_grad(dk_ptrs, dk * sm_scale, kv_keep, ACCUMULATE)
    store_grad(dv_ptrs, dv, kv_keep, ACCUMULATE)
