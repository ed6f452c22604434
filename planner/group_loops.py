"""Compiled (rank, block) groupings of tiles (numba): receive groups and their stages, movable tiles,
and the polish's groups (a move's histogram update, its rows' loads, its candidate units' weights).

Notation (docs/design.md): tiles (qb, kb) on ``rank``, ``home[b]`` owns block b, P ranks, nB blocks;
a receive group is the tiles of one rank that read one remote block (one transfer in the schedule).

Why: finishing a placement (planner/finish.py) groups its remote tiles by (rank, block) once and then
reads each group's first and last stage under every staging it weighs (a dozen a placement), and
``own_row_movable`` groups them by (rank, kv-block) again; in numpy each was a sort and a few
segment reductions, ~30-100 us of calls apiece on a merged one-node plan. These sort by two stable
counting passes (by block, then by rank: O(n + nB + P), no table of P * nB keys, which at 1M tokens /
64 ranks would cost more than the sort; one pass by the key where it is small) and give the same groups
in the same order. The polish (planner/polish.py) makes ~5,000 trial moves a multi-node plan, each ~30
numpy calls on a few tiles before; its floats stay numpy's (planner/float_sums.py).
"""

from __future__ import annotations

import numpy as np

from .float_sums import numpy_sum
from .jit import compiled
from .sort_loops import stable_order, two_digit_order


@compiled
def by_rank_and_block(tiles, rank, block):
    """``tiles`` stably ordered by (rank, block) of each tile (planner/sort_loops.py ``two_digit_order`` of
    the keys ``rank * (top block + 1) + block``)."""
    n = tiles.size
    if n == 0:
        return tiles.copy()
    top_rank, top_block = 0, 0
    for i in range(n):
        top_rank, top_block = max(top_rank, rank[tiles[i]]), max(top_block, block[tiles[i]])
    span = top_block + 1
    keys = np.empty(n, dtype=np.int64)
    for i in range(n):
        keys[i] = rank[tiles[i]] * span + block[tiles[i]]
    order = two_digit_order(keys, span, (top_rank + 1) * span)
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        out[i] = tiles[order[i]]
    return out


@compiled
def group_tiles(rank, block, tiles):
    """(``tiles`` ordered by (rank, block), each group's first position, each group's rank and block):
    planner/schedule.py ``_grouping``, groups ascending by ``rank * nB + block``."""
    order = by_rank_and_block(tiles, rank, block)
    n = order.size
    heads = np.empty(n, dtype=np.int64)
    group_rank = np.empty(n, dtype=np.int64)
    group_block = np.empty(n, dtype=np.int64)
    g = 0
    for i in range(n):
        t = order[i]
        if i == 0 or rank[t] != group_rank[g - 1] or block[t] != group_block[g - 1]:
            heads[g], group_rank[g], group_block[g] = i, rank[t], block[t]
            g += 1
    return order, heads[:g].copy(), group_rank[:g].copy(), group_block[:g].copy()


@compiled
def group_stages(order, heads, stage):
    """(first, last) stage of every group of ``group_tiles`` under per-tile ``stage``."""
    num_groups = heads.size
    first = np.empty(num_groups, dtype=np.int64)
    last = np.empty(num_groups, dtype=np.int64)
    for g in range(num_groups):
        end = heads[g + 1] if g + 1 < num_groups else order.size
        lo = hi = stage[order[heads[g]]]
        for i in range(heads[g] + 1, end):
            s = stage[order[i]]
            lo, hi = min(lo, s), max(hi, s)
        first[g], last[g] = lo, hi
    return first, last


@compiled
def own_row_movable(q, kv, stage, rank, home):
    """planner/stages.py ``own_row_movable``: tiles of a q-block their rank owns, except, per (rank,
    remote kv-block), the tile in the earliest stage (ties: the first), which keeps the block's arrival."""
    n = q.size
    out = np.empty(n, dtype=np.bool_)
    remote = np.empty(n, dtype=np.int64)
    m = 0
    for i in range(n):
        out[i] = home[q[i]] == rank[i]
        if home[kv[i]] != rank[i]:
            remote[m] = i
            m += 1
    order = by_rank_and_block(remote[:m], rank, kv)
    i = 0
    while i < m:
        t = order[i]
        anchor = t
        j = i + 1
        while j < m and rank[order[j]] == rank[t] and kv[order[j]] == kv[t]:
            if stage[order[j]] < stage[anchor]:  # (ascending tiles within a group: ties keep the first)
                anchor = order[j]
            j += 1
        out[anchor] = False
        i = j
    return out


@compiled
def unit_weights(members, starts, stage, seconds, groups, at_stage):
    """float64 per group of ``groups``: the seconds of its tiles (``members[starts[g]:starts[g + 1]]``)
    in stage ``at_stage``, summed as ``seconds[those tiles].sum()`` sums them (planner/polish.py)."""
    out = np.empty(groups.size)
    scratch = np.empty(0)
    for k in range(groups.size):
        g = groups[k]
        lo, hi = starts[g], starts[g + 1]
        if scratch.size < hi - lo:
            scratch = np.empty(hi - lo)
        n = 0
        for j in range(lo, hi):
            t = members[j]
            if stage[t] == at_stage:
                scratch[n] = seconds[t]
                n += 1
        out[k] = numpy_sum(scratch[:n])
    return out


@compiled
def shift_groups(tiles, old, new, seconds, compute_row, tile_groups, hist, first, last):
    """The forward / backward polish's move of ``tiles`` (of one rank) from stages ``old`` to ``new``
    (planner/polish.py ``StageSearch._shift``), in place: the rank's compute per stage (``compute_row``:
    each tile's seconds taken off its old stage, then added to its new one, in tile order, as np.add.at
    adds them), the stage histogram ``hist`` [groups, S] of the tiles' groups (``tile_groups`` [kinds,
    tiles], -1 where none) and those groups' ``first`` / ``last`` stages (an empty row: 0 and S - 1).
    Returns (the groups, ascending, their histogram rows, first and last stages before the move, the
    groups whose first stage moved, those whose last moved)."""
    for i in range(tiles.size):
        compute_row[old[i]] -= seconds[i]
    for i in range(tiles.size):
        compute_row[new[i]] += seconds[i]
    kinds, S = tile_groups.shape[0], hist.shape[1]
    touched = np.empty(kinds * tiles.size, dtype=np.int64)
    count = 0
    for k in range(kinds):
        for i in range(tiles.size):
            if tile_groups[k, tiles[i]] >= 0:
                touched[count] = tile_groups[k, tiles[i]]
                count += 1
    order = stable_order(touched[:count])
    groups = np.empty(count, dtype=np.int64)
    num_groups = 0
    for j in range(count):  # (distinct, ascending)
        g = touched[order[j]]
        if num_groups == 0 or groups[num_groups - 1] != g:
            groups[num_groups] = g
            num_groups += 1
    groups = groups[:num_groups]
    # the values before the move (for undo), then the move
    old_hist = np.empty((num_groups, S), dtype=hist.dtype)
    old_first = np.empty(num_groups, dtype=first.dtype)
    old_last = np.empty(num_groups, dtype=last.dtype)
    for j in range(num_groups):
        old_first[j], old_last[j] = first[groups[j]], last[groups[j]]
        for s in range(S):
            old_hist[j, s] = hist[groups[j], s]
    for k in range(kinds):
        for i in range(tiles.size):
            g = tile_groups[k, tiles[i]]
            if g >= 0:
                hist[g, old[i]] -= 1
                hist[g, new[i]] += 1
    moved_first = np.empty(num_groups, dtype=np.int64)
    moved_last = np.empty(num_groups, dtype=np.int64)
    num_first = num_last = 0
    for j in range(num_groups):
        g = groups[j]
        f, lst = 0, S - 1
        for s in range(S):
            if hist[g, s] > 0:
                f = s
                break
        for s in range(S - 1, -1, -1):
            if hist[g, s] > 0:
                lst = s
                break
        if f != first[g]:
            moved_first[num_first] = g
            num_first += 1
        if lst != last[g]:
            moved_last[num_last] = g
            num_last += 1
        first[g], last[g] = f, lst
    return groups, old_hist, old_first, old_last, moved_first[:num_first].copy(), moved_last[:num_last].copy()


@compiled
def add_rows(rows, sign, row_on, row_link, row_ex, row_bytes, row_src, row_dst, load, rows_at):
    """The polish's row loads (planner/polish.py ``StageSearch._add_rows``), in place: each of ``rows``
    that is on adds (``sign`` 1) or removes (-1) its bytes at its source (send) and destination
    (receive) in its exchange, on its link (``load`` [link, send / receive, rank, exchange]), and
    counts itself there (``rows_at`` [link, rank, exchange]). Integers: any order gives the same sums."""
    for k in range(rows.size):
        i = rows[k]
        if not row_on[i]:
            continue
        link, ex, nbytes = row_link[i], row_ex[i], row_bytes[i] * sign
        load[link, 0, row_src[i], ex] += nbytes
        load[link, 1, row_dst[i], ex] += nbytes
        rows_at[link, row_src[i], ex] += sign
        rows_at[link, row_dst[i], ex] += sign
