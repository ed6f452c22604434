"""dcp's passes after the first: the kept plan weighed against its homes balanced again other ways.

Notation (docs/design.md): nB blocks, P ranks, tile (qb, kb); ``home[b]`` owns block b.

Each pass plans new starts with the first pass's machinery (planner/first_pass.py ``_dcp``, seeded with
homes: ``_second_opinion``), refines them alike (transit relays, backward deferral) and keeps one only
where it simulates faster: the second opinion (spread sends), the NIC-shy and spread passes in rounds
(``_nic_passes``), the deal pass (``_deal_pass``, heavy document pieces and widely read blocks dealt
over a node's ranks) and the leveling pass (``_level_pass``). Where each runs is decided in
planner/dcp.py ``dcp``.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from . import first_pass
from .candidates import (_initial_home, _place, _schedule_bytes, _with_transit, coarsening_factor, merged_home,
                         with_deferred_backward)
from .cost_model import CostModel, Topology
from .first_pass import SECOND_OPINION_INITS, _dcp
from .placement import Placement
from .schedule import KIND_KV
from .starts import deal_blocks, deal_heavy_pieces, spread_read_blocks
from .tiles import TileSet, coarsen

# Several nodes, a plan still slower than NIC_SHY_FROM x the bound after its backward deferral: the
# kept plan's homes balanced again by a Balancer that sees the inter-node bandwidth scaled by each of
# NIC_SHY_SCALES (NIC transfers priced 1.33x and 2x), refined, transit-relayed and deferred alike; the
# fastest in the cost model is kept. The balancer's max(compute, transfers) estimate is optimistic where
# the staged execution cannot hide a transfer (the first exchange, per-exchange latency), so it sheds
# more across nodes than pays on small batches; scaling every balancer's NIC instead loses as often as
# it gains (evaluation cases, 32 / 8: x0.75 1.1860 -> 1.1864; x1.5, priced cheaper, 1.2350). The pass, fwd+bwd
# over the bound, evaluation cases, none slower: 32 / 8 1.1860 -> 1.1676 (fp32 partials, 11 of 19
# faster; 0.75 alone 1.1729, 0.5 alone 1.1715, adding 0.3 1.1656), bf16 1.1564 -> 1.1352; 16 / 8
# 1.0355 -> 1.0305; 16 / 4 1.0807 -> 1.0779. 1M / 64 (the bench batch): 1.193 -> 1.150 (fp32),
# 1.146 -> 1.102 (bf16), for ~1 s more planning (+60%); +23% on the 32 / 8 cases. Comparing the
# candidates before their deferral instead lost gains (one won at 1.10x the kept plan's time before it).
NIC_SHY_SCALES = (0.75, 0.5)
NIC_SHY_FROM = 1.10
# ... and then against its homes with the blocks other nodes read dealt over their node's ranks, all of
# them or those crossing nodes in the forward's first exchange (``_spread_homes``).
SPREAD_PASS = True
# Where the spread pass wins, its homes go through the NIC-shy pass and the spread pass again, for up to
# PASS_ROUNDS rounds (``_nic_passes``). Every pass only adds candidates (none slower). Fwd + bwd over the
# bound, 63 multi-node cases per seed (the bench's draws; fp32 partials), one round -> three: seed 0
# (the bench's batches) 32 / 8 1.1542 -> 1.1502; seed 777 16 / 4 1.1062 -> 1.1036, 32 / 8 1.2475 ->
# 1.2444 (a causal batch 1.583 -> 1.527); seed 1 (held out) 16 / 4 1.1042 -> 1.0976 (a causal batch
# 1.250 -> 1.155, its worst plan 1.430 -> 1.388); 10 of 189 plans faster (by up to 8%), planning +2-7%
# on these cases. Spreading also the plan before each round's NIC-shy pass cost one more start (0.9 s
# of a 1M / 64 plan, no gain there) and lost as much as it won (seed 777 one plan faster, seed 1 two
# slower); the spread pass before the NIC-shy one lost a held-out plan (1.430 -> 1.454).
PASS_ROUNDS = 3
# A plan still slower than DEAL_PASS_FROM x the bound after the NIC-shy and spread passes is weighed against
# homes with, inside each node, every document piece holding more than DEAL_PIECE_FROM ranks' shares of
# compute dealt round-robin over the node's ranks (``deal_heavy_pieces``), from "hierarchical" ("contiguous"
# on one node) and from the kept plan (``_dealt_homes``); balanced and refined as the second opinion's starts
# are on several nodes, as a one-node candidate on one (``_deal_pass``); kept where faster by more than the
# bytes it adds cost (``_worth_its_bytes``). A piece kept in contiguous runs leaves one home with most of
# its rows: it sheds them to node-mates, but each shed row sends its Q and takes back an OUT partial over
# that home's links, until its transfers equal its compute and max(compute, transfers) sees nothing more
# to gain (1M tokens / 64 ranks, a 32K-token document: one home at 6.1x a rank's share of compute, still
# 1.13x the mean after balancing). Dealt, every rank of the node holds rows of the piece and reads its KV
# from the others over NVLink. Fwd + bwd over the bound, none of the 105 cases of a draw slower: the
# bench's batches (seed 0) 16 / 4 1.0708 -> 1.0593, 32 / 8 1.1451 -> 1.1388 (a causal 16 / 4 plan 1.30
# -> 1.11); held out (seed 1) 16 / 8 1.0620 -> 1.0449, 16 / 4 1.0920 -> 1.0810, 32 / 8 1.2412 -> 1.2227
# (a shared-question plan 1.59 -> 1.33); seed 777 16 / 8 1.0548 -> 1.0407, 16 / 4 1.0996 -> 1.0917, 32 /
# 8 1.2273 -> 1.2015 (worst 1.682 -> 1.537), 32 (32) 1.0583 -> 1.0554; bf16 partials 16 / 8 1.0308 ->
# 1.0284, 16 / 4 1.0544 -> 1.0481, 32 / 8 1.1227 -> 1.1194. 1M tokens / 64 ranks, six Wikipedia
# batches: 1.23 -> 1.06, 1.14 -> 1.06, 1.30 -> 1.22 (three unchanged), for +4% planning in all (+10-26%
# on the 128K 16 / 4 and 32 / 8 cases). Before the NIC-shy pass instead (the later passes then start from the
# dealt plan): gains about as large, but six of 126 multi-node plans slower; from "hierarchical" alone:
# held out 16 / 4 1.0839 (against 1.0810), from the kept plan alone 32 / 8 1.2290 (against 1.2206; all
# three without the bytes rule, which took 32 / 8 1.2206 -> 1.2227).
DEAL_PASS_FROM = 1.05
# On one node the deal pass also weighs the kept plan's homes with its *widely read* blocks - KV that at
# least WIDELY_READ of the other ranks receive: a shared question, causal_blockwise's first block -
# dealt over the ranks (``deal_blocks``): in contiguous runs a few homes hold them all and send every
# copy. 32 ranks of one node, three draws (63 plans): 3 faster, none slower (shared question 1.130 ->
# 1.119 and 1.111 -> 1.051, a causal batch 1.115 -> 1.108), planning +0.5%; smaller shared-question
# batches (16-32K tokens on 16 or 32 ranks of one node) gain most: 3.59 -> 3.00, 2.05 -> 1.61x the bound.
WIDELY_READ = 0.5
# A multi-node plan still over LEVEL_FROM x the bound after the deal pass is weighed against its homes
# balanced again with every node whose mean compute is over the mean then leveling its own ranks
# (planner/balance.py ``level_nodes``; ``_level_pass``), refined as the second opinion's starts are; kept
# where faster. The balancer fills targets up to its cap over the whole batch: a node that cannot shed
# its excess over its NICs keeps it on whichever of its ranks hold it, while its node-mates sit at the
# cap (the held-out worst plan, 32 / 8: one rank at 1.27x the mean on a node at 1.07x). Fwd + bwd over
# the bound, the 84 multi-node plans per draw: seed 0 (the bench's batches) 8 faster, 1 slower (16 / 8
# 1.0267 -> 1.0244, 16 / 4 1.0500 -> 1.0426, a lambda plan 1.084 -> 1.024; the slower 1.017 -> 1.031:
# the deal pass's turned-down plan, polished, is not worth its bytes against the polished leveled plan,
# as it was against the plan before); held out, seed 1, 10 faster (32 / 8 1.1431 ->
# 1.1365, its worst plan 1.426 -> 1.367 through the re-plan, whose passes level too), seed 777, 8 faster
# (32 / 8 1.1330 -> 1.1264, worst 1.358 -> 1.314); 1M tokens / 64 ranks, one of six batches 1.171 ->
# 1.102. Planning +4-5% (seed 0, 32 / 8 and 16 / 4, runs alternated). The leveling always on in every
# balancer instead: seed 1 12 faster but 8 slower (a 32 / 8 plan 1.33 -> 1.42). With the deal pass's
# bytes rule: 3 of the 26 gains kept (its moves are rows to node-mates, over NVLink). From 1.0x the
# bound: seed 0 three more plans faster (16 / 4 1.0426 -> 1.0417), for a pass on nearly every plan.
# Part of the gain is the second balancing itself, with spread sends (most of seed 0's 16 / 4 gain; none
# of seed 1's): see docs/planner_log.md.
LEVEL_PASS = True
LEVEL_FROM = 1.05


def _second_opinion(tiles: TileSet, result: Placement, world_size: int, cost_model: CostModel, max_stages: int,
                    sizes: dict, seeds: list, *, opinion_inits: tuple = SECOND_OPINION_INITS, nic_scale: float = 1.0,
                    deferred: bool = False) -> Placement:
    """``result`` or, where one simulates faster, the fastest second-opinion finalist from ``seeds`` and
    ``opinion_inits`` (``_dcp(second_opinion=...)``), each given its transit relays and, with
    ``deferred``, its backward deferral (to compare with a ``result`` that has had its own)."""
    for alt in _dcp(tiles, world_size, cost_model, max_stages, sizes, None, second_opinion=seeds,
                    every_finalist=True, nic_scale=nic_scale, opinion_inits=opinion_inits):
        alt = _with_transit(tiles, alt, world_size, cost_model, sizes)
        if deferred:
            # (the node-local deferral path only on the first pass's kept plan: on every finalist too it
            # cost the 1M / 64 plan 1.5 s more for 1.1466 -> 1.1416x the bound on the bench's 32 / 8
            # cases; deferring the passes' result that way again made the passes' gains non-monotone)
            alt = with_deferred_backward(tiles, alt, world_size, cost_model, sizes, node_local=False,
                                         beat=result.sim_time)
        if alt.sim_time < result.sim_time:
            result = alt
    return result


def _nic_passes(tiles: TileSet, result: Placement, world_size: int, cost_model: CostModel, max_stages: int,
                sizes: dict, bound: float) -> Placement:
    """The NIC-shy and spread passes, in rounds: the kept homes balanced again with the NICs priced
    slower (NIC_SHY_SCALES); then, while the plan is over NIC_SHY_FROM x the bound, its spread homes
    (``_spread_homes``) not tried yet, each on its own; where one wins, its homes go through the
    NIC-shy pass in the next round. Each pass only adds candidates: the result is never slower than
    its input."""
    shy_seed, tried = result.block_home, []
    for _ in range(PASS_ROUNDS):
        for scale in NIC_SHY_SCALES:
            result = _second_opinion(tiles, result, world_size, cost_model, max_stages, sizes, [shy_seed],
                                     opinion_inits=(), nic_scale=scale, deferred=True)
        if not SPREAD_PASS or result.sim_time <= NIC_SHY_FROM * bound:
            break
        homes = [home for home in _spread_homes(tiles, result, world_size, cost_model.topology)
                 if not any(np.array_equal(home, seen) for seen in tried)]
        tried += homes
        # each on its own: together, one's finalists may drop the other's before their transit relays
        before_spread = result
        for home in homes:
            result = _second_opinion(tiles, result, world_size, cost_model, max_stages, sizes, [home],
                                     opinion_inits=(), deferred=True)
        if result is before_spread:
            break
        shy_seed = result.block_home
    return result


def _deal_pass(tiles: TileSet, result: Placement, world_size: int, cost_model: CostModel, max_stages: int,
               sizes: dict) -> tuple:
    """(``result`` or, where one simulates faster and is worth its bytes, a plan from the homes of
    ``_dealt_homes``; the fastest plan faster than that one but turned down for its bytes, or None): on
    several nodes balanced and refined as the second opinion's starts are (spread sends, transit relays),
    on one node balanced and staged as a one-node candidate; each with its backward deferral."""
    turned_down = None
    for home in _dealt_homes(tiles, result, world_size, cost_model, sizes):
        if world_size > cost_model.topology.ranks_per_node:
            alt = _second_opinion(tiles, result, world_size, cost_model, max_stages, sizes, [home],
                                  opinion_inits=(), deferred=True)
        else:
            alt, _ = _place(tiles, world_size, None, cost_model, max_stages, sizes, home=home, relays=False)
            alt = with_deferred_backward(tiles, alt, world_size, cost_model, sizes, beat=result.sim_time)
        if alt.sim_time < result.sim_time:
            if _worth_its_bytes(tiles, alt, result, sizes, cost_model.topology):
                result = alt
            elif turned_down is None or alt.sim_time < turned_down.sim_time:
                turned_down = alt
    if turned_down is not None and turned_down.sim_time >= result.sim_time:
        turned_down = None
    return result, turned_down


def _level_pass(tiles: TileSet, result: Placement, world_size: int, cost_model: CostModel, max_stages: int,
                sizes: dict) -> Placement:
    """``result`` or, where it simulates faster, its homes balanced again with every node still over the
    balancer's cap then leveling its own ranks (planner/balance.py ``level_nodes``), refined as the second
    opinion's starts are (spread sends, transit relays, backward deferral). As the NIC-shy passes, no
    bytes rule: the leveling moves work over NVLink only (with the deal pass's rule, 3 of the 26 plans it
    made faster on three draws stayed faster)."""
    return _second_opinion(tiles, result, world_size, replace(cost_model, balance_level_nodes=True), max_stages,
                           sizes, [result.block_home], opinion_inits=(), deferred=True)


def _worth_its_bytes(tiles: TileSet, alt: Placement, result: Placement, sizes: dict,
                     topology: Topology | None = None) -> bool:
    """Whether ``alt``, faster than ``result``, is worth the bytes it moves: as many or fewer, or a time
    gain over (BYTES_SLACK - 1) x its bytes over ``result``'s (2% for as many, 4% for twice as many). A
    dealt piece's KV is read on every rank of its node: a batch that is one long segment (causal_blockwise
    on one node of 32) dealt whole gained 2% for 4.8x the bytes. ``topology`` (several nodes): bytes between
    nodes weighed at the NIC's cost (``_schedule_bytes``)."""
    ratio = _schedule_bytes(tiles, alt, sizes, topology) / max(_schedule_bytes(tiles, result, sizes, topology), 1.0)
    return ratio <= 1.0 or 1.0 - alt.sim_time / result.sim_time > (first_pass.BYTES_SLACK - 1.0) * ratio


def _dealt_homes(tiles: TileSet, placement: Placement, world_size: int, cost_model: CostModel, sizes: dict) -> list:
    """The homes of "hierarchical" (on one node "contiguous") and of ``placement`` with their heavy pieces
    dealt over their nodes' ranks (``deal_heavy_pieces``), and on one node ``placement``'s with its widely
    read blocks dealt (WIDELY_READ), each where that changes it and once; dealt as merged blocks where
    the batch is planned on them (the seeds of ``_dcp(second_opinion=...)``)."""
    coarse, kept, of_block = _as_planned(tiles, world_size, placement.block_home, cost_model.topology)
    homes = [_initial_home(coarse, world_size, "hierarchical", cost_model, sizes)]
    if kept is not None:
        homes.append(kept)
    pairs = [(home, deal_heavy_pieces(coarse, home, world_size, cost_model.topology)) for home in homes]
    if WIDELY_READ and kept is not None and world_size <= cost_model.topology.ranks_per_node:
        kv_rows = placement.schedule.fwd.numpy()
        kv_rows = kv_rows[kv_rows[:, 3] == KIND_KV]  # one per receiving rank on one node (no relays yet)
        receivers = np.bincount(kv_rows[:, 4], minlength=tiles.num_blocks)
        widely = np.zeros(coarse.num_blocks, dtype=bool)
        widely[of_block[receivers >= WIDELY_READ * (world_size - 1)]] = True
        pairs.append((kept, deal_blocks(kept, widely, cost_model.topology)))
    dealt = []
    for home, home_dealt in pairs:
        if not np.array_equal(home_dealt, home) and not any(np.array_equal(home_dealt, seen) for seen in dealt):
            dealt.append(home_dealt)
    return [home[of_block] for home in dealt]


def _as_planned(tiles: TileSet, world_size: int, home: np.ndarray, topology) -> tuple:
    """(the blocks dcp plans this batch on - merged where ``coarsening_factor`` merges them -, ``home`` as
    their homes or None where it does not keep them whole, each real block's merged block)."""
    factor = coarsening_factor(tiles, world_size, topology)
    coarse = coarsen(tiles, factor)[0] if factor > 1 else tiles
    return coarse, merged_home(home, factor, coarse.num_blocks), np.arange(tiles.num_blocks) // factor


def _spread_homes(tiles: TileSet, placement: Placement, world_size: int, topology) -> list:
    """The homes of ``placement`` with, inside each node, the blocks other nodes read dealt over the
    node's ranks (``spread_read_blocks``), and with only those whose KV crosses nodes in the forward's
    first exchange dealt (``deal_blocks``): that exchange has no earlier one to send them ahead through
    a node-mate (a transit rank), so one home's NIC carries them all behind stage 0's compute. Dealt
    as merged blocks where the batch is planned on them (the seeds of ``_dcp(second_opinion=...)``)."""
    coarse, home, of_block = _as_planned(tiles, world_size, placement.block_home, topology)
    if home is None:
        return []  # not whole merged blocks: no seed survives merging
    fwd = placement.schedule.fwd.numpy().astype(np.int64)
    node_of = topology.node_of
    first = (fwd[:, 0] == 1) & (fwd[:, 3] == KIND_KV) & (node_of(fwd[:, 1]) != node_of(fwd[:, 2]))
    crossing = np.zeros(coarse.num_blocks, dtype=bool)
    crossing[of_block[fwd[first, 4]]] = True
    return [spread_read_blocks(coarse, home, topology)[of_block], deal_blocks(home, crossing, topology)[of_block]]
