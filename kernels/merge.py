"""Merge kernel: N partial (O, LSE) results of the same rows, over disjoint key sets, in one pass.

Notation (docs/design.md): N partials, R rows, H heads, D head dim; O [N, R, H, D], LSE [N, H, R]
natural log, fp32. lse = logsumexp_n lse_n, out = sum_n exp(lse_n - lse) * out_n. An empty partial
(lse_n = -inf) has weight 0 whatever its O holds; if every partial is empty: out = 0, lse = -inf.
"""
import triton
import triton.language as tl

from .mask_tile import LN2, LOG2E


@triton.jit
def merge_partials_kernel(
    Outs, Lses, Out, Lse, N, R,
    stride_on, stride_ot, stride_oh, stride_ln, stride_lh, stride_mt, stride_mh, stride_mlh,
    BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    h = tl.program_id(1)
    valid = rows < R
    offs_d = tl.arange(0, HEAD_DIM)
    lse_base = Lses + h.to(tl.int64) * stride_lh + rows

    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for n in range(N):
        m = tl.maximum(m, tl.load(lse_base + n * stride_ln, mask=valid, other=float("-inf")) * LOG2E)
    m_shift = tl.where(m == float("-inf"), 0.0, m)

    total = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, HEAD_DIM], tl.float32)
    o_base = Outs + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    for n in range(N):
        weight = tl.math.exp2(tl.load(lse_base + n * stride_ln, mask=valid, other=float("-inf")) * LOG2E - m_shift)
        o = tl.load(o_base + n * stride_on, mask=valid[:, None], other=0.0).to(tl.float32)
        acc += tl.where(weight[:, None] > 0, weight[:, None] * o, 0.0)
        total += weight

    nonempty = total > 0
    total_safe = tl.where(nonempty, total, 1.0)
    out = acc / total_safe[:, None]
    lse = tl.where(nonempty, (m_shift + tl.math.log2(total_safe)) * LN2, float("-inf"))
    tl.store(Out + rows[:, None] * stride_mt + h * stride_mh + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=valid[:, None])
    tl.store(Lse + h.to(tl.int64) * stride_mlh + rows, lse, mask=valid)
