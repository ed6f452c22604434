"""TileSet: the planner's numpy view of a BlockMask's non-empty tiles.

Notation (docs/design.md): T tokens, B block size, nB = ceil(T / B) blocks, a tile is a
(q-block, kv-block) pair. Every planner strategy works on this flat, (q, kv)-sorted list.

Compute cost of a tile: ``4 * D * Hq * pairs`` forward FLOPs, where ``pairs`` is its exact count of
unmasked (q, k) pairs (a FULL tile has ``len(q-block) * len(kv-block)``). Partial tiles are
therefore weighted by their unmasked count, not by their area.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch

from .tile_loops import boundary_crossings, key_sums, merge_tiles

# BlockMask -> TileSet, so planning the same mask for several world sizes / strategies converts once.
_from_block_mask_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_coarsen_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # TileSet -> {factor: coarsen()}


@dataclass(frozen=True, eq=False)
class TileSet:
    """Non-empty tiles of one mask at one block size, as int64 numpy arrays sorted by (q, kv)."""

    total_len: int
    block_size: int
    num_blocks: int
    q: np.ndarray  # int64 [n] q-block of each tile
    kv: np.ndarray  # int64 [n] kv-block of each tile
    full: np.ndarray  # bool [n]
    pairs: np.ndarray  # int64 [n] unmasked (q, k) pairs

    @classmethod
    def from_block_mask(cls, bm) -> "TileSet":
        """Read ``bm.tiles()`` / ``bm.tile_pairs()`` of a blockattn BlockMask (cached per BlockMask)."""
        try:
            cached = _from_block_mask_cache.get(bm)
        except TypeError:  # not weak-referenceable: no caching
            cached = None
        if cached is not None:
            return cached
        tq, tk, tf = bm.tiles()
        result = cls(
            total_len=int(bm.total_len),
            block_size=int(bm.block_size),
            num_blocks=int(bm.num_blocks),
            q=tq.numpy().astype(np.int64),
            kv=tk.numpy().astype(np.int64),
            full=tf.numpy().astype(bool, copy=False),  # (the mask's own where bool already: only read)
            pairs=np.asarray(bm.tile_pairs().numpy(), dtype=np.int64),  # (a new array: no copy)
        )
        object.__setattr__(result, "_mask_tensors", (tq, tk, tf))  # (frozen dataclass: a private memo)
        try:
            _from_block_mask_cache[bm] = result
        except TypeError:
            pass
        return result

    def index_tensors(self) -> tuple:
        """(int32 q, int32 kv, bool full) tensors of the tiles, as a Plan holds them: the BlockMask's own
        where this TileSet was read from one (shared, not copied: the Plan, like the BlockMask, only
        reads them), else converted from the arrays."""
        tensors = self.__dict__.get("_mask_tensors")
        if tensors is not None and all(t.dtype == d and t.is_contiguous() for t, d in
                                       zip(tensors, (torch.int32, torch.int32, torch.bool))):
            return tensors
        return (torch.from_numpy(self.q.astype(np.int32)), torch.from_numpy(self.kv.astype(np.int32)),
                torch.from_numpy(self.full.copy()))

    @property
    def num_tiles(self) -> int:
        return int(self.q.size)

    def block_lengths(self) -> np.ndarray:
        """int64 [nB] valid tokens of every block (the last one may be short)."""
        starts = np.arange(self.num_blocks, dtype=np.int64) * self.block_size
        return np.minimum(self.block_size, self.total_len - starts)

    def row_pairs(self) -> np.ndarray:
        """float64 [nB], read-only: each q-block's unmasked (q, k) pairs summed over its tiles (whole
        numbers, so exact). Computed once per TileSet: the starts (``hot_rows``, ``deal_heavy_pieces``)
        and dcp's test of long segments all weigh the rows by it."""
        cached = self.__dict__.get("_row_pairs")
        if cached is None:
            cached = key_sums(self.q, self.pairs.astype(np.float64), self.num_blocks)
            cached.setflags(write=False)
            object.__setattr__(self, "_row_pairs", cached)  # (frozen dataclass: a private memo)
        return cached

    def crossing_counts(self) -> np.ndarray:
        """int64 [nB + 1], read-only: for boundary j (between blocks j-1 and j), the tiles whose q and kv
        lie on opposite sides; cutting the block sequence there forces that many tiles to move data.
        Computed once per TileSet (dcp's candidates and its segment test all read it)."""
        cached = self.__dict__.get("_crossing")
        if cached is None:
            cached = boundary_crossings(self.q, self.kv, self.num_blocks)  # (compiled: planner/tile_loops.py)
            cached.setflags(write=False)
            object.__setattr__(self, "_crossing", cached)  # (frozen dataclass: a private memo)
        return cached


def forget_tile_sets() -> None:
    """Forget the TileSets converted from BlockMasks and their merged copies (with every memo they
    carry), so the next plan of the same mask starts from scratch, as a new batch would."""
    _from_block_mask_cache.clear()
    _coarsen_cache.clear()


def coarsen(tiles: TileSet, factor: int) -> tuple[TileSet, np.ndarray]:
    """Merge ``factor`` x ``factor`` blocks into one (block size ``factor * B``) for faster planning.

    Returns the coarse TileSet (pairs summed; ``full`` only when every merged tile is full and all
    ``factor**2`` exist) and, for every fine tile, the index of its coarse tile. Cached per TileSet
    and factor (the dcp candidates and its final baseline check merge the same batch).
    """
    per_tiles = _coarsen_cache.setdefault(tiles, {})
    if factor not in per_tiles:
        per_tiles[factor] = _coarsen(tiles, factor)
    return per_tiles[factor]


def _coarsen(tiles: TileSet, factor: int) -> tuple[TileSet, np.ndarray]:
    shift = factor.bit_length() - 1 if factor & (factor - 1) == 0 else -1  # (a power of two: shifts)
    q, kv, pairs, n_full, of_fine, row_pairs = merge_tiles(tiles.q, tiles.kv, tiles.full, tiles.pairs, factor, shift,
                                                           tiles.num_blocks)
    if "_row_pairs" not in tiles.__dict__:  # (``row_pairs``' memo, summed by the same pass)
        row_pairs.setflags(write=False)
        object.__setattr__(tiles, "_row_pairs", row_pairs)
    coarse = TileSet(total_len=tiles.total_len, block_size=tiles.block_size * factor,
                     num_blocks=-(-tiles.num_blocks // factor), q=q, kv=kv, full=n_full == factor * factor, pairs=pairs)
    return coarse, of_fine
