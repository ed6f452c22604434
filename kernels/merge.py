"""Merge kernels: N partial (O, LSE) results of the same rows, over disjoint key sets, in one pass; and
one partial folded into a running state in place, at given buffer rows.

Notation (docs/design.md): N partials, R rows, H heads, D head dim; O [N, R, H, D], LSE [N, H, R]
natural log, fp32. lse = logsumexp_n lse_n, out = sum_n exp(lse_n - lse) * out_n. An empty partial
(lse_n = -inf) has weight 0 whatever its O holds; if every partial is empty: out = 0, lse = -inf.
Rows are tiles of BLOCK_D >= D columns (kernels/tile_io.py); the padding is neither read nor written.
Both kernels fold their partials with the same helpers in the same order, so ``merge_into_kernel`` on
(running state, partial) gives the bits ``merge_partials_kernel`` gives on the two gathered rows.
"""
import triton
import triton.language as tl

from .mask_tile import LN2, LOG2E
from .tile_io import row_col_mask


@triton.jit
def _row_tile(R, BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """(first row, head, row offsets, column offsets, valid rows, valid [rows, BLOCK_D]) of this program."""
    row0 = (tl.program_id(0) * BLOCK_R).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    valid = row0 + offs_r < R
    return row0, tl.program_id(1), offs_r, offs_d, valid, row_col_mask(valid, offs_d, HEAD_DIM, HEAD_DIM == BLOCK_D)


@triton.jit
def _weight(lse, m_shift):
    """exp2-domain weight of partials with natural-log ``lse`` under the shift ``m_shift`` (0 if empty)."""
    return tl.math.exp2(lse * LOG2E - m_shift)


@triton.jit
def _fold(acc, total, weight, o):
    """(acc, total) with one more partial of ``weight`` and fp32 output ``o`` (an empty one adds 0, not NaN)."""
    return acc + tl.where(weight[:, None] > 0, weight[:, None] * o, 0.0), total + weight


@triton.jit
def _finish(acc, total, m_shift):
    """(out, lse) of the folded partials: (0, -inf) where every partial was empty."""
    nonempty = total > 0
    total_safe = tl.where(nonempty, total, 1.0)
    out = acc / total_safe[:, None]
    lse = tl.where(nonempty, (m_shift + tl.math.log2(total_safe)) * LN2, float("-inf"))
    return out, lse


@triton.jit
def _shift(m):
    """The exp2-domain shift of running max ``m``: 0 where every partial is empty (m = -inf)."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def merge_partials_kernel(
    Outs, Lses, Out, Lse, N, R,
    stride_on, stride_ot, stride_oh, stride_ln, stride_lh, stride_mt, stride_mh, stride_mlh,
    BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row0, h, offs_r, offs_d, valid, keep = _row_tile(R, BLOCK_R, HEAD_DIM, BLOCK_D)
    # a 64-bit scalar base per partial (stepped by its stride, so N * stride never overflows int32)
    # plus small int32 offsets inside the row tile
    o_offs = offs_r[:, None] * stride_ot + offs_d[None, :]
    lse_first = Lses + h.to(tl.int64) * stride_lh + row0
    o_first = Outs + row0 * stride_ot + h * stride_oh

    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    lse_n = lse_first
    for _ in range(N):
        m = tl.maximum(m, tl.load(lse_n + offs_r, mask=valid, other=float("-inf")) * LOG2E)
        lse_n += stride_ln
    m_shift = _shift(m)

    total = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    lse_n = lse_first
    o_n = o_first
    for _ in range(N):
        weight = _weight(tl.load(lse_n + offs_r, mask=valid, other=float("-inf")), m_shift)
        acc, total = _fold(acc, total, weight, tl.load(o_n + o_offs, mask=keep, other=0.0).to(tl.float32))
        lse_n += stride_ln
        o_n += stride_on

    out, lse = _finish(acc, total, m_shift)
    out_ptrs = Out + row0 * stride_mt + h * stride_mh + (offs_r[:, None] * stride_mt + offs_d[None, :])
    tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=keep)
    tl.store(Lse + h.to(tl.int64) * stride_mlh + row0 + offs_r, lse, mask=valid)


@triton.jit
def merge_into_kernel(
    Out, Lse, Rows, PartOut, PartLse, R,
    stride_ot, stride_oh, stride_lh, stride_pt, stride_ph, stride_plh,
    BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Partial row i (PartOut [R, H, D], PartLse [H, R]) folded into the running state (Out, Lse) at
    buffer row Rows[i], in place: one read of each side and one write, where gathering the running rows,
    stacking them with the partial, merging and scattering back moved every byte three times more."""
    i0, h, offs_r, offs_d, valid, keep = _row_tile(R, BLOCK_R, HEAD_DIM, BLOCK_D)
    rows = tl.load(Rows + i0 + offs_r, mask=valid, other=0).to(tl.int64)  # (gathered: 64-bit per row)
    run_lse_ptrs = Lse + h.to(tl.int64) * stride_lh + rows
    run_o_ptrs = Out + h * stride_oh + (rows[:, None] * stride_ot + offs_d[None, :])
    run_lse = tl.load(run_lse_ptrs, mask=valid, other=float("-inf"))
    part_lse = tl.load(PartLse + h.to(tl.int64) * stride_plh + i0 + offs_r, mask=valid, other=float("-inf"))

    # (as merge_partials_kernel with N = 2, the running state first: the same floats)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    m = tl.maximum(m, run_lse * LOG2E)
    m = tl.maximum(m, part_lse * LOG2E)
    m_shift = _shift(m)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    total = tl.zeros([BLOCK_R], tl.float32)
    acc, total = _fold(acc, total, _weight(run_lse, m_shift),
                       tl.load(run_o_ptrs, mask=keep, other=0.0).to(tl.float32))
    part_o_ptrs = PartOut + i0 * stride_pt + h * stride_ph + (offs_r[:, None] * stride_pt + offs_d[None, :])
    acc, total = _fold(acc, total, _weight(part_lse, m_shift),
                       tl.load(part_o_ptrs, mask=keep, other=0.0).to(tl.float32))

    out, lse = _finish(acc, total, m_shift)
    tl.store(run_o_ptrs, out.to(Out.dtype.element_ty), mask=keep)
    tl.store(run_lse_ptrs, lse, mask=valid)
