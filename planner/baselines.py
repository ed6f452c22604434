"""Baseline strategies in the Plan framework: "ring", "zigzag" and "allgather".

Notation (docs/design.md): nB blocks, P ranks, tile (qb, kb), ``home[b]`` the rank owning block b.

All three compute every tile on the home of its q-block (each rank produces its own output rows,
no OUT partials). Only the placement of blocks and the stage order differ:

* ring: P contiguous runs of blocks (sizes differ by <= 1 block); rank r receives the KV of the
  rank at ring distance d = (r - home[kb]) mod P in stage d, one peer per stage.
* zigzag: 2P contiguous runs; run i and run 2P-1-i live on rank i (balances a single causal
  sequence); same staged ring execution.
* allgather (Llama-3 style): zigzag placement, every remote KV block arrives in one stage.

In this framework a rank receives only the KV blocks its tiles read (receive-once rule), so these
baselines move fewer bytes than literal ring rotation, which forwards every shard P-1 times
(``ring_rotation_bytes`` gives that number for comparison).
"""

from __future__ import annotations

import numpy as np

from .placement import Placement, balanced_bounds, compact_stages, runs_to_home
from .tiles import TileSet


def contiguous_home(num_blocks: int, world_size: int) -> np.ndarray:
    """P contiguous runs of blocks, sizes within one block."""
    return runs_to_home(balanced_bounds(num_blocks, world_size), np.arange(world_size), num_blocks)


def zigzag_home(num_blocks: int, world_size: int) -> np.ndarray:
    """2P contiguous runs, run i and run 2P-1-i on rank i."""
    owners = np.r_[np.arange(world_size), np.arange(world_size)[::-1]]
    return runs_to_home(balanced_bounds(num_blocks, 2 * world_size), owners, num_blocks)


def ring(tiles: TileSet, world_size: int, **_) -> Placement:
    home = contiguous_home(tiles.num_blocks, world_size)
    rank = home[tiles.q]
    stage, _n = compact_stages((rank - home[tiles.kv]) % world_size)
    return Placement(home, rank, stage)


def zigzag(tiles: TileSet, world_size: int, **_) -> Placement:
    home = zigzag_home(tiles.num_blocks, world_size)
    rank = home[tiles.q]
    stage, _n = compact_stages((rank - home[tiles.kv]) % world_size)
    return Placement(home, rank, stage)


def allgather(tiles: TileSet, world_size: int, **_) -> Placement:
    home = zigzag_home(tiles.num_blocks, world_size)
    rank = home[tiles.q]
    stage = (home[tiles.kv] != rank).astype(np.int64)
    return Placement(home, rank, stage)


def ring_rotation_bytes(total_len: int, world_size: int, *, num_kv_heads: int, head_dim: int, element_size: int) -> int:
    """Forward bytes literal ring attention moves: every rank forwards a KV shard P-1 times."""
    kv_per_token = 2 * num_kv_heads * head_dim * element_size
    return int((world_size - 1) * total_len * kv_per_token)
