"""Per-row key intervals: the compact exact form of structured masks.

A mask row is stored as two half-open key intervals ``[lo1, hi1) U [lo2, hi2)``, canonical form:
clamped to ``[0, T]``, an empty interval is ``(0, 0)``, non-empty intervals are disjoint and not
adjacent, and ``lo1 <= lo2`` when both are non-empty (an empty first slot implies an empty second).
Canonical form lets the block classifier count coverage without double counting, and makes the
interval table a faithful signature of the mask.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

Interval = Tuple[torch.Tensor, torch.Tensor]


def canonicalize(pieces: Sequence[Interval], total_len: int) -> Optional[torch.Tensor]:
    """Union of any number of per-row intervals -> int32 ``[4, T]``, or None if a row needs > 2 intervals."""
    T = total_len
    lo = [p[0].to(torch.int64).clamp(0, T) for p in pieces]
    hi = [p[1].to(torch.int64).clamp(0, T) for p in pieces]
    # Empty pieces sort last (start T+1) so the sweep below can ignore them; a compare-swap
    # network is much cheaper than a general sort for the 1-4 pieces per row seen here.
    start = [torch.where(h > l, l, torch.full_like(l, T + 1)) for l, h in zip(lo, hi)]
    K = len(pieces)
    for i in range(K):
        for j in range(K - 1 - i):
            swap = start[j + 1] < start[j]
            for arr in (start, lo, hi):
                a, b = arr[j], arr[j + 1]
                arr[j], arr[j + 1] = torch.where(swap, b, a), torch.where(swap, a, b)
    empty = [s > T for s in start]

    n_rows = lo[0].shape[0]
    out_lo = [torch.zeros(n_rows, dtype=torch.int64) for _ in range(2)]
    out_hi = [torch.zeros(n_rows, dtype=torch.int64) for _ in range(2)]
    count = torch.zeros(n_rows, dtype=torch.int64)  # merged pieces so far per row
    cur_lo = torch.zeros(n_rows, dtype=torch.int64)
    cur_hi = torch.zeros(n_rows, dtype=torch.int64)
    has_cur = torch.zeros(n_rows, dtype=torch.bool)
    overflow = torch.zeros(n_rows, dtype=torch.bool)

    def flush(rows: torch.Tensor) -> None:
        nonlocal count
        slot = count
        overflow.logical_or_(rows & (slot >= 2))
        for s in range(2):
            sel = rows & (slot == s)
            out_lo[s] = torch.where(sel, cur_lo, out_lo[s])
            out_hi[s] = torch.where(sel, cur_hi, out_hi[s])
        count = count + rows.to(torch.int64)

    for j in range(K):
        valid = ~empty[j]
        # A piece that starts at or before the running end extends it (adjacent pieces merge too).
        extends = valid & has_cur & (lo[j] <= cur_hi)
        starts_new = valid & ~extends
        flush(starts_new & has_cur)
        cur_hi = torch.where(extends, torch.maximum(cur_hi, hi[j]), cur_hi)
        cur_lo = torch.where(starts_new, lo[j], cur_lo)
        cur_hi = torch.where(starts_new, hi[j], cur_hi)
        has_cur = has_cur | valid
    flush(has_cur)
    if bool(overflow.any()):
        return None
    return torch.stack([out_lo[0], out_hi[0], out_lo[1], out_hi[1]]).to(torch.int32)


def _pieces(iv: torch.Tensor) -> list[Interval]:
    iv = iv.to(torch.int64)
    return [(iv[0], iv[1]), (iv[2], iv[3])]


def intersect(a: torch.Tensor, b: torch.Tensor, total_len: int) -> Optional[torch.Tensor]:
    """Row-wise intersection of two canonical interval tables (None if a row needs > 2 intervals)."""
    pieces = [
        (torch.maximum(lo_a, lo_b), torch.minimum(hi_a, hi_b)) for lo_a, hi_a in _pieces(a) for lo_b, hi_b in _pieces(b)
    ]
    return canonicalize(pieces, total_len)


def union(a: torch.Tensor, b: torch.Tensor, total_len: int) -> Optional[torch.Tensor]:
    """Row-wise union of two canonical interval tables (None if a row needs > 2 intervals)."""
    return canonicalize(_pieces(a) + _pieces(b), total_len)
