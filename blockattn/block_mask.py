"""BlockMask: every (q-block, kv-block) tile of a mask classified EMPTY, PARTIAL or FULL.

The compressed lists follow FlexAttention's BlockMask: per q-block the FULL and PARTIAL kv-blocks
(forward, dQ), and the transposed per-kv-block lists (dK/dV), here in CSR form. Structured masks
are classified analytically from their per-row key intervals: a few vectorised passes over the
rows cut them into pieces along which every bound is constant or grows by one per row, and tile
states and partial-tile pair counts follow from the pieces in closed form, so the cost is
O(T + pieces + tiles) and never O(T^2); masks given only as a ``mask_mod`` are evaluated in row
chunks and keep a bitmask for each partial tile.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple, Optional

import numpy as np
import torch

EMPTY, PARTIAL, FULL = 0, 1, 2

# Cap on the elements of one chunk's [q-blocks, kv-blocks] (or [rows, T]) work array.
_CHUNK_ELEMS = 1 << 23


def _sort_key(blocks: np.ndarray, n_blocks: int) -> np.ndarray:
    """Block indices as uint16 when they fit: numpy's stable sort is then a linear-time radix sort."""
    return blocks.astype(np.uint16) if n_blocks <= np.iinfo(np.uint16).max else blocks


def _csr(row_ids: np.ndarray, cols: np.ndarray, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR (ptr, idx) from entries already grouped by ascending row."""
    ptr = np.zeros(n_rows + 1, dtype=np.int32)
    np.cumsum(np.bincount(row_ids, minlength=n_rows), out=ptr[1:])
    return torch.from_numpy(ptr), torch.from_numpy(np.ascontiguousarray(cols, dtype=np.int32))


@dataclass(frozen=True, eq=False)
class BlockMask:
    """Tile classification of a mask at one block size (see docs/design.md for the field table)."""

    total_len: int
    block_size: int
    num_blocks: int
    full_kv_ptr: torch.Tensor
    full_kv_idx: torch.Tensor
    part_kv_ptr: torch.Tensor
    part_kv_idx: torch.Tensor
    part_count: torch.Tensor
    row_intervals: Optional[torch.Tensor]
    part_bits: Optional[torch.Tensor]

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_mask_spec(cls, spec, block_size: int) -> "BlockMask":
        T, B = spec.total_len, int(block_size)
        if B < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        nB = -(-T // B)
        iv = spec.row_intervals()
        if iv is not None:
            pieces = _row_pieces(iv.numpy(), T, B, nB)
            runs, bits = _classify_intervals(pieces, T, B, nB), None
        else:
            pieces = None
            *runs, bits = _classify_mask_mod(spec, T, B, nB)
        return cls._from_runs(T, B, nB, *runs, iv, pieces, bits)

    @classmethod
    def _from_runs(cls, T, B, nB, r_qb, r_k0, r_len, r_state, iv, pieces, bits) -> "BlockMask":
        """Build from runs of same-state kv-blocks (sorted by q-block, then start)."""
        full = r_state == FULL
        fq, fk = _expand_runs(r_qb[full], r_k0[full], r_len[full])
        pq, pk = _expand_runs(r_qb[~full], r_k0[~full], r_len[~full])
        full_kv_ptr, full_kv_idx = _csr(fq, fk, nB)
        part_kv_ptr, part_kv_idx = _csr(pq, pk, nB)
        if pieces is not None:
            part_count = _partial_counts(pieces, pq, pk, T, B)
        else:
            part_count = bits.sum(dim=(1, 2)).numpy().astype(np.int64)
        return cls(
            total_len=T,
            block_size=B,
            num_blocks=nB,
            full_kv_ptr=full_kv_ptr,
            full_kv_idx=full_kv_idx,
            part_kv_ptr=part_kv_ptr,
            part_kv_idx=part_kv_idx,
            part_count=torch.from_numpy(part_count),
            row_intervals=iv,
            part_bits=bits,
        )

    # ------------------------------------------------------------------ all tiles, q-major
    @cached_property
    def _tiles(self):
        nB = self.num_blocks
        fq = np.repeat(np.arange(nB, dtype=np.int32), np.diff(self.full_kv_ptr.numpy()))
        pq = np.repeat(np.arange(nB, dtype=np.int32), np.diff(self.part_kv_ptr.numpy()))
        tq = np.concatenate([fq, pq])
        tk = np.concatenate([self.full_kv_idx.numpy(), self.part_kv_idx.numpy()])
        is_full = np.concatenate([np.ones(fq.size, dtype=bool), np.zeros(pq.size, dtype=bool)])
        # int64 key: (q-block, kv-block) order; both lists are already sorted inside each q-block.
        order = np.argsort(tq.astype(np.int64) * nB + tk, kind="stable")
        return torch.from_numpy(tq[order]), torch.from_numpy(tk[order]), torch.from_numpy(is_full[order])

    @property
    def tile_q(self) -> torch.Tensor:
        """int32 q-block of every non-empty tile, sorted by (q-block, kv-block)."""
        return self._tiles[0]

    @property
    def tile_kv(self) -> torch.Tensor:
        """int32 kv-block of every non-empty tile, same order as ``tile_q``."""
        return self._tiles[1]

    @property
    def tile_full(self) -> torch.Tensor:
        """bool: the tile is FULL (else PARTIAL), same order as ``tile_q``."""
        return self._tiles[2]

    # ------------------------------------------------------------------ transposed (kv-major) lists
    # Built on first use: only the backward pass and some planners need them, and for dense masks
    # at large T they are as big as the forward lists.
    @cached_property
    def _transposed(self):
        nB = self.num_blocks
        fq = np.repeat(np.arange(nB, dtype=np.int32), np.diff(self.full_kv_ptr.numpy()))
        pq = np.repeat(np.arange(nB, dtype=np.int32), np.diff(self.part_kv_ptr.numpy()))
        fk, pk = self.full_kv_idx.numpy(), self.part_kv_idx.numpy()
        # A stable sort by kv-block keeps q-blocks ascending inside each transposed row.
        order_f = np.argsort(_sort_key(fk, nB), kind="stable")
        order_p = np.argsort(_sort_key(pk, nB), kind="stable")
        full_ptr, full_idx = _csr(fk[order_f], fq[order_f], nB)
        part_ptr, part_idx = _csr(pk[order_p], pq[order_p], nB)
        return full_ptr, full_idx, part_ptr, part_idx, torch.from_numpy(order_p.astype(np.int32))

    @property
    def full_q_ptr(self) -> torch.Tensor:
        """Transposed CSR row pointers: FULL q-blocks of each kv-block."""
        return self._transposed[0]

    @property
    def full_q_idx(self) -> torch.Tensor:
        return self._transposed[1]

    @property
    def part_q_ptr(self) -> torch.Tensor:
        """Transposed CSR row pointers: PARTIAL q-blocks of each kv-block."""
        return self._transposed[2]

    @property
    def part_q_idx(self) -> torch.Tensor:
        return self._transposed[3]

    @property
    def part_q_tile(self) -> torch.Tensor:
        """For each transposed partial entry, its index in the q-major partial list (bits, counts)."""
        return self._transposed[4]

    # ------------------------------------------------------------------ views
    @property
    def num_tiles(self) -> int:
        """Number of non-empty tiles."""
        return int(self.full_kv_idx.numel() + self.part_kv_idx.numel())

    def block_len(self, block: torch.Tensor) -> torch.Tensor:
        """Valid token count of each block index (the last block may be short)."""
        block = torch.as_tensor(block, dtype=torch.int64)
        return (self.total_len - block * self.block_size).clamp(max=self.block_size)

    def tiles(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """All non-empty tiles as (q_block, kv_block, is_full), sorted by (q_block, kv_block)."""
        return self.tile_q, self.tile_kv, self.tile_full

    def tile_pairs(self) -> torch.Tensor:
        """int64 unmasked (q, k) pairs of each tile, in ``tiles()`` order."""
        # Every block but the last is whole, so only tiles in the last row or column are not B * B
        # (the planner reads this for every tile of every batch: no per-tile gathers).
        B, last = self.block_size, self.num_blocks - 1
        tq, tk = self.tile_q.numpy(), self.tile_kv.numpy()
        pairs = np.full(tq.size, B * B, dtype=np.int64)
        short = self.total_len - last * B
        if short < B:
            pairs[np.searchsorted(tq, last):] = short * B  # (tiles sorted by q: the last row is a suffix)
            col = tk == last
            pairs[col] = pairs[col] // B * short
        # Partial tiles appear in tiles() in the same relative order as in the q-major partial list.
        pairs[~self.tile_full.numpy()] = self.part_count.numpy()
        return torch.from_numpy(pairs)

    def tile_state(self) -> torch.Tensor:
        """Dense int8 ``[nB, nB]`` of EMPTY/PARTIAL/FULL (for tests and small masks)."""
        state = torch.zeros(self.num_blocks, self.num_blocks, dtype=torch.int8)
        state[self.tile_q.long(), self.tile_kv.long()] = torch.where(self.tile_full, FULL, PARTIAL).to(torch.int8)
        return state

    def density(self) -> float:
        """Fraction of the T x T (q, k) pairs that are unmasked."""
        return float(self.tile_pairs().sum()) / float(self.total_len) ** 2

    def __repr__(self) -> str:
        n_full = int(self.full_kv_idx.numel())
        return (
            f"BlockMask(T={self.total_len}, B={self.block_size}, blocks={self.num_blocks}, "
            f"full={n_full}, partial={self.num_tiles - n_full}, density={self.density():.4f})"
        )


class _RowPieces(NamedTuple):
    """Rows of an interval table cut into pieces: runs of rows inside one q-block along which each
    of the four bounds is ``x0 + slope * i`` (i = row - start, slope 0 or 1)."""

    start: np.ndarray  # int64 [P] first row
    length: np.ndarray  # int64 [P] rows
    x0: np.ndarray  # int64 [4, P] bounds at the first row; an end equal to T is stored as nB * B
    slope: np.ndarray  # int64 [4, P] 0 or 1
    block_ptr: np.ndarray  # int64 [nB + 1] pieces of q-block b are block_ptr[b]:block_ptr[b + 1]


def _row_pieces(iv: np.ndarray, T: int, B: int, nB: int) -> _RowPieces:
    """Cut the rows of a canonical ``[4, T]`` table into pieces (see ``_RowPieces``).

    Structured masks have one or two pieces per q-block (a bound only jumps at a document or
    segment edge), so everything downstream is O(pieces) instead of O(T).
    """
    d = np.diff(iv, axis=1)  # d[:, r - 1] = step from row r - 1 to row r
    # As unsigned, a negative step is huge: one compare tests 0 <= step <= 1.
    step01 = d.view(np.uint32) <= 1 if d.dtype == np.int32 else (d >= 0) & (d <= 1)
    # Row r extends the piece of row r - 1 when every bound steps by 0 or 1 and, from the third
    # row on, by the same amount as the step before (a step change makes the next row a new piece).
    extends = step01.all(axis=0)
    extends[1:] &= (d[:, 1:] == d[:, :-1]).all(axis=0)
    new_piece = np.concatenate([[True], ~extends])
    new_piece[::B] = True
    start = np.flatnonzero(new_piece)

    length = np.diff(np.append(start, T))
    x0 = np.take(iv, start, axis=1).astype(np.int64)
    # An end equal to T fully covers the short last kv-block, as nB * B would: store it so, and
    # block arithmetic needs no special case. (A slope-1 end reaches T only on its piece's last
    # row, after a row that does not cover the last block, which therefore cannot be FULL.)
    x0[1::2][x0[1::2] == T] = nB * B
    slope = np.zeros_like(x0)
    multi = length > 1
    slope[:, multi] = np.take(d, start[multi], axis=1)
    block_ptr = np.searchsorted(start, np.arange(nB + 1, dtype=np.int64) * B)
    return _RowPieces(start, length, x0, slope, block_ptr)


def _block_steps(x0: np.ndarray, slope: np.ndarray, n: np.ndarray, B: int, round_up: bool):
    """Block index of ``x0 + slope * i`` (ceil or floor of x / B) at i = 0, and how many leading
    rows share it; across at most B rows with slope <= 1 the rest have the next index."""
    a = B - 1 if round_up else 0
    v = (x0 + a) // B
    same = np.where(slope == 0, n, np.minimum(n, (v + 1) * B - a - x0))
    return v, same


def _classify_intervals(p: _RowPieces, T: int, B: int, nB: int):
    """Tiles of an interval mask from its row pieces, in O(pieces log pieces + tiles).

    Per row, interval j touches the kv-blocks ``[t0, t1)`` and fully covers ``[f0, f1)``. Over a
    piece the touched ranges overlap from row to row (bounds move by at most one key), so their
    union is ``[t0 of the first row, t1 of the last)``; f0 and f1 take at most two consecutive
    values each. Events at those kv-blocks (+1/-1 for touch, +rows/-rows for full cover), summed
    in (q-block, kv-block) order, give how many pieces touch and how many rows fully cover each
    run of kv-blocks between consecutive events: FULL when every row of the q-block covers the
    run, PARTIAL when some piece touches it.
    """
    keys, touch, full = [], [], []
    piece_qb = p.start // B
    for j in range(2):
        (lo, hi), (s_lo, s_hi) = p.x0[2 * j : 2 * j + 2], p.slope[2 * j : 2 * j + 2]
        # An empty (0, 0) row can only be a piece's first row: interval j of a piece is empty
        # throughout iff it is empty on the last row. Empty ones add no events.
        hi_last = hi + s_hi * (p.length - 1)
        nonempty = hi_last > 0
        lo, hi, s_lo, s_hi, hi_last, n, qb = (
            x[nonempty] for x in (lo, hi, s_lo, s_hi, hi_last, p.length, piece_qb)
        )
        f0, f0_rows = _block_steps(lo, s_lo, n, B, round_up=True)
        f1, f1_rows = _block_steps(hi, s_hi, n, B, round_up=False)
        # A row with f1 <= f0 covers nothing, yet adds +1 at f0 and -1 at f1: that only lowers the
        # count of blocks the row does not cover, which cannot be FULL anyway.
        # Six events per piece: touch +1 at t0, -1 at t1; full cover +rows at f0 and f0 + 1 (the
        # rows past the step), -rows at f1 and f1 + 1. kv-block keys run 0..nB + 1.
        kb = np.concatenate([lo // B, (hi_last - 1) // B + 1, f0, f0 + 1, f1, f1 + 1])
        keys.append(np.tile(qb, 6) * (nB + 2) + kb)
        touch.append(np.repeat(np.array([1, -1, 0, 0, 0, 0]), n.size))
        no_cover = np.zeros(2 * n.size, dtype=np.int64)
        full.append(np.concatenate([no_cover, f0_rows, n - f0_rows, -f1_rows, f1_rows - n]))
    # Each event kind is already in q-block order, runs that the stable sort (timsort) exploits.
    key, touch, full = np.concatenate(keys), np.concatenate(touch), np.concatenate(full)
    order = np.argsort(key, kind="stable")
    key, touch, full = key[order], touch[order], full[order]
    first = np.flatnonzero(np.diff(key, prepend=-1))
    touch = np.cumsum(np.add.reduceat(touch, first)) if first.size else touch
    full = np.cumsum(np.add.reduceat(full, first)) if first.size else full
    u_qb, u_kb = np.divmod(key[first], nB + 2)

    # Run i spans [u_kb[i], u_kb[i+1]) of q-block u_qb[i]; the last event of a q-block closes it.
    same_block = np.append(u_qb[1:] == u_qb[:-1], False)
    run_end = np.append(u_kb[1:], 0)
    rows_in_block = np.minimum(T - u_qb * B, B)
    state = np.where(full == rows_in_block, FULL, np.where(touch > 0, PARTIAL, EMPTY))
    keep = same_block & (state != EMPTY) & (run_end > u_kb)
    return u_qb[keep], u_kb[keep], (run_end - u_kb)[keep], state[keep]


def count_tiles(spec, block_size: int) -> int:
    """Non-empty tiles of ``spec`` at ``block_size``, without listing them: for an interval mask the
    runs of ``_classify_intervals`` summed, O(T + pieces), so a caller can weigh block sizes whose
    tile lists would not fit in memory; a ``mask_mod`` mask is classified (its BlockMask)."""
    B = int(block_size)
    iv = spec.row_intervals()
    if iv is None:
        return spec.block_mask(B).num_tiles
    T = spec.total_len
    nB = -(-T // B)
    _qb, _k0, r_len, _state = _classify_intervals(_row_pieces(iv.numpy(), T, B, nB), T, B, nB)
    return int(r_len.sum())


def _expand_runs(r_qb: np.ndarray, r_k0: np.ndarray, r_len: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Runs of consecutive kv-blocks -> (q-block, kv-block) int32 pairs; kv = run start + offset."""
    r_len = r_len.astype(np.int64)
    offsets = np.arange(int(r_len.sum()), dtype=np.int64) - np.repeat(np.cumsum(r_len) - r_len, r_len)
    tk = np.repeat(r_k0.astype(np.int64), r_len) + offsets
    return np.repeat(r_qb.astype(np.int32), r_len), tk.astype(np.int32)


def _prefix_clip(m: np.ndarray, ks: np.ndarray, ke: np.ndarray) -> np.ndarray:
    """``sum(clip(x, ks, ke) - ks for 0 <= x < m)``: keys of ``[ks, ke)`` below x, summed over x."""
    u = np.clip(m, ks, ke) - ks
    return ((u * (u - 1)) >> 1) + np.maximum(m - ke, 0) * (ke - ks)


def _sum_clip(x0: np.ndarray, slope: np.ndarray, n: np.ndarray, ks: np.ndarray, ke: np.ndarray) -> np.ndarray:
    """``sum(clip(x0 + slope * i, ks, ke) - ks for 0 <= i < n)`` for slopes 0 and 1."""
    constant = n * (np.clip(x0, ks, ke) - ks)
    return np.where(slope == 1, _prefix_clip(x0 + n, ks, ke) - _prefix_clip(x0, ks, ke), constant)


def _partial_counts(p: _RowPieces, pq: np.ndarray, pk: np.ndarray, T: int, B: int) -> np.ndarray:
    """Unmasked pairs of each partial tile, summed in closed form over the pieces of its q-block.

    A row's keys in ``[ks, ke)`` are ``C(hi1) - C(lo1) + C(hi2) - C(lo2)`` with
    ``C(x) = clip(x, ks, ke) - ks`` (canonical rows have lo <= hi), and along a piece each bound
    is an arithmetic progression of step 0 or 1, whose clipped sum has a closed form.
    """
    counts = np.zeros(pq.size, dtype=np.int64)
    # Single-interval masks (documents, causal, windows) have hi2 = 0 everywhere: skip lo2, hi2.
    bounds = range(4) if p.x0[3].any() or p.slope[3].any() else range(2)
    chunk = max(1, _CHUNK_ELEMS // (4 * B))  # a q-block has at most B pieces
    for c0 in range(0, pq.size, chunk):
        q, k = pq[c0 : c0 + chunk].astype(np.int64), pk[c0 : c0 + chunk].astype(np.int64)
        first, n_pieces = p.block_ptr[q], p.block_ptr[q + 1] - p.block_ptr[q]
        # One entry per (tile, piece of the tile's q-block), tile-major.
        tile_start = np.cumsum(n_pieces) - n_pieces
        tile = np.repeat(np.arange(q.size), n_pieces)
        piece = first[tile] + np.arange(tile.size) - tile_start[tile]
        ks = k[tile] * B
        ke = np.minimum(ks + B, T)
        n = p.length[piece]
        keys = np.zeros(piece.size, dtype=np.int64)
        for c in bounds:  # lo1, hi1, lo2, hi2: ends add, starts subtract
            sign = 1 if c % 2 else -1
            keys += sign * _sum_clip(p.x0[c][piece], p.slope[c][piece], n, ks, ke)
        counts[c0 : c0 + chunk] = np.add.reduceat(keys, tile_start)
    return counts


def _classify_mask_mod(spec, T: int, B: int, nB: int):
    """Tiles of an arbitrary mask by chunked evaluation; keeps each partial tile's bitmask."""
    Tp = nB * B
    k = torch.arange(T, dtype=torch.int64).view(1, T)
    blocks_per_chunk = max(1, _CHUNK_ELEMS // (B * Tp))
    lens = np.minimum(T - np.arange(nB, dtype=np.int64) * B, B)
    out_q, out_k, out_s, out_bits = [], [], [], []
    for c0 in range(0, nB, blocks_per_chunk):
        c1 = min(nB, c0 + blocks_per_chunk)
        q = torch.arange(c0 * B, min(T, c1 * B), dtype=torch.int64).view(-1, 1)
        m = torch.zeros((c1 - c0) * B, Tp, dtype=torch.bool)
        m[: q.shape[0], :T] = spec.mask_mod(q, k).expand(q.shape[0], T)
        tiles = m.view(c1 - c0, B, nB, B).permute(0, 2, 1, 3)  # [cq, nB, B, B]
        count = tiles.sum(dim=(2, 3)).numpy()
        area = lens[c0:c1, None] * lens[None, :]
        state = np.where(count == area, FULL, np.where(count > 0, PARTIAL, EMPTY)).astype(np.int8)
        lq, lk = np.nonzero(state)
        s = state[lq, lk]
        out_q.append(lq + c0)
        out_k.append(lk)
        out_s.append(s)
        part = s == PARTIAL
        out_bits.append(tiles[torch.from_numpy(lq[part]), torch.from_numpy(lk[part])].clone())
    bits = torch.cat(out_bits) if out_bits else torch.zeros(0, B, B, dtype=torch.bool)
    tq, tk = np.concatenate(out_q), np.concatenate(out_k)
    return tq, tk, np.ones_like(tk), np.concatenate(out_s), bits
