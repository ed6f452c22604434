"""Triton helpers: exact masks of partial tiles and the online-softmax step.

Notation (docs/design.md): T total tokens, B block size (= KernelMask.block_size), q_idx / k_idx global
token indices of a tile's rows / columns, ``intervals`` int32 [4, T] (lo1, hi1, lo2, hi2 per query:
q attends k iff lo1<=k<hi1 or lo2<=k<hi2), ``bits`` uint8 [n_partial, B, B] (q-major tile bitmask),
``tile_bits`` index of a tile's bitmask (-1: use intervals). Scores are kept in the exp2 domain:
``s2 = scale * log2(e) * q.k``; LSE is stored in natural log. With logit soft-capping (SOFTCAP, Gemma 2)
the score is ``c * tanh(scale * q.k / c)``: the kernels get ``qk_scale = scale / c`` and
``cap = c * log2(e)``, so ``s2 = cap * tanh(qk_scale * q.k)``, and ``t = s2 / cap`` is the tanh again in
the backward, where dS picks up ``d s / d (scale * q.k) = 1 - t^2``.
"""
import triton
import triton.language as tl

# The CPU interpreter multiplies bf16 operands as raw integers; there the dot upcasts to fp32 first
# (bf16/fp16 products are exact in fp32, so the result matches the tensor-core fp32 accumulation).
UPCAST_DOT = tl.constexpr(bool(triton.knobs.runtime.interpret))

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def mma(a, b, acc, DOT_PREC: tl.constexpr):
    """a @ b (+ acc) with fp32 accumulation."""
    if UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PREC)


@triton.jit
def load_intervals(Intervals, T, q_idx, q_valid):
    """Per-query key intervals (lo1, hi1, lo2, hi2); rows past T get empty intervals."""
    lo1 = tl.load(Intervals + q_idx, mask=q_valid, other=0)
    hi1 = tl.load(Intervals + T + q_idx, mask=q_valid, other=0)
    lo2 = tl.load(Intervals + 2 * T + q_idx, mask=q_valid, other=0)
    hi2 = tl.load(Intervals + 3 * T + q_idx, mask=q_valid, other=0)
    return lo1, hi1, lo2, hi2


@triton.jit
def interval_mask(lo1, hi1, lo2, hi2, k_idx):
    """[M, N] mask of a q-major tile from the rows' intervals and the columns' key indices."""
    k = k_idx[None, :]
    return ((k >= lo1[:, None]) & (k < hi1[:, None])) | ((k >= lo2[:, None]) & (k < hi2[:, None]))


@triton.jit
def interval_mask_t(k_idx, lo1, hi1, lo2, hi2):
    """[N, M] mask of a kv-major tile: rows are keys, columns are queries with their intervals."""
    k = k_idx[:, None]
    return ((k >= lo1[None, :]) & (k < hi1[None, :])) | ((k >= lo2[None, :]) & (k < hi2[None, :]))


@triton.jit
def bits_mask(Bits, tile_bits, q_rel, k_rel, BLOCK: tl.constexpr, KV_MAJOR: tl.constexpr):
    """Mask from a tile's stored bitmask; q_rel/k_rel are offsets inside the B x B tile."""
    base = Bits + tl.maximum(tile_bits, 0).to(tl.int64) * (BLOCK * BLOCK)
    if KV_MAJOR:
        ptrs = base + q_rel[None, :] * BLOCK + k_rel[:, None]
    else:
        ptrs = base + q_rel[:, None] * BLOCK + k_rel[None, :]
    # a -1 tile index (interval tile) loads nothing; the mask is built as a tensor, not a scalar
    if KV_MAJOR:
        present = (k_rel[:, None] * 0 + q_rel[None, :] * 0 + tile_bits) >= 0
    else:
        present = (q_rel[:, None] * 0 + k_rel[None, :] * 0 + tile_bits) >= 0
    return tl.load(ptrs, mask=present, other=0) != 0


@triton.jit
def tanh(x):
    """tanh(x) to a few fp32 ulp: (1 - e) / (1 + e) with e = exp(-2|x|) (no overflow), and near 0, where
    1 - e cancels (a cap far above the scores would lose their low bits), x - x^3/3 + 2x^5/15."""
    # (Triton has no tanh of its own that also runs in the CPU interpreter; libdevice's does not)
    ax = tl.abs(x)
    e = tl.math.exp2(ax * (-2.0 * LOG2E))
    far = (1.0 - e) / (1.0 + e)
    small = tl.minimum(ax, 0.1)  # (the branch not taken stays finite)
    x2 = small * small
    near = small * (1.0 - x2 * (1.0 / 3.0) * (1.0 - x2 * 0.4))
    return tl.where(x < 0, -1.0, 1.0) * tl.where(ax < 0.1, near, far)


@triton.jit
def scores2(qk, qk_scale, cap, SOFTCAP: tl.constexpr):
    """exp2-domain scores of a tile of raw q.k products (module docstring)."""
    if SOFTCAP:
        s2 = cap * tanh(qk * qk_scale)
    else:
        s2 = qk * qk_scale
    return s2


@triton.jit
def through_cap(ds, s2, cap, SOFTCAP: tl.constexpr):
    """dS of the capped scores taken back to dS of the plain scaled scores: times 1 - tanh^2."""
    if SOFTCAP:
        t = s2 * (1.0 / cap)  # (one scalar division, not one per score)
        ds = ds * (1.0 - t * t)
    return ds


@triton.jit
def softmax_step(acc, m_i, l_i, s2, v, GUARD_EMPTY: tl.constexpr, DOT_PREC: tl.constexpr):
    """Fold one tile of exp2-domain scores s2 [M, N] and values v [N, D] into (acc, m_i, l_i)."""
    m_new = tl.maximum(m_i, tl.max(s2, 1))
    if GUARD_EMPTY:
        # a row with every key masked so far has m_new = -inf; shift by 0 instead (p = 0, no NaN)
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_shift = m_new
    alpha = tl.math.exp2(m_i - m_shift)
    p = tl.math.exp2(s2 - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = mma(p.to(v.dtype), v, acc, DOT_PREC)
    return acc, m_new, l_i
