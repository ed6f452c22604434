"""Backward staging: in which stage each tile runs in the backward, given the forward's placement.

Notation (docs/design.md): P ranks, S stages, tiles (qb, kb) on ``tile_rank``; ``home[b]`` owns block b.

In the backward every forward input is already on the tile's rank; only dO / lse / delta of remote
q-blocks travel home -> rank, and dQ / dK / dV partials rank -> home. ``backward_stages`` gives the
class rule (tiles sending a dK/dV partial first, tiles waiting for dO next, purely local tiles last);
``split_backward_stages`` and ``defer_backward_groups`` move whole (rank, kv-block) groups of stage-0
tiles into the stages whose exchanges the rule leaves exposed; ``spread_backward_local`` pours purely
local tiles into the remaining gaps (compiled, with the forward's spreads: planner/spread_loops.py).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .backward_loops import class_rule_stages, split_stage0_groups, stage0_kv_groups
from .cost_model import CostModel
from .placement import per_rank_and_stage
from .spread_loops import backward_gaps
from .stages import LocalWork, _grouped_cumsum
from .tile_loops import pour

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
    q, kv, rank, home = (np.asarray(x, dtype=np.int64) for x in (q, kv, rank, home))
    return class_rule_stages(q, kv, rank, home, num_stages)  # (compiled: one pass, no temporaries)


def _stage0_remote_kv_groups(stage: np.ndarray, kv: np.ndarray, rank: np.ndarray, home: np.ndarray,
                             compute: np.ndarray, ranks: np.ndarray, ranks_per_node: int | None = None):
    """The whole (rank, kv-block) groups of backward stage-0 tiles reading remote KV, on the ``ranks``
    flagged ([P] bool): (tile indices, each tile's group, each group's rank, each group's seconds),
    groups ordered per rank with the latest kv-block first; None when there is none. With
    ``ranks_per_node``, only groups whose kv-block's home is on the rank's node. Compiled
    (planner/backward_loops.py ``stage0_kv_groups``)."""
    found = stage0_kv_groups(*(np.asarray(x, dtype=np.int64) for x in (stage, kv, rank, home)),
                             np.asarray(compute, dtype=np.float64), np.asarray(ranks, dtype=bool),
                             0 if ranks_per_node is None else int(ranks_per_node))
    return None if found[0].size == 0 else found


def split_backward_stages(stage: np.ndarray, q: np.ndarray, kv: np.ndarray, rank: np.ndarray, home: np.ndarray,
                          compute: np.ndarray, comm_time: np.ndarray, *, world_size: int, num_stages: int) -> np.ndarray:
    """``backward_stages`` refined where a rank's exchange 1 (the dK/dV partials of its stage-0 tiles,
    dO for its stage-1 tiles) is exposed while stage 0 has compute to spare: whole (rank, kv-block)
    groups of stage-0 tiles, latest kv-blocks first, move to stage 1 - up to half the smaller of gap
    and surplus, since each moved group's partial also moves on to exchange 2. ``compute``: per-tile
    backward seconds; ``comm_time`` [P, S + 1]: backward transfer time per exchange."""
    if num_stages < 3:
        return stage
    return split_stage0_groups(*(np.asarray(x, dtype=np.int64) for x in (stage, kv, rank, home)),
                               np.asarray(compute, dtype=np.float64), np.ascontiguousarray(comm_time, dtype=np.float64),
                               int(world_size), int(num_stages))  # (compiled: planner/backward_loops.py)


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
    return defer_backward_orders(stage, kv, rank, home, compute, load, comm_time, share=share,
                                 orders=(largest_first,), into_last=into_last, ranks_per_node=ranks_per_node)[0]


def defer_backward_orders(stage: np.ndarray, kv: np.ndarray, rank: np.ndarray, home: np.ndarray,
                          compute: np.ndarray, load: np.ndarray, comm_time: np.ndarray, *,
                          share: float = DEFER_SHARE, orders: tuple = (False,), into_last: bool = False,
                          ranks_per_node: int | None = None) -> list:
    """``defer_backward_groups`` for each ``largest_first`` of ``orders``, in that order: the groups
    and the room are the same for both orders, so they are found once (the deferral rounds try both:
    half of a 1M / 64 plan's group searches were repeats)."""
    P, S = load.shape
    if S < 3:
        return [stage] * len(orders)
    top = S if into_last else S - 1  # stages 1 .. top - 1 take groups
    gaps = np.maximum(0.0, comm_time[:, 1:top] - load[:, 1:top])  # stage j overlaps exchange j
    surplus = np.maximum(0.0, load[:, 0] - comm_time[:, 0])
    upto = np.minimum(np.cumsum(share * gaps, axis=1), surplus[:, None])  # [P, top - 1] work placed up to stage j
    found = _stage0_remote_kv_groups(stage, kv, rank, home, compute, upto[:, -1] > 0, ranks_per_node)
    if found is None:
        return [stage] * len(orders)
    return [_deferred(stage, found, upto, top - 1, largest_first) for largest_first in orders]


def defer_backward_variants(stage: np.ndarray, kv: np.ndarray, rank: np.ndarray, home: np.ndarray,
                            compute: np.ndarray, load: np.ndarray, comm_time: np.ndarray, variants, *,
                            into_last: bool = False, ranks_per_node: int | None = None):
    """``defer_backward_groups`` for each (largest_first, node_local) of ``variants`` (node_local: by
    ``ranks_per_node``), yielded as (variant, stages): each node_local's groups are searched once for
    all its orders (``defer_backward_orders``), and only when the first of its variants is asked for,
    so a caller that stops early skips the rest."""
    for node_local in dict.fromkeys(local for _, local in variants):
        orders = tuple(largest_first for largest_first, local in variants if local == node_local)
        staged = defer_backward_orders(stage, kv, rank, home, compute, load, comm_time, orders=orders,
                                       into_last=into_last, ranks_per_node=ranks_per_node if node_local else None)
        for largest_first, cand in zip(orders, staged):
            yield (largest_first, node_local), cand


def _deferred(stage: np.ndarray, found: tuple, upto: np.ndarray, F: int, largest_first: bool) -> np.ndarray:
    """``stage`` with the groups ``found`` (``_stage0_remote_kv_groups``) moved into the room ``upto``
    [P, F] (work placed up to each of stages 1 .. F), each rank's groups in the order ``largest_first``
    asks for; ``stage`` itself where none moves."""
    P = upto.shape[0]
    idx, of_tile, group_rank, group_c = found
    if largest_first:
        order = np.lexsort((-group_c, group_rank))
        end = np.empty_like(group_c)
        end[order] = _grouped_cumsum(group_rank[order], group_c[order])
    else:
        end = _grouped_cumsum(group_rank, group_c)
    # a group goes to the first stage j whose cumulative room reaches its end (as the spreads' pour
    # does, planner/tile_loops.py)
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


def _spread_backward_local(stage: np.ndarray, compute: np.ndarray, rank: np.ndarray, local: LocalWork,
                           comm_time: np.ndarray, *, world_size: int, num_stages: int,
                           per_stage: np.ndarray | None = None) -> tuple:
    """Move purely local tiles (no transfer) from their backward stage (``backward_stages``) into the
    stages whose next transfers (``comm_time`` [P, S + 1], backward) would otherwise be exposed:
    partials arriving at a home, dO leaving it. ``compute``: per-tile backward seconds. Each rank
    keeps in the local stage what hides its own next transfers and fills the gaps of the other
    stages in order; the schedule is unchanged (local tiles move nothing). ``local``: the LocalWork of
    the purely local tiles in tile order under ``compute``, all still in their class-rule stage. Also
    returns the compute per rank and stage of ``stage`` (``backward_time`` reuses it where no tile moves);
    ``per_stage``: those sums, where the caller has them."""
    S, P = num_stages, world_size
    if per_stage is None:
        per_stage = per_rank_and_stage(rank, stage, compute, P, S)
    if S < 2:
        return stage, per_stage
    # (compiled: planner/spread_loops.py; the grouping of the local tiles is kept by ``local``)
    gaps, movable, fill, exposed = backward_gaps(per_stage, np.ascontiguousarray(comm_time, dtype=np.float64),
                                                 np.asarray(local.total, dtype=np.float64))
    if not exposed or local.tiles.size == 0:
        return stage, per_stage
    order, ranks, end = local.grouped
    return pour(np.ascontiguousarray(stage, dtype=np.int64), order, ranks, end, local.total, gaps, movable,
                fill)[0], per_stage


def spread_backward_local(stage: np.ndarray, compute: np.ndarray, rank: np.ndarray, local: LocalWork,
                          comm_time: np.ndarray, *, world_size: int, num_stages: int,
                          per_stage: np.ndarray | None = None) -> np.ndarray:
    """``_spread_backward_local``'s stages alone."""
    return _spread_backward_local(stage, compute, rank, local, comm_time, world_size=world_size,
                                  num_stages=num_stages, per_stage=per_stage)[0]


def backward_time(stage_bwd: np.ndarray, compute_bwd: np.ndarray, rank: np.ndarray, local: LocalWork,
                  comm_bwd: np.ndarray, *, world_size: int, num_stages: int, cost_model: CostModel) -> tuple:
    """(``stage_bwd`` with its local tiles spread against ``comm_bwd`` [P, S + 1], the slowest rank's
    overlapped backward time); ``compute_bwd``: per-tile backward seconds, ``local``: their LocalWork."""
    spread, per = _spread_backward_local(stage_bwd, compute_bwd, rank, local, comm_bwd, world_size=world_size,
                                         num_stages=num_stages)
    if spread is not stage_bwd:  # (where no tile moved, the sums just taken are these)
        per = per_rank_and_stage(rank, spread, compute_bwd, world_size, num_stages)
    return spread, float(cost_model.overlapped_time(per, comm_bwd).max())
