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
from .group_loops import by_rank_and_block
from .tile_loops import stage_loads


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
def split_stage0_groups(stage, kv, rank, home, compute, comm_time, world_size, num_stages):
    """planner/stages_bwd.py ``split_backward_stages`` for S >= 3: per rank, take = half the smaller of
    exchange 1's gap and stage 0's surplus over exchange 0; the rank's whole (rank, kv-block) groups of
    stage-0 tiles reading remote KV, latest kv-block first, move to stage 1 while their running sum of
    seconds stays within take. Returns ``stage`` itself where no group moves, else a new array."""
    P, S, num_blocks = world_size, num_stages, home.size
    per = stage_loads(rank, stage, compute, P, S)
    take = np.empty(P)
    for r in range(P):
        take[r] = min(comm_time[r, 1] - per[r, 1], per[r, 0] - comm_time[r, 0]) / 2
    eligible = np.empty(stage.size, dtype=np.int64)
    latest_first = np.empty(stage.size, dtype=np.int64)  # nB - 1 - kv: groups of later kv-blocks first
    m = 0
    for i in range(stage.size):
        latest_first[i] = num_blocks - 1 - kv[i]
        if stage[i] == 0 and home[kv[i]] != rank[i] and take[rank[i]] > 0:
            eligible[m] = i
            m += 1
    if m == 0:
        return stage
    # (by rank, then latest kv-block first; a group's tiles in tile order, as the numpy form adds them)
    order = by_rank_and_block(eligible[:m], rank, latest_first)
    out = stage.copy()
    # the running sum over all groups less the sum before the rank's first (``_grouped_cumsum``'s floats)
    cum, before, current = 0.0, 0.0, -1
    i = 0
    while i < m:
        t = order[i]
        r, block = rank[t], kv[t]
        value, j = 0.0, i
        while j < m and rank[order[j]] == r and kv[order[j]] == block:
            value += compute[order[j]]
            j += 1
        cum += value
        if r != current:
            before, current = cum - value, r
        if cum - before <= take[r]:
            for k in range(i, j):
                out[order[k]] = 1
        i = j
    return out
