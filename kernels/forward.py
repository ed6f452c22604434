"""Forward kernel: masked blockwise attention over a q-major tile list (online softmax, exp2 domain).

Notation (docs/design.md): T total tokens, B block size, one program = (BLOCK_M rows of a work q-block,
one q head hq); hk = hq // GROUP is its kv head (GQA without repeating K/V). Partner kv-blocks are
walked in BLOCK_N sub-tiles: FULL tiles first with no mask arithmetic, then PARTIAL tiles with the exact
mask (intervals or per-tile bits). ``row`` = buffer row, ``glob`` = global token index. Head dims are
tiles of BLOCK_D >= HEAD_DIM columns (kernels/tile_io.py): the padding reads as 0 and is not stored.
Programs are numbered (work tile, head) with the head fastest.
State per row: m_i running max of s2 = qk_scale * q.k (qk_scale = scale * log2 e; SOFTCAP: s2 = cap *
tanh(qk_scale * q.k), kernels/mask_tile.py), l_i running sum of
exp2(s2 - m_i), acc the unnormalized output. Rows with no unmasked key end with O = 0, LSE = -inf.
ACCUMULATE merges the result with the (O, LSE) already in Out/Lse, after the tile loops.
"""
import triton
import triton.language as tl

from .mask_tile import LN2, LOG2E, bits_mask, interval_mask, load_intervals, mma, scores2, softmax_step
from .tile_io import load_partner, load_rows, locate_work_rows, row_col_mask


@triton.jit
def attention_fwd_kernel(
    Q, K, V, Out, Lse,
    WorkOrder, WorkRow, WorkGlob, FullPtr, FullRow, FullGlob, PartPtr, PartRow, PartGlob, PartBits,
    Intervals, Bits,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lh,
    T, num_heads, qk_scale, cap,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_T: tl.constexpr, HAS_INTERVALS: tl.constexpr,
    HAS_BITS: tl.constexpr, ACCUMULATE: tl.constexpr, DOT_PREC: tl.constexpr, SOFTCAP: tl.constexpr,
):
    M_SPLIT: tl.constexpr = BLOCK // BLOCK_M
    N_SPLIT: tl.constexpr = BLOCK // BLOCK_N
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    # heads vary fastest across programs: the GROUP q heads of one kv head run together and share
    # each K/V tile through L2
    hq, hk, w, m_rel, offs_m, q_glob, q_row0, q_valid = locate_work_rows(
        WorkOrder, WorkGlob, WorkRow, T, num_heads, GROUP, M_SPLIT, BLOCK_M
    )
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    q = load_rows(Q, q_row0, offs_m, stride_qt, hq * stride_qh, offs_d, q_valid, EVEN_T, HEAD_DIM, EVEN_D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # FULL tiles: every valid (q, k) pair attends; only the ragged last block needs a column mask
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
        if not EVEN_T:
            s2 = tl.where(k_valid[None, :], s2, float("-inf"))
        acc, m_i, l_i = softmax_step(acc, m_i, l_i, s2, v, not EVEN_T, DOT_PREC)

    # PARTIAL tiles: exact mask by interval arithmetic or the tile's bitmask (none without a mask)
    if HAS_INTERVALS or HAS_BITS:
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
            s2 = scores2(mma(q, tl.trans(k), None, DOT_PREC), qk_scale, cap, SOFTCAP)
            if HAS_BITS:
                tile_bits = tl.load(PartBits + j)
                keep = bits_mask(Bits, tile_bits, m_rel, n0 + offs_n, BLOCK, False)
                if HAS_INTERVALS:
                    keep = tl.where(tile_bits >= 0, keep, interval_mask(lo1, hi1, lo2, hi2, k_glob))
            else:
                keep = interval_mask(lo1, hi1, lo2, hi2, k_glob)
            keep = keep & k_valid[None, :] & q_valid[:, None]
            s2 = tl.where(keep, s2, float("-inf"))
            acc, m_i, l_i = softmax_step(acc, m_i, l_i, s2, v, True, DOT_PREC)

    has_key = l_i > 0
    l_safe = tl.where(has_key, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has_key, (m_i + tl.math.log2(l_safe)) * LN2, float("-inf"))
    l_ptrs = Lse + hq.to(tl.int64) * stride_lh + q_row0 + offs_m
    if ACCUMULATE:
        # fused merge with the given partial (O0, LSE0), folded in after the loops so that it adds
        # no live registers to them; an empty side (LSE = -inf) has weight 0 whatever its O holds
        lse0 = tl.load(l_ptrs, mask=q_valid, other=float("-inf"))
        o0 = load_rows(Out, q_row0, offs_m, stride_ot, hq * stride_oh, offs_d, q_valid, EVEN_T, HEAD_DIM,
                       EVEN_D).to(tl.float32)
        m_tot = tl.maximum(lse, lse0)
        m_shift = tl.where(m_tot == float("-inf"), 0.0, m_tot)
        w0 = tl.math.exp2((lse0 - m_shift) * LOG2E)
        w1 = tl.math.exp2((lse - m_shift) * LOG2E)
        total = w0 + w1
        total_safe = tl.where(total > 0, total, 1.0)
        out = (tl.where(w0[:, None] > 0, w0[:, None] * o0, 0.0) + w1[:, None] * out) / total_safe[:, None]
        lse = tl.where(total > 0, m_shift + tl.math.log2(total_safe) * LN2, float("-inf"))
    o_ptrs = Out + q_row0 * stride_ot + hq * stride_oh + (offs_m[:, None] * stride_ot + offs_d[None, :])
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_col_mask(q_valid, offs_d, HEAD_DIM, EVEN_D))
    tl.store(l_ptrs, lse, mask=q_valid)
