"""Stage assignment: order each rank's remote inputs so that stage s+1's transfers hide behind stage s.

Notation (docs/design.md): P ranks, tiles (qb, kb) already placed on ``tile_rank``; ``home[b]`` owns
block b. An *item* is one remote input a rank must receive (a Q block or a KV block), exactly one
row of the forward CommSchedule.

Per rank: stage 0 computes the tiles whose inputs are all home. The items are sorted by how much
compute they unlock per second of transfer (a tile needing one remote item credits it fully, a tile
needing two credits each half), then cut into at most ``max_stages`` consecutive groups: group 1
is as large as stage 0's compute time can hide, group s+1 as large as the compute completed by
group s can hide (at least one item per stage); the last group takes the rest. A tile runs in the
stage of its last-arriving item.

Tiles that move no transfer (purely local tiles, and tiles of a rank's own rows whose KV arrives for
an earlier tile anyway) are then spread into the stages whose exchanges would be exposed
(``spread_local_tiles``, ``spread_own_rows``; compiled, with the backward's, in planner/spread_loops.py). The
backward's staging is planner/stages_bwd.py; a placement finished and scored, planner/finish.py.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np

from . import group_loops
from .cost_model import CostModel
from .placement import first_occurrence, weighted_bincount
from .schedule import KIND_KV, KIND_Q, payload_bytes
from .stage_cuts import max_over_items, remote_items, stage_items
from .spread_loops import local_tiles_spread, own_rows_spread
from .tile_loops import group_by_rank, grouped_running_sums, stage_loads


def assign_stages(q: np.ndarray, kv: np.ndarray, flops: np.ndarray, rank: np.ndarray, home: np.ndarray, *,
                  block_size: int, total_len: int, world_size: int, cost_model: CostModel, max_stages: int,
                  num_q_heads: int, num_kv_heads: int, head_dim: int, element_size: int, grad_element_size: int = 4,
                  budget_scale: float | tuple = 1.0, both_ends: bool = False) -> np.ndarray:
    """int64 [ntiles] stage of every tile (see module docstring). ``budget_scale`` > 1 lets each stage's
    transfers exceed the compute hiding them by that factor (items front-loaded into fewer, earlier
    stages), which leaves the last stages lighter for the transfers this per-receiver rule cannot
    see: other ranks' requests and the partials returning to this rank; with several scales each rank
    takes the one giving the least overlapped time by its own estimate. ``both_ends``: stage the items
    of all ranks together, each stage's items fitting the budgets of receiver *and* sender
    (``_stage_items_both_ends``), so a rank many others read from is not flooded in one exchange."""
    n = q.size
    stage = np.zeros(n, dtype=np.int64)
    nB = int(home.size)
    # Items: (rank, kind, block) keys, one per distinct remote input (compiled: planner/stage_cuts.py)
    tile_idx, item_of, keys, num_q_entries, needs = remote_items(*(np.asarray(x, dtype=np.int64)
                                                                   for x in (q, kv, rank, home)))
    if tile_idx.size == 0:
        return stage
    remote = needs > 0
    topo = cost_model.topology
    compute_time = flops / cost_model.fwd_rate
    item_rank = keys // (2 * nB)
    item_kind = np.where((keys // nB) % 2 == 1, KIND_KV, KIND_Q)
    item_block = keys % nB
    block_len = np.minimum(block_size, total_len - item_block * block_size)
    nbytes = payload_bytes(item_kind, block_len, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                           head_dim=head_dim, element_size=element_size,
                           grad_element_size=grad_element_size).astype(np.float64)
    inter = topo.node_of(home[item_block]) != topo.node_of(item_rank)
    item_time = nbytes / np.where(inter, topo.inter_bw, topo.intra_bw)

    if not both_ends:
        # each rank's items cut on their own (compiled: planner/stage_cuts.py); both_ends, all ranks' together
        scales = np.atleast_1d(np.asarray(budget_scale, dtype=np.float64))
        return stage_items(n, tile_idx, item_of, num_q_entries, needs, item_rank, item_time,
                           np.ascontiguousarray(compute_time, dtype=np.float64), rank, remote, world_size,
                           max_stages, scales)
    if np.ndim(budget_scale):
        raise ValueError(f"both_ends stages all ranks with one budget_scale, got {budget_scale!r}")

    # Credit each item with the compute it unlocks (half when the tile needs two remote items).
    credit = weighted_bincount(item_of, compute_time[tile_idx] / needs[tile_idx], keys.size)
    order = np.lexsort((item_block, item_kind, -credit / item_time, item_rank))
    position = np.empty(keys.size, dtype=np.int64)
    position[order] = np.arange(keys.size)
    local_compute = weighted_bincount(rank[~remote], compute_time[~remote], world_size)
    item_stage = _stage_items_both_ends(order, item_rank, home[item_block], inter, item_time, item_of, tile_idx,
                                        num_q_entries, compute_time, local_compute, tile_rank=rank,
                                        world_size=world_size, max_stages=max_stages, budget_scale=budget_scale)
    return max_over_items(n, tile_idx, item_stage[item_of], num_q_entries, 0)


def _stage_items_both_ends(order, receiver, sender, inter, item_time, item_of, tile_idx, num_q_entries, compute_time,
                           local_compute, *, tile_rank, world_size, max_stages, budget_scale) -> np.ndarray:
    """Stage of every item, stage by stage over all ranks: exchange s-1 (the inputs of stage s) overlaps
    stage s-1, so an item joins stage s while, in priority order (``order``), the transfer time on its
    link stays within stage s-1's compute at its receiver and at its sender; the others wait (the
    last stage takes all that is left). Each receiver gets at least its first waiting item, so every
    stage makes progress."""
    P, n = world_size, tile_rank.size  # (``tile_idx``: the Q items' entries first, ``num_q_entries`` of them)
    link = inter.astype(np.int64)
    item_stage = np.full(order.size, max_stages, dtype=np.int64)
    placed = np.full(order.size, np.iinfo(np.int64).max, dtype=np.int64)  # stage of the items placed so far
    pending = order
    budget = local_compute  # [P] compute of the previous stage
    for s in range(1, max_stages):
        if pending.size == 0:
            break
        t = item_time[pending]
        limit = budget * budget_scale
        fits = ((_grouped_cumsum(receiver[pending] * 2 + link[pending], t) <= limit[receiver[pending]])
                & (_grouped_cumsum(sender[pending] * 2 + link[pending], t) <= limit[sender[pending]]))
        fits |= first_occurrence(receiver[pending], np.empty(P, dtype=np.int64))
        item_stage[pending[fits]] = placed[pending[fits]] = s
        pending = pending[~fits]
        # the next budget: compute of the remote tiles whose last item arrives in this stage
        now = max_over_items(n, tile_idx, placed[item_of], num_q_entries, -1) == s
        budget = weighted_bincount(tile_rank[now], compute_time[now], P)
    return item_stage


def _grouped_cumsum(key: np.ndarray, value: np.ndarray) -> np.ndarray:
    """Per position, the sum of ``value`` over the positions up to it with the same key."""
    # already grouped (the spreads list local tiles rank by rank): no sort and no scatter back (a
    # stable sort of sorted keys is the identity, so the sums are the same)
    grouped = key.size < 2 or bool((key[1:] >= key[:-1]).all())
    by = None if grouped else np.argsort(key, kind="stable")
    k, v = (key, value) if grouped else (key[by], value[by])
    # (the running sum less the sum before each group's first: compiled, planner/tile_loops.py)
    sums = grouped_running_sums(np.ascontiguousarray(k, dtype=np.int64), np.ascontiguousarray(v, dtype=np.float64))
    if grouped:
        return sums
    out = np.empty_like(sums)
    out[by] = sums
    return out


def spread_local_tiles(stage: np.ndarray, flops: np.ndarray, rank: np.ndarray, is_local: np.ndarray,
                       comm_time: np.ndarray, *, world_size: int, num_stages: int, fwd_rate: float,
                       extra_stage: bool = False) -> np.ndarray:
    """Move purely local tiles (no transfer depends on them) from stage 0 into later stages where a
    rank's compute would not cover that stage's exchange (e.g. OUT partials arriving at a donor).

    ``comm_time``: [P, S + 1] transfer time per rank and exchange for the current placement. Each rank
    keeps in stage 0 at least what hides exchange 0; the rest of its local work is poured into the
    uncovered gaps of stages 1..S-1, latest gap first. With ``extra_stage`` the last exchange (the
    partials of stage S-1, otherwise after all compute) counts as the gap of a new stage S, which the
    caller then adds (it carries no input, so no transfer changes).
    """
    S = num_stages
    if S < 2:
        return stage
    rank, stage = (np.ascontiguousarray(x, dtype=np.int64) for x in (rank, stage))
    seconds, comm_time = (np.ascontiguousarray(x, dtype=np.float64) for x in (flops / fwd_rate, comm_time))
    return local_tiles_spread(stage, seconds, rank, np.ascontiguousarray(is_local, dtype=bool), comm_time,
                              int(world_size), S, S if extra_stage else S - 1)  # (compiled: planner/spread_loops.py)


def own_row_movable(q: np.ndarray, kv: np.ndarray, stage: np.ndarray, rank: np.ndarray, home: np.ndarray) -> np.ndarray:
    """bool [ntiles]: tiles that may run in any later stage without changing a transfer - of a q-block
    their rank owns (no Q in, no OUT partial out) and reading a KV block that is home or that an
    earlier-or-equal-staged tile of the same rank, which stays, also reads (the block still arrives
    for that tile: its first need does not move). Compiled (planner/group_loops.py)."""
    q, kv, stage, rank, home = (np.asarray(x, dtype=np.int64) for x in (q, kv, stage, rank, home))
    return group_loops.own_row_movable(q, kv, stage, rank, home)


def spread_own_rows(stage: np.ndarray, seconds: np.ndarray, rank: np.ndarray, movable_of,
                    comm_time: np.ndarray, *, world_size: int, num_stages: int,
                    extra_stage: bool = False) -> np.ndarray:
    """Move movable tiles (``own_row_movable``) into later stages whose exchanges would otherwise be
    exposed (OUT partials that helpers computed late arriving at a home that has finished): stage by
    stage from the latest, each stage's surplus over its own exchange fills the gaps after it. No
    transfer changes. ``seconds``: per-tile forward compute; ``comm_time`` [P, S + 1]. With
    ``extra_stage`` the last exchange counts as the gap of a new stage S (as ``spread_local_tiles``).
    ``movable_of()`` gives their bool mask; it is called only where some exchange is exposed.

    Before it only purely local tiles were spread, and a home whose local tiles all hide exchange 0
    sat idle while its partials arrived (16 ranks / 8 per node, a Wikipedia causal batch: forward
    656 -> 524 us against a 497 us bound). From each rank's last stage with compute only, over the 95
    eval cases per dtype: fp32 partials 37 faster, 1 slower (0.7%), 16 / 8 geomean 1.062 -> 1.047x the
    bound; bf16 55 / 1 (0.2%); 20 more Wikipedia batches on 8 ranks 1.021 -> 1.018 (max 1.050 ->
    1.026). From every stage: fp32 a further 29 faster, 3 slower (<= 1.2%; 32 (32) 1.098 -> 1.086),
    bf16 32 / 2 (two long-tail plans 0.3% and 1.8% slower with 30-37% fewer bytes; 16 / 4 1.076 -> 1.061)."""
    S, P = num_stages, world_size
    if S < 2:
        return stage
    width = S + 1 if extra_stage else S
    rank, stage = (np.ascontiguousarray(x, dtype=np.int64) for x in (rank, stage))
    seconds, comm_time = (np.ascontiguousarray(x, dtype=np.float64) for x in (seconds, comm_time))
    per = stage_loads(rank, stage, seconds, P, width)
    # (the first pour needs an exposed gap after stage 1; without one nothing moves and the movable
    # tiles are not needed)
    if not (comm_time[:, 2:width] > per[:, 2:width]).any():
        return stage
    movable = np.ascontiguousarray(movable_of(), dtype=bool)
    return own_rows_spread(stage, seconds, rank, movable, comm_time, per, P, S, width)  # (planner/spread_loops.py)


class LocalWork:
    """Tiles that may move between stages (no transfer depends on them): ``tiles`` in the order they
    leave (within a rank), ``total`` [P] their seconds per rank. Grouped by rank (``grouped``: stably,
    so a rank keeps its tiles' order) with their seconds laid end to end per rank on first use only:
    most spreads find no exposed gap to fill, and on a one-node 128K / 8 plan that grouping was ~10% of
    the planning time for nothing (numpy; compiled since, planner/tile_loops.py)."""

    def __init__(self, tiles: np.ndarray, rank: np.ndarray, seconds: np.ndarray, world_size: int):
        self.tiles, self._rank_of, self._seconds, self._world_size = tiles, rank, seconds, world_size
        # (bincount adds each bin's weights in input order, the grouped order's per rank: the same sums)
        self.total = weighted_bincount(rank[tiles], seconds[tiles], world_size)

    @cached_property
    def grouped(self) -> tuple:
        """(int64 tile indices grouped by ascending rank, their ranks, float64 each one's end position in
        its rank's list in seconds)."""
        return group_by_rank(np.ascontiguousarray(self.tiles, dtype=np.int64), self._rank_of, self._seconds,
                             self._world_size)
