"""Forward polish: a local search over a finished plan's forward stages, everything else kept.

Notation (docs/design.md): P ranks, S stages, exchange j carries the inputs (Q, KV) of stage j + 1 and
the partials (OUT) of stage j - 1 (planner/cost_model.py). A *group* is one remote input of a rank,
(rank, q-block) or (rank, kv-block): one input row in exchange ``first - 1`` and, for a q-block, one
OUT row in exchange ``last + 1``, where first / last are the stages of the group's first and last
tiles (planner/schedule.py).

Why: ``assign_stages`` orders each rank's inputs by its own receive time, so it cannot see what other
ranks ask of it (a home's KV sends) or the partials it sends back, and the refinements after it
keep or drop whole stagings. On the held-out 32 / 8 batches the forward simulated 1.07-1.67x the
bound where no rank's compute or link bytes exceeded 1.02-1.27x.
With the polish (fwd + bwd over the bound, geomean): the bench's 32 / 8 1.139 -> 1.120, held out
1.205 -> 1.174; 220 of 315 multi-node evaluation plans faster, none slower (docs/planner_log.md).

Search: the slowest rank's exposed exchanges (transfers longer than the compute beside them) name
the candidate moves: a *unit* (a group's tiles in its first stage, or a q-group's in its last) moved
one stage earlier or later (remote tiles stay >= 1: stage 0 reads home blocks only). Every candidate
is applied, scored and undone incrementally (byte loads per rank, exchange and link; compute per
rank and stage), and the one that lowers (slowest rank, sum of the POLISH_TOP slowest) most is
kept; POLISH_ROUNDS at most. A move that breaks a relay drags the units it breaks along (a proxy
must hold its block a stage before its relay receivers need it; a transit source receives it one
stage before its first receiver) or is not made. The backward, the homes, the tile ranks and the
relay table stay exactly as they were, so only the forward time can change: the caller keeps the
result where it simulates faster.

``StageSearch`` is the part the backward polish (planner/polish_bwd.py) shares: groups and their
stage histogram, row loads, per-rank times, moves made of steps (tiles of one rank, a stage) with
their undo, and the greedy rounds; a subclass places its rows and names its moves.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .comm_loops import rank_times
from .cost_model import CostModel
from .group_loops import add_rows, shift_groups, unit_weights
from .placement import Placement, compact_stages, per_rank_and_stage, positions_by_key, run_heads
from .schedule import KIND_KV, KIND_OUT, KIND_Q, as_relay_table, derive_schedule, payload_bytes
from .stages import own_row_movable, spread_local_tiles, spread_own_rows

# Greedy rounds at most (a round makes one move). At 120, 8 of 38 forward searches over the held-out
# 32 / 8 plans stopped at the cap (none of the backward's); 240 made 14 of 189 plans of three draws
# faster, none slower, planning time within noise (the capped searches are few and small).
POLISH_ROUNDS = 240
POLISH_EXCHANGES = 2  # the slowest rank's most exposed exchanges looked at per round
POLISH_WIDTH = 4  # candidate units per exchange and kind (rows by bytes, own units by compute)
POLISH_TOP = 4  # tie-break: the sum of this many slowest ranks' times
# Ranks whose moves a round tries, slowest first, while none of them has one (a move of the next
# slowest must still not slow the slowest). Measured with both polishes (held-out 32 / 8, seed 1):
# 1 -> 1.1512, 2 -> 1.1460, 4 -> 1.1427; planning at 32 / 8 +11% / +39% over 1 (2 costs what 1 did
# before undo became a journal: 97 s for those 21 plans).
POLISH_LOOK = 2


class StageSearch:
    """What the forward and the backward polish share: the search state of one placement's stages in
    one direction (tile groups and their first / last stages, byte loads per link, rank and exchange,
    compute per rank and stage, per-rank times), the incremental move and its undo, and the greedy
    rounds. A subclass says which rows a group's first / last stage places (``_reroute``), which moves
    to try (``_candidates``) and which relays a move must keep (``apply``)."""

    def _setup(self, tiles, placement: Placement, stage: np.ndarray, seconds: np.ndarray, *, world_size: int,
               cost_model: CostModel, local_groups: bool) -> None:
        """The tile state: ranks, ``stage`` (copied), per-tile ``seconds``, the groups (``_groups``) and
        the compute per rank and stage. The rows follow in the subclass, then ``_start``."""
        self.cost_model = cost_model
        self.P, self.S = world_size, placement.schedule.num_stages
        self.home = np.asarray(placement.block_home, dtype=np.int64)
        self.rank = np.asarray(placement.tile_rank, dtype=np.int64)
        self.stage = np.asarray(stage, dtype=np.int64).copy()
        self.seconds = seconds
        self._journal = None  # where _shift records old values for undo (None: not recording)
        self._groups(tiles, local_groups)
        P, S = self.P, self.S
        self.compute = per_rank_and_stage(self.rank, self.stage, self.seconds, P, S)

    def _start(self, row_src, row_dst, row_ex, row_bytes, row_on=None) -> None:
        """The rows (ids in the subclass's layout), their loads, and every rank's time."""
        self.row_src, self.row_dst = row_src.astype(np.int64), row_dst.astype(np.int64)
        self.row_ex, self.row_bytes = row_ex.astype(np.int64), row_bytes.astype(np.int64)
        self.row_on = np.ones(row_src.size, dtype=bool) if row_on is None else row_on
        node_of = self.cost_model.topology.node_of
        self.row_link = (node_of(self.row_src) != node_of(self.row_dst)).astype(np.int64)
        self.load = np.zeros((2, 2, self.P, self.S + 1), dtype=np.int64)  # [link, send / receive, rank, exchange]
        self.rows_at = np.zeros((2, self.P, self.S + 1), dtype=np.int64)  # rows at (rank, exchange) per link
        self._add_rows(np.arange(self.row_ex.size), 1)
        self.time = self._times(np.arange(self.P))

    def _groups(self, tiles, local_groups: bool) -> None:
        """The q-groups (ids 0..Gq-1), then the kv-groups (..G-1), then (``local_groups``) the tiles that
        read no remote block grouped by (rank, q-block) (..G_all-1: no rows, units of compute only):
        their ranks, blocks, member tiles (listed group by group), each tile's groups, and the stage
        histogram that gives a group's first and last."""
        home, rank, nB = self.home, self.rank, tiles.num_blocks
        members, counts, g_rank, g_block, of_tile, base = [], [], [], [], [], 0
        remote_q, remote_kv = home[tiles.q] != rank, home[tiles.kv] != rank
        kinds = [(tiles.q, remote_q), (tiles.kv, remote_kv)]
        if local_groups:
            kinds.append((tiles.q, ~(remote_q | remote_kv)))
        for block, chosen in kinds:
            idx = np.flatnonzero(chosen)
            key = rank[idx] * nB + block[idx]
            order = np.argsort(key, kind="stable")
            idx, key = idx[order], key[order]
            head = run_heads(key)
            tile_group = np.full(block.size, -1, dtype=np.int64)
            tile_group[idx] = base + np.cumsum(head) - 1
            base += int(head.sum())
            of_tile.append(tile_group)
            members.append(idx)
            counts.append(np.diff(np.append(np.flatnonzero(head), idx.size)))
            g_rank.append(key[head] // nB)
            g_block.append(key[head] % nB)
        self.members = np.concatenate(members)
        self.starts = np.concatenate([[0], np.cumsum(np.concatenate(counts))]).astype(np.int64)
        self.g_rank, self.g_block = np.concatenate(g_rank), np.concatenate(g_block)
        self.num_q_groups = g_rank[0].size
        self.num_groups = g_rank[0].size + g_rank[1].size  # G: the groups with rows
        self.tile_groups = of_tile
        self.tile_group_table = np.stack(of_tile)  # [kinds, tiles] (``shift_groups``)
        all_groups = self.g_rank.size
        self.hist = np.zeros((all_groups, self.S), dtype=np.int64)
        for groups in self.tile_groups:
            t = np.flatnonzero(groups >= 0)
            np.add.at(self.hist, (groups[t], self.stage[t]), 1)
        self.first, self.last = self._ends(np.arange(all_groups))

    def _relays(self, kv_relay, nB: int) -> tuple[np.ndarray, np.ndarray]:
        """Each kv-group's proxy group (``proxy_of``, or -1) or transit source (``transit_of``, or -1),
        each proxy's receivers (``children``), each transit source's (``transit_dsts``). Returns every
        group's input source and the transit sources' keys (source * nB + block)."""
        relay = as_relay_table(kv_relay)
        G, Gq = self.num_groups, self.num_q_groups
        kv_ids = np.arange(Gq, G)
        group_key = self.g_rank[kv_ids] * nB + self.g_block[kv_ids]
        src = self.home[self.g_block[:G]].copy()
        self.proxy_of = np.full(G, -1, dtype=np.int64)
        self.transit_of = np.full(G, -1, dtype=np.int64)
        block, dst, source = relay.T
        receiver = kv_ids[np.searchsorted(group_key, dst * nB + block)]
        src[receiver] = source
        source_key = source * nB + block
        pos = np.minimum(np.searchsorted(group_key, source_key), max(group_key.size - 1, 0))
        proxy = group_key[pos] == source_key if group_key.size else np.zeros(block.size, dtype=bool)
        self.proxy_of[receiver[proxy]] = kv_ids[pos[proxy]]
        self.children = {}
        for p, d in zip(kv_ids[pos[proxy]].tolist(), receiver[proxy].tolist()):
            self.children.setdefault(p, []).append(d)
        transit_key, self.transit_of[receiver[~proxy]] = np.unique(source_key[~proxy], return_inverse=True)
        through = self.transit_of[receiver[~proxy]]
        self.transit_dsts = [receiver[~proxy][at] for at in positions_by_key(through, transit_key.size)]
        return src, transit_key

    # state updates --------------------------------------------------------------------------------------

    def _ends(self, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(first, last) stage of each of ``groups``, from the histogram."""
        used = self.hist[groups] > 0
        return used.argmax(axis=1), self.S - 1 - used[:, ::-1].argmax(axis=1)

    def _add_rows(self, rows: np.ndarray, sign: int) -> None:
        """Add (``sign`` 1) or remove (-1) ``rows``' bytes and counts at both ends in their exchanges
        (rows switched off are not counted; compiled: planner/group_loops.py ``add_rows``)."""
        add_rows(np.asarray(rows, dtype=np.int64), sign, self.row_on, self.row_link, self.row_ex, self.row_bytes,
                 self.row_src, self.row_dst, self.load, self.rows_at)

    def _comm(self, ranks) -> np.ndarray:
        """Transfer time of ``ranks`` (an int or an array) in every exchange (planner/cost_model.py
        ``stage_comm_time``), from the current loads."""
        return self.cost_model.link_time(self.load[:, :, ranks].max(axis=1), self.rows_at[:, ranks] > 0)

    def _times(self, ranks: np.ndarray) -> np.ndarray:
        """Overlapped time of ``ranks`` in this direction from the current loads and compute (compiled:
        planner/comm_loops.py ``rank_times``, the floats of ``overlapped_time`` of ``_comm``)."""
        topo = self.cost_model.topology
        return rank_times(np.asarray(ranks, dtype=np.int64), self.load, self.rows_at, self.compute,
                          float(topo.intra_bw), float(topo.inter_bw), float(topo.intra_lat), float(topo.inter_lat))

    def _save(self, name: str, index) -> None:
        """Record ``name[index]``'s values in the open journal (``_shift``), for ``undo``."""
        if self._journal is not None:
            self._journal.append((name, index, getattr(self, name)[index].copy()))

    def _shift(self, tiles: np.ndarray, to, journal: list | None = None) -> np.ndarray:
        """Move ``tiles`` (of one rank) to stage(s) ``to``; every derived quantity follows, the old values
        recorded in ``journal`` (None: not recorded). Returns the groups whose first stage changed."""
        self._journal = journal
        old = self.stage[tiles]
        self._save("stage", tiles)
        self.stage[tiles] = to
        new = self.stage[tiles]
        r = int(self.rank[tiles[0]])
        self._save("compute", r)
        # (compiled: the rank's compute per stage, the groups' histogram rows and first / last stages)
        groups, *before, moved_first, moved_last = shift_groups(tiles, old, new, self.seconds[tiles], self.compute[r],
                                                               self.tile_group_table, self.hist, self.first,
                                                               self.last)
        if self._journal is not None:
            self._journal.extend((name, groups, values) for name, values in zip(("hist", "first", "last"), before))
        G = self.num_groups
        moved_first = moved_first[moved_first < G]  # (local groups have no rows)
        ranks = np.unique(np.append(self._reroute(moved_first, moved_last[moved_last < G]), r))
        self._save("time", ranks)
        self.time[ranks] = self._times(ranks)
        self._journal = None
        return moved_first

    def _move_rows(self, *changes: tuple) -> np.ndarray:
        """Give each ``(rows, columns)`` of ``changes`` its new columns (row_ex, row_dst, row_on: arrays;
        the rows of different changes distinct), loads following in one pass; returns the ranks at the
        rows' ends, before and after."""
        changes = [(rows, columns) for rows, columns in changes if rows.size]
        if not changes:
            return np.zeros(0, dtype=np.int64)
        rows = np.concatenate([rows for rows, _ in changes])
        ends = [self.row_src[rows], self.row_dst[rows]]
        for name in ("load", "rows_at"):
            self._save(name, ...)
        for name in ("row_ex", "row_dst", "row_on", "row_link"):
            self._save(name, rows)
        self._add_rows(rows, -1)
        node_of = self.cost_model.topology.node_of
        for moved, columns in changes:
            for name, values in columns.items():
                getattr(self, name)[moved] = values
            if "row_dst" in columns:
                self.row_link[moved] = node_of(self.row_src[moved]) != node_of(self.row_dst[moved])
        self._add_rows(rows, 1)
        return np.concatenate(ends + [self.row_dst[rows]])

    def _unit(self, g: int, stage: int) -> np.ndarray:
        """Group g's tiles in ``stage``."""
        tiles = self.members[self.starts[g]:self.starts[g + 1]]
        return tiles[self.stage[tiles] == stage]

    def undo(self, journal: list) -> None:
        """Take back the moves ``apply`` recorded in ``journal``: every value it changed restored, latest
        first (exactly: no float sums undone)."""
        for name, index, old in reversed(journal):
            getattr(self, name)[index] = old

    def _score(self) -> tuple[float, float]:
        """(slowest rank's time, sum of the POLISH_TOP slowest)."""
        top = np.partition(self.time, self.P - min(POLISH_TOP, self.P))[-POLISH_TOP:]
        return float(self.time.max()), float(top.sum())

    # search ---------------------------------------------------------------------------------------------

    def _exposed(self, r: int) -> tuple[list, np.ndarray]:
        """Rank r's POLISH_EXCHANGES most exposed exchanges (transfer time over the compute beside it),
        each with its busiest (link, send / receive), and the rows that make up that load, largest
        first (POLISH_WIDTH of them)."""
        topo = self.cost_model.topology
        S = self.S
        seconds = self.load[:, :, r] / np.array([topo.intra_bw, topo.inter_bw])[:, None, None]
        comm = self._comm(r)
        exposed = np.append(comm[:S] - self.compute[r], comm[S])
        out = []
        for j in np.argsort(-exposed)[:POLISH_EXCHANGES].tolist():
            if exposed[j] <= 0:
                break
            link, side = np.unravel_index(int(seconds[:, :, j].argmax()), (2, 2))
            at = self.row_src if side == 0 else self.row_dst
            rows = np.flatnonzero((at == r) & (self.row_ex == j) & (self.row_link == link) & self.row_on)
            out.append((j, rows[np.argsort(-self.row_bytes[rows], kind="stable")[:POLISH_WIDTH]]))
        return out

    def _heaviest(self, r: int, f: int, starting: bool = False) -> list:
        """Rank r's POLISH_WIDTH heaviest units in stage f (their groups; ``starting``: only groups whose
        first stage is f)."""
        own = np.flatnonzero((self.g_rank == r) & ((self.first == f) if starting else (self.hist[:, f] > 0)))
        if own.size == 0:
            return []
        weight = unit_weights(self.members, self.starts, self.stage, self.seconds, own, f)  # (compiled)
        return own[np.argsort(-weight, kind="stable")[:POLISH_WIDTH]].tolist()

    def _slack(self, r: int, j: int) -> list:
        """Rank r's stages other than j whose compute outlasts their exchange, most spare first."""
        spare = self.compute[r] - self._comm(r)[:self.S]
        return [f for f in np.argsort(-spare, kind="stable").tolist() if spare[f] > 0 and f != j][:2]

    def _one_stage(self, named: list) -> list:
        """(key, steps) of the moves (group, its unit's stage, direction): that unit one stage along."""
        return [((g, at, d), ((self._unit(g, at), at + d),)) for g, at, d in named]

    def _lowest(self, unit: np.ndarray) -> int:
        """The earliest stage ``unit`` may move to."""
        return 1

    def _moves(self, r: int) -> list:
        """The candidate moves of a round, unique: each a tuple of steps (tiles of one rank, stage)."""
        moves = {}
        for key, steps in self._candidates(r):
            moves.setdefault(key, steps)
        return [steps for steps in moves.values()
                if all(tiles.size and self._lowest(tiles) <= to <= self.S - 1 for tiles, to in steps)]

    def _make(self, steps: tuple, undo: list | None) -> bool:
        """Apply every step of a move (recorded in ``undo``, unless None); False where one cannot be made."""
        return all(self.apply(tiles, to, undo) for tiles, to in steps)

    def run(self, rounds: int | None = None) -> bool:
        """Greedy rounds (module docstring), POLISH_ROUNDS by default; True where the stages changed."""
        rounds = POLISH_ROUNDS if rounds is None else rounds
        best = self._score()
        changed = False
        for _ in range(rounds):
            found = None
            for r in np.argsort(-self.time, kind="stable")[:POLISH_LOOK].tolist():
                for steps in self._moves(r):
                    undo = []
                    ok = self._make(steps, undo)
                    score = self._score() if ok else None
                    self.undo(undo)
                    # (lexicographic: the slowest rank first, then the POLISH_TOP slowest together)
                    if ok and score < (best if found is None else found[0]):
                        found = (score, steps)
                if found is not None:
                    break  # (the next slowest ranks are looked at only where the slowest has no move)
            if found is None:
                break
            best, steps = found
            if not self._make(steps, None):
                raise AssertionError("a scored move could not be made again")
            changed = True
        return changed


class ForwardPolish(StageSearch):
    """The forward stages' search state of one placement (see module docstring)."""

    def __init__(self, tiles, placement: Placement, *, world_size: int, cost_model: CostModel, sizes: dict):
        self._setup(tiles, placement, placement.tile_stage, forward_seconds(tiles, cost_model, sizes),
                    world_size=world_size, cost_model=cost_model, local_groups=False)
        src, transit_key = self._relays(placement.kv_relay, tiles.num_blocks)
        self._rows(src, transit_key, tiles, sizes)

    def _rows(self, src: np.ndarray, transit_key: np.ndarray, tiles, sizes: dict) -> None:
        """The forward rows: a group's input row (id g), a q-group's OUT row (id G + g), a transit
        source's KV row (id G + Gq + k); their bytes, links and exchanges, and the loads they make."""
        G, Gq, nB, home = self.num_groups, self.num_q_groups, tiles.num_blocks, self.home
        t_block = transit_key % nB
        kinds = np.concatenate([np.where(np.arange(G) < Gq, KIND_Q, KIND_KV), np.full(Gq, KIND_OUT),
                                np.full(transit_key.size, KIND_KV)])
        row_src = np.concatenate([src, self.g_rank[:Gq], home[t_block]])
        row_dst = np.concatenate([self.g_rank[:G], home[self.g_block[:Gq]], transit_key // nB])
        row_block = np.concatenate([self.g_block[:G], self.g_block[:Gq], t_block])
        row_ex = np.concatenate([self.first[:G] - 1, self.last[:Gq] + 1,
                                 [self._transit_exchange(k) for k in range(transit_key.size)]])
        self._start(row_src, row_dst, row_ex, payload_bytes(kinds, tiles.block_lengths()[row_block], **sizes))

    def _transit_exchange(self, k: int) -> int:
        """The exchange a transit source receives its block in: one stage before its first receiver's."""
        return int(self.first[self.transit_dsts[k]].min()) - 2

    def _reroute(self, moved_first: np.ndarray, moved_last: np.ndarray) -> np.ndarray:
        """The input rows of groups whose first stage moved, the OUT rows of q-groups whose last did, and
        the rows into the transit sources they read from; returns the ranks at their ends."""
        G, Gq = self.num_groups, self.num_q_groups
        moved_last = moved_last[moved_last < Gq]
        rows, ex = [moved_first, G + moved_last], [self.first[moved_first] - 1, self.last[moved_last] + 1]
        transit = self.transit_of[moved_first]
        transit = np.unique(transit[transit >= 0])
        if transit.size:
            rows.append(G + Gq + transit)
            ex.append(np.array([self._transit_exchange(k) for k in transit.tolist()], dtype=np.int64))
        return self._move_rows((np.concatenate(rows), dict(row_ex=np.concatenate(ex))))

    def apply(self, tiles: np.ndarray, to: int, undo: list | None, depth: int = 0) -> bool:
        """Move ``tiles`` to stage ``to`` (recorded in ``undo``, unless None) with the relay cascades it
        needs; False where a relay cannot be kept (the caller undoes)."""
        for g in self._shift(tiles, to, undo).tolist():
            if self.transit_of[g] >= 0 and self.first[g] < 2:
                return False  # the transit source would receive before exchange 0
            p = self.proxy_of[g]
            if p >= 0 and self.first[p] >= self.first[g]:
                if depth >= 2 or self.first[g] - 1 < 1:
                    return False
                if not self.apply(self._unit(p, self.first[p]), self.first[g] - 1, undo, depth + 1):
                    return False
            for d in self.children.get(g, ()):
                if self.first[d] <= self.first[g]:
                    late = self.members[self.starts[d]:self.starts[d + 1]]
                    late = late[self.stage[late] <= self.first[g]]
                    if depth >= 2 or self.first[g] + 1 > self.S - 1:
                        return False
                    if not self.apply(late, self.first[g] + 1, undo, depth + 1):
                        return False
        return True

    def _candidates(self, r: int) -> list:
        """(key, steps) of the moves around rank r's most exposed exchanges: a unit moved one stage, of
        the units whose rows make up r's busiest link and direction there (the POLISH_WIDTH largest),
        and of r's own units whose compute could move beside that exchange (the POLISH_WIDTH largest)."""
        out = []
        G, Gq = self.num_groups, self.num_q_groups
        for j, rows in self._exposed(r):
            named = []
            for row in rows.tolist():
                if row < G:
                    named += [(row, int(self.first[row]), d) for d in (-1, 1)]
                elif row < G + Gq:
                    named += [(row - G, int(self.last[row - G]), d) for d in (-1, 1)]
                else:
                    named += [(g, int(self.first[g]), d) for g in self.transit_dsts[row - G - Gq][:2].tolist()
                              for d in (-1, 1)]
            if j < self.S:
                # r's compute beside exchange j: units starting in stage j + 1 (earlier) or j - 1 (later)
                for f, d in ((j + 1, -1), (j - 1, 1)):
                    named += [(g, f, d) for g in self._heaviest(r, f, starting=True)]
            out += self._one_stage(named)
        return out


def forward_seconds(tiles, cost_model: CostModel, sizes: dict) -> np.ndarray:
    """Each tile's forward compute time (planner/cost_model.py; the backward's is ``bwd_flops_factor``
    times as long)."""
    return cost_model.tile_flops(tiles.pairs, num_q_heads=sizes["num_q_heads"],
                                 head_dim=sizes["head_dim"]) / cost_model.fwd_rate


def staged_time(rank: np.ndarray, seconds: np.ndarray, stage: np.ndarray, stage_bwd: np.ndarray, comm: dict, *,
                world_size: int, num_stages: int, cost_model: CostModel) -> float:
    """Simulated step time (slowest rank's forward + slowest rank's backward) of tiles on ``rank`` with
    forward ``seconds``, in forward ``stage`` / backward ``stage_bwd``, beside ``comm`` (``staged_comm``)."""
    P, S = world_size, num_stages

    def per_stage(st):
        return per_rank_and_stage(rank, st, seconds, P, S)

    fwd, bwd = cost_model.step_times(per_stage(stage), comm["fwd"], comm["bwd"], per_stage(stage_bwd))
    return float(fwd.max() + bwd.max())


def staged_comm(tiles, placement: Placement, stage: np.ndarray, stage_bwd: np.ndarray, *, world_size: int,
                cost_model: CostModel, sizes: dict) -> tuple:
    """(schedule, {"fwd", "bwd": transfer time [P, S + 1]}) of ``placement`` under forward stages
    ``stage`` and backward stages ``stage_bwd``."""
    S = placement.schedule.num_stages
    sched = derive_schedule(placement.block_home, tiles.q, tiles.kv, placement.tile_rank, stage,
                            num_blocks=tiles.num_blocks, num_stages=S, world_size=world_size,
                            kv_relay=placement.kv_relay, tile_stage_bwd=stage_bwd)
    block_len, comm = tiles.block_lengths(), {}
    for direction in ("fwd", "bwd"):
        table = sched.cost_rows(direction)  # (sums: any order)
        comm[direction] = cost_model.table_comm_time(table, block_len, world_size, S, **sizes)
    return sched, comm


def polish_forward(tiles, placement: Placement, *, world_size: int, cost_model: CostModel, sizes: dict) -> Placement:
    """``placement`` with its forward stages polished (module docstring) where that simulates faster; then
    also with its local tiles and own rows spread into the gaps the new stages leave (planner/stages.py
    ``spread_own_rows``, ``spread_local_tiles``: no transfer changes), kept where faster still.
    ``placement`` must be scored (``sim_time``, ``schedule``, ``tile_stage_bwd`` set)."""
    if world_size == 1 or placement.schedule is None or placement.schedule.num_stages < 3:
        return placement  # (remote tiles all in stage 1: nothing to move)
    search = ForwardPolish(tiles, placement, world_size=world_size, cost_model=cost_model, sizes=sizes)
    if not search.run():
        return placement
    S, home, rank, stage = search.S, search.home, search.rank, search.stage
    stage_bwd = np.asarray(placement.tile_stage_bwd, dtype=np.int64)
    sched, comm = staged_comm(tiles, placement, stage, stage_bwd, world_size=world_size, cost_model=cost_model,
                              sizes=sizes)
    seconds = search.seconds
    local = (home[tiles.q] == rank) & (home[tiles.kv] == rank)
    movable = lambda: own_row_movable(tiles.q, tiles.kv, stage, rank, home)  # noqa: E731
    spread = spread_own_rows(stage, seconds, rank, movable, comm["fwd"], world_size=world_size, num_stages=S)
    spread = spread_local_tiles(spread, seconds * cost_model.fwd_rate, rank, local, comm["fwd"],
                                world_size=world_size, num_stages=S, fwd_rate=cost_model.fwd_rate)
    best = placement
    for staged in (stage, spread):
        # (a stage left empty would be renumbered away from the backward's by make_plan's compaction)
        if compact_stages(staged)[1] != S:
            continue
        sim_time = staged_time(rank, seconds, staged, stage_bwd, comm, world_size=world_size, num_stages=S,
                               cost_model=cost_model)
        if sim_time < best.sim_time:
            best = replace(placement, tile_stage=staged.copy(), schedule=sched, sim_time=sim_time)
    return best
