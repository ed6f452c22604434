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


@compiled
def two_digit_order(keys, base, num_keys):
    """The stable argsort of ints ``keys`` in [0, num_keys), each ``high * base + low`` (low < base): one
    counting pass where there are not many more keys than values (``num_keys <= 4 * n``), else two, by
    the low digit, then by the high one (counters for ``base`` and ``num_keys / base`` values, not for
    every key)."""
    n = keys.size
    if num_keys <= 4 * n:
        return counting_order(keys, num_keys)
    digit = np.empty(n, dtype=np.int64)
    for i in range(n):
        digit[i] = keys[i] % base
    first = counting_order(digit, base)
    for i in range(n):
        digit[i] = keys[first[i]] // base
    second = counting_order(digit, (num_keys + base - 1) // base)
    order = np.empty(n, dtype=np.int64)
    for i in range(n):
        order[i] = first[second[i]]
    return order


@compiled
def rows_in_wire_order(table):
    """int32 [m, 5]: the rows of a non-negative int64 schedule table [m, 5] in lexicographic order of
    their columns, ties in table order (numpy's stable argsort of the mixed-radix key, or lexsort):
    one stable counting pass per column, last column first."""
    m = table.shape[0]
    order = np.empty(m, dtype=np.int64)
    for i in range(m):
        order[i] = i
    keys = np.empty(m, dtype=np.int64)
    for c in range(4, -1, -1):
        top = 0
        for i in range(m):
            keys[i] = table[order[i], c]
            top = max(top, keys[i])
        by_column = counting_order(keys, top + 1)
        previous = order.copy()
        for i in range(m):
            order[i] = previous[by_column[i]]
    out = np.empty((m, 5), dtype=np.int32)
    for i in range(m):
        for c in range(5):
            out[i, c] = table[order[i], c]
    return out


@compiled
def bisect(keys, key, lo, right):
    """``lo + np.searchsorted(keys[lo:], key, "right" if right else "left")`` for the ascending ``keys``:
    the first position from ``lo`` on whose value exceeds ``key`` (``right``) or reaches it (a binary
    search in a loop: numba's ``np.searchsorted`` compiles in seconds)."""
    hi = keys.size
    while lo < hi:
        mid = (lo + hi) // 2
        if keys[mid] < key or (right and keys[mid] == key):
            lo = mid + 1
        else:
            hi = mid
    return lo


@compiled
def find_sorted(keys, key):
    """The position of ``key`` in the ascending ``keys``, or -1."""
    lo = bisect(keys, key, 0, False)
    return lo if lo < keys.size and keys[lo] == key else -1
