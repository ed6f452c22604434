"""BlockMask: every (q-block, kv-block) tile of a mask classified EMPTY, PARTIAL or FULL.

The compressed lists follow FlexAttention's BlockMask: per q-block the FULL and PARTIAL kv-blocks
(forward, dQ), and the transposed per-kv-block lists (dK/dV), here in CSR form. Structured masks
are classified analytically from their per-row key intervals with difference arrays over the
block grid, so the cost is O(T + nB^2) and never O(T^2); masks given only as a ``mask_mod`` are
evaluated in row chunks and keep a bitmask for each partial tile.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional

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
            runs = _classify_intervals(iv.numpy().astype(np.int64), T, B, nB)
            bits = None
        else:
            *runs, bits = _classify_mask_mod(spec, T, B, nB)
        return cls._from_runs(T, B, nB, *runs, iv, bits)

    @classmethod
    def _from_runs(cls, T, B, nB, r_qb, r_k0, r_len, r_state, iv, bits) -> "BlockMask":
        """Build from runs of same-state kv-blocks (sorted by q-block, then start)."""
        full = r_state == FULL
        fq, fk = _expand_runs(r_qb[full], r_k0[full], r_len[full])
        pq, pk = _expand_runs(r_qb[~full], r_k0[~full], r_len[~full])
        full_kv_ptr, full_kv_idx = _csr(fq, fk, nB)
        part_kv_ptr, part_kv_idx = _csr(pq, pk, nB)
        if iv is not None:
            part_count = _partial_counts(iv.numpy().astype(np.int64), pq, pk, T, B)
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
        pairs = self.block_len(self.tile_q) * self.block_len(self.tile_kv)
        # Partial tiles appear in tiles() in the same relative order as in the q-major partial list.
        pairs[~self.tile_full] = self.part_count
        return pairs

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


def _classify_intervals(iv: np.ndarray, T: int, B: int, nB: int):
    """Tiles of an interval mask, in O(T + segments log segments + tiles).

    Per row, interval j touches the contiguous kv-block range ``[t0, t1)`` and fully covers
    ``[f0, f1)``. Consecutive rows of a q-block with identical ranges collapse into one weighted
    segment (structured masks have a handful per block). Each segment adds +w at a range start and
    -w at its end; sorted by (q-block, kv-block) a single running sum gives, between consecutive
    event positions, how many rows touch / fully cover the kv-blocks of that run, hence the run's
    state: FULL when every row of the q-block covers it, PARTIAL when some row touches it.
    """
    q = np.arange(T, dtype=np.int64)
    qb = q // B
    ranges = []
    for j in range(2):
        lo, hi = iv[2 * j], iv[2 * j + 1]
        nonempty = hi > lo
        t0 = lo // B
        t1 = np.where(nonempty, (hi - 1) // B + 1, t0)
        f0 = -(-lo // B)
        f1 = np.where(hi >= T, nB, hi // B)
        f1 = np.where(nonempty, np.maximum(f1, f0), f0)
        ranges += [t0, t1, f0, f1]
    vals = np.stack(ranges + [qb])  # [9, T]
    seg_start = np.concatenate([[0], np.flatnonzero((vals[:, 1:] != vals[:, :-1]).any(axis=0)) + 1])
    weight = np.diff(np.concatenate([seg_start, [T]]))
    seg = vals[:, seg_start]
    seg_qb = seg[8]

    # Events: (q-block, kv-block, d_touch, d_full) for both intervals' touch and full ranges.
    ev_kb, ev_touch, ev_full = [], [], []
    for j in range(2):
        t0, t1, f0, f1 = seg[4 * j : 4 * j + 4]
        ev_kb += [t0, t1, f0, f1]
        zero = np.zeros_like(weight)
        ev_touch += [weight, -weight, zero, zero]
        ev_full += [zero, zero, weight, -weight]
    ev_qb = np.tile(seg_qb, 8)
    key = ev_qb * (nB + 1) + np.concatenate(ev_kb)
    uniq, inverse = np.unique(key, return_inverse=True)
    touch = np.cumsum(np.bincount(inverse, weights=np.concatenate(ev_touch), minlength=uniq.size))
    full = np.cumsum(np.bincount(inverse, weights=np.concatenate(ev_full), minlength=uniq.size))
    u_qb, u_kb = uniq // (nB + 1), uniq % (nB + 1)

    # Run i spans [u_kb[i], u_kb[i+1]) of q-block u_qb[i]; the last event of a q-block closes it.
    same_block = np.concatenate([u_qb[1:] == u_qb[:-1], [False]])
    run_end = np.concatenate([u_kb[1:], [0]])
    rows_in_block = np.bincount(qb, minlength=nB)
    state = np.where(np.rint(full) == rows_in_block[u_qb], FULL, np.where(np.rint(touch) > 0, PARTIAL, EMPTY))
    keep = same_block & (state != EMPTY) & (run_end > u_kb)
    return u_qb[keep], u_kb[keep], (run_end - u_kb)[keep], state[keep]


def _expand_runs(r_qb: np.ndarray, r_k0: np.ndarray, r_len: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Runs of consecutive kv-blocks -> (q-block, kv-block) int32 pairs; kv = run start + offset."""
    r_len = r_len.astype(np.int64)
    offsets = np.arange(int(r_len.sum()), dtype=np.int64) - np.repeat(np.cumsum(r_len) - r_len, r_len)
    tk = np.repeat(r_k0.astype(np.int64), r_len) + offsets
    return np.repeat(r_qb.astype(np.int32), r_len), tk.astype(np.int32)


def _partial_counts(iv: np.ndarray, pq: np.ndarray, pk: np.ndarray, T: int, B: int) -> np.ndarray:
    """Unmasked pairs of each partial tile: row-wise interval overlap with the kv-block's span."""
    counts = np.zeros(pq.size, dtype=np.int64)
    chunk = max(1, _CHUNK_ELEMS // B)
    offs = np.arange(B, dtype=np.int64)
    for c0 in range(0, pq.size, chunk):
        q_rows = pq[c0 : c0 + chunk, None].astype(np.int64) * B + offs  # [n, B]
        valid = q_rows < T
        q_rows = np.minimum(q_rows, T - 1)
        ks = pk[c0 : c0 + chunk, None].astype(np.int64) * B
        ke = np.minimum(ks + B, T)
        total = np.zeros(q_rows.shape, dtype=np.int64)
        for j in range(2):
            lo, hi = iv[2 * j][q_rows], iv[2 * j + 1][q_rows]
            total += np.clip(np.minimum(hi, ke) - np.maximum(lo, ks), 0, None)
        counts[c0 : c0 + chunk] = np.where(valid, total, 0).sum(1)
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
