"""Node-level relays ("hierarchical" transfers) of hot KV blocks, forward and backward.

Notation (docs/design.md): P ranks on nodes of ``ranks_per_node`` consecutive ranks, nB blocks,
``home[b]`` owns block b, S = num_stages (stages 0..S-1, transfers 0..S). A *receiver* of KV block b
is a rank that computes a tile (q, b) while home[b] is another rank; it first needs b in stage f and
last computes with it in stage l.

Without relays every receiver gets b from the home, so the home of a block many ranks read (a shared
question, the first blocks of causal_blockwise, a sink) pushes one copy per remote *rank* through its
NIC (``inter_bw``, 9x slower than NVLink in the cost model). With a relay it sends one per remote
*node*:

* For b and a remote node N with >= 2 receivers, the *proxy* p is a receiver on N with the earliest
  f (ties: the lowest rank, or rotating with b so that a node's NICs share the inbound copies; both
  are weighed); it receives b from the home as before. Each other receiver r on N with
  f_r > f_p gets b from p in stage f_r: stage f_r's exchange is posted before stage f_r - 1 computes,
  when p already holds b (received by stage f_p <= f_r - 1).
* A receiver with f_r == f_p either *delays* its tiles that read b to stage f_p + 1 (a tile may
  always run later; one extra stage is allowed while the plan has fewer than ``max_stages``) and then
  gets b from p, or keeps receiving b from the home.
* Backward (derived by planner/schedule.py from the same table): relayed receivers send their dK/dV
  partial of b to p, which adds it to its own and sends one sum home.

* Transit relays (``add_transit``, on dcp's final plan): a block that only one rank of a node reads
  still crossed that rank's own NIC, so a rank holding a long document's end on a node of its own
  pulled the document's KV alone. A *transit* rank t of the same node that computes nothing with b
  receives it one stage before the reader needs it and forwards it over NVLink, so the node's NICs
  share the load (``transit_relays``; the schedule derives t's receive, planner/schedule.py
  ``relayed_kv_rows``); the reader's dK/dV partial goes back through t, which forwards it home a stage
  later where the stages allow. Mirrored, t may be a node-mate of a hot *home*, which hands it the
  block over NVLink and sends it out through its own NIC. The transit ranks are chosen to even out
  each node's NIC loads, receiving or sending (a greedy pass over the eligible groups,
  ``_balancing_transit``), or rotate with b; kept where the cost model says so (fwd+bwd / bound over
  the benchmark cases, 32 ranks / 8 per node: none 1.454, rotating 1.422, balanced 1.389).

Which receivers delay is the cost model's call. Candidates: the input, relays without delays, relays
with every possible delay, and a per-rank mix (a rank delays only if its own simulated fwd and bwd
times stay within the slowest rank of the no-delay candidate, so no rank becomes a new straggler).
Each is scored as dcp scores plans (fwd + bwd overlapped time, planner/cost_model.py); the fastest
wins. Everything but the transit choice is numpy over (rank, block) receive groups: no Python loop
over blocks or tiles.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .comm_loops import transit_choices
from .cost_model import CostModel
from .finish import Finisher
from .jit import read_only_int64
from .placement import Placement, compact_stages, per_rank_and_stage, run_heads
from .schedule import (KIND_DKV, KIND_KV, KIND_OUT, KIND_Q, CommSchedule, InputGroups, as_relay_table,
                       kv_block_bytes, receive_groups, row_bytes, schedule_rows)
from .stages import LocalWork
from .stages_bwd import backward_stages, backward_time, choose_backward_staging, spread_backward_local
from .tiles import TileSet


def add_relays(tiles: TileSet, placement: Placement, *, world_size: int, cost_model: CostModel, max_stages: int,
               sizes: dict) -> Placement:
    """``placement`` with KV relays inside nodes when the cost model says they make it faster, else the
    input itself. ``sizes``: num_q_heads, num_kv_heads, head_dim, element_size, grad_element_size (as dcp
    passes them).

    A relayed result carries compact stages, its CommSchedule, its ``kv_relay`` table and ``sim_time``
    (simulated fwd + bwd time). The input's ``sim_time``, when set, is taken as its score (dcp has just
    computed it), so ``result.sim_time`` is then always the returned placement's score.
    """
    base_time, variants = _variants(tiles, placement, world_size=world_size, cost_model=cost_model,
                                    max_stages=max_stages, sizes=sizes)
    best = min(variants, key=lambda v: v.time, default=None)
    if best is None or best.time >= base_time:
        return placement
    return best.placement(placement.block_home, placement.tile_rank, world_size)


def add_transit(tiles: TileSet, placement: Placement, *, world_size: int, cost_model: CostModel,
                sizes: dict) -> Placement:
    """``placement`` (scored: ``sim_time`` set) with the transit relays (``transit_relays``) that even out
    NIC loads inside nodes, if that simulates faster; else the input."""
    rpn = cost_model.topology.ranks_per_node
    if world_size <= rpn or tiles.num_tiles == 0 or placement.sim_time is None:
        return placement
    home = np.asarray(placement.block_home, dtype=np.int64)
    rank = np.asarray(placement.tile_rank, dtype=np.int64)
    stage, _ = compact_stages(placement.tile_stage)
    groups = placement_groups(tiles.kv, KIND_KV, home, rank, stage, None, tiles.num_blocks)
    relay = as_relay_table(placement.kv_relay)
    # Transit relays that even out the NIC loads of each node: a receiver's (its node-mates take the
    # inbound KV of blocks it alone reads) or a home's (node-mates send them out for it), and both
    # together where either alone was faster; with no load to even out, every eligible block through a
    # transit rank (the receives a stage earlier may find room). The fastest is kept if faster than none.
    fwd = placement.schedule.fwd.numpy().astype(np.int64)
    node_of = cost_model.topology.node_of
    inter = node_of(fwd[:, 1]) != node_of(fwd[:, 2])
    block_len = tiles.block_lengths()
    nbytes = row_bytes(fwd[inter], block_len, **sizes)
    kw = dict(ranks_per_node=rpn, world_size=world_size,
              kv_bytes=kv_block_bytes(block_len, **sizes))
    send_load = np.bincount(fwd[inter, 1], weights=nbytes, minlength=world_size)
    by_receiver = transit_relays(home, groups, relay, side="receiver", **kw,
                                 load=np.bincount(fwd[inter, 2], weights=nbytes, minlength=world_size))

    finisher = Finisher(tiles, home, rank, stage, world_size=world_size, cost_model=cost_model, sizes=sizes)

    def with_transit(transit):
        table = np.concatenate([relay, transit])
        return finisher.finish(table[np.lexsort((table[:, 1], table[:, 0]))], spread_forward=False)

    tried = [with_transit(t) for t in (by_receiver, transit_relays(home, groups, relay, side="home", **kw,
                                                                   load=send_load)) if t.size]
    if len(tried) == 2 and min(alt.sim_time for alt in tried) < placement.sim_time:
        rest = transit_relays(home, groups, np.concatenate([relay, by_receiver]), side="home", **kw, load=send_load)
        if rest.size:
            tried.append(with_transit(np.concatenate([by_receiver, rest])))
    if not tried:  # no NIC load to even out: still, receives a stage earlier may find room
        every = transit_relays(home, groups, relay, ranks_per_node=rpn, world_size=world_size)
        if every.size:
            tried.append(with_transit(every))
    return min([placement] + tried, key=lambda alt: alt.sim_time)


def transit_relays(home: np.ndarray, kv_groups, relay: np.ndarray, *, ranks_per_node: int, world_size: int,
                   load: np.ndarray | None = None, kv_bytes: np.ndarray | None = None,
                   side: str = "receiver") -> np.ndarray:
    """int64 [m, 3] (block, dst, t) relays through *transit* ranks, sorted by (block, dst): every receive
    group (``receive_groups``) that still gets its KV block from the home on another node (no row in
    ``relay``), first needing it in stage >= 2, gets it from a rank t of its own node that computes no
    tile of the block - from (b mod n) on, so a node's blocks spread over its ranks - which receives it
    one stage earlier (planner/comm_loops.py ``relayed_kv_rows``).

    With ``load`` (float [P]: bytes each rank receives, or with ``side="home"`` sends, over its NIC) and
    ``kv_bytes`` [nB], only the groups that even out each node's NIC load (``_balancing_transit``); with
    ``side="home"`` the transit rank is on the home's node instead (NVLink from the home, then its own
    NIC), which spreads a hot home's sends over its node."""
    if side not in ("receiver", "home"):
        raise ValueError(f"side must be 'receiver' or 'home', got {side!r}")
    r, b, first, _ = kv_groups
    nB = home.size
    relayed = np.zeros(world_size * nB, dtype=bool)
    relayed[relay[:, 1] * nB + relay[:, 0]] = True
    reads = np.zeros(world_size * nB, dtype=bool)
    reads[r * nB + b] = True
    node = r // ranks_per_node
    idx = np.flatnonzero((node != home[b] // ranks_per_node) & (first >= 2) & ~relayed[r * nB + b])
    if idx.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    if load is not None:
        giver = r[idx] if side == "receiver" else home[b[idx]]
        return _balancing_transit(giver, r[idx], b[idx], first[idx], reads, load, kv_bytes,
                                  ranks_per_node=ranks_per_node, world_size=world_size, one_entry=side == "receiver")
    start = node[idx] * ranks_per_node
    size = np.minimum(ranks_per_node, world_size - start)
    t = np.full(idx.size, -1, dtype=np.int64)
    for j in range(ranks_per_node):  # the first rank from (b mod n) on that neither reads b nor is r
        cand = start + (b[idx] + j) % size
        ok = (t < 0) & (cand != r[idx]) & ~reads[cand * nB + b[idx]]
        t[ok] = cand[ok]
    keep = t >= 0
    rows = np.stack([b[idx][keep], r[idx][keep], t[keep]], axis=1)
    return rows[np.lexsort((rows[:, 1], rows[:, 0]))]


def _balancing_transit(giver: np.ndarray, r: np.ndarray, b: np.ndarray, first: np.ndarray, reads: np.ndarray,
                       load: np.ndarray, kv_bytes: np.ndarray, *, ranks_per_node: int, world_size: int,
                       one_entry: bool) -> np.ndarray:
    """Transit relays (block, r, t) for some of the eligible groups (r, b, first), each weighing on its
    ``giver``'s NIC (the receiver r, or the home): per node, givers in order of decreasing NIC load hand
    their groups (latest first need first: the transit's receive comes a stage earlier) to the
    least-loaded rank of the node that computes no tile of the block, while that leaves the taker's load
    below the giver's. ``one_entry`` (receiver side): a block already entering the node through a
    transit rank reuses it at no further cost; on the home's side every forward is a send of its own.
    ``reads`` [P * nB] marks the (rank, block) pairs with tiles; ``load`` [P] is not modified. Compiled
    (planner/comm_loops.py ``transit_choices``): its Python loop, a few numpy calls per group, was ~7%
    of a 1M / 64 plan."""
    order = np.lexsort((b, -first, giver))  # per giver: latest first need first
    rows = transit_choices(*map(read_only_int64, (giver, r, b, order)), np.ascontiguousarray(reads, dtype=bool),
                           np.array(load, dtype=np.float64), np.array(kv_bytes, dtype=np.float64),
                           int(ranks_per_node), int(world_size), bool(one_entry))
    return rows[np.lexsort((rows[:, 1], rows[:, 0]))]


def relay_variants(tiles: TileSet, placement: Placement, *, world_size: int, cost_model: CostModel,
                   max_stages: int, sizes: dict) -> tuple[float, list[Placement]]:
    """(the input's simulated time, every relayed candidate add_relays weighs, as scored Placements;
    see the module docstring). No candidates (and time inf, not computed) on one node or when no
    block has two receivers on one remote node."""
    base_time, variants = _variants(tiles, placement, world_size=world_size, cost_model=cost_model,
                                    max_stages=max_stages, sizes=sizes)
    return base_time, [v.placement(placement.block_home, placement.tile_rank, world_size) for v in variants]


def _variants(tiles: TileSet, placement: Placement, *, world_size: int, cost_model: CostModel, max_stages: int,
              sizes: dict) -> tuple[float, list]:
    if isinstance(max_stages, bool) or not isinstance(max_stages, (int, np.integer)) or max_stages < 1:
        raise ValueError(f"max_stages must be an int >= 1, got {max_stages!r}")
    if world_size <= cost_model.topology.ranks_per_node or tiles.num_tiles == 0:
        return np.inf, []  # one node: every transfer already travels over NVLink
    home = np.asarray(placement.block_home, dtype=np.int64)
    rank = np.asarray(placement.tile_rank, dtype=np.int64)
    if (home.shape != (tiles.num_blocks,) or rank.shape != (tiles.num_tiles,)
            or np.shape(placement.tile_stage) != (tiles.num_tiles,)):
        raise ValueError(f"placement does not fit the tiles: block_home {home.shape} for {tiles.num_blocks} "
                         f"blocks, tile_rank {rank.shape} / tile_stage for {tiles.num_tiles} tiles")
    if as_relay_table(placement.kv_relay).shape[0]:
        raise ValueError("add_relays expects a placement without relays (its kv_relay is already set)")
    stage, num_stages, schedule, kv_groups = relay_groups(tiles, home, rank, placement)
    rpn = cost_model.topology.ranks_per_node
    # two proxy choices, each weighed below: the lowest-ranked earliest receiver or one
    # rotating over them with the block (a node's NICs share the inbound copies)
    cands = [c for c in (relay_candidates(home, kv_groups, ranks_per_node=rpn, rotate=rotate)
                         for rotate in (False, True)) if c is not None]
    if len(cands) == 2 and np.array_equal(cands[0].proxy, cands[1].proxy) and np.array_equal(cands[0].dst, cands[1].dst):
        cands = cands[:1]  # one earliest receiver per (block, node): the same relays
    last_stage = delay_limit(num_stages, max_stages)
    cands = [cand for cand in cands if any(m.any() for m in _late_early(cand, last_stage))]
    if not cands:
        return np.inf, []
    score = RelayScorer.of(tiles, placement, home, rank, (stage, num_stages, schedule, kv_groups),
                           world_size=world_size, cost_model=cost_model, sizes=sizes)
    base_time = score.base() if placement.sim_time is None else placement.sim_time
    return float(base_time), [v for cand in cands for v in score.weigh(cand, last_stage)]


def relay_groups(tiles: TileSet, home: np.ndarray, rank: np.ndarray, placement: Placement) -> tuple:
    """(compact forward stages, their count, the placement's schedule where it was derived for those
    stages else None, the kv receive groups) of a relay-free placement, as the relay variants start
    from them."""
    stage, num_stages = compact_stages(placement.tile_stage)
    schedule = placement.schedule
    if schedule is not None and (schedule.num_stages != num_stages or not np.array_equal(stage, placement.tile_stage)):
        schedule = None  # derived for other stage numbers
    kv_groups = placement_groups(tiles.kv, KIND_KV, home, rank, stage, schedule, tiles.num_blocks)
    return stage, num_stages, schedule, kv_groups


def delay_limit(num_stages: int, max_stages: int) -> int:
    """The last stage a delayed tile may move to: stage f_p + 1 must exist, and stages go up to S - 1,
    or S when one more is allowed."""
    return num_stages if num_stages - 1 < max_stages else num_stages - 1


def _late_early(cand: "RelayCandidates", last_stage: int) -> tuple[np.ndarray, np.ndarray]:
    """(receivers that need the block after their proxy has it, receivers that would need a delay and
    can have one)."""
    late = cand.first > cand.proxy_first
    return late, ~late & (cand.proxy_first + 1 <= last_stage)


class _Variant(NamedTuple):
    time: float  # simulated fwd + bwd time
    stage: np.ndarray  # int64 [ntiles], compact
    num_stages: int
    fwd: np.ndarray  # float64 [P] per-rank forward time
    bwd: np.ndarray  # float64 [P] per-rank backward time
    rows: tuple  # (fwd, bwd) int64 schedule rows, unsorted
    relay: np.ndarray  # int64 [m, 3] (block, dst, src), sorted
    stage_bwd: np.ndarray  # int64 [ntiles] backward stages

    def placement(self, home, rank, world_size: int) -> Placement:
        schedule = CommSchedule.from_rows(*self.rows, num_stages=self.num_stages, world_size=world_size)
        return Placement(block_home=np.asarray(home, dtype=np.int64), tile_rank=np.asarray(rank, dtype=np.int64),
                         tile_stage=self.stage, schedule=schedule, kv_relay=self.relay, sim_time=self.time,
                         tile_stage_bwd=self.stage_bwd)


class RelayCandidates(NamedTuple):
    """Receivers that may relay: one entry per (block, remote node, non-proxy receiver), arrays of equal
    length, sorted by (block, node, first stage, rank)."""

    block: np.ndarray  # int64 kv-block
    dst: np.ndarray  # int64 the receiver
    proxy: np.ndarray  # int64 its node's proxy for the block
    first: np.ndarray  # int64 the receiver's first-need stage
    proxy_first: np.ndarray  # int64 the proxy's first-need (= receive) stage
    group: np.ndarray  # int64 index of the receiver's (rank, block) entry in the kv receive groups


def relay_candidates(home: np.ndarray, kv_groups, *, ranks_per_node: int, rotate: bool = False) -> RelayCandidates | None:
    """The non-proxy receivers of every (KV block, remote node) with >= 2 receivers, from the tiles'
    kv ``receive_groups`` (planner/schedule.py); None if there are none. The proxy is the lowest-ranked
    receiver with the earliest need, or with ``rotate`` the (b mod n)-th of those n receivers."""
    r, b, first, _ = kv_groups
    node = r // ranks_per_node
    idx = np.flatnonzero(node != home[b] // ranks_per_node)
    if idx.size < 2:
        return None
    key = b * (int(node.max()) + 1) + node  # one key per (block, node)
    idx = idx[np.lexsort((r[idx], first[idx], key[idx]))]  # per (block, node): earliest need, then lowest rank
    group = key[idx]
    head = run_heads(group)
    start = np.flatnonzero(head)
    of_group = np.cumsum(head) - 1
    # rotating: a node's copies of consecutive blocks arrive through different NICs, not all through one
    earliest = np.bincount(of_group, weights=first[idx] == first[idx[start]][of_group]).astype(np.int64)
    proxy_pos = start + (b[idx[start]] % earliest if rotate else 0)
    proxy_idx = idx[proxy_pos][of_group]
    member = np.arange(idx.size) != proxy_pos[of_group]
    if not member.any():
        return None
    idx, proxy_idx = idx[member], proxy_idx[member]
    return RelayCandidates(block=b[idx], dst=r[idx], proxy=r[proxy_idx], first=first[idx],
                           proxy_first=first[proxy_idx], group=idx)


def placement_groups(block, kind: int, home, rank, stage, schedule, num_blocks: int):
    """``receive_groups`` of the tiles' remote q-blocks (kind Q) or kv-blocks (KV): read off the rows of
    the placement's relay-free schedule when it has one (far fewer rows than tiles), else from the tiles.
    An input row ``(first, home, r, kind, b)`` and a result row ``(last + 1, r, home, OUT / DKV, b)``
    exist per group (planner/schedule.py)."""
    if schedule is None:
        remote = home[block] != rank
        return receive_groups(rank[remote], block[remote], stage[remote], num_blocks)
    fwd, bwd = schedule.fwd.numpy(), schedule.bwd.numpy()
    rin = fwd[fwd[:, 3] == kind].astype(np.int64)
    # the forward last stage: OUT rows for q-blocks; kv-blocks have no forward result (their DKV
    # rows follow the backward stages, and only the backward uses a kv group's last stage)
    rback = (fwd[fwd[:, 3] == KIND_OUT] if kind == KIND_Q else bwd[bwd[:, 3] == KIND_DKV]).astype(np.int64)
    rin = rin[np.argsort(rin[:, 2] * num_blocks + rin[:, 4])]  # receiver-major, like receive_groups
    rback = rback[np.argsort(rback[:, 1] * num_blocks + rback[:, 4])]
    return rin[:, 2], rin[:, 4], rin[:, 0], rback[:, 0] - 1


class RelayScorer:
    """dcp's plan score for variants of one placement that differ only in stages and relays (node proxies
    here, one-node fan-outs in planner/fanout.py): simulated
    forward + backward time, each the slowest rank's overlapped time (planner/cost_model.py), over the
    CommSchedule rows and the per-stage compute. The receive groups are computed once; a variant only
    patches the groups of the (rank, block) pairs it delays."""

    def __init__(self, tiles: TileSet, home: np.ndarray, rank: np.ndarray, stage: np.ndarray, num_stages: int,
                 q_groups, kv_groups, *, world_size: int, cost_model: CostModel, sizes: dict, bwd_choice=None):
        self.tiles, self.home, self.rank, self.P, self.cm, self.sizes = tiles, home, rank, world_size, cost_model, sizes
        self.stage, self.num_stages, self.q_groups, self.kv_groups = stage, num_stages, q_groups, kv_groups
        flops = cost_model.tile_flops(tiles.pairs, num_q_heads=sizes["num_q_heads"], head_dim=sizes["head_dim"])
        self.compute_time = flops / cost_model.fwd_rate
        self.block_len = tiles.block_lengths()
        self.remote_q = home[tiles.q] != rank
        nB = tiles.num_blocks
        self.kv_tiles = np.flatnonzero(home[tiles.kv] != rank)  # only these can be delayed
        self.kv_tile_key = rank[self.kv_tiles] * nB + tiles.kv[self.kv_tiles]
        # [P, S + 1]: room for the one extra stage a delay may open
        self.base_compute = per_rank_and_stage(rank, stage, self.compute_time, self.P, num_stages + 1)
        self.remote_kv = home[tiles.kv] != rank
        self.compute_bwd_time = self.compute_time * cost_model.bwd_flops_factor
        self.local_work = LocalWork(np.flatnonzero(~self.remote_q & ~self.remote_kv), rank, self.compute_bwd_time,
                                    world_size)
        self._bwd_cache = {}
        self._bwd_sums = {}  # (num_stages, "bwd" / "fwd") -> ``_backward_sums``
        if bwd_choice is not None and bwd_choice.fits(tiles, home, rank, num_stages):
            # (the placement's own finish chose it from the same inputs: ``_backward`` would again)
            self._bwd_cache[num_stages] = (bwd_choice.stage_bwd, bwd_choice.groups)

    @classmethod
    def of(cls, tiles: TileSet, placement: Placement, home: np.ndarray, rank: np.ndarray, groups: tuple, *,
           world_size: int, cost_model: CostModel, sizes: dict) -> "RelayScorer":
        """The scorer of a relay-free ``placement``'s variants from its ``relay_groups`` (``groups``): its
        q receive groups read off the same schedule, and the backward staging its finish chose."""
        stage, num_stages, schedule, kv_groups = groups
        q_groups = placement_groups(tiles.q, KIND_Q, home, rank, stage, schedule, tiles.num_blocks)
        return cls(tiles, home, rank, stage, num_stages, q_groups, kv_groups, world_size=world_size,
                   cost_model=cost_model, sizes=sizes, bwd_choice=placement.bwd_choice)

    def _backward(self, num_stages: int):
        """(backward stages, their (q, kv) receive groups) for ``num_stages``: they follow from what
        each tile sends and needs (planner/stages_bwd.py backward_stages), not from the forward stages."""
        if num_stages not in self._bwd_cache:
            t, nB = self.tiles, self.tiles.num_blocks
            groups = InputGroups(self.rank, t.q, t.kv, self.remote_q, self.remote_kv)

            def bwd_comm(groups):
                rows = schedule_rows(self.home, self.q_groups, self.kv_groups, num_blocks=nB, num_stages=num_stages,
                                     bwd_groups=groups)[1]
                return self.cm.table_comm_time(rows, self.block_len, self.P, num_stages, **self.sizes)

            def derive(stage_bwd):
                stage_groups = groups(stage_bwd)
                return stage_groups, bwd_comm(stage_groups)

            def time_of(stage_bwd, comm):
                return backward_time(stage_bwd, self.compute_bwd_time, self.rank, self.local_work, comm,
                                     world_size=self.P, num_stages=num_stages, cost_model=self.cm)

            # the backward staging finish_placement would pick for the relay-free placement (local
            # tiles are spread per variant, in _score, against that variant's transfers)
            plain = backward_stages(t.q, t.kv, self.rank, self.home, num_stages)
            stage_bwd, _, stage_groups, _ = choose_backward_staging(
                plain, derive(plain), derive, time_of, q=t.q, kv=t.kv, rank=self.rank, home=self.home,
                compute=self.compute_bwd_time, world_size=self.P, num_stages=num_stages)
            self._bwd_cache[num_stages] = (stage_bwd, stage_groups)
        return self._bwd_cache[num_stages]

    def _backward_sums(self, num_stages: int, seconds: str) -> np.ndarray:
        """The per-(rank, stage) sums of ``_backward``'s stages in backward (``seconds="bwd"``) or forward
        seconds: the same for every variant with this stage count (before its local tiles are spread),
        where each variant summed them again (~250 sums of every tile in a 1M / 64 plan)."""
        key = (num_stages, seconds)
        if key not in self._bwd_sums:
            stage_bwd = self._backward(num_stages)[0]
            weights = self.compute_bwd_time if seconds == "bwd" else self.compute_time
            sums = per_rank_and_stage(self.rank, stage_bwd, weights, self.P, num_stages)
            sums.setflags(write=False)  # (shared by the variants)
            self._bwd_sums[key] = sums
        return self._bwd_sums[key]

    def _score(self, q_groups, kv_groups, relay, compute: np.ndarray, num_stages: int):
        """(fwd + bwd time, fwd per rank, bwd per rank, backward stages, rows) of a variant's groups."""
        stage_bwd, bwd_groups = self._backward(num_stages)
        rows = schedule_rows(self.home, q_groups, kv_groups, num_blocks=self.tiles.num_blocks, num_stages=num_stages,
                             kv_relay=relay, bwd_groups=bwd_groups)
        comm = [self.cm.table_comm_time(table, self.block_len, self.P, num_stages, **self.sizes)
                for table in rows]
        spread = spread_backward_local(stage_bwd, self.compute_bwd_time, self.rank, self.local_work, comm[1],
                                       world_size=self.P, num_stages=num_stages,
                                       per_stage=self._backward_sums(num_stages, "bwd"))
        compute_bwd = (self._backward_sums(num_stages, "fwd") if spread is stage_bwd
                       else per_rank_and_stage(self.rank, spread, self.compute_time, self.P, num_stages))
        stage_bwd = spread
        fwd, bwd = self.cm.step_times(compute, *comm, compute_bwd)
        return float(fwd.max() + bwd.max()), fwd, bwd, stage_bwd, rows

    def base(self) -> float:
        """The input placement's time (with the backward stages of planner/stages_bwd.py)."""
        return self._score(self.q_groups, self.kv_groups, None, self.base_compute[:, :self.num_stages],
                           self.num_stages)[0]

    def weigh(self, cand: RelayCandidates, last_stage: int) -> list:
        """The scored variants of ``cand`` (module docstring): relays without delays where some
        receiver needs none, with every possible delay, and the per-rank mix (a rank delays only if its
        own fwd and bwd times stay within the no-delay variant's slowest rank); ``last_stage``:
        ``delay_limit``."""
        late, early = _late_early(cand, last_stage)
        variants = []
        if not late.any() and not early.any():
            return variants
        lazy = self.variant(cand, np.zeros(cand.block.size, dtype=bool))
        if late.any():
            variants.append(lazy)
        if early.any():
            eager = self.variant(cand, early)
            variants.append(eager)
            fits = (eager.fwd <= lazy.fwd.max()) & (eager.bwd <= lazy.bwd.max())
            mixed = early & fits[cand.dst]
            if mixed.any() and not np.array_equal(mixed, early):
                variants.append(self.variant(cand, mixed))
        return variants

    def variant(self, cand: RelayCandidates, delay: np.ndarray) -> _Variant:
        """Relays for every candidate that needs no delay plus the ``delay``-flagged ones (their tiles
        reading the block move to the proxy's stage + 1), scored."""
        t, nB = self.tiles, self.tiles.num_blocks
        stage, num_stages, compute = self.stage, self.num_stages, self.base_compute
        q_groups, kv_groups = self.q_groups, self.kv_groups
        if delay.any():
            # Only the delayed (rank, block) pairs' tiles move; every other kv first need, in particular
            # each proxy's, is unchanged, so the relays' "held strictly before" conditions stay true.
            to = cand.proxy_first[delay] + 1
            target = np.empty(self.P * nB, dtype=np.int64)  # only the kv tiles' cells are written and read
            target[self.kv_tile_key] = -1
            target[cand.dst[delay] * nB + cand.block[delay]] = to
            new = target[self.kv_tile_key]
            later = new > stage[self.kv_tiles]
            moved, new = self.kv_tiles[later], new[later]
            compute = compute.copy()
            size = compute.size
            compute -= np.bincount(self.rank[moved] * (num_stages + 1) + stage[moved],
                                   weights=self.compute_time[moved], minlength=size).reshape(compute.shape)
            compute += np.bincount(self.rank[moved] * (num_stages + 1) + new,
                                   weights=self.compute_time[moved], minlength=size).reshape(compute.shape)
            stage = stage.copy()
            stage[moved] = new
            # (the groups' last stages are not needed: the backward rows follow the backward groups)
            r, b, first, last = kv_groups
            first = first.copy()
            first[cand.group[delay]] = to
            if self.remote_q[moved].any():  # some moved tile reads a remote q-block: its group may change
                rq = self.remote_q
                q_groups = receive_groups(self.rank[rq], t.q[rq], stage[rq], nB)
            # renumber the used stages >= 1 as 1, 2, ... (monotone: every strict order between stages stays)
            used = np.bincount(stage, minlength=num_stages + 1) > 0
            used[0] = False
            remap = np.cumsum(used)
            num_stages = int(remap[-1]) + 1
            if not np.array_equal(remap[1:num_stages], np.arange(1, num_stages)):
                stage, first = remap[stage], remap[first]
                q_groups = (q_groups[0], q_groups[1], remap[q_groups[2]], remap[q_groups[3]])
                merged = np.zeros((self.P, num_stages + 1))
                np.add.at(merged.T, remap, compute.T)  # columns of stages that collapse onto one
                compute = merged
            kv_groups = (r, b, first, last)
        compute = compute[:, :num_stages]
        use = (cand.first > cand.proxy_first) | delay
        relay = np.stack([cand.block[use], cand.dst[use], cand.proxy[use]], axis=1)
        relay = relay[np.lexsort((relay[:, 1], relay[:, 0]))]
        total, fwd, bwd, stage_bwd, rows = self._score(q_groups, kv_groups, relay, compute, num_stages)
        return _Variant(total, stage, num_stages, fwd, bwd, rows, relay, stage_bwd)
