"""Compiled spreads of tiles that move no transfer into exposed transfer gaps (numba).

Notation (docs/design.md): P ranks, S stages, tiles on ``rank`` with per-tile ``seconds``; ``comm``
[P, S + 1] each rank's transfer seconds per exchange (exchange s overlaps stage s, exchange S follows
the last stage); ``per`` [P, width] each rank's compute per stage; a *gap* is the part of an exchange
that its stage's compute leaves exposed, ``max(0, comm - per)``.

Why: finishing a placement spreads such tiles three ways - the forward's tiles of a rank's own rows
and its purely local tiles (planner/stages.py ``spread_own_rows``, ``spread_local_tiles``), and the
backward's purely local tiles each time a backward staging is weighed (planner/stages_bwd.py
``backward_time``) - and in numpy each spread took ~15 calls on [P, S] tables around the compiled
sums and pour, most of its time call overhead. Here each is one call with the same floats: the same
compiled sums (``stage_loads``, ``key_sums``) and pour, the gaps as the same subtractions, row sums
as numpy's (planner/float_sums.py). On a long-tail 128K / 8 plan (merged 4x) the three took 0.78 ->
0.49 ms, the tiles' own-row mask and the sums included. tests/test_spread_loops.py keeps the numpy
forms and compares.
"""

from __future__ import annotations

import numpy as np

from .float_sums import numpy_sum
from .jit import compiled
from .tile_loops import group_by_rank, key_sums, pour, stage_loads


@compiled
def poured(stage, tiles, rank, seconds, gaps, movable, fill, world_size):
    """(stages, whether a tile moved): ``tiles`` (in the order they leave, within a rank) poured into
    ``gaps`` [P, F] of stages ``fill`` [F], up to ``movable`` [P] seconds a rank (planner/tile_loops.py
    ``pour``; ``stage`` itself where nothing is exposed, movable or poured)."""
    if tiles.size == 0 or gaps.shape[1] == 0 or not (gaps != 0).any() or not (movable > 0).any():
        return stage, False
    total = key_sums(rank[tiles], seconds[tiles], world_size)
    order, ranks, end = group_by_rank(tiles, rank, seconds, world_size)
    return pour(stage, order, ranks, end, total, gaps, movable, fill)


@compiled
def own_rows_spread(stage, seconds, rank, movable, comm, per, world_size, num_stages, width):
    """planner/stages.py ``spread_own_rows`` from the per-(rank, stage) compute ``per`` [P, width] of
    ``stage``: from the latest stage down, each stage's surplus over its own exchange fills the exposed
    gaps of the stages after it, earliest first, with its ``movable`` tiles, the latest tile first."""
    P, n = world_size, stage.size
    fresh = True
    for source in range(num_stages - 1, 0, -1):
        if not fresh:
            per = stage_loads(rank, stage, seconds, P, width)
            fresh = True
        num_fill = width - source - 1
        gaps = np.empty((P, num_fill))
        for r in range(P):
            for j in range(num_fill):
                gaps[r, j] = max(0.0, comm[r, source + 1 + j] - per[r, source + 1 + j])
        if not (gaps != 0).any():
            continue
        count = 0
        for i in range(n):
            if movable[i] and stage[i] == source:
                count += 1
        if count == 0:
            continue
        cand = np.empty(count, dtype=np.int64)
        k = 0
        for i in range(n - 1, -1, -1):
            if movable[i] and stage[i] == source:
                cand[k] = i
                k += 1
        surplus = np.empty(P)
        for r in range(P):
            surplus[r] = per[r, source] - comm[r, source]
        fill = np.arange(source + 1, width)
        stage, moved = poured(stage, cand, rank, seconds, gaps, surplus, fill, P)
        if moved:
            fresh = False
    return stage


@compiled
def local_tiles_spread(stage, seconds, rank, is_local, comm, world_size, num_stages, last):
    """planner/stages.py ``spread_local_tiles``: each rank's purely local stage-0 tiles beyond what hides
    its exchange 0, the last tile first, poured into the exposed gaps of stages ``last`` .. 1, latest
    first."""
    P, n = world_size, stage.size
    per = stage_loads(rank, stage, seconds, P, num_stages + 1)
    gaps = np.empty((P, last))
    for r in range(P):
        for j in range(last):
            gaps[r, j] = max(0.0, comm[r, last - j] - per[r, last - j])
    if not (gaps != 0).any():
        return stage
    count = 0
    for i in range(n):
        if is_local[i] and stage[i] == 0:
            count += 1
    local0 = np.empty(count, dtype=np.int64)
    k = 0
    for i in range(n):
        if is_local[i] and stage[i] == 0:
            local0[k] = i
            k += 1
    movable = key_sums(rank[local0], seconds[local0], P)
    for r in range(P):
        movable[r] -= comm[r, 0]
    fill = np.arange(last, 0, -1)
    return poured(stage, local0[::-1].copy(), rank, seconds, gaps, movable, fill, P)[0]


@compiled
def backward_gaps(per, comm, local_total):
    """planner/stages_bwd.py ``_spread_backward_local``'s pour (S >= 2 stages): (``gaps`` [P, S - 1] of
    every stage but the local tiles' own, ``movable`` [P] - what each rank's local stage holds beyond
    its own exchange, at most its local tiles' ``local_total`` -, ``fill`` [S - 1] those stages, whether
    anything is exposed and movable)."""
    P, S = per.shape
    home_stage = min(2, S - 1)
    fill = np.empty(S - 1, dtype=np.int64)
    k = 0
    for s in range(S):
        if s != home_stage:
            fill[k] = s
            k += 1
    gaps = np.empty((P, S - 1))
    movable = np.empty(P)
    for r in range(P):
        for j in range(S - 1):
            gaps[r, j] = max(0.0, comm[r, fill[j]] - per[r, fill[j]])
        movable[r] = min(per[r, home_stage] - comm[r, home_stage], local_total[r])
    return gaps, movable, fill, bool((gaps != 0).any() and (movable > 0).any())


@compiled
def overlapped_times(compute, comm):
    """float64 [P]: planner/cost_model.py ``CostModel.overlapped_time``, each rank's stages' max(compute,
    exchange) summed as numpy sums a row, plus its last exchange."""
    P, S = compute.shape
    out = np.empty(P)
    row = np.empty(S)
    for r in range(P):
        for s in range(S):
            row[s] = max(compute[r, s], comm[r, s])
        out[r] = numpy_sum(row) + comm[r, S]
    return out
