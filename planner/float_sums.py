"""numpy's float64 summation, compiled (numba): ``numpy_sum(a)`` is ``a.sum()`` bit for bit.

Why: a compiled loop that stands for numpy code must give the same floats where they decide a plan -
the Balancer's per-rank loads (planner/balance_moves.py), the polish's unit weights and rank times
(planner/group_loops.py, planner/comm_loops.py) - and numpy sums a float64 array pairwise, not in
order: runs under 8 values in order, up to 128 in eight interleaved sums combined pairwise, longer
ones halved at a multiple of 8 and the halves' sums added (numpy/_core/src/umath/loops_utils.h.src).
tests/test_balancer.py and tests/test_compiled_loops.py compare it with np.sum.
"""

from __future__ import annotations

import numpy as np

from .jit import compiled


@compiled(error_model="numpy")  # (numpy: float division by zero gives inf)
def _pairwise_leaf(a, lo, n):
    """numpy's sum of at most 128 values a[lo:lo + n]: eight running sums (fewer than 8 values: one)."""
    if n < 8:
        res = 0.0
        for i in range(lo, lo + n):
            res += a[i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i, m = 8, n - n % 8
    while i < m:
        j = lo + i
        r0 += a[j]
        r1 += a[j + 1]
        r2 += a[j + 2]
        r3 += a[j + 3]
        r4 += a[j + 4]
        r5 += a[j + 5]
        r6 += a[j + 6]
        r7 += a[j + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@compiled(error_model="numpy")
def _pairwise(a):
    """numpy's pairwise summation of ``a`` (numpy/_core/src/umath/loops_utils.h.src): runs of more than
    128 values split in two halves (the first a multiple of 8 long), summed separately and added. With
    an explicit stack: numba's cache does not load recursive functions back."""
    zero = np.int64(0)  # (one specialization of the leaf: its start is always a variable int64)
    if a.size <= 128:
        return _pairwise_leaf(a, zero, a.size)
    seg_lo = np.empty(128, dtype=np.int64)
    seg_n = np.empty(128, dtype=np.int64)
    combine = np.empty(128, dtype=np.bool_)  # the entry adds the two sums on top of ``sums``
    sums = np.empty(128)
    top, depth = 0, 0
    seg_lo[0], seg_n[0], combine[0] = zero, a.size, False
    while top >= 0:
        lo, n, add = seg_lo[top], seg_n[top], combine[top]
        top -= 1
        if add:
            depth -= 1
            sums[depth - 1] = sums[depth - 1] + sums[depth]
        elif n <= 128:
            sums[depth] = _pairwise_leaf(a, lo, n)
            depth += 1
        else:
            half = n // 2
            half -= half % 8
            # popped in the order: first half, second half, then their sum
            seg_lo[top + 1], seg_n[top + 1], combine[top + 1] = 0, 0, True
            seg_lo[top + 2], seg_n[top + 2], combine[top + 2] = lo + half, n - half, False
            seg_lo[top + 3], seg_n[top + 3], combine[top + 3] = lo, half, False
            top += 3
    return sums[0]


@compiled(error_model="numpy")
def numpy_sum(a):
    """``a.sum()`` for a contiguous float64 array, bit for bit."""
    return 0.0 + _pairwise(a)
