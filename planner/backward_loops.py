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

from .group_loops import by_rank_and_block
from .jit import compiled
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
    seconds summed in tile order), groups by rank, latest kv-block first; no tiles where none is."""
    n = stage.size
    eligible = np.empty(n, dtype=np.int64)
    m = 0
    for i in range(n):
        r, h = rank[i], home[kv[i]]
        same_node = ranks_per_node <= 0 or h // ranks_per_node == r // ranks_per_node
        if stage[i] == 0 and h != r and ranks[r] and same_node:
            eligible[m] = i
            m += 1
    idx = eligible[:m].copy()
    order = by_rank_and_block(idx, rank, kv, True)
    group_of = np.empty(n, dtype=np.int64)  # (only the eligible tiles' entries are written and read)
    group_rank = np.empty(m, dtype=np.int64)
    group_seconds = np.empty(m, dtype=np.float64)
    g = -1
    for i in range(m):
        t = order[i]
        if i == 0 or rank[t] != rank[order[i - 1]] or kv[t] != kv[order[i - 1]]:
            g += 1
            group_rank[g], group_seconds[g] = rank[t], 0.0
        group_seconds[g] += compute[t]  # (a group's tiles ascending: bincount's order)
        group_of[t] = g
    of_tile = np.empty(m, dtype=np.int64)
    for j in range(m):
        of_tile[j] = group_of[idx[j]]
    return idx, of_tile, group_rank[:g + 1].copy(), group_seconds[:g + 1].copy()


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
