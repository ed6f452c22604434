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
"""

from __future__ import annotations

from dataclasses import replace
from functools import cached_property
from typing import NamedTuple

import numpy as np

from .cost_model import CostModel
from .placement import Placement, compact_stages, first_occurrence, prefix_sums, run_heads
from .schedule import (KIND_KV, KIND_Q, InputGroups, payload_bytes, row_bytes, schedule_from_groups,
                       schedule_rows)

# ``defer_backward_groups``: the share of each exposed backward gap a rank's deferred groups fill, and
# the rounds tried per phase (each kept only where faster). Over the 57 multi-node evaluation cases
# (fp32 partials) a share of 1.0 instead of 0.5 made 12 plans slower for a geomean 0.4% faster, and
# rounds 5-8 changed 7 plans by <= 0.5%.
DEFER_SHARE = 0.5
DEFER_ROUNDS = 4
# Finisher.deferred's (largest_first, node_local) variants of defer_backward_groups, one greedy path per
# set, the faster end kept (several nodes, ``node_local``; else the first set alone). Measured in
# planner/candidates.py ``with_deferred_backward``.
DEFER_VARIANT_SETS = (((False, False), (True, False)), ((False, False), (True, False), (False, True), (True, True)))


def defer_variant_sets(world_size: int, ranks_per_node: int, node_local: bool = True) -> tuple:
    """The DEFER_VARIANT_SETS ``Finisher.deferred`` follows: all of them with ``node_local`` on several
    nodes, else the first alone (on one node every group is node-local: a second path would repeat
    the first). The last set holds every variant tried."""
    return DEFER_VARIANT_SETS[: None if node_local and world_size > ranks_per_node else 1]


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
    remote_q = home[q] != rank
    remote_kv = home[kv] != rank
    remote = remote_q | remote_kv
    if not np.any(remote):
        return stage
    nB = int(home.size)
    topo = cost_model.topology
    compute_time = flops / cost_model.fwd_rate

    # Items: (rank, kind, block) keys, one per distinct remote input.
    tile_idx = np.concatenate((np.flatnonzero(remote_q), np.flatnonzero(remote_kv)))
    kind = np.concatenate((np.full(int(remote_q.sum()), KIND_Q), np.full(int(remote_kv.sum()), KIND_KV)))
    block = np.concatenate((q[remote_q], kv[remote_kv]))
    item_key = (rank[tile_idx] * 2 + (kind == KIND_KV)) * nB + block
    keys, item_of = _dense_unique(item_key)
    item_rank = keys // (2 * nB)
    item_kind = np.where((keys // nB) % 2 == 1, KIND_KV, KIND_Q)
    item_block = keys % nB
    block_len = np.minimum(block_size, total_len - item_block * block_size)
    nbytes = payload_bytes(item_kind, block_len, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                           head_dim=head_dim, element_size=element_size,
                           grad_element_size=grad_element_size).astype(np.float64)
    inter = topo.node_of(home[item_block]) != topo.node_of(item_rank)
    item_time = nbytes / np.where(inter, topo.inter_bw, topo.intra_bw)

    # Credit each item with the compute it unlocks (half when the tile needs two remote items).
    needs = remote_q.astype(np.int64) + remote_kv.astype(np.int64)
    credit = np.bincount(item_of, weights=compute_time[tile_idx] / needs[tile_idx], minlength=keys.size)
    order = np.lexsort((item_block, item_kind, -credit / item_time, item_rank))
    position = np.empty(keys.size, dtype=np.int64)
    position[order] = np.arange(keys.size)

    # A tile completes when its last item (highest position) has arrived.
    done_at = _max_over_items(n, tile_idx, position[item_of], remote_q, -1)

    ranks_sorted = item_rank[order]
    starts = np.searchsorted(ranks_sorted, np.arange(world_size + 1))
    cum_time = prefix_sums(item_time[order])
    local_compute = np.bincount(rank[~remote], weights=compute_time[~remote], minlength=world_size)
    remote_tiles = np.flatnonzero(remote)
    by_done = remote_tiles[np.argsort(done_at[remote_tiles], kind="stable")]
    done_sorted = done_at[by_done]
    cum_done = prefix_sums(compute_time[by_done])

    if both_ends:
        if np.ndim(budget_scale):
            raise ValueError(f"both_ends stages all ranks with one budget_scale, got {budget_scale!r}")
        item_stage = _stage_items_both_ends(order, item_rank, home[item_block], inter, item_time, item_of, tile_idx,
                                            remote_q, compute_time, local_compute, tile_rank=rank,
                                            world_size=world_size, max_stages=max_stages, budget_scale=budget_scale)
        return _max_over_items(n, tile_idx, item_stage[item_of], remote_q, 0)
    item_stage = np.zeros(keys.size, dtype=np.int64)
    scales = np.atleast_1d(np.asarray(budget_scale, dtype=np.float64)).tolist()
    for r in range(world_size):
        lo, hi = int(starts[r]), int(starts[r + 1])
        if lo == hi:
            continue
        # with several scales, the rank keeps the cuts of the least estimated overlapped time
        cuts = min((_cut_items(lo, hi, local_compute[r], scale, max_stages, cum_time, done_sorted, cum_done)
                    for scale in scales), key=lambda estimate_cuts: estimate_cuts[0])[1]
        for begin, end, s in cuts:
            item_stage[order[begin:end]] = s

    return _max_over_items(n, tile_idx, item_stage[item_of], remote_q, 0)


def _cut_items(lo: int, hi: int, budget: float, scale: float, max_stages: int, cum_time: np.ndarray,
               done_sorted: np.ndarray, cum_done: np.ndarray) -> tuple[float, list]:
    """(estimated overlapped time, [(begin, end, stage)]) of one rank's items ``order[lo:hi]`` cut
    into stages: each group as long as the compute of the previous stage (``budget``: the local
    compute for stage 1) times ``scale`` can hide, the last stage taking the rest."""
    begin, s, cuts, estimate = lo, 1, [], 0.0
    while begin < hi:
        if s == max_stages:
            end = hi
        else:
            # largest prefix whose transfer time fits the budget (at least one item)
            end = int(np.searchsorted(cum_time, cum_time[begin] + budget * scale, side="right")) - 1
            end = min(hi, max(end, begin + 1))
        cuts.append((begin, end, s))
        estimate += max(budget, cum_time[end] - cum_time[begin])
        # compute unlocked by this stage's items hides the next stage's transfers
        a, b = np.searchsorted(done_sorted, [begin, end])
        budget = cum_done[b] - cum_done[a]
        begin, s = end, s + 1
    return estimate + budget, cuts


def _stage_items_both_ends(order, receiver, sender, inter, item_time, item_of, tile_idx, remote_q, compute_time,
                           local_compute, *, tile_rank, world_size, max_stages, budget_scale) -> np.ndarray:
    """Stage of every item, stage by stage over all ranks: exchange s-1 (the inputs of stage s) overlaps
    stage s-1, so an item joins stage s while, in priority order (``order``), the transfer time on its
    link stays within stage s-1's compute at its receiver and at its sender; the others wait (the
    last stage takes all that is left). Each receiver gets at least its first waiting item, so every
    stage makes progress."""
    P, n = world_size, tile_rank.size
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
        now = _max_over_items(n, tile_idx, placed[item_of], remote_q, -1) == s
        budget = np.bincount(tile_rank[now], weights=compute_time[now], minlength=P)
    return item_stage


def _grouped_cumsum(key: np.ndarray, value: np.ndarray) -> np.ndarray:
    """Per position, the sum of ``value`` over the positions up to it with the same key."""
    # already grouped (the spreads list local tiles rank by rank): no sort and no scatter back (a
    # stable sort of sorted keys is the identity, so the sums are the same)
    grouped = key.size < 2 or bool((key[1:] >= key[:-1]).all())
    by = None if grouped else np.argsort(key, kind="stable")
    k, v = (key, value) if grouped else (key[by], value[by])
    cum = np.cumsum(v)
    group_start = np.maximum.accumulate(np.where(run_heads(k), np.arange(k.size), 0))
    sums = cum - (cum - v)[group_start]
    if grouped:
        return sums
    out = np.empty_like(sums)
    out[by] = sums
    return out


def _dense_unique(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(keys, return_inverse=True)`` for small non-negative ints, by a presence table."""
    present = np.zeros(int(keys.max()) + 1, dtype=bool)
    present[keys] = True
    uniq = np.flatnonzero(present)
    index = np.empty(present.size, dtype=np.int64)  # only the present cells are written and read
    index[uniq] = np.arange(uniq.size)
    return uniq, index[keys]


def _max_over_items(n: int, tile_idx: np.ndarray, value: np.ndarray, remote_q: np.ndarray, fill: int) -> np.ndarray:
    """Per tile, the max of ``value`` over its (at most two) items: the Q items come first in
    ``tile_idx``, then the KV items, each group in ascending tile order."""
    nq = int(remote_q.sum())
    out = np.full(n, fill, dtype=np.int64)
    out[tile_idx[:nq]] = value[:nq]
    kv_tiles = tile_idx[nq:]
    out[kv_tiles] = np.maximum(out[kv_tiles], value[nq:])
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
    seconds = flops / fwd_rate
    # (a column for stage S too: spread_own_rows may already have opened it)
    compute = np.bincount(rank * (S + 1) + stage, weights=seconds, minlength=world_size * (S + 1)).reshape(
        world_size, S + 1)
    last = S if extra_stage else S - 1
    gaps = np.maximum(0.0, comm_time[:, 1:last + 1] - compute[:, 1:last + 1])  # stage s overlaps exchange s
    if not gaps.any():
        return stage  # (as _pour would: nothing exposed to fill)
    local0 = is_local & (stage == 0)
    movable = np.bincount(rank[local0], weights=seconds[local0], minlength=world_size) - comm_time[:, 0]
    # the last local tiles of a rank leave stage 0 first, into the latest gap first
    fill = np.arange(last, 0, -1)
    return _pour(stage, LocalWork(np.flatnonzero(local0)[::-1], rank, seconds, world_size), gaps[:, fill - 1],
                 movable, fill)


def own_row_movable(q: np.ndarray, kv: np.ndarray, stage: np.ndarray, rank: np.ndarray, home: np.ndarray) -> np.ndarray:
    """bool [ntiles]: tiles that may run in any later stage without changing a transfer - of a q-block
    their rank owns (no Q in, no OUT partial out) and reading a KV block that is home or that an
    earlier-or-equal-staged tile of the same rank, which stays, also reads (the block still arrives
    for that tile: its first need does not move)."""
    own = home[q] == rank
    remote_kv = home[kv] != rank
    idx = np.flatnonzero(remote_kv)
    anchor = np.zeros(q.size, dtype=bool)
    if idx.size:
        # per (rank, kv-block) the tile in its earliest stage (ties: the first) keeps the block's arrival
        span = int(kv.max()) + 1
        key = (rank[idx] * span + kv[idx]) * (int(stage.max()) + 1) + stage[idx]
        by = idx[np.argsort(key, kind="stable")]
        group = rank[by] * span + kv[by]
        anchor[by[run_heads(group)]] = True
    return own & ~anchor


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
    ranks = np.arange(P)
    per = movable = None  # per-rank compute per stage (recounted only after a pour), the mask on first need
    # from the latest stage down: a stage's surplus over its own exchange goes to the exposed gaps of the
    # stages after it, earliest first
    for source in range(S - 1, 0, -1):
        if per is None:
            per = np.bincount(rank * width + stage, weights=seconds, minlength=P * width).reshape(P, width)
        gaps = np.maximum(0.0, comm_time[:, :width] - per)
        gaps[:, : source + 1] = 0.0
        if not gaps.any():
            continue
        if movable is None:
            movable = movable_of()
        cand = np.flatnonzero(movable & (stage == source))[::-1]
        if cand.size == 0:
            continue
        surplus = per[ranks, source] - comm_time[ranks, source]
        fill = np.arange(source + 1, width)
        poured = _pour(stage, LocalWork(cand, rank, seconds, world_size), gaps[:, fill], surplus, fill)
        if poured is not stage:
            stage, per = poured, None
    return stage


def backward_stages(q: np.ndarray, kv: np.ndarray, rank: np.ndarray, home: np.ndarray, num_stages: int) -> np.ndarray:
    """int64 [ntiles] backward stage of every tile, by what the tile sends and needs.

    In the backward every forward input is already on the tile's rank; only dO / lse / delta of a
    remote q-block arrive (from its home, in the stage that first needs them, never stage 0), and
    every remote tile sends a dQ and / or dK/dV partial home after its last stage. So the tiles run
    in the reverse of the forward's order of need: tiles of home q-blocks that read remote KV (a
    dK/dV partial out, nothing in) first, in stage 0; tiles of remote q-blocks (dO in, partials
    out) in stage 1; purely local tiles (no transfer) last, in stage 2, where they hide the partials
    of stage 1. Fewer stages merge the later classes.
    """
    last = max(num_stages - 1, 0)
    remote_q = home[q] != rank
    remote_kv = home[kv] != rank
    return np.where(remote_q, min(1, last), np.where(remote_kv, 0, min(2, last))).astype(np.int64)


def _stage0_remote_kv_groups(stage: np.ndarray, kv: np.ndarray, rank: np.ndarray, home: np.ndarray,
                             compute: np.ndarray, ranks: np.ndarray, ranks_per_node: int | None = None):
    """The whole (rank, kv-block) groups of backward stage-0 tiles reading remote KV, on the ``ranks``
    flagged ([P] bool): (tile indices, each tile's group, each group's rank, each group's seconds),
    groups ordered per rank with the latest kv-block first; None when there is none. With
    ``ranks_per_node``, only groups whose kv-block's home is on the rank's node."""
    nB = home.size
    eligible = (stage == 0) & (home[kv] != rank) & ranks[rank]
    if ranks_per_node is not None:
        eligible &= home[kv] // ranks_per_node == rank // ranks_per_node
    idx = np.flatnonzero(eligible)
    if idx.size == 0:
        return None
    groups, of_tile = _dense_unique(rank[idx] * nB + (nB - 1 - kv[idx]))
    return idx, of_tile, groups // nB, np.bincount(of_tile, weights=compute[idx], minlength=groups.size)


def split_backward_stages(stage: np.ndarray, q: np.ndarray, kv: np.ndarray, rank: np.ndarray, home: np.ndarray,
                          compute: np.ndarray, comm_time: np.ndarray, *, world_size: int, num_stages: int) -> np.ndarray:
    """``backward_stages`` refined where a rank's exchange 1 (the dK/dV partials of its stage-0 tiles,
    dO for its stage-1 tiles) is exposed while stage 0 has compute to spare: whole (rank, kv-block)
    groups of stage-0 tiles, latest kv-blocks first, move to stage 1 - up to half the smaller of gap
    and surplus, since each moved group's partial also moves on to exchange 2. ``compute``: per-tile
    backward seconds; ``comm_time`` [P, S + 1]: backward transfer time per exchange."""
    S, P = num_stages, world_size
    if S < 3:
        return stage
    per_stage = np.bincount(rank * S + stage, weights=compute, minlength=P * S).reshape(P, S)
    take = np.minimum(comm_time[:, 1] - per_stage[:, 1], per_stage[:, 0] - comm_time[:, 0]) / 2
    found = _stage0_remote_kv_groups(stage, kv, rank, home, compute, take > 0)
    if found is None:
        return stage
    idx, of_tile, group_rank, group_c = found
    chosen = _grouped_cumsum(group_rank, group_c) <= take[group_rank]
    stage = stage.copy()
    stage[idx[chosen[of_tile]]] = 1
    return stage


def defer_backward_groups(stage: np.ndarray, kv: np.ndarray, rank: np.ndarray, home: np.ndarray,
                          compute: np.ndarray, load: np.ndarray, comm_time: np.ndarray, *,
                          share: float = DEFER_SHARE, largest_first: bool = False,
                          into_last: bool = False, ranks_per_node: int | None = None) -> np.ndarray:
    """Backward stages with whole (rank, kv-block) groups of stage-0 tiles that read remote KV moved to
    the stages 1 .. S-2 whose exchanges are exposed: a home computes most of its backward in stage 0
    (its rows' dK/dV partials leave in exchange 1), then idles while its helpers' partials and the dO
    its stage-1 tiles wait for arrive. Each rank fills ``share`` of each exposed gap, earliest first,
    while its stage-0 surplus over exchange 0 lasts, with its groups of the latest kv-blocks first (or,
    ``largest_first``, its groups of the most compute, which send the fewest partials per second moved);
    a moved group's partial leaves one exchange after its new stage, which the next stage's compute
    then has to hide, hence only a share. ``into_last``: stage S-1 may take groups too, whose partials
    then leave after all compute (where its exchange's gap is the larger cost). ``ranks_per_node``:
    only groups whose kv-block is homed on the rank's node move (their partials stay on NVLink; one
    that crosses nodes late, often summed through a relay's reduce tree, leaves a proxy's NIC after
    the last compute).

    ``stage``: backward stages (only tiles with remote KV move, so local tiles may be in their
    class-rule stage or spread); ``compute``: per-tile backward seconds; ``load`` [P, S]: the backward
    seconds per rank and stage the gaps are measured against (local tiles spread); ``comm_time``
    [P, S + 1]: the backward's transfer time per exchange. Returns ``stage`` itself when nothing moves."""
    P, S = load.shape
    if S < 3:
        return stage
    top = S if into_last else S - 1  # stages 1 .. top - 1 take groups
    gaps = np.maximum(0.0, comm_time[:, 1:top] - load[:, 1:top])  # stage j overlaps exchange j
    surplus = np.maximum(0.0, load[:, 0] - comm_time[:, 0])
    upto = np.minimum(np.cumsum(share * gaps, axis=1), surplus[:, None])  # [P, top - 1] work placed up to stage j
    found = _stage0_remote_kv_groups(stage, kv, rank, home, compute, upto[:, -1] > 0, ranks_per_node)
    if found is None:
        return stage
    idx, of_tile, group_rank, group_c = found
    if largest_first:
        order = np.lexsort((-group_c, group_rank))
        end = np.empty_like(group_c)
        end[order] = _grouped_cumsum(group_rank[order], group_c[order])
    else:
        end = _grouped_cumsum(group_rank, group_c)
    # a group goes to the first stage j whose cumulative room reaches its end (as in ``_pour``)
    F = top - 1
    shift = 2.0 * float(max(end.max(), upto.max())) + 1.0
    flat = (upto + shift * np.arange(P)[:, None]).ravel()
    j = np.searchsorted(flat, end + shift * group_rank, side="left") - group_rank * F
    moved = (j < F)[of_tile]
    if not moved.any():
        return stage
    out = stage.copy()
    out[idx[moved]] = 1 + j[of_tile][moved]
    return out


def choose_backward_staging(plain: np.ndarray, plain_transfers: tuple, derive, time_of, *, q: np.ndarray,
                            kv: np.ndarray, rank: np.ndarray, home: np.ndarray, compute: np.ndarray, world_size: int,
                            num_stages: int) -> tuple:
    """The class-rule backward staging ``plain`` or its ``split_backward_stages`` refinement, whichever
    simulates faster (finish_placement and the relay scorer both stage this way).

    ``plain_transfers``: (payload, comm_bwd [P, S + 1]) of ``plain``, payload being whatever the caller
    derives the transfers into (a schedule, receive groups); ``derive(stage_bwd)`` gives the same pair
    for another staging; ``time_of(stage_bwd, comm_bwd)`` -> (stage_bwd with local tiles spread, time).
    Returns (stage_bwd, its spread form, payload, comm_bwd) of the faster one."""
    payload, comm = plain_transfers
    split = split_backward_stages(plain, q, kv, rank, home, compute, comm, world_size=world_size,
                                  num_stages=num_stages)
    spread, time = time_of(plain, comm)
    if not np.array_equal(split, plain):
        split_payload, split_comm = derive(split)
        split_spread, split_time = time_of(split, split_comm)
        if split_time < time:
            return split, split_spread, split_payload, split_comm
    return plain, spread, payload, comm


class BackwardChoice(NamedTuple):
    """The relay-free backward staging ``choose_backward_staging`` picked for one placement, before its
    local tiles were spread, with its (q, kv) receive groups: ``Finisher.finish`` records it on the
    Placement (``bwd_choice``), and the relay scorer (planner/relay.py ``RelayScorer``), which would
    choose the same staging from the same inputs, starts from it. Those inputs are the homes, the tile
    ranks and the number of stages: the class rule, its split and their transfer times (DO / DQ / DKV
    rows, relay-free) do not depend on the forward stages."""

    tiles: object  # the TileSet
    home: np.ndarray
    rank: np.ndarray
    num_stages: int
    stage_bwd: np.ndarray  # the chosen backward stages, local tiles not spread
    groups: tuple  # their (q, kv) receive_groups

    def fits(self, tiles, home: np.ndarray, rank: np.ndarray, num_stages: int) -> bool:
        """Whether it was chosen for exactly these tiles, homes, tile ranks and number of stages."""
        return (tiles is self.tiles and num_stages == self.num_stages and np.array_equal(rank, self.rank)
                and np.array_equal(home, self.home))


class LocalWork:
    """Tiles that may move between stages (no transfer depends on them): ``tiles`` in the order they
    leave (within a rank), ``total`` [P] their seconds per rank. Grouped by rank (``order``, stably, so
    a rank keeps its tiles' order; ``rank``) with their seconds laid end to end per rank (``end``) on
    first use only: most spreads find no exposed gap to fill, and on a one-node 128K / 8 plan that
    grouping (a sort and a segmented cumsum) was ~10% of the planning time for nothing."""

    def __init__(self, tiles: np.ndarray, rank: np.ndarray, seconds: np.ndarray, world_size: int):
        self.tiles, self._rank_of, self._seconds = tiles, rank, seconds
        # (bincount adds each bin's weights in input order, the grouped order's per rank: the same sums)
        self.total = np.bincount(rank[tiles], weights=seconds[tiles], minlength=world_size)

    @cached_property
    def order(self) -> np.ndarray:
        """int64 tile indices, grouped by ascending rank."""
        return self.tiles[np.argsort(self._rank_of[self.tiles], kind="stable")]

    @cached_property
    def rank(self) -> np.ndarray:
        """int64 the ranks of ``order``."""
        return self._rank_of[self.order]

    @cached_property
    def end(self) -> np.ndarray:
        """float64 each tile's end position in its rank's list (seconds)."""
        return _grouped_cumsum(self.rank, self._seconds[self.order])


def spread_backward_local(stage: np.ndarray, compute: np.ndarray, rank: np.ndarray, local: LocalWork,
                          comm_time: np.ndarray, *, world_size: int, num_stages: int) -> np.ndarray:
    """Move purely local tiles (no transfer) from their backward stage (``backward_stages``) into the
    stages whose next transfers (``comm_time`` [P, S + 1], backward) would otherwise be exposed:
    partials arriving at a home, dO leaving it. ``compute``: per-tile backward seconds. Each rank
    keeps in the local stage what hides its own next transfers and fills the gaps of the other
    stages in order; the schedule is unchanged (local tiles move nothing). ``local``: the LocalWork of
    the purely local tiles in tile order under ``compute``, all still in their class-rule stage."""
    S, P = num_stages, world_size
    if S < 2:
        return stage
    home_stage = min(2, S - 1)
    per_stage = np.bincount(rank * S + stage, weights=compute, minlength=P * S).reshape(P, S)
    gaps = np.maximum(0.0, comm_time[:, :S] - per_stage)  # stage s overlaps exchange s
    movable = np.minimum(per_stage[:, home_stage] - comm_time[:, home_stage], local.total)
    fill = np.array([s for s in range(S) if s != home_stage], dtype=np.int64)  # earliest gap first
    return _pour(stage, local, gaps[:, fill], movable, fill)


def backward_time(stage_bwd: np.ndarray, compute_bwd: np.ndarray, rank: np.ndarray, local: LocalWork,
                  comm_bwd: np.ndarray, *, world_size: int, num_stages: int, cost_model: CostModel) -> tuple:
    """(``stage_bwd`` with its local tiles spread against ``comm_bwd`` [P, S + 1], the slowest rank's
    overlapped backward time); ``compute_bwd``: per-tile backward seconds, ``local``: their LocalWork."""
    spread = spread_backward_local(stage_bwd, compute_bwd, rank, local, comm_bwd, world_size=world_size,
                                   num_stages=num_stages)
    per = np.bincount(rank * num_stages + spread, weights=compute_bwd,
                      minlength=world_size * num_stages).reshape(world_size, num_stages)
    return spread, float(cost_model.overlapped_time(per, comm_bwd).max())


def _pour(stage: np.ndarray, local: LocalWork, gaps: np.ndarray, movable: np.ndarray, fill: np.ndarray) -> np.ndarray:
    """Move local tiles into transfer gaps: per rank, ``local``'s tiles (in the order they leave)
    fill the gaps ``gaps[r, i]`` of stages ``fill[i]`` in turn, up to ``movable[r]`` seconds in all;
    a tile goes to the gap its cumulative end position falls into (else it stays). Shared by the
    forward and backward spreads (a local tile moves no transfer)."""
    P, F = gaps.shape
    movable = np.clip(movable, 0.0, None)
    if local.tiles.size == 0 or F == 0 or not gaps.any() or not movable.any():
        return stage
    r, end, total = local.rank, local.end, local.total
    upto = np.minimum(np.cumsum(gaps, axis=1), movable[:, None])  # [P, F] work placed up to gap i
    # the first gap i with end <= upto[r, i]: upto is non-decreasing along i, so one searchsorted over
    # the rows laid end to end, each shifted past the previous one, finds it for every tile at once
    shift = 2.0 * float(max(total.max(), upto.max())) + 1.0
    flat = (upto + shift * np.arange(P)[:, None]).ravel()
    i = np.searchsorted(flat, end + shift * r, side="left") - r * F
    moved = i < F
    stage = stage.copy()
    stage[local.order[moved]] = fill[i[moved]]
    return stage


def finish_placement(tiles, home: np.ndarray, rank: np.ndarray, stage: np.ndarray, *, world_size: int,
                     cost_model: CostModel, sizes: dict, kv_relay=None, spread_forward: bool = True,
                     max_stages: int | None = None, score: bool = True) -> Placement:
    """The Placement of given homes, tile ranks and forward stages, completed: stages compacted,
    backward stages (``backward_stages``), the CommSchedule, local tiles spread into the stages where
    transfers would otherwise be exposed (forward only with ``spread_forward``, then also the tiles of
    a rank's own rows that move no transfer, ``spread_own_rows``; into one more stage after the last
    when ``max_stages`` allows it; backward always), and the simulated
    forward + backward time (``score``; without it, ``sim_time`` is None and the forward's transfer
    times are not computed). ``sizes``: num_q_heads, num_kv_heads, head_dim, element_size, grad_element_size."""
    return Finisher(tiles, home, rank, stage, world_size=world_size, cost_model=cost_model, sizes=sizes).finish(
        kv_relay, spread_forward=spread_forward, max_stages=max_stages, score=score)


class Finisher:
    """``finish_placement`` for one (homes, tile ranks, forward stages) under any number of relay tables
    (add_transit weighs several): what does not depend on the relays (compute, local tiles, the forward
    receive groups, the class-rule backward stages' groups) is computed once."""

    def __init__(self, tiles, home: np.ndarray, rank: np.ndarray, stage: np.ndarray, *, world_size: int,
                 cost_model: CostModel, sizes: dict):
        self.tiles, self.home, self.rank, self.P, self.cost_model, self.sizes = (tiles, home, rank, world_size,
                                                                                 cost_model, sizes)
        self.stage, self.num_stages = compact_stages(stage)
        self.block_len = tiles.block_lengths()
        q, kv = tiles.q, tiles.kv
        self.remote_q, self.remote_kv = home[q] != rank, home[kv] != rank
        self.local = ~self.remote_q & ~self.remote_kv
        self.compute = cost_model.tile_flops(tiles.pairs, num_q_heads=sizes["num_q_heads"],
                                             head_dim=sizes["head_dim"]) / cost_model.fwd_rate
        self.compute_bwd = self.compute * cost_model.bwd_flops_factor
        self._fwd_groups = None
        self._input_groups = None  # InputGroups of these ranks, once a staging needs its groups
        self._plain_bwd = {}  # num_stages -> (class-rule backward stages, their receive groups)
        self._local_work = None
        self._own_movable = None  # (``_own_row_movable``)

    def _groups(self, stage: np.ndarray) -> tuple:
        """(q, kv) ``receive_groups`` of the remote inputs under per-tile ``stage``."""
        if self._input_groups is None:
            t = self.tiles
            self._input_groups = InputGroups(self.rank, t.q, t.kv, self.remote_q, self.remote_kv, t.num_blocks)
        return self._input_groups(stage)

    def _own_row_movable(self) -> np.ndarray:
        """``own_row_movable`` of the forward stages (the same under every relay table), on first need."""
        if self._own_movable is None:
            self._own_movable = own_row_movable(self.tiles.q, self.tiles.kv, self.stage, self.rank, self.home)
        return self._own_movable

    def _forward_groups(self) -> tuple:
        # moving purely local tiles between stages (the forward spread) changes no remote tile's stage
        if self._fwd_groups is None:
            self._fwd_groups = self._groups(self.stage)
        return self._fwd_groups

    def _plain_backward(self, num_stages: int) -> tuple:
        if num_stages not in self._plain_bwd:
            stage_bwd = backward_stages(self.tiles.q, self.tiles.kv, self.rank, self.home, num_stages)
            self._plain_bwd[num_stages] = (stage_bwd, self._groups(stage_bwd))
        return self._plain_bwd[num_stages]

    def _schedule(self, kv_relay, num_stages: int, stage_bwd: np.ndarray | None = None):
        """(backward stages, CommSchedule, the backward's receive groups); ``stage_bwd`` None: the
        class-rule backward stages."""
        if stage_bwd is None:
            stage_bwd, bwd_groups = self._plain_backward(num_stages)
        else:
            bwd_groups = self._groups(stage_bwd)
        sched = schedule_from_groups(self.home, *self._forward_groups(), num_blocks=self.tiles.num_blocks,
                                     num_stages=num_stages, world_size=self.P, kv_relay=kv_relay,
                                     bwd_groups=bwd_groups)
        return stage_bwd, sched, bwd_groups

    def _comm(self, sched, directions) -> dict:
        comm = {}
        for direction in directions:
            table = sched.table(direction).numpy().astype(np.int64)
            comm[direction] = self.cost_model.stage_comm_time(table, row_bytes(table, self.block_len, **self.sizes),
                                                              self.P, sched.num_stages)
        return comm

    def _backward_time(self, stage_bwd: np.ndarray, comm_bwd: np.ndarray, num_stages: int) -> tuple:
        """``backward_time`` of ``stage_bwd`` (local tiles in their class-rule stage) under ``comm_bwd``."""
        if self._local_work is None:
            self._local_work = LocalWork(np.flatnonzero(self.local), self.rank, self.compute_bwd, self.P)
        return backward_time(stage_bwd, self.compute_bwd, self.rank, self._local_work, comm_bwd, world_size=self.P,
                             num_stages=num_stages, cost_model=self.cost_model)

    def _backward_transfers(self, kv_relay, num_stages: int, stage_bwd: np.ndarray) -> tuple:
        """(receive groups, transfer time [P, S + 1]) of the backward under ``stage_bwd``, from the
        schedule's unsorted rows: the costs are sums per rank and exchange, so no wire order is needed."""
        groups = self._groups(stage_bwd)
        _, rows = schedule_rows(self.home, *self._forward_groups(), num_blocks=self.tiles.num_blocks,
                                num_stages=num_stages, kv_relay=kv_relay, bwd_groups=groups)
        nbytes = row_bytes(rows, self.block_len, **self.sizes)
        return groups, self.cost_model.stage_comm_time(rows, nbytes, self.P, num_stages)

    def deferred(self, placement: Placement, node_local: bool = True) -> Placement:
        """``placement`` (finished from this Finisher's homes, ranks and forward stages) with its backward
        restaged by rounds of ``defer_backward_groups`` (``_deferred_rounds``), once over any remote-KV
        group and, with ``node_local`` on several nodes, once with the node-local variants too
        (``DEFER_VARIANT_SETS``); the faster backward is kept. ``placement`` itself unless the result
        is faster."""
        sched, kv_relay = placement.schedule, placement.kv_relay
        S = sched.num_stages
        if S < 3 or not np.array_equal(self.stage, placement.tile_stage):
            return placement
        # From the class-rule staging chosen anew under this placement's relays (a relay variant keeps
        # the backward stages chosen for the placement without relays). Starting from the placement's
        # own staging instead ends slower as often as not: 9 of 57 multi-node evaluation plans 0.1-1.7%
        # slower, 2 faster.
        plain = self._plain_backward(S)[0]
        start = choose_backward_staging(
            plain, self._backward_transfers(kv_relay, S, plain), lambda st: self._backward_transfers(kv_relay, S, st),
            lambda st, c: self._backward_time(st, c, S), q=self.tiles.q, kv=self.tiles.kv, rank=self.rank,
            home=self.home, compute=self.compute_bwd, world_size=self.P, num_stages=S)
        # the rounds are greedy: each set of variants is followed on its own path, the faster end kept
        memo = {}  # the paths share their first rounds' candidates
        ends = [self._deferred_rounds(start, kv_relay, S, variants, memo)
                for variants in defer_variant_sets(self.P, self.cost_model.topology.ranks_per_node, node_local)]
        _, spread, groups, _, _ = min(ends, key=lambda end: end[-1])  # (first of equals: the plain variants)
        sched = schedule_from_groups(self.home, *self._forward_groups(), num_blocks=self.tiles.num_blocks,
                                     num_stages=S, world_size=self.P, kv_relay=kv_relay, bwd_groups=groups)
        comm = self._comm(sched, ("fwd", "bwd"))

        def per_stage(stage):
            return np.bincount(self.rank * S + stage, weights=self.compute, minlength=self.P * S).reshape(self.P, S)

        fwd, bwd = self.cost_model.step_times(per_stage(placement.tile_stage), comm["fwd"], comm["bwd"],
                                              per_stage(spread))
        sim_time = float(fwd.max() + bwd.max())
        if sim_time >= placement.sim_time:
            return placement
        return replace(placement, schedule=sched, tile_stage_bwd=spread, sim_time=sim_time)

    def _deferred_rounds(self, start: tuple, kv_relay, S: int, variants: tuple, memo: dict) -> tuple:
        """(unspread, spread, groups, comm, backward time) after the deferral rounds from ``start`` (a
        ``choose_backward_staging`` result): up to DEFER_ROUNDS into the stages before the last, then up
        to DEFER_ROUNDS into the last one too. Each round tries the ``variants`` ((largest_first,
        node_local) pairs of ``defer_backward_groups``) and keeps the fastest, if the backward then
        simulates faster; the first round that does not gain ends a phase. ``memo``: candidate stages
        (bytes) -> their (groups, comm, spread, time), shared with the other paths."""
        rpn = self.cost_model.topology.ranks_per_node
        unspread, spread, groups, comm = start
        best = self._backward_time(unspread, comm, S)[1]
        for into_last in (False, True):
            for _ in range(DEFER_ROUNDS):
                load = np.bincount(self.rank * S + spread, weights=self.compute_bwd,
                                   minlength=self.P * S).reshape(self.P, S)
                tried, found = [], None
                for largest_first, node_local in variants:
                    cand = defer_backward_groups(unspread, self.tiles.kv, self.rank, self.home, self.compute_bwd,
                                                 load, comm, largest_first=largest_first, into_last=into_last,
                                                 ranks_per_node=rpn if node_local else None)
                    if cand is unspread or any(np.array_equal(cand, other) for other in tried):
                        continue
                    tried.append(cand)
                    key = cand.tobytes()
                    if key not in memo:
                        cand_groups, cand_comm = self._backward_transfers(kv_relay, S, cand)
                        memo[key] = (cand_groups, cand_comm, *self._backward_time(cand, cand_comm, S))
                    cand_groups, cand_comm, cand_spread, cand_time = memo[key]
                    # (a relative margin: these costs sum the rows in another order than the schedule's)
                    if cand_time < (best if found is None else found[-1]) * (1 - 1e-9):
                        found = (cand, cand_spread, cand_groups, cand_comm, cand_time)
                if found is None:
                    break
                unspread, spread, groups, comm, best = found
        return unspread, spread, groups, comm, best

    def finish(self, kv_relay=None, *, spread_forward: bool = True, max_stages: int | None = None,
               score: bool = True) -> Placement:
        """The completed Placement under ``kv_relay`` (see ``finish_placement``)."""
        tiles, home, rank, P, cost_model = self.tiles, self.home, self.rank, self.P, self.cost_model
        stage, num_stages = self.stage, self.num_stages
        directions = ("fwd", "bwd") if score or spread_forward else ("bwd",)

        def schedule_and_comm(num_stages):
            stage_bwd, sched, groups = self._schedule(kv_relay, num_stages)
            return stage_bwd, sched, self._comm(sched, directions), groups

        stage_bwd, sched, comm, groups = schedule_and_comm(num_stages)
        compute, compute_bwd = self.compute, self.compute_bwd
        if num_stages > 1:
            # moving local tiles between stages changes no transfer, so the schedule stays valid
            if spread_forward:
                extra = max_stages is not None and num_stages <= max_stages
                stage = spread_own_rows(stage, compute, rank, self._own_row_movable, comm["fwd"], world_size=P,
                                        num_stages=num_stages, extra_stage=extra)
                stage = spread_local_tiles(stage, compute * cost_model.fwd_rate, rank, self.local, comm["fwd"],
                                           world_size=P, num_stages=num_stages, fwd_rate=cost_model.fwd_rate,
                                           extra_stage=extra)
                if stage.max() == num_stages:  # a last stage of local tiles now hides the final partials
                    num_stages += 1
                    if kv_relay is None:
                        # same rows (local tiles move none; the backward classes of remote tiles keep
                        # their stages), one more stage: no need to derive the schedule again
                        stage_bwd, groups = self._plain_backward(num_stages)
                        sched = replace(sched, num_stages=num_stages)
                        comm = self._comm(sched, directions)
                    else:  # a DKV reduce tree may find room in the new stage
                        stage_bwd, sched, comm, groups = schedule_and_comm(num_stages)

            def spread_and_time(stage_bwd, comm_bwd):
                return self._backward_time(stage_bwd, comm_bwd, num_stages)

            # (on one node too: 32 ranks on one NVLink domain, whose small per-rank batches leave
            # exchange 1 exposed: 1.49 -> 1.34x the bound on a Wikipedia batch)
            def derive(stage_bwd):
                _, split_sched, split_groups = self._schedule(kv_relay, num_stages, stage_bwd)
                split_comm = self._comm(split_sched, directions)
                return (split_sched, split_comm, split_groups), split_comm["bwd"]

            chosen, stage_bwd, (sched, comm, groups), _ = choose_backward_staging(
                stage_bwd, ((sched, comm, groups), comm["bwd"]), derive, spread_and_time, q=tiles.q, kv=tiles.kv,
                rank=rank, home=home, compute=compute_bwd, world_size=P, num_stages=num_stages)
        else:
            chosen = stage_bwd

        def per_stage(st):
            return np.bincount(rank * num_stages + st, weights=compute, minlength=P * num_stages).reshape(P, num_stages)

        sim_time = None
        if score:
            fwd, bwd = cost_model.step_times(per_stage(stage), comm["fwd"], comm["bwd"], per_stage(stage_bwd))
            sim_time = float(fwd.max() + bwd.max())
        choice = None
        if kv_relay is None:  # (what the relay scorer would choose again for this placement)
            choice = BackwardChoice(tiles, home, rank, num_stages, chosen, groups)
        return Placement(block_home=home, tile_rank=rank, tile_stage=stage, schedule=sched,
                         kv_relay=None if kv_relay is None else np.asarray(kv_relay, dtype=np.int64),
                         sim_time=sim_time, tile_stage_bwd=stage_bwd, bwd_choice=choice)
