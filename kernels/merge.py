"""Merge kernel: N partial (O, LSE) results of the same rows, over disjoint key sets, in one pass.

Notation (docs/design.md): N partials, R rows, H heads, D head dim; O [N, R, H, D], LSE [N, H, R]
natural log, fp32. lse = logsumexp_n lse_n, out = sum_n exp(lse_n - lse) * out_n. An empty partial
(lse_n = -inf) has weight 0 whatever its O holds; if every partial is empty: out = 0, lse = -inf.
Rows are tiles of BLOCK_D >= D columns (kernels/tile_io.py); the padding is neither read nor written.
"""
import triton
import triton.language as tl

from .mask_tile import LN2, LOG2E
from .tile_io import row_col_mask


@triton.jit
def merge_partials_kernel(
    Outs, Lses, Out, Lse, N, R,
    stride_on, stride_ot, stride_oh, stride_ln, stride_lh, stride_mt, stride_mh, stride_mlh,
    BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row0 = (tl.program_id(0) * BLOCK_R).to(tl.int64)
    h = tl.program_id(1)
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    valid = row0 + offs_r < R
    keep = row_col_mask(valid, offs_d, HEAD_DIM, HEAD_DIM == BLOCK_D)
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
    m_shift = tl.where(m == float("-inf"), 0.0, m)

    total = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    lse_n = lse_first
    o_n = o_first
    for _ in range(N):
        weight = tl.math.exp2(tl.load(lse_n + offs_r, mask=valid, other=float("-inf")) * LOG2E - m_shift)
        o = tl.load(o_n + o_offs, mask=keep, other=0.0).to(tl.float32)
        acc += tl.where(weight[:, None] > 0, weight[:, None] * o, 0.0)
        total += weight
        lse_n += stride_ln
        o_n += stride_on

    nonempty = total > 0
    total_safe = tl.where(nonempty, total, 1.0)
    out = acc / total_safe[:, None]
    lse = tl.where(nonempty, (m_shift + tl.math.log2(total_safe)) * LN2, float("-inf"))
    out_ptrs = Out + row0 * stride_mt + h * stride_mh + (offs_r[:, None] * stride_mt + offs_d[None, :])
    tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=keep)
    tl.store(Lse + h.to(tl.int64) * stride_mlh + row0 + offs_r, lse, mask=valid)
