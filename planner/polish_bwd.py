"""Backward polish: a local search over a finished plan's backward stages, everything else kept.

Notation (docs/design.md, planner/polish.py): P ranks, S stages, exchange j overlaps stage j's compute.
A *group* is one remote input of a rank, (rank, q-block) or (rank, kv-block); here its first / last
stages are over the tiles' *backward* stages (``tile_stage_bwd``). The backward rows (planner/schedule.py):
a q-group's DO in exchange ``first - 1`` and its DQ partial in ``last + 1``; a kv-group's DKV partial in
``last + 1`` to the home, or up the reduce tree its forward relay mirrors (to a proxy, which then
sends at ``max(own last + 1, children's last + 2)``; through a transit rank, one exchange after its
last child's).

Why: the backward stages come from a rule per tile (``backward_stages``: tiles that send a dK/dV
partial first, then those that need dO, then local ones) refined by splitting and deferring whole
classes (planner/stages_bwd.py, planner/candidates.py ``with_deferred_backward``); as for the forward, no step
weighs what a rank's peers send it in the same exchange, or a proxy's sum that can only leave after its
children's partials arrived. The backward is 2.5x the forward's compute, and on the held-out 32 / 8
batches its worst plans simulated 1.54x the bound against a busiest-rank compute of 1.27x.

Search (as the forward's, planner/polish.py ``StageSearch``): the slowest rank's most exposed exchanges
name the moves, each scored incrementally, the best made, up to POLISH_ROUNDS. A *unit* is a group's
tiles in one stage (tiles of a remote q-block stay >= 1: their dO arrives behind stage 0 at the
earliest); tiles that read no remote block form groups of their own, by (rank, q-block), with no rows.
Moves: a unit whose row is among the largest on the exposed link moved one stage either way (for a
sum a proxy or transit rank forwards, also the partials it waits for, one stage earlier); the rank's
own heaviest units beside the exchange moved one stage into it; *fills*: its heaviest units of the
stages with compute to spare moved straight into the exposed stage (a home that ran most of its
backward in stage 0 and then waits on its helpers' partials: single-stage moves of that compute
change nothing until it reaches the late stages); and a reduce tree's sum moved one exchange earlier
as a whole (every partial it waits for, and the proxy's own tiles). Relays impose no constraint: a
reduce tree re-routes itself (a child whose partial would leave too late for its proxy to forward it
sends it home), and a move is scored with the re-routed rows, block by block, by the schedule's own
rule (``dkv_routes``). The forward, the homes, the tile ranks and the relay table stay exactly as
they were.

Measured (fwd + bwd over the bound, geomean, after the forward polish): held-out 32 / 8 1.174 ->
1.155 (worst 1.50 -> 1.46), seed 777 1.159 -> 1.139, the bench's 1.120 -> 1.108; 234 of 315
multi-node evaluation plans faster, none slower; 0.01-0.9 s a plan. Without the fills 1.165 (held
out), without the tree moves 1.156, without those and the waited-for partials 1.161 (docs/planner_log.md).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .cost_model import CostModel
from .placement import Placement, positions_by_key
from .polish import StageSearch, forward_seconds, staged_comm, staged_time
from .schedule import KIND_DKV, KIND_DO, KIND_DQ, dkv_routes, payload_bytes


class BackwardPolish(StageSearch):
    """The backward stages' search state of one placement (see module docstring). Rows: a q-group's DO
    (id g), a group's partial, DQ or DKV (id Gq + g), a transit rank's forwarded DKV sum (id Gq + G + k,
    switched off while no child sends through it)."""

    def __init__(self, tiles, placement: Placement, *, world_size: int, cost_model: CostModel, sizes: dict):
        seconds = forward_seconds(tiles, cost_model, sizes) * cost_model.bwd_flops_factor
        self._setup(tiles, placement, placement.tile_stage_bwd, seconds, world_size=world_size,
                    cost_model=cost_model, local_groups=True)
        self.remote_q = self.home[tiles.q] != self.rank
        nB, G, Gq, home = tiles.num_blocks, self.num_groups, self.num_q_groups, self.home
        src, self.transit_key = self._relays(placement.kv_relay, nB)
        self.kv_src, self.nB = src[Gq:G], nB
        # per block: its kv-groups (ascending by rank, as the schedule orders them) and transit ranks
        kv_block = self.g_block[Gq:G]
        self.block_groups = [Gq + at for at in positions_by_key(kv_block, nB)]
        self.block_transits = positions_by_key(self.transit_key % nB, nB)
        self.block_tree = np.zeros(nB, dtype=bool)
        self.block_tree[kv_block[self.kv_src != home[kv_block]]] = True
        T = self.transit_key.size
        block = np.concatenate([self.g_block[:Gq], self.g_block[:G], self.transit_key % nB])
        kinds = np.concatenate([np.full(Gq, KIND_DO), np.full(Gq, KIND_DQ), np.full(G - Gq, KIND_DKV),
                                np.full(T, KIND_DKV)])
        row_src = np.concatenate([home[self.g_block[:Gq]], self.g_rank[:G], self.transit_key // nB])
        dst, stage, transit_rows = dkv_routes(home, self.g_rank[Gq:G], kv_block, self.last[Gq:G], self.kv_src, nB,
                                               self.S)
        t_on, t_ex = self._transit_state(transit_rows)
        row_dst = np.concatenate([self.g_rank[:Gq], home[self.g_block[:Gq]], dst, home[self.transit_key % nB]])
        row_ex = np.concatenate([self.first[:Gq] - 1, self.last[:Gq] + 1, stage, t_ex])
        row_on = np.concatenate([np.ones(Gq + G, dtype=bool), t_on])
        self._start(row_src, row_dst, row_ex, payload_bytes(kinds, tiles.block_lengths()[block], **sizes), row_on)

    def _transit_state(self, transit_rows: np.ndarray, ids: np.ndarray | None = None) -> tuple:
        """(on, exchange) of the transit rows ``ids`` (default all) given ``dkv_routes``' rows."""
        ids = np.arange(self.transit_key.size) if ids is None else ids
        on, ex = np.zeros(ids.size, dtype=bool), np.zeros(ids.size, dtype=np.int64)
        if transit_rows.shape[0]:
            at = np.searchsorted(self.transit_key[ids], transit_rows[:, 1] * self.nB + transit_rows[:, 4])
            on[at], ex[at] = True, transit_rows[:, 0]
        return on, ex

    def _reroute(self, moved_first: np.ndarray, moved_last: np.ndarray) -> np.ndarray:
        """DO rows of q-groups whose first stage moved, DQ rows of those whose last did, and the DKV rows
        of every block a moved kv-group's last belongs to (its reduce tree routed again); returns the
        ranks at their ends."""
        Gq, G = self.num_q_groups, self.num_groups
        q_first = moved_first[moved_first < Gq]
        q_last, kv_last = moved_last[moved_last < Gq], moved_last[moved_last >= Gq]
        blocks = self.g_block[kv_last]
        plain = ~self.block_tree[blocks]
        changes = [(q_first, dict(row_ex=self.first[q_first] - 1)),
                   (Gq + q_last, dict(row_ex=self.last[q_last] + 1)),
                   (Gq + kv_last[plain], dict(row_ex=self.last[kv_last[plain]] + 1))]
        trees = np.unique(blocks[~plain]).tolist()
        if trees:
            # (kv-group ids ascend with (rank, block), as dkv_routes' lookups need; blocks route independently)
            groups = np.sort(np.concatenate([self.block_groups[b] for b in trees]))
            dst, stage, transit_rows = dkv_routes(self.home, self.g_rank[groups], self.g_block[groups],
                                                   self.last[groups], self.kv_src[groups - Gq], self.nB, self.S)
            changes.append((Gq + groups, dict(row_dst=dst, row_ex=stage)))
            transits = np.sort(np.concatenate([self.block_transits[b] for b in trees]))
            if transits.size:
                on, ex = self._transit_state(transit_rows, transits)
                changes.append((Gq + G + transits, dict(row_on=on, row_ex=ex)))
        return self._move_rows(*changes)

    def _lowest(self, unit: np.ndarray) -> int:
        """Tiles of a remote q-block wait for its dO, which travels behind stage 0 at the earliest."""
        return 1 if self.remote_q[unit].any() else 0

    def apply(self, tiles: np.ndarray, to: int, undo: list | None) -> bool:
        """Move ``tiles`` to stage ``to`` (recorded in ``undo``, unless None); always possible (module
        docstring)."""
        self._shift(tiles, to, undo)
        return True

    def _candidates(self, r: int) -> list:
        """(key, steps) of the moves around rank r's most exposed exchanges: a unit moved one stage, of
        the units whose rows make up r's busiest link and direction there (the POLISH_WIDTH largest; a
        sum that a proxy or transit rank forwards late also names the partials it waits for), and of r's
        own units whose compute could move beside that exchange (the POLISH_WIDTH largest per side); and
        a reduce tree's sum arriving in that exchange moved one exchange earlier as a whole (``_tree``)."""
        out = []
        Gq, G = self.num_q_groups, self.num_groups
        for j, rows in self._exposed(r):
            named = []
            for row in rows.tolist():
                if row < Gq:
                    named += [(row, int(self.first[row]), d) for d in (-1, 1)]
                    continue
                senders = self._senders(row)
                if row < Gq + G:
                    named += [(row - Gq, int(self.last[row - Gq]), d) for d in (-1, 1)]
                late = sorted(senders.tolist(), key=lambda c: -int(self.row_ex[Gq + c]))
                named += [(c, int(self.last[c]), -1) for c in late[:2]]
                tree = self._tree(row, senders, j) if senders.size else ()
                if tree:
                    out.append((("tree", row, j), tree))
            if j < self.S:
                # r's compute beside exchange j: units in stage j + 1 (earlier) or j - 1 (later)
                for f, d in ((j + 1, -1), (j - 1, 1)):
                    if 0 <= f < self.S:
                        named += [(g, f, d) for g in self._heaviest(r, f)]
                # or from any stage with compute to spare
                out += [(("fill", g, f, j), ((self._unit(g, f), j),)) for f in self._slack(r, j)
                        for g in self._heaviest(r, f)]
            out += self._one_stage(named)
        return out

    def _senders(self, row: int) -> np.ndarray:
        """The kv-groups whose DKV partials ``row`` (a DKV row, or a transit rank's) forwards."""
        Gq, G = self.num_q_groups, self.num_groups
        if row < Gq + Gq:
            return np.zeros(0, dtype=np.int64)  # (a DQ row: its own partial only)
        block = self.g_block[row - Gq] if row < Gq + G else self.transit_key[row - Gq - G] % self.nB
        groups = self.block_groups[block]
        return groups[(self.row_dst[Gq + groups] == self.row_src[row]) & (Gq + groups != row)]

    def _tree(self, row: int, senders: np.ndarray, j: int) -> tuple:
        """The steps that let ``row`` (a sum forwarded in exchange j) leave in exchange j - 1: every
        partial it waits for one exchange earlier (its senders' tiles after stage j - 3 to j - 3) and, for
        a proxy, its own tiles after stage j - 2 to j - 2. A single step cannot: the sum leaves only
        after its last partial arrived, so moving one sender alone changes nothing."""
        steps = []
        for c in senders.tolist():
            tiles = self.members[self.starts[c]:self.starts[c + 1]]
            steps.append((tiles[self.stage[tiles] > j - 3], j - 3))
        Gq, G = self.num_q_groups, self.num_groups
        if row < Gq + G:
            g = row - Gq
            tiles = self.members[self.starts[g]:self.starts[g + 1]]
            steps.append((tiles[self.stage[tiles] > j - 2], j - 2))
        return tuple((tiles, to) for tiles, to in steps if tiles.size)


def polish_backward(tiles, placement: Placement, *, world_size: int, cost_model: CostModel, sizes: dict) -> Placement:
    """``placement`` with its backward stages polished (module docstring) where that simulates faster.
    ``placement`` must be scored (``sim_time``, ``schedule``, ``tile_stage_bwd`` set)."""
    if world_size == 1 or placement.schedule is None or placement.schedule.num_stages < 2:
        return placement
    search = BackwardPolish(tiles, placement, world_size=world_size, cost_model=cost_model, sizes=sizes)
    if not search.run():
        return placement
    stage = np.asarray(placement.tile_stage, dtype=np.int64)
    sched, comm = staged_comm(tiles, placement, stage, search.stage, world_size=world_size, cost_model=cost_model,
                              sizes=sizes)
    sim_time = staged_time(search.rank, forward_seconds(tiles, cost_model, sizes), stage, search.stage, comm,
                           world_size=world_size, num_stages=search.S, cost_model=cost_model)
    if sim_time >= placement.sim_time:
        return placement
    return replace(placement, tile_stage_bwd=search.stage.copy(), schedule=sched, sim_time=sim_time)
