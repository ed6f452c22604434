"""Stable argsorts for the compiled planner steps (numba), in explicit loops.

numba's own ``np.argsort(kind="mergesort")`` and array assignments compile in seconds each (their
generic and error-reporting paths); these compile in a fraction of that, and give numpy's
``kind="stable"`` order: ties keep their positions' order.
"""

from __future__ import annotations

import numpy as np

from .jit import compiled



@compiled
def stable_argsort(keys, lo, hi, out):
    """out[lo:hi] = lo + the stable argsort of keys[lo:hi] (a bottom-up merge sort)."""
    n = hi - lo
    a = np.empty(n, dtype=np.int64)
    b = np.empty(n, dtype=np.int64)
    for i in range(n):
        a[i] = lo + i
    width = 1
    while width < n:
        for left in range(0, n, 2 * width):
            mid, right = min(left + width, n), min(left + 2 * width, n)
            i, j, k = left, mid, left
            while i < mid and j < right:
                if keys[a[j]] < keys[a[i]]:  # (ties: the left run's first)
                    b[k] = a[j]
                    j += 1
                else:
                    b[k] = a[i]
                    i += 1
                k += 1
            while i < mid:
                b[k] = a[i]
                i += 1
                k += 1
            while j < right:
                b[k] = a[j]
                j += 1
                k += 1
        a, b = b, a
        width *= 2
    for i in range(n):
        out[lo + i] = a[i]


@compiled
def stable_order(keys):
    """The stable argsort of ``keys`` (int64 positions)."""
    out = np.empty(keys.size, dtype=np.int64)
    stable_argsort(keys, 0, keys.size, out)
    return out


@compiled
def counting_order(keys, num_keys):
    """The stable argsort of ints in [0, num_keys), by counting: O(n + num_keys)."""
    start = np.zeros(num_keys + 1, dtype=np.int64)
    for i in range(keys.size):
        start[keys[i] + 1] += 1
    for k in range(num_keys):
        start[k + 1] += start[k]
    order = np.empty(keys.size, dtype=np.int64)
    for i in range(keys.size):
        order[start[keys[i]]] = i
        start[keys[i]] += 1
    return order
