"""dcp's first pass: the candidate starts planned, compared and refined into finalists (``_dcp``).

Notation (docs/design.md): nB blocks, P ranks, tile (qb, kb); ``home[b]`` owns block b.

Each candidate start (planner/starts.py, planner/fcp.py) is balanced (planner/balance.py), staged and
scored (planner/candidates.py); large batches are planned on merged blocks and mapped back. On one
node the fastest plan is kept, or of the near-fastest the one moving the fewest bytes; on several
nodes the fastest candidates get relays and join relay-aware starts as finalists, the fastest of which
are refined. The same pass, seeded with given homes, is the second opinion of planner/passes.py. The
steps are described in full in planner/dcp.py's docstring.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .candidates import (_balanced, _initial_home, _lower_bound, _place, _relay_balanced, _restaged,
                         _schedule_bytes, _staged, _time_floor, coarsening_factor, merged_home, moved_bytes)
from .cost_model import CostModel, Topology
from .placement import Placement, compact_stages, prefix_sums
from .relay import add_relays
from .schedule import derive_schedule_merged
from .starts import hot_rows
from .tile_loops import inherit_merged
from .tiles import TileSet, coarsen

# Initial data placements tried, in order of how often each won in bench/bench_planner.py runs; the
# first plan within GOOD_ENOUGH of the lower bound (fwd + bwd) is kept without trying the rest.
# One node: "fcp-docs" first, as fast as "fcp" or faster on 17 of the 19 one-node benchmark cases and
# 14-52% fewer bytes on the Wikipedia causal/lambda batches (8 ranks: bytes over zigzag 1.76 -> 1.55
# geomean, fwd+bwd over the bound 1.0174 -> 1.0161); "fcp" stays for the batches it moves fewer bytes on.
SINGLE_NODE_INITS = ("fcp-docs", "fcp", "contiguous")
# Several nodes: "zigzag" (the balanced zigzag placement) was dropped when "fcp-docs" came in: over the
# benchmark cases it no longer won anywhere, and one candidate less keeps the relay finalists for the
# others (fwd+bwd / bound on 16/8, 32/8, 16/4: 1.082 / 1.467 / 1.188 with it, 1.079 / 1.454 / 1.186 without).
# "hierarchical-fcp-wide" (last, dropped where its homes are "hierarchical-fcp"'s): the node packing with a
# cut's KV priced over the node's NICs, as relays and transit relays spread it, not over one NIC; one
# NIC keeps a document a little heavier than a node on it (fwd + bwd over the bound, 32 ranks / 8 per
# node, a Wikipedia lambda batch: node compute 1.29x the mean, 1.50x the bound; wide 1.22x).
MULTI_NODE_INITS = ("hierarchical", "hierarchical-fcp", "fcp", "zigzag-ring", "fcp-docs", "hierarchical-fcp-wide")
GOOD_ENOUGH = 1.05
# One node, most of the compute in segments longer than a rank's memory (``_mostly_split_segments``):
# every candidate is planned, and of those within GOOD_ENOUGH of the bound and within BYTES_SLACK of
# the fastest the one moving the fewest bytes is kept. On the long-tail batches (8 ranks) "contiguous"
# then wins with 20-55% fewer bytes at 1.020 instead of 1.006-1.015 x the bound. On several nodes the
# same rule picks among the first pass's finalists.
BYTES_SLACK = 1.02
# One node, a batch planned on merged blocks: the balancer's donors shed until within 1% of the mean compute
# (``CostModel.balance_slack``; 2% elsewhere). Such a plan is final once its real tiles inherit it, and it
# ended just under the 2% cap (the bench's 128K / 8 batches, seeds 0 and 777, 38 plans, with the one-node
# merging of planner/candidates.py: fwd + bwd over the bound 1.0168 -> 1.0090 geomean, 29 plans faster, 3
# slower by up to 0.7%, bytes +4%, planning +1%; 0.5%: 1.0047, bytes +10%, planning +6%). Not on real blocks:
# on 32 ranks of one node at 128K (not merged) 33 of 38 plans were faster but 5 slower by up to 3.4%, and
# a 32K-token batch on 32 ranks lost its duplex re-plan's gain (1.220 -> 1.313x the bound).
ONE_NODE_MERGED_SLACK = 0.01
# Several candidates: ranked on 2x-merged blocks first (>= 32 merged blocks per rank, batches of
# >= 2048 tiles), and only the best SELECT_KEEP are planned at full resolution.
SELECT_MIN_TILES = 2048
SELECT_MIN_BLOCKS_PER_RANK = 32
SELECT_KEEP = 2
REFINE_TOP = 2  # finalists refined (relay-aware rebalancing, restaging) before the fastest is kept
# ... and one more where "hierarchical-fcp-wide" is among the candidates: its plan often ranks second,
# and then pushed a finalist that refined better out (a 32 / 8 shared-question batch 1.17 -> 1.23x).
WIDE_REFINE_TOP = 3
# Relays are weighed for this many of the fastest candidates (their scoring is costly): a candidate's
# time before relays ranks it poorly for after (fcp 3rd before, fastest after on a 16/8 batch), and 2
# lost such cases once "fcp-docs" joined the candidates. 5 (with the finalists compared after their
# transit relays and the second opinion seeded with every first-pass finalist's homes): a 16-rank
# shared-question batch 1.270 -> 1.201 ("hierarchical-fcp", 5th before relays), nothing else changed
# over the 57 multi-node cases (fp32 and bf16 partials) or seven 1M batches.
RELAY_TOP = 5
# Several nodes: these candidates are also balanced with KV already on a node priced as NVLink (the
# relay add_relays then sets up) and join the finalists with their relays. "hierarchical" keeps a long
# document's part on a node in contiguous runs, so one rank can hold most of its compute, and only
# this pricing lets it shed rows to its node-mates (1M tokens / 64 ranks: 2.76 -> 2.53 x the bound).
RELAY_AWARE_INITS = ("hierarchical",)
# ... and these always (unless an init is forced), as relay-aware finalists only: "hierarchical-spread"
# (``spread_read_blocks``, see SECOND_OPINION_INITS). 128K benchmark cases, fp32 partials: three
# shared-question plans 1-4% faster (32/8 geomean 1.375 -> 1.372), none slower; bf16: three 0.4-2.4%
# faster, one 0.3% slower; 1M / 64 ranks: one Wikipedia batch 1.66 -> 1.57x the bound (fp32), another
# 1.58 -> 1.49x (bf16); +2-10% planning time.
RELAY_AWARE_EXTRA = ("hierarchical-spread",)
# The second opinion's starts besides the first plan's homes: "hierarchical", and the same with each
# node's blocks that other nodes read dealt over the node's ranks ("hierarchical-spread",
# ``spread_read_blocks``). A long document's part on a node then leaves through every NIC of the node
# in exchange 0, when only the homes hold it and no relay can help yet. Seven 1M-token / 64-rank
# Wikipedia batches, fwd+bwd / bound with fp32 partials: 2.25 -> 1.56 (an 84K-token document),
# 1.56 -> 1.29, 1.28 -> 1.31, the others unchanged; bf16: 1.84 -> 1.38, 1.53 -> 1.35, 1.28 -> 1.16,
# 1.23 -> 1.19. On the 128K benchmark cases it never wins.
SECOND_OPINION_INITS = ("hierarchical", "hierarchical-spread")
# The second opinion's finalists within RECHECK of the fastest are all carried to full resolution and
# compared after their transit relays: merged blocks rank near-equal plans unreliably, and transit
# relays gain less on homes already spread. 1M / 64 ranks, the bench batch: 1.632 vs 1.634 x the bound
# merged, 1.50 vs 1.38 final (fp32 partials; bf16 1.33 -> 1.22); another batch 1.31 -> 1.28. Finalists
# further off were not faster over the seven batches, and each one carried costs ~0.3 s at 1M.
RECHECK = 1.10


def _dcp(tiles: TileSet, world_size: int, cost_model: CostModel, max_stages: int, sizes: dict,
         init: str | None, relays: bool = True, second_opinion: list | None = None,
         every_finalist: bool = False, nic_scale: float = 1.0,
         opinion_inits: tuple = SECOND_OPINION_INITS) -> Placement | list:
    """dcp's placement before the baseline check and the transit relays. ``relays=False``: without
    node-level relays and the refinements that redo them (the balanced candidates alone).
    ``second_opinion`` (several nodes; a list of first plans' block homes, possibly empty): the second
    opinion, i.e. the ``opinion_inits`` placements and these homes (each distinct one once) balanced
    with the homes' inter-node sends priced on their node's NICs, refined alike, and no other candidate;
    no plan (an empty list, with ``every_finalist``) where there is no start left, i.e. no
    ``opinion_inits`` and no seed home that survives merging the blocks. ``every_finalist``: the
    (refined) finalists within RECHECK of the fastest, fastest first, instead of the fastest alone.
    ``nic_scale``: the balancer sees the inter-node bandwidth times this (NIC_SHY_SCALES)."""
    factor = coarsening_factor(tiles, world_size, cost_model.topology)
    if factor > 1:
        coarse, of_fine = coarsen(tiles, factor)
        if world_size <= cost_model.topology.ranks_per_node:
            cost_model = replace(cost_model, balance_slack=ONE_NODE_MERGED_SLACK)
        if second_opinion is not None:
            # the first plans' homes as merged blocks' homes, where they are whole merged blocks (a
            # baseline's may not be: then left out, so memory stays as balanced as planned)
            merged = [merged_home(home, factor, coarse.num_blocks) for home in second_opinion]
            second_opinion = [coarse_home for coarse_home in merged if coarse_home is not None]
        plans = _dcp(coarse, world_size, cost_model, max_stages, sizes, init, relays, second_opinion, every_finalist,
                     nic_scale=nic_scale, opinion_inits=opinion_inits)
        fines = []
        for plan in plans if every_finalist else [plans]:
            # Fine tiles inherit their merged tile's rank and stage: their inputs are subsets of its
            # inputs, so they are home / received by that stage; the schedule is derived afresh.
            # On one node the backward stages are inherited too (the same reasoning: a fine tile's dO
            # is part of its merged tile's), so the fine schedule is derived once, from the merged tiles
            # (``_with_merged_schedule``), instead of make_plan choosing the backward staging again over
            # every fine tile: 50 one-node 128K / 8 plans on merged blocks 15-40% faster, fwd + bwd over
            # the bound within +-0.06% (geomean 1.0158 -> 1.0159). On several nodes every fine plan is
            # finished and scored again anyway.
            inherit = world_size <= cost_model.topology.ranks_per_node and plan.tile_stage_bwd is not None
            block_home = plan.block_home[np.arange(tiles.num_blocks) // factor]
            if inherit:  # (the gathers and the covering the merged schedule needs, in one pass)
                *inherited, covered = _inherited(tiles, of_fine, factor, coarse, plan)
                fine = Placement(block_home=block_home, tile_rank=inherited[0], tile_stage=inherited[1],
                                 tile_stage_bwd=inherited[2], merged_time=plan.sim_time)
            else:
                fine = Placement(block_home=block_home, tile_rank=plan.tile_rank[of_fine],
                                 tile_stage=plan.tile_stage[of_fine])
            # relays found on merged blocks do not carry over (the fine schedule is derived afresh)
            unrelayed = fine
            if relays:
                fine = add_relays(tiles, fine, world_size=world_size, cost_model=cost_model, max_stages=max_stages,
                                  sizes=sizes)
            if inherit and fine is unrelayed:
                fine = _with_merged_schedule(tiles, coarse, of_fine, factor, fine, plan, world_size, covered)
            fines.append(fine)
        return fines if every_finalist else fines[0]
    if second_opinion is not None:
        inits = []
    elif init is not None:
        inits = [init]
    elif world_size <= cost_model.topology.ranks_per_node:
        inits = list(SINGLE_NODE_INITS)
    else:
        inits = list(MULTI_NODE_INITS)
    multi_node = world_size > cost_model.topology.ranks_per_node
    if init is None and second_opinion is None and hot_rows(tiles).size:
        inits += ["dealt", "dealt-nodes"] if multi_node else ["dealt"]
    inits = _distinct_inits(tiles, inits, world_size, cost_model, sizes)
    if len(inits) > len(SINGLE_NODE_INITS):
        inits = _preselect(tiles, world_size, inits, cost_model, max_stages, sizes)
    good_enough = GOOD_ENOUGH * _lower_bound(tiles, world_size, cost_model, sizes)
    # one node, mostly long documents: every candidate, for the fewest bytes among the near-fastest
    plan_all = not multi_node and _mostly_split_segments(tiles, world_size)
    if plan_all and len(inits) > 1:
        return _fewest_bytes_staging_few(tiles, world_size, inits, cost_model, max_stages, sizes, good_enough)
    planned = []  # (time, order, placement) before relays
    for name in inits:
        placement, sim_time = _place(tiles, world_size, name, cost_model, max_stages, sizes, relays=False)
        planned.append((sim_time, len(planned), placement))
        if sim_time <= good_enough and not plan_all:
            break  # cannot gain more than a few percent: skip the other candidates
    if not multi_node:
        return _fewest_bytes(tiles, [placement for _, _, placement in planned], good_enough, sizes)
    # several nodes: relays (hot KV blocks cross each inter-node link once and fan out over NVLink)
    # are weighed for the RELAY_TOP fastest candidates only
    # finalists: (placement, balanced relay-aware already)
    finalists = [(placement, False) for _, _, placement in sorted(planned, key=lambda item: item[:2])[:RELAY_TOP]]
    if second_opinion is not None:
        homes = [_initial_home(tiles, world_size, name, cost_model, sizes) for name in opinion_inits]
        for seed in second_opinion:
            if not any(np.array_equal(home, seed) for home in homes):
                homes.append(seed)  # (the first plan's homes are often hierarchical's own)
        if not homes:  # (the NIC-shy pass on merged blocks, its seed not whole merged blocks)
            return []
        finalists = [(_place(tiles, world_size, None, cost_model, max_stages, sizes, home=home, relays=relays,
                             relay_aware=True, spread_sends=True, nic_scale=nic_scale)[0], True) for home in homes]
    elif multi_node and min(t for t, _, _ in planned) > good_enough:
        if relays:
            finalists = [(add_relays(tiles, placement, world_size=world_size, cost_model=cost_model,
                                     max_stages=max_stages, sizes=sizes), False) for placement, _ in finalists]
        # plus candidates balanced on the premise of relays (KV already on a node priced as NVLink),
        # scored with their relays: ranked before relays they would look slow
        finalists += [(_place(tiles, world_size, name, cost_model, max_stages, sizes, relays=relays,
                              relay_aware=True)[0], True)
                      for name in [n for n in RELAY_AWARE_INITS if n in inits]
                      + (list(RELAY_AWARE_EXTRA) if init is None else [])]
    finalists.sort(key=lambda item: item[0].sim_time)  # stable: first of equals in candidate order
    if relays and multi_node and finalists[0][0].sim_time > good_enough:
        # the refinements gain unequally: the two fastest finalists are refined, the faster result kept
        # (three with "hierarchical-fcp-wide" among the candidates: see WIDE_REFINE_TOP)
        refined = []
        top = WIDE_REFINE_TOP if "hierarchical-fcp-wide" in inits else REFINE_TOP
        for placement, balanced in finalists[:top]:
            if not balanced:  # (a relay-aware finalist would meet the same balancer on the same homes)
                placement = _relay_balanced(tiles, placement, world_size, cost_model, max_stages, sizes)
            refined.append((_restaged(tiles, placement, world_size, cost_model, max_stages, sizes), balanced))
        finalists = refined
    if every_finalist:
        fastest = min(placement.sim_time for placement, _ in finalists)
        return sorted((placement for placement, _ in finalists if placement.sim_time <= RECHECK * fastest),
                      key=lambda placement: placement.sim_time)
    return min(finalists, key=lambda item: item[0].sim_time)[0]


def _inherited(tiles: TileSet, of_fine: np.ndarray, factor: int, coarse: TileSet, plan: Placement) -> tuple:
    """(rank, stage, backward stage) of every real tile, its merged tile's in ``plan`` (int32: this
    placement goes to make_plan as it is), and which real rows and columns each merged tile covers
    (planner/tile_loops.py ``inherit_merged``)."""
    rank, stage, stage_bwd = (np.asarray(x, dtype=np.int64) for x in (plan.tile_rank, plan.tile_stage,
                                                                       plan.tile_stage_bwd))
    rank, stage, stage_bwd, rows, columns = inherit_merged(tiles.q, tiles.kv, of_fine, factor.bit_length() - 1,
                                                           coarse.num_tiles, rank, stage, stage_bwd, True)
    return rank, stage, stage_bwd, (rows, columns)


def _with_merged_schedule(tiles: TileSet, coarse: TileSet, of_fine: np.ndarray, factor: int, fine: Placement,
                          plan: Placement, world_size: int, covered: tuple) -> Placement:
    """``fine`` (real tiles with the merged ``plan``'s ranks and both stages, no relays) with its schedule,
    derived from the merged tiles (planner/schedule.py ``derive_schedule_merged``) where its stages are
    compact already, as make_plan would have them; else as it is (make_plan derives it). Same schedules
    (126 one-node plans of three draws on 8 and 32 ranks); runs alternated, min of 7: the long-tail
    128K / 8 batches 13.9 / 10.7 / 15.8 -> 13.0 / 10.3 / 14.7 ms, a 213K-tile Wikipedia one 21.4 -> 19.3 ms,
    batches merged 2x (40-90K tiles) within noise."""
    stage, num_stages = compact_stages(plan.tile_stage)
    if not np.array_equal(stage, plan.tile_stage):
        return fine
    schedule = derive_schedule_merged(tiles, coarse, of_fine, factor, plan.block_home, plan.tile_rank,
                                      plan.tile_stage, plan.tile_stage_bwd, num_stages=num_stages,
                                      world_size=world_size, covered=covered)
    return replace(fine, schedule=schedule)


def _distinct_inits(tiles: TileSet, inits: list, world_size: int, cost_model: CostModel, sizes: dict) -> list:
    """``inits`` without the candidates that would give another candidate's homes, so the same plan is
    not balanced and staged twice: "fcp" where it gives "fcp-docs"' (fcp_home depends on ``documents``
    through the segments alone, and where no document starts inside a block that the cut by tile
    counts keeps - causal_blockwise, most long-tail batches - they are the same), and
    "hierarchical-fcp-wide" where no segment is split differently from "hierarchical-fcp" (166 of the
    189 multi-node benchmark cases of seeds 0, 1 and 777)."""
    from .fcp import segments

    drop = set()
    if "fcp" in inits and "fcp-docs" in inits and np.array_equal(segments(tiles), segments(tiles, documents=True)):
        drop.add("fcp")
    wide = "hierarchical-fcp-wide"
    if wide in inits and "hierarchical-fcp" in inits and np.array_equal(
            _initial_home(tiles, world_size, wide, cost_model, sizes),
            _initial_home(tiles, world_size, "hierarchical-fcp", cost_model, sizes)):
        drop.add(wide)
    return [name for name in inits if name not in drop]


def _mostly_split_segments(tiles: TileSet, world_size: int) -> bool:
    """Whether most of the compute lies in segments (planner/fcp.py ``segments``, documents cut at the
    blocks they start in, so short documents that share blocks stay apart) longer than a rank's memory
    share: cut up in any placement, where runs along memory ("contiguous") may read less KV than FCP's
    zigzag groups (the long-tail benchmark batches on 8 ranks, and Wikipedia batch 2 with its long
    documents)."""
    from .fcp import segments

    bounds = segments(tiles, documents=True)
    work = tiles.row_pairs()
    prefix = prefix_sums(work)
    long = np.diff(bounds) > -(-tiles.num_blocks // world_size)
    return float((prefix[bounds[1:]] - prefix[bounds[:-1]])[long].sum()) > 0.5 * prefix[-1]


def _fewest_bytes(tiles: TileSet, planned: list, good_enough: float, sizes: dict,
                  topology: Topology | None = None) -> Placement:
    """The fastest of the candidates ``planned`` (scored Placements), or among those within BYTES_SLACK
    of it and within ``good_enough`` (seconds) the one that moves the fewest bytes (``topology``: bytes
    between nodes weighed at the NIC's cost, ``_schedule_bytes``)."""
    fastest = min(planned, key=lambda p: p.sim_time)  # first of equals in candidate order
    near = [p for p in planned if p.sim_time <= min(good_enough, BYTES_SLACK * fastest.sim_time)]
    if len(near) < 2:
        return fastest
    return min(near, key=lambda p: _schedule_bytes(tiles, p, sizes, topology))


def _fewest_bytes_staging_few(tiles: TileSet, world_size: int, inits: list, cost_model: CostModel, max_stages: int,
                              sizes: dict, good_enough: float) -> Placement:
    """``_fewest_bytes`` over the one-node candidates ``inits``, every one balanced but only those staged
    and scored that the choice needs. On one node a plan's bytes follow from its homes and tile ranks
    alone (``moved_bytes``) and its time is at least its busiest rank's compute (``_time_floor``): the
    candidate moving the fewest bytes, once staged, is the choice itself where it lies within
    ``good_enough`` and within BYTES_SLACK of every other candidate's floor; otherwise every candidate is
    staged and compared as before. Same plan, ~1/3 less planning on 128K / 8 batches whose long documents
    have every candidate planned."""
    balanced = [_balanced(tiles, world_size, name, cost_model, sizes) for name in inits]
    moved = [moved_bytes(tiles, home, rank, sizes) for home, rank in balanced]
    fewest = min(range(len(inits)), key=lambda i: (moved[i], i))  # first of equals in candidate order
    first = _staged(tiles, world_size, *balanced[fewest], cost_model, max_stages, sizes)
    flops = cost_model.tile_flops(tiles.pairs, num_q_heads=sizes["num_q_heads"], head_dim=sizes["head_dim"])
    others = min(_time_floor(rank, flops, world_size, cost_model)
                 for i, (_, rank) in enumerate(balanced) if i != fewest)
    if first.sim_time <= min(good_enough, BYTES_SLACK * others):
        return first
    planned = [first if i == fewest else _staged(tiles, world_size, *balanced[i], cost_model, max_stages, sizes)
               for i in range(len(inits))]
    return _fewest_bytes(tiles, planned, good_enough, sizes)


def _preselect(tiles: TileSet, world_size: int, inits: list, cost_model: CostModel, max_stages: int,
               sizes: dict) -> list:
    """Rank the candidate initial placements on a 2x-merged copy of the batch (a quarter of the
    tiles) and keep the best SELECT_KEEP: the full-resolution plan is then built for those only.
    The ranking of candidates is stable under merging, their absolute times are not (measured in
    bench/bench_planner.py), so the choice among the survivors is still made at full resolution."""
    if (tiles.num_tiles < SELECT_MIN_TILES
            or tiles.num_blocks // 2 < SELECT_MIN_BLOCKS_PER_RANK * world_size):
        return inits
    coarse, _ = coarsen(tiles, 2)
    lower_bound = _lower_bound(coarse, world_size, cost_model, sizes)
    scored = []
    for name in inits:
        scored.append((_place(coarse, world_size, name, cost_model, max_stages, sizes, relays=False)[1], len(scored),
                       name))
        if scored[-1][0] <= GOOD_ENOUGH * lower_bound:
            break
    return [name for _t, _i, name in sorted(scored)[:SELECT_KEEP]]
