"""Compiled backward-staging loops (numba): the class rule and its split (planner/stages_bwd.py).

Notation (docs/design.md): P ranks, S stages, tiles (qb, kb) on ``rank``; ``home[b]`` owns block b; a
(rank, kv-block) group is the tiles of one rank reading one remote KV block (one dK/dV partial).

Why: finishing a placement stages its backward by the class rule and weighs the rule's split once or
twice (planner/finish.py); in numpy the split was ~15 calls (a dense unique over (rank, kv-block)
keys, a weighted bincount, a grouped running sum) for a few thousand tiles. One loop each gives the
same stages: the group sums add the same floats in the same order as the numpy form.
"""

from __future__ import annotations

import numpy as np

from .jit import compiled
from .sort_loops import two_digit_order
from .tile_loops import grouped_running_sums, stage_loads


@compiled
def class_rule_stages(q, kv, rank, home, num_stages):
    """planner/stages_bwd.py ``backward_stages``: remote q-block -> stage 1, else remote kv-block -> 0,
    else 2 (each at most the last stage)."""
    last = max(num_stages - 1, 0)
    remote_q_stage, remote_kv_stage, local_stage = min(1, last), 0, min(2, last)
    out = np.empty(q.size, dtype=np.int64)
    for i in range(q.size):
        if home[q[i]] != rank[i]:
            out[i] = remote_q_stage
        elif home[kv[i]] != rank[i]:
            out[i] = remote_kv_stage
        else:
            out[i] = local_stage
    return out


@compiled
def stage0_kv_groups(stage, kv, rank, home, compute, ranks, ranks_per_node):
    """planner/stages_bwd.py ``_stage0_remote_kv_groups``: the whole (rank, kv-block) groups of stage-0
    tiles reading remote KV on the flagged ``ranks`` (``ranks_per_node`` > 0: only kv-blocks homed on
    the rank's node), as (tile indices ascending, each one's group, each group's rank, each group's
    seconds summed in tile order), groups by rank, latest kv-block first; no tiles where none is.
    Each eligible tile's group key is kept beside it, so the grouping reads the sorted keys instead of
    gathering every tile's rank and block again in sorted (random) order: ~20% faster on a 1M / 64
    plan's 137K eligible tiles (3.8 -> 3.0 ms a call, ~70 calls a plan)."""
    n, P, nB = stage.size, ranks.size, home.size
    # (each rank's and each block's home's node, 0 for all without ranks_per_node: a gather per tile
    # instead of two divisions)
    rank_node = np.zeros(P, dtype=np.int64)
    block_node = np.zeros(nB, dtype=np.int64)
    if ranks_per_node > 0:
        for r in range(P):
            rank_node[r] = r // ranks_per_node
        for b in range(nB):
            block_node[b] = home[b] // ranks_per_node
    idx = np.empty(n, dtype=np.int64)
    key = np.empty(n, dtype=np.int64)  # rank * nB + (nB - 1 - kv-block): by rank, latest block first
    m = 0
    for i in range(n):
        r, b = rank[i], kv[i]
        if stage[i] == 0 and ranks[r] and home[b] != r and block_node[b] == rank_node[r]:
            idx[m], key[m] = i, r * nB + (nB - 1 - b)
            m += 1
    order = two_digit_order(key[:m], nB, P * nB)
    of_tile = np.empty(m, dtype=np.int64)
    group_rank = np.empty(m, dtype=np.int64)
    group_seconds = np.empty(m, dtype=np.float64)
    g, previous = -1, -1
    for i in range(m):
        j = order[i]
        if key[j] != previous:
            g += 1
            previous = key[j]
            group_rank[g], group_seconds[g] = rank[idx[j]], 0.0
        group_seconds[g] += compute[idx[j]]  # (a group's tiles ascending: bincount's order)
        of_tile[j] = g
    return idx[:m].copy(), of_tile, group_rank[:g + 1].copy(), group_seconds[:g + 1].copy()


@compiled
def split_stage0_groups(stage, kv, rank, home, compute, comm_time, world_size, num_stages):
    """planner/stages_bwd.py ``split_backward_stages`` for S >= 3: per rank, take = half the smaller of
    exchange 1's gap and stage 0's surplus over exchange 0; the rank's whole (rank, kv-block) groups of
    stage-0 tiles reading remote KV, latest kv-block first, move to stage 1 while their running sum of
    seconds stays within take. Returns ``stage`` itself where no group is eligible, else a new array."""
    P, S = world_size, num_stages
    per = stage_loads(rank, stage, compute, P, S)
    take = np.empty(P)
    for r in range(P):
        take[r] = min(comm_time[r, 1] - per[r, 1], per[r, 0] - comm_time[r, 0]) / 2
    idx, of_tile, group_rank, group_seconds = stage0_kv_groups(stage, kv, rank, home, compute, take > 0, 0)
    if idx.size == 0:
        return stage
    upto = grouped_running_sums(group_rank, group_seconds)  # (each rank's groups, latest first)
    moved = np.empty(group_rank.size, dtype=np.bool_)
    for g in range(group_rank.size):
        moved[g] = upto[g] <= take[group_rank[g]]
    out = stage.copy()
    for j in range(idx.size):
        if moved[of_tile[j]]:
            out[idx[j]] = 1
    return out
