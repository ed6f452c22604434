"""Per-row key intervals: the compact exact form of structured masks.

A mask row is stored as two half-open key intervals ``[lo1, hi1) U [lo2, hi2)``, canonical form:
clamped to ``[0, T]``, an empty interval is ``(0, 0)``, non-empty intervals are disjoint and not
adjacent, and ``lo1 <= lo2`` when both are non-empty (an empty first slot implies an empty second).
Canonical form lets the block classifier count coverage without double counting, and makes the
interval table a faithful signature of the mask.

The work is done in numpy on whole columns: these tables have one entry per token (1M+), so the
cost is a few dozen vectorised passes, never a per-row Python loop.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np
import torch

Interval = Tuple[torch.Tensor, torch.Tensor]

# Pieces are packed as ``start << 32 | end`` (both <= T + 1 < 2**31): one int64 compare then sorts
# by start and carries the end along, so sorting needs only minimum/maximum.
_SHIFT = 32
_LOW = (1 << _SHIFT) - 1


def _clamped(x, T: int) -> np.ndarray:
    """A column as int64 numpy, clamped to ``[0, T]``."""
    return np.clip(np.asarray(x), 0, T, dtype=np.int64)


def _pack(lo, hi, T: int) -> np.ndarray:
    """Packed sort keys; empty pieces get start T + 1 and end 0 so they sort last and never merge."""
    key, hi = _clamped(lo, T), _clamped(hi, T)  # key holds the start until it is shifted
    empty = hi <= key
    key <<= _SHIFT
    key |= hi
    key[empty] = (T + 1) << _SHIFT
    return key


def _sort_network(keys: list[np.ndarray]) -> None:
    """Sort K columns element-wise in place (bubble network: cheaper than a general sort for K <= 4)."""
    K = len(keys)
    for i in range(K):
        for j in range(K - 1 - i):
            a, b = keys[j], keys[j + 1]
            keys[j], keys[j + 1] = np.minimum(a, b), np.maximum(a, b)


def canonicalize(pieces: Sequence[Interval], total_len: int) -> Optional[torch.Tensor]:
    """Union of any number of per-row intervals -> int32 ``[4, T]``, or None if a row needs > 2 intervals."""
    T = total_len
    n_rows = np.asarray(pieces[0][0]).shape[0]
    out = np.empty((4, n_rows), dtype=np.int32)
    if len(pieces) == 1:
        # A single interval needs no merging, only clamping and the (0, 0) form for empty rows.
        for row, x in zip(out, pieces[0]):
            np.clip(np.asarray(x), 0, T, out=row, casting="unsafe")
        out[:2, out[1] <= out[0]] = 0
        out[2:] = 0
        return torch.from_numpy(out)

    keys = [_pack(lo, hi, T) for lo, hi in pieces]
    _sort_network(keys)
    lo = [k >> _SHIFT for k in keys]
    hi = [k & _LOW for k in keys]  # empty pieces have end 0, so they never raise the running end
    # After sorting by start, piece j opens a new interval iff it starts after the running end of
    # pieces 0..j-1 (a piece starting exactly at the end is adjacent and merges).
    run_end = [hi[0]]
    for j in range(1, len(keys)):
        run_end.append(np.maximum(run_end[-1], hi[j]))
    opens = [(lo[j] <= T) & (lo[j] > run_end[j - 1]) for j in range(1, len(keys))]
    if len(opens) > 1 and bool((np.sum(opens, axis=0) > 1).any()):
        return None
    out[0] = np.where(lo[0] <= T, lo[0], 0)
    hi1, lo2 = run_end[-1], np.zeros(n_rows, dtype=np.int64)
    for j, o in enumerate(opens, start=1):
        hi1 = np.where(o, run_end[j - 1], hi1)
        lo2 = np.where(o, lo[j], lo2)
    out[1] = hi1
    out[2] = lo2
    out[3] = np.where(np.any(opens, axis=0), run_end[-1], 0)
    return torch.from_numpy(out)


def _pieces(iv: torch.Tensor) -> list[tuple[np.ndarray, np.ndarray]]:
    """The two (lo, hi) columns of an interval table, as numpy views."""
    iv = iv.numpy()
    return [(iv[0], iv[1]), (iv[2], iv[3])]


def _single(iv: np.ndarray) -> bool:
    """True when no row of a canonical table has a second interval (an empty slot is (0, 0))."""
    return np.count_nonzero(iv[3]) == 0


def _intersect_single(a: np.ndarray, b: np.ndarray) -> torch.Tensor:
    """``intersect`` when ``a`` has one interval per row: ``A & B1`` then ``A & B2``, already in order
    and separated (B1 and B2 are), so only the empty pieces need moving out."""
    out = np.empty_like(b)
    lo, hi = np.maximum(a[0], b[0], out=out[0]), np.minimum(a[1], b[1], out=out[1])
    empty1 = hi <= lo
    if _single(b):
        np.copyto(out[:2], 0, where=empty1)
        out[2:] = 0
        return torch.from_numpy(out)
    lo, hi = np.maximum(a[0], b[2], out=out[2]), np.minimum(a[1], b[3], out=out[3])
    empty2 = hi <= lo
    np.copyto(out[:2], out[2:], where=empty1)  # A & B1 empty: A & B2 (or nothing) moves first
    np.copyto(out[2:], 0, where=empty1 | empty2)
    np.copyto(out[:2], 0, where=empty1 & empty2)
    return torch.from_numpy(out)


def intersect(a: torch.Tensor, b: torch.Tensor, total_len: int) -> Optional[torch.Tensor]:
    """Row-wise intersection of two canonical interval tables (None if a row needs > 2 intervals).

    With ``a = A1 U A2`` and ``b = B1 U B2`` canonical, the pieces ``Ai & Bj`` are disjoint and not
    adjacent, ``A1 & B1`` comes first, ``A2 & B2`` last, and ``A1 & B2``, ``A2 & B1`` cannot both be
    non-empty (the first needs B1 to end inside A1, the second A1 to end inside B1). So the result
    is the non-empty pieces of that order, at most two of them: no sort and no merge.
    """
    # Tables with one interval per row (documents, causal, windows) take a shorter path; the
    # canonical form is unique, so it gives the same table.
    if _single(a.numpy()):
        return _intersect_single(a.numpy(), b.numpy())
    if _single(b.numpy()):
        return _intersect_single(b.numpy(), a.numpy())
    (a_lo1, a_hi1), (a_lo2, a_hi2) = _pieces(a)
    (b_lo1, b_hi1), (b_lo2, b_hi2) = _pieces(b)
    cross12 = (np.maximum(a_lo1, b_lo2), np.minimum(a_hi1, b_hi2))
    cross21 = (np.maximum(a_lo2, b_lo1), np.minimum(a_hi2, b_hi1))
    use12 = cross12[1] > cross12[0]
    ordered = [
        (np.maximum(a_lo1, b_lo1), np.minimum(a_hi1, b_hi1)),
        tuple(np.where(use12, x12, x21) for x12, x21 in zip(cross12, cross21)),
        (np.maximum(a_lo2, b_lo2), np.minimum(a_hi2, b_hi2)),
    ]
    has = [hi > lo for lo, hi in ordered]
    n_nonempty = has[0].astype(np.int8) + has[1] + has[2]
    if bool((n_nonempty > 2).any()):
        return None
    out = np.empty((4, n_nonempty.size), dtype=np.int32)
    for k in range(2):  # lo, then hi
        p0, p1, p2 = (piece[k] for piece in ordered)
        first_nonempty = np.where(has[0], p0, np.where(has[1], p1, p2))
        second_nonempty = np.where(has[2], p2, p1)  # only used when two pieces are non-empty
        np.multiply(first_nonempty, n_nonempty >= 1, out=out[k])
        np.multiply(second_nonempty, n_nonempty == 2, out=out[2 + k])
    return torch.from_numpy(out)


def _union_single(a: np.ndarray, b: np.ndarray) -> Optional[torch.Tensor]:
    """``union`` when ``a`` has one interval A per row: A merges with the pieces of b it overlaps or
    touches, or else sits beside them (a third interval: None)."""
    a_lo, a_hi, b_lo1, b_hi1, b_lo2, b_hi2 = a[0], a[1], b[0], b[1], b[2], b[3]
    b_two = not _single(b)
    out = b.copy()
    a_in = a_hi > 0  # canonical: empty is (0, 0), non-empty has hi > lo >= 0
    touch1 = a_in & (b_hi1 > 0) & (a_lo <= b_hi1) & (b_lo1 <= a_hi)
    # A touching B1 (and B2 if it reaches it) widens the first interval.
    if b_two:
        touch2 = a_in & (b_hi2 > 0) & (a_lo <= b_hi2) & (b_lo2 <= a_hi)
        np.copyto(out[1], np.maximum(a_hi, np.where(touch2, b_hi2, b_hi1)), where=touch1)
        # A touching B2 only widens the second; touching both leaves one interval.
        only2 = touch2 & ~touch1
        np.copyto(out[2], np.minimum(a_lo, b_lo2), where=only2)
        np.copyto(out[3], np.maximum(a_hi, b_hi2), where=only2)
        np.copyto(out[2:], 0, where=touch1 & touch2)
        apart = a_in & ~(touch1 | touch2)
        if bool((apart & (b_hi2 > 0)).any()):
            return None
    else:
        np.copyto(out[1], np.maximum(a_hi, b_hi1), where=touch1)
        apart = a_in & ~touch1
    np.copyto(out[0], np.minimum(a_lo, b_lo1), where=touch1)
    # A apart from a b with at most one interval: A first (B1, possibly empty, moves second) or second.
    first = apart & ((b_hi1 == 0) | (a_lo < b_lo1))
    second = apart & ~first
    np.copyto(out[2:], out[:2], where=first)
    np.copyto(out[:2], a[:2], where=first)
    np.copyto(out[2:], a[:2], where=second)
    return torch.from_numpy(out)


def union(a: torch.Tensor, b: torch.Tensor, total_len: int) -> Optional[torch.Tensor]:
    """Row-wise union of two canonical interval tables (None if a row needs > 2 intervals)."""
    # A table with one interval per row (documents, causal, windows) merges directly; the
    # canonical form is unique, so the table is the same as the general merge's.
    if _single(a.numpy()):
        return _union_single(a.numpy(), b.numpy())
    if _single(b.numpy()):
        return _union_single(b.numpy(), a.numpy())
    return canonicalize(_pieces(a) + _pieces(b), total_len)
