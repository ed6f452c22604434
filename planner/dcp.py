""""dcp" strategy: dynamic context parallelism with a fast, vectorized placement (no hypergraph library).

Notation (docs/design.md): T tokens, nB blocks of B tokens, P ranks, tile (qb, kb) with forward FLOPs
``4 * D * Hq * pairs``; ``home[b]`` owns block b; M = mean per-rank FLOPs.

Three steps, each near-linear in the number of tiles:

1. Data placement (memory): P contiguous runs of blocks with equal token counts (within one block),
   each cut nudged by at most ``CUT_SLACK`` of a run to the boundary crossed by the fewest tiles, so
   documents stay whole where a cheap cut exists and long documents are split into neighbouring
   ranks (neighbours share a node). Alternatively (``init="fcp"``) the FCP group placement.
2. Tile placement (compute): every tile starts on its q-block's home (reads remote KV only; no OUT
   partial). Ranks above ``(1 + BALANCE_SLACK) * M`` then shed work:
   a. to the kv-block's home (the other zero-extra-input choice: only the Q block moves, plus one OUT
      partial back), whole q-rows first, intra-node pairs first, largest rows first - a row moved to
      a rank costs one Q and one OUT however many of its tiles move (receive-once rule);
   b. what remains goes to the least loaded ranks (same node first) as rectangles of a rows x b
      kv-blocks with ``b = sqrt(n * (Q + OUT) / KV)`` for n tiles, which minimizes
      ``a * (Q + OUT) + b * KV`` for that amount of work.
3. Stages (planner/stages.py): stage 0 = tiles whose inputs are home; remote inputs ordered by the
   compute they unlock per transfer second and cut into <= ``max_stages`` stages, each sized to hide
   behind the previous stage's compute.
"""

from __future__ import annotations

import numpy as np

from .cost_model import CostModel
from .placement import Placement, balanced_bounds, compact_stages, runs_to_home
from .balance import Balancer
from .schedule import derive_schedule, payload_bytes
from .stages import assign_stages, spread_local_tiles
from .tiles import TileSet

CUT_SLACK = 0.03  # a run boundary may move by up to 3% of a run to find a cheaper cut


def contiguous_cut_home(tiles: TileSet, world_size: int) -> np.ndarray:
    """Home of each block: P equal-token contiguous runs, each cut moved (within CUT_SLACK) to the
    boundary with the fewest crossing tiles (ties: the nearest to the balanced cut)."""
    nB = tiles.num_blocks
    bounds = balanced_bounds(nB, world_size)
    slack = int(CUT_SLACK * nB / world_size)
    if slack > 0 and tiles.num_tiles:
        crossing = tiles.crossing_counts()
        inner = bounds[1:-1]
        offsets = np.arange(-slack, slack + 1)
        cand = np.clip(inner[:, None] + offsets[None, :], 0, nB)
        # cost: crossing tiles first, distance from the balanced cut second
        score = crossing[cand] * (2 * slack + 1) + np.abs(offsets)[None, :]
        best = cand[np.arange(inner.size), np.argmin(score, axis=1)]
        bounds = np.r_[0, np.maximum.accumulate(best), nB]
    return runs_to_home(bounds, np.arange(world_size), nB)


def dcp(tiles: TileSet, world_size: int, *, cost_model: CostModel, num_q_heads: int, num_kv_heads: int,
        head_dim: int, element_size: int, max_stages: int, init: str = "contiguous", **_) -> Placement:
    """DCP placement (see module docstring)."""
    if init == "fcp":
        from .fcp import fcp_home

        home = fcp_home(tiles, world_size, cost_model=cost_model, num_q_heads=num_q_heads, head_dim=head_dim)
    else:
        home = contiguous_cut_home(tiles, world_size)
    flops = cost_model.tile_flops(tiles.pairs, num_q_heads=num_q_heads, head_dim=head_dim)
    rank = Balancer(tiles, home, flops / cost_model.fwd_rate, world_size, cost_model.topology,
                    num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                    element_size=element_size).run()
    stage = assign_stages(tiles.q, tiles.kv, flops, rank, home, block_size=tiles.block_size,
                          total_len=tiles.total_len, world_size=world_size, cost_model=cost_model,
                          max_stages=max_stages, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                          head_dim=head_dim, element_size=element_size)
    stage, num_stages = compact_stages(stage)
    local = (home[tiles.q] == rank) & (home[tiles.kv] == rank)
    sched = None
    if num_stages > 1:
        sched = derive_schedule(home, tiles.q, tiles.kv, rank, stage, num_blocks=tiles.num_blocks,
                                num_stages=num_stages, world_size=world_size)
        table = sched.fwd.numpy().astype(np.int64)
        block_len = np.minimum(tiles.block_size, tiles.total_len - table[:, 4] * tiles.block_size)
        nbytes = payload_bytes(table[:, 3], block_len, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                               head_dim=head_dim, element_size=element_size)
        comm = cost_model.stage_comm_time(table, nbytes, world_size, num_stages)
        stage = spread_local_tiles(stage, flops, rank, local, comm, world_size=world_size,
                                   num_stages=num_stages, fwd_rate=cost_model.fwd_rate)
    # moving local tiles between stages changes no transfer, so the schedule stays valid
    return Placement(block_home=home, tile_rank=rank, tile_stage=stage, schedule=sched)
