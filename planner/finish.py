"""Finishing a placement: homes, tile ranks and forward stages -> a scored Placement.

Notation (docs/design.md): P ranks, S stages, tiles (qb, kb) on ``tile_rank``; ``home[b]`` owns block b.

``finish_placement`` compacts the forward stages, chooses the backward staging (planner/stages_bwd.py),
derives the CommSchedule (planner/schedule.py) under a relay table, spreads local tiles into the
stages whose transfers would be exposed (planner/stages.py) and simulates the forward + backward
time (planner/cost_model.py). ``Finisher`` keeps what does not depend on the relay table, so a
placement weighed under several tables (add_transit) or deferred (``Finisher.deferred``) shares it.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .cost_model import CostModel
from .placement import Placement, compact_stages, per_rank_and_stage
from .schedule import InputGroups, as_relay_table, relayed_kv_side, schedule_from_groups, schedule_rows
from .stages import LocalWork, own_row_movable, spread_local_tiles, spread_own_rows
from .stages_bwd import (DEFER_ROUNDS, BackwardChoice, backward_stages, backward_time, choose_backward_staging,
                         defer_backward_variants, defer_variant_sets)


def finish_placement(tiles, home: np.ndarray, rank: np.ndarray, stage: np.ndarray, *, world_size: int,
                     cost_model: CostModel, sizes: dict, kv_relay=None, spread_forward: bool = True,
                     max_stages: int | None = None, score: bool = True, bwd_choice=None) -> Placement:
    """The Placement of given homes, tile ranks and forward stages, completed: stages compacted,
    backward stages (``backward_stages``), the CommSchedule, local tiles spread into the stages where
    transfers would otherwise be exposed (forward only with ``spread_forward``, then also the tiles of
    a rank's own rows that move no transfer, ``spread_own_rows``; into one more stage after the last
    when ``max_stages`` allows it; backward always), and the simulated
    forward + backward time (``score``; without it, ``sim_time`` is None and the forward's transfer
    times are not computed). ``sizes``: num_q_heads, num_kv_heads, head_dim, element_size, grad_element_size.
    ``bwd_choice``: another placement's ``BackwardChoice`` (planner/stages_bwd.py), taken as this one's
    where it fits these homes, tile ranks and stage count without relays (it would be chosen again)."""
    return Finisher(tiles, home, rank, stage, world_size=world_size, cost_model=cost_model, sizes=sizes).finish(
        kv_relay, spread_forward=spread_forward, max_stages=max_stages, score=score, bwd_choice=bwd_choice)


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
        self._plain_bwd = {}  # min(num_stages, 3) -> (class-rule backward stages, their receive groups)
        self._local_work = None
        self._own_movable = None  # (``_own_row_movable``)
        self._kv_sides = {}  # relay table (bytes) -> relayed_kv_side of the forward groups

    def _groups(self, stage: np.ndarray) -> tuple:
        """(q, kv) ``receive_groups`` of the remote inputs under per-tile ``stage``."""
        if self._input_groups is None:
            t = self.tiles
            self._input_groups = InputGroups(self.rank, t.q, t.kv, self.remote_q, self.remote_kv)
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

    def _kv_side(self, kv_relay):
        """``relayed_kv_side`` of the forward groups under ``kv_relay`` (None without relays), once per
        table: every backward staging weighed under it shares the forward's KV sources (half of a
        1M / 64 plan's relayed KV derivations were repeats, most of them in the deferral rounds)."""
        relay = as_relay_table(kv_relay)
        if relay.shape[0] == 0:
            return None
        key = relay.tobytes()
        if key not in self._kv_sides:
            self._kv_sides[key] = relayed_kv_side(self.home, self._forward_groups()[1], relay, self.tiles.num_blocks)
        return self._kv_sides[key]

    def _plain_backward(self, num_stages: int) -> tuple:
        # (the class rule's three stages all fit from 3 stages on: the same stages and groups for any
        # more, as when the forward spread opens one more stage)
        key = min(num_stages, 3)
        if key not in self._plain_bwd:
            stage_bwd = backward_stages(self.tiles.q, self.tiles.kv, self.rank, self.home, num_stages)
            self._plain_bwd[key] = (stage_bwd, self._groups(stage_bwd))
        return self._plain_bwd[key]

    def _schedule(self, kv_relay, num_stages: int, stage_bwd: np.ndarray | None = None):
        """(backward stages, CommSchedule, the backward's receive groups); ``stage_bwd`` None: the
        class-rule backward stages."""
        if stage_bwd is None:
            stage_bwd, bwd_groups = self._plain_backward(num_stages)
        else:
            bwd_groups = self._groups(stage_bwd)
        sched = schedule_from_groups(self.home, *self._forward_groups(), num_blocks=self.tiles.num_blocks,
                                     num_stages=num_stages, world_size=self.P, kv_relay=kv_relay,
                                     bwd_groups=bwd_groups, kv_side=self._kv_side(kv_relay))
        return stage_bwd, sched, bwd_groups

    def _comm(self, sched, directions) -> dict:
        comm = {}
        for direction in directions:
            table = sched.cost_rows(direction)
            comm[direction] = self.cost_model.table_comm_time(table, self.block_len, self.P, sched.num_stages,
                                                              **self.sizes)
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
                                num_stages=num_stages, kv_relay=kv_relay, bwd_groups=groups,
                                kv_side=self._kv_side(kv_relay))
        return groups, self.cost_model.table_comm_time(rows, self.block_len, self.P, num_stages, **self.sizes)

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
                                     num_stages=S, world_size=self.P, kv_relay=kv_relay, bwd_groups=groups,
                                     kv_side=self._kv_side(kv_relay))
        comm = self._comm(sched, ("fwd", "bwd"))

        def per_stage(stage):
            return per_rank_and_stage(self.rank, stage, self.compute, self.P, S)

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
                load = per_rank_and_stage(self.rank, spread, self.compute_bwd, self.P, S)
                cands = dict(defer_backward_variants(unspread, self.tiles.kv, self.rank, self.home, self.compute_bwd,
                                                     load, comm, variants, into_last=into_last, ranks_per_node=rpn))
                tried, found = [], None
                for variant in variants:
                    cand = cands[variant]
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
               score: bool = True, bwd_choice=None) -> Placement:
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
                        sched = sched.with_num_stages(num_stages)
                        comm = self._comm(sched, directions)
                    else:  # a DKV reduce tree may find room in the new stage
                        stage_bwd, sched, comm, groups = schedule_and_comm(num_stages)

            def spread_and_time(stage_bwd, comm_bwd):
                return self._backward_time(stage_bwd, comm_bwd, num_stages)

            # (on one node too: 32 ranks on one NVLink domain, whose small per-rank batches leave
            # exchange 1 exposed: 1.49 -> 1.34x the bound on a Wikipedia batch). The split is weighed on
            # its backward transfers alone (the forward's are the same), and its schedule derived only
            # where it wins: 1 in 3 one-node plans.
            def derive(stage_bwd):
                return self._backward_transfers(kv_relay, num_stages, stage_bwd)

            plain, spread = stage_bwd, None
            if kv_relay is None and bwd_choice is not None and bwd_choice.fits(tiles, home, rank, num_stages):
                # (the class rule, its split and their relay-free transfers do not depend on the forward
                # stages: the choice is the same; 23 of a 1M / 64 plan's 121 choices are restagings')
                chosen = plain if np.array_equal(bwd_choice.stage_bwd, plain) else bwd_choice.stage_bwd
            else:
                chosen, spread, groups, _ = choose_backward_staging(
                    plain, (groups, comm["bwd"]), derive, spread_and_time, q=tiles.q, kv=tiles.kv,
                    rank=rank, home=home, compute=compute_bwd, world_size=P, num_stages=num_stages)
            if chosen is not plain:
                _, sched, groups = self._schedule(kv_relay, num_stages, chosen)
                comm = self._comm(sched, directions)
            stage_bwd = spread_and_time(chosen, comm["bwd"])[0] if spread is None else spread
        else:
            chosen = stage_bwd

        def per_stage(st):
            return per_rank_and_stage(rank, st, compute, P, num_stages)

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
