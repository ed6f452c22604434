"""One dcp candidate plan, from a start to a scored Placement, and the refinements of one plan.

Notation (docs/design.md): T tokens, nB blocks of B tokens, P ranks, tile (qb, kb); ``home[b]`` owns
block b. A candidate is an initial data placement (planner/starts.py, named by ``_initial_home``) whose
tiles the Balancer places (``_balanced``), staged (``_staged``, planner/stages.py) and scored
(``_scored``: backward stages, CommSchedule, simulated fwd + bwd time); ``_place`` does all three, with
node-level relays on several nodes. A scored plan can be restaged (``_restaged``), rebalanced
relay-aware (``_relay_balanced``), given transit relays (``_with_transit``) and its backward deferred
(``with_deferred_backward``), each kept only where faster. planner/dcp.py searches over candidates and
refines the kept plan with these; large batches are planned on merged blocks (``coarsening_factor``,
``merged_home``). The bounds and byte counts that the search compares plans by: ``_lower_bound``,
``_time_floor``, ``moved_bytes``, ``_schedule_bytes``.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .balance import balanced_ranks, pushed_rows
from .cost_model import CostModel, Topology
from .finish import Finisher, finish_placement
from .placement import Placement, per_rank_and_stage, weighted_bincount
from .relay import add_relays, add_transit
from .schedule import KIND_DKV, KIND_DO, KIND_DQ, KIND_KV, KIND_OUT, KIND_Q, bytes_per_token, kv_block_bytes, row_bytes
from .stages import assign_stages
from .stages_bwd import defer_backward_variants, defer_variant_sets
from .starts import contiguous_cut_home, dealt_home, hierarchical_home, spread_read_blocks
from .tile_loops import remote_tokens
from .tiles import TileSet

# planner/baselines.py zigzag, allgather and ring as they are: "ring" (contiguous shards) for local masks, where
# the neighbour's tail is all a rank reads (a sliding window over 27.7K tokens on 5 ranks, one per node: dcp
# 1.110x the bound, ring 1.053x)
BASELINE_INITS = ("zigzag-ring", "zigzag-allgather", "ring")
FCP_PLAN = "fcp-plan"  # the fcp strategy's plan as it is (planner/fcp.py: owner computes on FCP's homes)
# Large batches are planned on merged blocks (2x2, 4x4, ... tiles) while that keeps >= 32 merged
# blocks per rank (memory balance within ~3%); the result is mapped back to the real blocks.
COARSE_TILE_LIMIT = 16384
MIN_COARSE_BLOCKS_PER_RANK = 32
# One node, a batch merged already: merged further while over ONE_NODE_TILE_LIMIT merged tiles, down to 16
# merged blocks per rank where they still split over the ranks within ONE_NODE_MEMORY_SLACK of the mean.
# With the merged blocks' balance slack (planner/first_pass.py ONE_NODE_MERGED_SLACK), on the bench's 128K / 8
# batches (seeds 0 and 777, 38 plans, most merged 4x -> 8x): planning 4.96 -> 3.74 ms geomean (paired,
# min of 5), fwd + bwd over the bound 1.0158 -> 1.0090, bytes +6%. On several nodes coarser blocks rank
# the candidates worse (1M / 64: 1.081 -> 1.140x on one batch, session 32); 32 ranks of one node are not
# merged at 128K (docs/planner_log.md, session 50).
ONE_NODE_TILE_LIMIT = 4096
ONE_NODE_MIN_BLOCKS_PER_RANK = 16
ONE_NODE_MEMORY_SLACK = 0.03
# Several nodes: the refined finalists are also staged with the budget rule of planner/stages.py
# doubled (transfers front-loaded) and the faster staging is kept. Neither wins everywhere (doubled for every
# candidate: 27 of 57 benchmark cases faster, 11 slower): a rank's later stages also carry other
# ranks' requests and returning partials, which the per-receiver rule cannot see. Trying it on the
# winner only gives the same geomean as on every candidate (fwd+bwd / bound on 32 ranks 1.79 -> 1.70).
FRONT_LOAD = 2.0
# ... and staged with each rank's budget scale chosen among these by its own overlapped-time estimate: a
# rank that holds little local work and reads most of its KV over the NIC needs its early exchanges
# overfilled, or the last one carries most of its transfers (fwd+bwd / bound, 32 ranks, a Wikipedia
# batch with a 38K document: 1.85 -> 1.46). As a third restaging, kept only where faster.
ADAPTIVE_SCALES = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Transit relays are added in passes until one gains nothing (at most TRANSIT_PASSES): a pass's relays
# free NIC time that the next pass's can use (over the benchmark cases 3 passes equal 6; a second pass
# gained 0.2-0.9% on six of 57 multi-node cases, none lost).
TRANSIT_PASSES = 3


def merged_home(home: np.ndarray, factor: int, num_merged: int) -> np.ndarray | None:
    """The homes of the merged blocks (``coarsen(tiles, factor)``) where ``home`` keeps every merged
    block whole on one rank, else None."""
    merged = home[np.arange(num_merged) * factor]
    return merged if np.array_equal(merged[np.arange(home.size) // factor], home) else None


def with_deferred_backward(tiles: TileSet, placement: Placement, world_size: int, cost_model: CostModel,
                           sizes: dict, node_local: bool = True, beat: float | None = None) -> Placement:
    """``placement`` scored, its backward restaged by ``Finisher.deferred`` where faster: after the
    candidates are compared, as it costs up to 4 * DEFER_ROUNDS backward schedule derivations. Skipped
    where the plan takes no longer than its busiest rank's compute, or where its own backward has no
    group to defer (one cheap pass over its exchanges). Evaluation cases, fwd + bwd over
    the bound, fp32 partials (51 of 95 plans faster, none slower): 16 / 4 1.117 -> 1.081, 32 / 8
    1.324 -> 1.186, 32 (32) 1.086 -> 1.057, 16 / 8 1.045 -> 1.036; bf16 partials (24 of 76 faster,
    none slower): 32 / 8 1.193 -> 1.156. ``node_local`` (several nodes): the rounds followed a second time
    with node-local variants too (planner/stages_bwd.py ``DEFER_VARIANT_SETS``), the faster kept; over the
    63 multi-node cases of the bench's batches (seed 0), held-out ones (seeds 1, 777) and bf16
    partials: 64 of 252 plans faster (up to 7.2%), one slower (1.3%: another candidate kept later);
    32 / 8 1.1502 -> 1.1466, held out 1.2696 -> 1.2627 (worst 2.078 -> 1.928) and 1.2444 -> 1.2341.

    ``beat`` (seconds): the plan is only wanted if its deferral brings it under this; skipped where even a
    fully hidden backward could not (its forward time, which deferral leaves as it is, plus its busiest
    rank's backward compute), so the result is the same: 71 of the 121 second-opinion deferrals of the
    bench's 32 / 8 cases, 10 of 42 over six 1M / 64 batches (-5% planning in both)."""
    placement = _scored(tiles, placement, world_size, cost_model, sizes)
    if world_size == 1:
        return placement
    flops = cost_model.tile_flops(tiles.pairs, num_q_heads=sizes["num_q_heads"], head_dim=sizes["head_dim"])
    if placement.sim_time <= _time_floor(placement.tile_rank, flops, world_size, cost_model) * (1 + 1e-3):
        return placement  # no transfer exposed anywhere that matters
    S = placement.schedule.num_stages
    compute_bwd = flops / cost_model.fwd_rate * cost_model.bwd_flops_factor

    def load_and_comm(stage, seconds, direction):
        """[P, S] seconds per rank and stage, [P, S + 1] transfer time per rank and exchange."""
        load = per_rank_and_stage(placement.tile_rank, stage, seconds, world_size, S)
        table = placement.schedule.cost_rows(direction)  # (sums: any order)
        return load, cost_model.table_comm_time(
            table, tiles.block_lengths(), world_size, S, **sizes)

    if beat is not None:
        busiest_bwd = weighted_bincount(placement.tile_rank, compute_bwd, world_size).max()
        forward = cost_model.overlapped_time(*load_and_comm(placement.tile_stage, flops / cost_model.fwd_rate, "fwd"))
        if float(forward.max() + busiest_bwd) >= beat:
            return placement
    # one cheap pass over the plan's own backward exchanges: nothing to defer, nothing to derive
    stage_bwd = placement.tile_stage_bwd
    load, comm = load_and_comm(stage_bwd, compute_bwd, "bwd")
    # (with every variant Finisher.deferred may try: a node-local one draws from fewer groups, so the
    # groups before a large one can fit where the plain variants fit none; no plan of the 126
    # multi-node cases of seeds 0 and 1 changed by it)
    rpn = cost_model.topology.ranks_per_node
    variants = defer_variant_sets(world_size, rpn, node_local)[-1]
    if all(cand is stage_bwd for _, cand in defer_backward_variants(
            stage_bwd, tiles.kv, placement.tile_rank, placement.block_home, compute_bwd, load, comm, variants,
            into_last=True, ranks_per_node=rpn)):
        return placement
    return Finisher(tiles, placement.block_home, placement.tile_rank, placement.tile_stage, world_size=world_size,
                    cost_model=cost_model, sizes=sizes).deferred(placement, node_local=node_local)


def _with_transit(tiles: TileSet, placement: Placement, world_size: int, cost_model: CostModel,
                  sizes: dict) -> Placement:
    """``placement`` scored, with the transit relays of planner/relay.py ``add_transit`` where faster
    (several nodes: KV that crosses into a node for one rank alone enters through another rank's NIC)."""
    placement = _scored(tiles, placement, world_size, cost_model, sizes)
    for _ in range(TRANSIT_PASSES):
        better = add_transit(tiles, placement, world_size=world_size, cost_model=cost_model, sizes=sizes)
        if better is placement:
            break
        placement = better
    return placement


def _schedule_bytes(tiles: TileSet, placement: Placement, sizes: dict, topology: Topology | None = None) -> float:
    """Forward + backward payload bytes of a scored placement's CommSchedule (relays included). With a
    ``topology``, a row between nodes counts ``intra_bw / inter_bw`` times its bytes (bytes as NVLink
    would carry them in the same time), so the bytes rules that read this weigh a NIC byte at what it
    costs: counted plainly, 16 ranks at 8 per node kept causal_blockwise's hot rows pushed per kv-rank
    (1.042x the bound, 4.96 GB of which 1.86 GB between nodes) over per kv-node (1.037x, 11.8 GB of which
    0.89 GB between nodes)."""
    block_len = tiles.block_lengths()
    total = 0.0
    for direction in ("fwd", "bwd"):
        rows = placement.schedule.table(direction).numpy().astype(np.int64)
        moved = row_bytes(rows, block_len, **sizes).astype(np.float64)
        if topology is not None:
            between = topology.node_of(rows[:, 1]) != topology.node_of(rows[:, 2])
            moved[between] *= topology.intra_bw / topology.inter_bw
        total += float(moved.sum())
    return total


def moved_bytes(tiles: TileSet, home: np.ndarray, rank: np.ndarray, sizes: dict) -> float:
    """Forward + backward payload bytes of a plan without relays (as its CommSchedule's rows add up):
    per remote q-block a rank computes tiles of, Q, OUT, dO and dQ; per remote kv-block, KV and dK/dV."""
    block_len = tiles.block_lengths()
    world_size = int(rank.max()) + 1 if rank.size else 1
    per_token = bytes_per_token(**sizes)
    total = 0.0
    for blocks, kinds in ((tiles.q, (KIND_Q, KIND_OUT, KIND_DO, KIND_DQ)), (tiles.kv, (KIND_KV, KIND_DKV))):
        tokens = float(remote_tokens(blocks, home, rank, block_len, world_size))
        total += tokens * float(sum(int(per_token[kind]) for kind in kinds))
    return total


def _time_floor(rank: np.ndarray, flops: np.ndarray, world_size: int, cost_model: CostModel) -> float:
    """A floor under a plan's simulated forward + backward time: its busiest rank's compute (``flops``:
    each tile's forward FLOPs)."""
    busiest = weighted_bincount(rank, flops, world_size).max() / cost_model.fwd_rate
    return float((1 + cost_model.bwd_flops_factor) * busiest)


def baseline_floors(tiles: TileSet, world_size: int, cost_model: CostModel, sizes: dict) -> dict:
    """BASELINE_INITS name -> a floor under that baseline's simulated forward + backward time: its busiest
    rank's compute, as every baseline computes a tile on its q-block's home (planner/baselines.py); from
    the rows' pairs (``TileSet.row_pairs``: a batch planned on merged blocks has them from merging)."""
    from .baselines import contiguous_home, zigzag_home

    # (each block's row as one "tile" on its home: ``_time_floor`` of the blocks)
    per_pair = cost_model.tile_flops(1, num_q_heads=sizes["num_q_heads"], head_dim=sizes["head_dim"])
    row_flops = tiles.row_pairs() * per_pair
    zigzag = _time_floor(zigzag_home(tiles.num_blocks, world_size), row_flops, world_size, cost_model)
    ring = _time_floor(contiguous_home(tiles.num_blocks, world_size), row_flops, world_size, cost_model)
    return {"zigzag-ring": zigzag, "zigzag-allgather": zigzag, "ring": ring}


def _relay_balanced(tiles: TileSet, placement: Placement, world_size: int, cost_model: CostModel, max_stages: int,
                    sizes: dict) -> Placement:
    """``placement``'s data placement rebalanced by a Balancer that counts a KV block already held on
    the target's node as an NVLink transfer (the relay add_relays then sets up), if that simulates
    faster. The per-rank NIC view wins some batches and loses the others, and keeping the faster of
    the two never loses."""
    alt, _ = _place(tiles, world_size, None, cost_model, max_stages, sizes,
                    home=placement.block_home, relay_aware=True)
    return alt if alt.sim_time < placement.sim_time else placement


def _restaged(tiles: TileSet, placement: Placement, world_size: int, cost_model: CostModel, max_stages: int,
              sizes: dict) -> Placement:
    """``placement`` restaged, if that simulates faster (relays redone on the new stages): with each
    stage's transfers allowed FRONT_LOAD times the compute hiding them, and with every rank's items
    staged together so that each stage also fits the *senders'* compute (``both_ends``)."""
    flops = cost_model.tile_flops(tiles.pairs, num_q_heads=sizes["num_q_heads"], head_dim=sizes["head_dim"])
    home, rank = placement.block_home, placement.tile_rank
    best, choice = placement, placement.bwd_choice
    for scale, both_ends in ((FRONT_LOAD, False), (1.0, True), (ADAPTIVE_SCALES, False)):
        stage = assign_stages(tiles.q, tiles.kv, flops, rank, home, block_size=tiles.block_size,
                              total_len=tiles.total_len, world_size=world_size, cost_model=cost_model,
                              max_stages=max_stages, budget_scale=scale, both_ends=both_ends, **sizes)
        # (the same homes and tile ranks each time: a backward staging chosen for one stage count is
        # taken again where the next restaging has as many stages)
        finished = finish_placement(tiles, home, rank, stage, world_size=world_size, cost_model=cost_model,
                                    sizes=sizes, max_stages=max_stages, bwd_choice=choice)
        choice = finished.bwd_choice
        alt = add_relays(tiles, finished, world_size=world_size, cost_model=cost_model, max_stages=max_stages,
                         sizes=sizes)
        if alt.sim_time < best.sim_time:
            best = alt
    return best


def _lower_bound(tiles: TileSet, world_size: int, cost_model: CostModel, sizes: dict) -> float:
    """Forward + backward time of perfectly balanced compute with fully hidden communication."""
    flops = float(tiles.pairs.sum()) * cost_model.tile_flops(1, num_q_heads=sizes["num_q_heads"],
                                                             head_dim=sizes["head_dim"])
    return flops * (1 + cost_model.bwd_flops_factor) / (world_size * cost_model.fwd_rate)


def coarsening_factor(tiles: TileSet, world_size: int, topology: Topology) -> int:
    """Power of two by which to merge blocks before planning (1: plan the real blocks); further on one
    node of ``topology`` (ONE_NODE_TILE_LIMIT)."""
    factor = 1
    while (tiles.num_tiles > COARSE_TILE_LIMIT * factor * factor
           and tiles.num_blocks // (2 * factor) >= MIN_COARSE_BLOCKS_PER_RANK * world_size):
        factor *= 2
    if factor == 1 or world_size > topology.ranks_per_node:
        return factor
    while tiles.num_tiles > ONE_NODE_TILE_LIMIT * factor * factor:
        merged = -(-tiles.num_blocks // (2 * factor))
        if (merged < ONE_NODE_MIN_BLOCKS_PER_RANK * world_size
                or -(-merged // world_size) * world_size > (1 + ONE_NODE_MEMORY_SLACK) * merged):
            break
        factor *= 2
    return factor


def _initial_home(tiles: TileSet, world_size: int, init: str, cost_model: CostModel, sizes: dict) -> np.ndarray:
    num_q_heads, head_dim = sizes["num_q_heads"], sizes["head_dim"]
    if init == "contiguous":
        return contiguous_cut_home(tiles, world_size)
    if init == "hierarchical-spread":
        home = _initial_home(tiles, world_size, "hierarchical", cost_model, sizes)
        return spread_read_blocks(tiles, home, cost_model.topology)
    if init in ("hierarchical", "hierarchical-fcp", "hierarchical-fcp-wide"):
        return hierarchical_home(tiles, world_size, cost_model=cost_model, num_q_heads=num_q_heads, head_dim=head_dim,
                                 inner="contiguous" if init == "hierarchical" else "fcp",
                                 kv_bytes=kv_block_bytes(tiles.block_lengths(), **sizes),
                                 cut_links=cost_model.topology.ranks_per_node if init.endswith("-wide") else 1)
    if init == "zigzag":
        from .baselines import zigzag_home

        return zigzag_home(tiles.num_blocks, world_size)
    if init in ("dealt", "dealt-nodes"):
        return dealt_home(tiles, world_size, topology=cost_model.topology)
    if init in ("fcp", "fcp-docs"):
        from .fcp import fcp_home, neighbor_affinity_for

        return fcp_home(tiles, world_size, cost_model=cost_model, num_q_heads=num_q_heads, head_dim=head_dim,
                        documents=init == "fcp-docs", neighbor_affinity=neighbor_affinity_for(world_size, cost_model),
                        memory_slack=cost_model.home_memory_slack)
    raise ValueError(f"unknown dcp init {init!r}; choose contiguous, hierarchical, hierarchical-fcp, "
                     "hierarchical-fcp-wide, hierarchical-spread, zigzag, fcp, fcp-docs, dealt or dealt-nodes")


def _scored(tiles: TileSet, placement: Placement, world_size: int, cost_model: CostModel, sizes: dict) -> Placement:
    """``placement`` with its backward stages, CommSchedule and simulated fwd + bwd time (computed if
    missing; its forward stages, e.g. inherited from merged blocks, are kept as they are)."""
    if placement.sim_time is not None and placement.schedule is not None and placement.tile_stage_bwd is not None:
        return placement
    return finish_placement(tiles, placement.block_home, placement.tile_rank, placement.tile_stage,
                            world_size=world_size, cost_model=cost_model, sizes=sizes, kv_relay=placement.kv_relay,
                            spread_forward=False)


def _place(tiles: TileSet, world_size: int, init: str | None, cost_model: CostModel, max_stages: int,
           sizes: dict, *, relays: bool = True, home: np.ndarray | None = None,
           relay_aware: bool = False, spread_sends: bool = False, nic_scale: float = 1.0) -> tuple[Placement, float]:
    """One dcp placement from an initial data placement (``init``, or with init None the given ``home``
    itself; with init FCP_PLAN, ``home`` may give FCP's homes already computed), and its simulated
    fwd + bwd time (with node-level KV relays where they pay, unless ``relays`` is False).
    ``relay_aware``: the balancer prices KV already on a target's node as NVLink traffic (and with
    ``spread_sends`` a home's inter-node KV sends as spread over its node's NICs). ``nic_scale``: the
    balancer alone sees the inter-node bandwidth times this (staging and scoring see the true one)."""
    if init in BASELINE_INITS or init == FCP_PLAN:  # a baseline itself, so dcp is never slower
        from .baselines import allgather, ring, zigzag

        if init == FCP_PLAN:
            from .fcp import fcp

            base = fcp(tiles, world_size, cost_model=cost_model, max_stages=max_stages, home=home, **sizes)
        else:
            base = {"zigzag-ring": zigzag, "zigzag-allgather": allgather, "ring": ring}[init](tiles, world_size)
        placement = finish_placement(tiles, base.block_home, base.tile_rank, base.tile_stage, world_size=world_size,
                                     cost_model=cost_model, sizes=sizes, max_stages=max_stages)
    else:
        home, rank = _balanced(tiles, world_size, init, cost_model, sizes, home=home, relay_aware=relay_aware,
                               spread_sends=spread_sends, nic_scale=nic_scale)
        placement = _staged(tiles, world_size, home, rank, cost_model, max_stages, sizes)
    if relays:  # several nodes: hot KV blocks cross each inter-node link once and fan out over NVLink
        placement = add_relays(tiles, placement, world_size=world_size, cost_model=cost_model,
                               max_stages=max_stages, sizes=sizes)
    return placement, placement.sim_time


def _balanced(tiles: TileSet, world_size: int, init: str | None, cost_model: CostModel, sizes: dict, *,
              home: np.ndarray | None = None, relay_aware: bool = False, spread_sends: bool = False,
              nic_scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(block homes, tile ranks) of ``_place`` before staging: the initial data placement ``init`` (or
    the given ``home``) and the Balancer's tile placement on it."""
    if init is not None:
        home = _initial_home(tiles, world_size, init, cost_model, sizes)
    elif home is None:
        raise ValueError("_place needs an init name or a home")
    # dealt hot rows start on their kv-homes (or kv-nodes) where that moves fewer bytes (from every
    # other start this was worse as often as better over the benchmark cases)
    start = None
    if init in ("dealt", "dealt-nodes"):
        by_node = cost_model.topology.ranks_per_node if init == "dealt-nodes" else None
        start = pushed_rows(tiles, home, ranks_per_node=by_node, **sizes)
    topology = cost_model.topology
    if nic_scale != 1.0:
        topology = replace(topology, inter_bw=topology.inter_bw * nic_scale)
    flops = cost_model.tile_flops(tiles.pairs, num_q_heads=sizes["num_q_heads"], head_dim=sizes["head_dim"])
    rank = balanced_ranks(tiles, home, flops / cost_model.fwd_rate, world_size, topology, start=start,
                          relay_aware=relay_aware, spread_sends=spread_sends, overlap=cost_model.balance_overlap,
                          duplex=cost_model.balance_duplex, level_nodes=cost_model.balance_level_nodes,
                          priced_rows=cost_model.balance_priced_rows, slack=cost_model.balance_slack,
                          **sizes)
    return home, rank


def _staged(tiles: TileSet, world_size: int, home: np.ndarray, rank: np.ndarray, cost_model: CostModel,
            max_stages: int, sizes: dict) -> Placement:
    """The scored Placement of given homes and tile ranks, staged by ``assign_stages`` (no relays)."""
    flops = cost_model.tile_flops(tiles.pairs, num_q_heads=sizes["num_q_heads"], head_dim=sizes["head_dim"])
    stage = assign_stages(tiles.q, tiles.kv, flops, rank, home, block_size=tiles.block_size,
                          total_len=tiles.total_len, world_size=world_size, cost_model=cost_model,
                          max_stages=max_stages, **sizes)
    return finish_placement(tiles, home, rank, stage, world_size=world_size, cost_model=cost_model,
                            sizes=sizes, max_stages=max_stages)
