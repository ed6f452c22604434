""""dcp" strategy: dynamic context parallelism with a fast, vectorized placement (no hypergraph library).

Notation (docs/design.md): T tokens, nB blocks of B tokens, P ranks, tile (qb, kb) with forward FLOPs
``4 * D * Hq * pairs``; ``home[b]`` owns block b; M = mean per-rank FLOPs.

Steps (vectorized numpy; the balancer loops over donor/target rank pairs, not tiles):

1. Data placement (memory, always within a few percent; planner/starts.py): "contiguous" runs cut
   where few tiles cross; on several nodes "hierarchical" / "hierarchical-fcp" / "hierarchical-fcp-wide"
   (documents packed onto nodes by FCP, then onto each node's ranks); "fcp" / "fcp-docs"
   (planner/fcp.py) or "zigzag" (planner/baselines.py); "dealt" / "dealt-nodes" where rows are hot.
2. Tile placement (compute, planner/balance.py): every tile starts on its q-block's home (reads
   remote KV only, no OUT partial) - for "dealt", a row's piece starts on its kv-home where that
   moves fewer bytes (``pushed_rows``); for "dealt-nodes" (several nodes), a row's piece on another
   node starts on one rank of that node, so its Q block crosses into the node once. Overloaded
   ranks then shed q-rows to the kv-homes (only Q and one OUT partial move per row, receive-once)
   and rectangles to the least loaded ranks, same node first, each move taken only if the cost
   model says it shortens the slower of the two ranks. On several nodes a second, relay-aware
   balancer prices KV as the relays will move it (once into a node, then over NVLink).
3. Stages (planner/stages.py): stage 0 = tiles whose inputs are home; remote inputs ordered by the
   compute they unlock per transfer second and cut into <= ``max_stages`` stages, each sized to hide
   behind the previous stage's compute; purely local tiles, and tiles of a rank's own rows whose KV
   still arrives for an earlier tile, are then spread into later stages where a rank's transfers
   (e.g. OUT partials returning to a donor) would otherwise be exposed: neither moves a transfer.
4. Relays (planner/relay.py, several nodes only): a KV block read by several ranks of a remote
   node crosses the inter-node link once, to a proxy on that node that forwards it over NVLink,
   and their dK/dV partials are summed on the way back; kept only where the cost model says so.
   On the finalists, KV that still crosses into a node for one rank alone may go through a
   transit rank of that node (``add_transit``, in passes until one gains nothing), spreading a
   node's inbound KV over its NICs. On one node a block many ranks read may be fanned out through
   its earliest readers instead (planner/fanout.py), so its home's NVLink port sends fewer copies.

No initial placement dominates (measured over the benchmark batches: on one node "fcp-docs", "fcp"
and "contiguous" reach about the same time, the FCP packings with 40-60% fewer bytes on Wikipedia
batches, "contiguous" with fewer on long documents; on several nodes each of the five candidates
wins somewhere; batches with hot rows add "dealt", and on several nodes "dealt-nodes"), so dcp plans
them in turn and keeps the one with the lowest simulated forward + backward time, stopping early
once a plan is within 5% of the lower bound - except on one node where most of the compute lies in
segments longer than a rank's memory: there every candidate is balanced, and of those within 5% of
the bound and 2% of the fastest the one moving the fewest bytes is kept ("contiguous" on long
documents: rows move to the ranks holding their KV); bytes follow from the balanced placement, so
only that candidate is staged and scored where its time settles the choice. With more than two candidates they are first
ranked on 2x-merged blocks and only the best two are planned at full resolution. On several nodes
the five fastest candidates (``RELAY_TOP``) get relays and join a relay-aware "hierarchical" plan
(``RELAY_AWARE_INITS``) and a relay-aware "hierarchical-spread" one (``RELAY_AWARE_EXTRA``: each
node's blocks that other nodes read dealt over its ranks) as finalists; the two fastest finalists
are refined (relay-aware rebalancing of their data placement, restaging with front-loaded transfers,
with all ranks' items staged against receivers' and senders' compute alike, and with each rank's own
best budget scale, each kept only where faster); the refined finalists within ``RECHECK`` of the
fastest go to full resolution and get their transit relays, and the fastest is kept. The plain
zigzag baseline ("zigzag-ring") is a candidate too, and the final plan is checked against both
baselines at full resolution (skipped for a baseline ``BASELINE_MARGIN`` slower on the merged
blocks), so dcp is never slower than them in the cost model; after every pass below, the fcp
strategy's own plan is weighed as it is too (on several nodes, and on one node where the plan is not
within 5% of the bound, kept there by the bytes rule). A multi-node plan still
``SECOND_OPINION`` times the bound gets a second opinion: balanced again with its homes' inter-node
sends priced as spread over their node's NICs (from "hierarchical", from "hierarchical" with each
node's blocks that other nodes read dealt over its ranks, and from the homes of the kept plan and of
every first-pass finalist), refined alike; its finalists within ``RECHECK`` of the fastest go to
full resolution and get their transit relays before they are compared, and the fastest plan is kept.
Batches with many tiles are planned on merged blocks (``coarsen``) and mapped back, which keeps
planning time near-linear in the batch (on one node with the merged tiles' backward stages mapped
back too). Last, the kept plan's backward defers whole remote-KV groups
out of stage 0 into the stages whose exchanges it leaves exposed, where faster
(``with_deferred_backward``; not for a large one-node batch planned on merged blocks); on several
nodes its greedy rounds are followed twice, the second time also trying to defer only groups whose
kv-block is homed on the rank's node (a deferred group whose dK/dV partial crosses nodes, summed
through a relay's reduce tree, can leave a proxy's NIC sending after all compute). On several
nodes a plan still ``NIC_SHY_FROM`` times the bound is then weighed against its homes balanced again
with the NICs priced 1.33x and 2x (``NIC_SHY_SCALES``; the balancer alone sees them slower, staging
and scoring see the true ones), each refined, transit-relayed and deferred alike: the balancer's
max(compute, transfers) estimate is optimistic where the stages cannot hide a transfer (the first
exchange, per-exchange latency), so on small batches it sheds more compute across nodes than pays.
A plan still that slow is last weighed against its homes with, inside each node, the blocks other
nodes read dealt over the node's ranks, and (apart) only those whose KV crosses nodes in the forward's
first exchange (``_spread_homes``, ``SPREAD_PASS``): nothing can send those ahead through a node-mate,
so one home's NIC carries them all behind its stage-0 compute. Where such homes win, they go through
the NIC-shy and spread passes again (``PASS_ROUNDS``, ``_nic_passes``). A plan still ``DEAL_PASS_FROM``
times the bound (one node too) is then weighed against homes with every document piece that holds more
than a rank's compute on a node dealt round-robin over the node's ranks (``deal_heavy_pieces``), so that
no one home carries the Q and OUT transfers of shedding its rows (kept where faster by more than the bytes
it adds cost, ``_worth_its_bytes``); on one node also against the kept homes with the blocks that at least
``WIDELY_READ`` of the ranks read dealt over the ranks. A one-node plan over ``POLISH_FROM_ONE_NODE`` times
the bound is then weighed against itself with those blocks fanned out (``FANOUT``). A plan still ``REPLAN_FROM``
times the bound (``REPLAN_FROM_ONE_NODE`` on one node) is planned once more from the start with every
balancer estimating a rank's time as max(compute, transfers) + ``REPLAN_OVERLAP`` x min(compute,
transfers), so that a donor whose transfers about equal its compute still sheds compute, and on one node
once more with every balancer taking a rank's transfers on a link as the busier of its sends and receives
(``REPLAN_DUPLEX``: a home that many ranks read while it reads others' KV; kept only where worth its
bytes); the fastest plan is kept.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

import numpy as np

from .candidates import (BASELINE_INITS, FCP_PLAN, _balanced, _initial_home, _lower_bound, _place, _relay_balanced,
                         _restaged, _schedule_bytes, _scored, _staged, _time_floor, _with_transit,
                         coarsening_factor, merged_home, moved_bytes, with_deferred_backward)
from .cost_model import CostModel
from .fanout import add_fanout
from .fcp import strategy_home
from .placement import Placement, compact_stages, prefix_sums
from .polish import polish_forward
from .polish_bwd import polish_backward
from .relay import add_relays
from .schedule import KIND_KV, as_relay_table, derive_schedule_merged
from .starts import deal_blocks, deal_heavy_pieces, hot_rows, spread_read_blocks
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
BASELINE_MARGIN = 1.25  # a baseline this much slower on merged blocks is not re-planned at full resolution
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
# Several nodes, a final plan slower than SECOND_OPINION x the lower bound (fwd + bwd): planned again
# with the homes' inter-node KV sends priced as spread over their node's NICs (``Balancer(spread_sends=
# True)``, which home-side transit relays then realize), from SECOND_OPINION_INITS and from the first
# plan's homes, refined and transit-relayed alike; the faster of the two plans is kept. It pays where a
# document needs more than its homes' node can compute. 1M tokens / 64 ranks, seven Wikipedia batches
# (fp32 partials): 2.17 -> 1.50, 1.91 -> 1.56, 1.37 -> 1.23, 1.45 -> 1.28, 3.17 -> 2.25, 1.76 -> 1.66 x
# the bound, one unchanged (1.58), for 1.3-2.3 -> 2.0-3.8 s of planning. On the 128K benchmark cases
# (bf16 partials) 32/8 goes 1.241 -> 1.228 for +6% planning time; from 1.15 on: 1.226 for +29%, from
# 1.5 on: nothing.
SECOND_OPINION = 1.25
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
# Several nodes, a plan still slower than REPLAN_FROM x the bound after every pass: planned again from the
# start with the balancer estimating a rank's time as max(C, X) + REPLAN_OVERLAP * min(C, X) instead of
# max(C, X) (planner/balance.py ``overlap``), and the faster plan kept. Its slowest ranks are donors
# whose transfers about equal their compute, where max(C, X) sees nothing to gain from shedding compute
# while the stages leave part of either exposed (a held-out 32 / 8 Wikipedia causal batch: three
# ranks at 1.6x the mean compute, fwd + bwd 1.93x the bound; 1.76x re-planned). Neither estimate wins
# everywhere: with 0.5 on every plan, of the 63 multi-node cases of a draw 22 / 19 / 25 were faster
# and 24 / 26 / 19 slower (seeds 0 / 1 / 777). Fwd + bwd over the bound, 32 / 8, re-planning those
# over 1.25x: seed 0 1.1466 -> 1.1451 (worst 1.368 -> 1.349), seed 1 1.2627 -> 1.2412 (1.928 ->
# 1.764), seed 777 1.2341 -> 1.2273 (1.744 -> 1.682); the 16 / 4 and 16 / 8 plans over 1.25x: four,
# three faster; planning +5% / +36% / +33% on the 32 / 8 cases. Seeds 1 and 777, 0.25: 1.2463 /
# 1.2302; 1.0: 1.2411 / 1.2290 (worst 1.800 / 1.682). From 1.15x: 1.2389 / 1.2221 for +67% / +73%.
# 1M tokens / 64 ranks: one of six Wikipedia batches re-planned, 1.48 -> 1.30x for 4.2 -> 9.1 s.
# One node (large batches planned on merged blocks excepted: NVLink-bound, see _dcp_selected), from
# REPLAN_FROM_ONE_NODE x the bound: 32 ranks on one NVLink domain 1.0595 -> 1.0519 (seed 0), 1.0743 ->
# 1.0639 (seed 1; a shared-question batch 1.231 -> 1.192), 1.0643 -> 1.0583 (seed 777), planning
# +14% / +33% / +43% on those cases; no 8-rank plan of the three draws is that slow (all unchanged).
REPLAN_FROM = 1.25
REPLAN_FROM_ONE_NODE = 1.05
REPLAN_OVERLAP = 0.5
# ... and on one node a second time with every balancer taking a rank's transfers on a link as the busier of
# its sends and receives instead of their sum (``CostModel.balance_duplex``, planner/balance.py ``duplex``),
# kept where faster and worth its bytes (``_worth_its_bytes``). A long document's first blocks are read by
# every rank holding its later rows while their homes read others' KV in the same exchanges: summed, their
# transfers equal their compute and they stop shedding it (32 ranks on one NVLink domain, a Wikipedia
# causal batch with a 15K-token document: compute 1.13x the mean, 1.173x the bound; duplex 1.02x,
# 1.115x). Balancing every plan that way loses as often as it wins (seed 0: 22 of 105 plans faster, 22
# slower, 32 / 8 1.1063 -> 1.1292). As a re-plan, 32 (32): seed 1 1.0450 -> 1.0390 (max 1.173 -> 1.115),
# seed 777 1.0394 -> 1.0375, seed 0 unchanged, none slower, planning +40-47% on those cases; without the
# bytes rule also causal_blockwise 1.0268 -> 1.0262 for ~3.5x its bytes. On several nodes measured and
# not taken: in the re-plan (from REPLAN_FROM), 1 of 84 plans faster (1.358 -> 1.302) for +24-28%
# planning at 32 / 8; as a pass from the kept homes after the NIC-shy and spread passes (from 1.05x),
# 6 of 168 plans faster (2 with the bytes rule) for +5-13% planning, none of six 1M / 64 batches. No
# 8-rank plan of the three draws is slow enough to be re-planned.
REPLAN_DUPLEX = True
# The kept plan's forward stages are polished by planner/polish.py (a local search on the slowest rank's
# exposed exchanges); on one node only from this many times the bound, as below it the polish costs
# about as long as planning a 128K batch on 8 ranks (1-26 ms) for gains under 0.1%.
POLISH_FROM_ONE_NODE = 1.03
# The polishes run on the kept plan and on the runner-up (the best plan the NIC or deal passes beat) where
# that is within this fraction of it: a plan beaten before the polishes can end faster after them (as in
# the transit-relay test, where the plan without transit relays ends at 1.386x the bound against the kept
# 1.437x). Held-out 32 / 8 (seed 1) 1.1548 -> 1.1512, bench 16 / 4 1.0531 -> 1.0524; 5 of 126 multi-node
# plans faster (seeds 0, 1, 777), none slower, planning time within noise. 0.25 with the two best beaten
# plans: no more gained.
POLISH_RUNNER_UP = 0.10
# ... and so is the deal pass's fastest plan that its bytes rule turned down (faster than the kept plan, but
# not by enough for the bytes it adds, ``_worth_its_bytes``): it is kept where, polished, it beats the
# polished kept plan by the same rule, as the polishes gain unequally (a 32K-token long-tail batch on 8
# ranks, 4 per node: 1.218 -> 1.121x the bound). The bench's 16 / 4 and 32 / 8 cases of three draws
# (seeds 0, 1, 777) and seed 0's 16 / 8 and 32 (32): 3 of 168 plans faster (1.063 -> 1.017, 1.267 ->
# 1.221, 1.173 -> 1.110x the bound), none slower; a polish more where such a plan exists (7 of the 42
# held-out 32 / 8 plans), planning +5-9% on those sets.
POLISH_BYTES_REJECTED = True
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
# A one-node plan over POLISH_FROM_ONE_NODE x the bound is weighed, before its polish, against itself with
# its widely read KV fanned out through the ranks that got it first (planner/fanout.py), its backward
# deferred; kept where faster, the plan it beat polished as a runner-up. With the dealt widely-read blocks
# above: 32 (32) three draws 3 of 63 plans faster (shared question 1.119 -> 1.081), none slower (two were
# 0.1-0.3% slower without the runner-up polish), planning +11% at 32 (32); without them no plan gained
# (the question's homes were still computing more than their share: the forward waited on compute).
FANOUT = True
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
# Last of all, the fcp strategy's own plan as it is (FCP's homes, owner computes), kept where faster (on
# one node only for a plan not within GOOD_ENOUGH of the bound, and where worth its bytes): 8 ranks on two
# nodes, 7 of 21 plans of seed 0 faster (1.0176 -> 1.0162 geomean), 4 of seed 1 (1.0267 -> 1.0244); a
# 16 / 8 Wikipedia causal batch of seed 1 1.105 -> 1.075x the bound; no other plan of either changes.
FCP_PLAN_LAST = True
FCP_HOME = "fcp-home"  # (the memo's key of the fcp strategy's homes and their compute floor)
# The steps dcp records in ``Placement.search`` (``Plan.explain``), in the order they run; each runs only
# where its condition holds (see ``dcp``)
SEARCH_STEPS = ("candidates", "restaging", "zigzag baselines", "second opinion", "backward deferral",
                "NIC-shy and spread passes", "deal pass", "leveling pass", "fan-out", "polish",
                "re-plan weighing exposed transfers",
                "re-plan with duplex links", "the fcp strategy's plan")


def dcp(tiles: TileSet, world_size: int, *, cost_model: CostModel, num_q_heads: int, num_kv_heads: int,
        head_dim: int, element_size: int, max_stages: int, init: str | None = None, grad_element_size: int = 4,
        polish: bool = True, memo: dict | None = None, **_) -> Placement:
    """DCP placement (see module docstring). ``init`` forces one initial data placement ("contiguous",
    "hierarchical", "hierarchical-fcp", "hierarchical-fcp-wide", "zigzag", "fcp", "fcp-docs", "dealt",
    "dealt-nodes"); by default the candidates of SINGLE_NODE_INITS / MULTI_NODE_INITS are planned in
    turn and the fastest (simulated fwd + bwd time) is kept. The kept plan's backward then defers remote-KV groups into the stages its
    transfers leave exposed, where faster (``with_deferred_backward``); on several nodes, a plan still
    slower than NIC_SHY_FROM x the bound is weighed against its homes balanced with the NICs priced
    slower (NIC_SHY_SCALES), and then against its homes with the blocks other nodes read dealt over their
    node's ranks (``_spread_homes``), in rounds (``_nic_passes``); then (one node too, from DEAL_PASS_FROM x
    the bound) against homes with each node's heavy document pieces (on one node also its widely read
    blocks, WIDELY_READ) dealt over its ranks (``_deal_pass``); on several nodes then (from LEVEL_FROM x the
    bound) against its homes balanced with every node over the cap leveling its own ranks (``_level_pass``);
    a one-node plan then against itself with its widely read KV fanned out through its first readers
    (FANOUT, planner/fanout.py).
    A plan still slower than REPLAN_FROM x the bound (REPLAN_FROM_ONE_NODE on one node) is planned again
    with every balancer weighing exposed transfers (REPLAN_OVERLAP), and on one node again with every
    balancer taking a link's busier direction for a rank's transfers (REPLAN_DUPLEX, where worth its
    bytes), the fastest plan kept. Last (``polish``),
    the kept plan (on one node one over POLISH_FROM_ONE_NODE x the bound) has its forward, then backward
    stages polished by a local search (planner/polish.py, planner/polish_bwd.py), where faster, and so has
    the best plan the passes beat if within POLISH_RUNNER_UP of it, and the deal pass's fastest plan that
    its bytes rule turned down (POLISH_BYTES_REJECTED; kept by the same rule); the re-plan's too; the
    fastest kept. Then the fcp strategy's own plan as it is, where faster (on one node, only for a plan
    not within GOOD_ENOUGH of the bound, and where worth its bytes). ``memo``: what this call and its
    re-plans share, none of it read off the balancer settings a re-plan changes: the polished plans,
    by content (``_polished``), and the fcp strategy's plan. The result records the steps that ran, each
    with its kept plan's simulated time (``Placement.search``, shown by ``Plan.explain``)."""
    sizes = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, element_size=element_size,
                 grad_element_size=grad_element_size)
    memo = {} if memo is None else memo
    steps = []  # (``Placement.search``)
    placement = _dcp_selected(tiles, world_size, cost_model, max_stages, sizes, init, steps)
    if placement.sim_time is None and world_size <= cost_model.topology.ranks_per_node:
        # a large batch on one node, planned on merged blocks: NVLink-bound (see _dcp_selected); its
        # fine plan is scored by make_plan (None: the plan's own time)
        return replace(placement, search=(("candidates", None),))
    if not steps:
        steps.append(("candidates", placement.sim_time))
    result = with_deferred_backward(tiles, placement, world_size, cost_model, sizes)
    steps.append(("backward deferral", result.sim_time))
    bound = _lower_bound(tiles, world_size, cost_model, sizes)
    multi_node = world_size > cost_model.topology.ranks_per_node
    beaten = []
    turned_down = None
    if init is None and multi_node and result.sim_time > NIC_SHY_FROM * bound:
        before = result
        result = _nic_passes(tiles, result, world_size, cost_model, max_stages, sizes, bound)
        steps.append(("NIC-shy and spread passes", result.sim_time))
        if result is not before:
            beaten.append(before)
    if init is None and world_size > 1 and result.sim_time > DEAL_PASS_FROM * bound:
        before = result
        result, turned_down = _deal_pass(tiles, result, world_size, cost_model, max_stages, sizes)
        steps.append(("deal pass", result.sim_time))
        if result is not before:
            beaten.append(before)
    if LEVEL_PASS and init is None and multi_node and result.sim_time > LEVEL_FROM * bound:
        before = result
        result = _level_pass(tiles, result, world_size, cost_model, max_stages, sizes)
        steps.append(("leveling pass", result.sim_time))
        if result is not before:
            beaten.append(before)
    replan_from = REPLAN_FROM if multi_node else REPLAN_FROM_ONE_NODE
    replan = (init is None and world_size > 1 and result.sim_time > replan_from * bound
              and cost_model.balance_overlap == 0 and not cost_model.balance_duplex)
    if (FANOUT and init is None and not multi_node and result.sim_time > POLISH_FROM_ONE_NODE * bound
            and as_relay_table(result.kv_relay).shape[0] == 0):
        # (after the deal pass: a fan-out pays where the widely read blocks' homes no longer compute
        # more than their share)
        alt = add_fanout(tiles, result, world_size=world_size, cost_model=cost_model, max_stages=max_stages,
                         sizes=sizes)
        if alt is not None:
            alt = with_deferred_backward(tiles, alt, world_size, cost_model, sizes)
            if alt.sim_time < result.sim_time:
                beaten.append(result)
                result = alt
        steps.append(("fan-out", result.sim_time))
    if polish and init is None and (multi_node or result.sim_time > POLISH_FROM_ONE_NODE * bound):
        # last, on the kept plan and the runner-up (every choice above compares plans as staged); the
        # re-plan below is decided on the time before it, and its plan is polished too
        close = [p for p in beaten if p.sim_time < (1 + POLISH_RUNNER_UP) * result.sim_time]
        polished = [_polished(tiles, p, world_size, cost_model, sizes, memo)
                    for p in [result] + sorted(close, key=lambda p: p.sim_time)[:1]]
        result = min(polished, key=lambda p: p.sim_time)  # (the kept plan on a tie)
        if POLISH_BYTES_REJECTED and turned_down is not None:
            alt = _polished(tiles, turned_down, world_size, cost_model, sizes, memo)
            if alt.sim_time < result.sim_time and _worth_its_bytes(tiles, alt, result, sizes):
                result = alt
        steps.append(("polish", result.sim_time))
    if replan:
        # planned again from the start with the balancer weighing exposed transfers (REPLAN_OVERLAP)
        again = dcp(tiles, world_size, cost_model=replace(cost_model, balance_overlap=REPLAN_OVERLAP),
                    max_stages=max_stages, polish=polish, memo=memo, **sizes)
        if again.sim_time < result.sim_time:
            result = again
        steps.append(("re-plan weighing exposed transfers", result.sim_time))
        if REPLAN_DUPLEX and not multi_node:
            # kept by the bytes rule too: the duplex view spreads the compute of blocks many ranks read
            again = dcp(tiles, world_size, cost_model=replace(cost_model, balance_duplex=True),
                        max_stages=max_stages, polish=polish, memo=memo, **sizes)
            if again.sim_time < result.sim_time and _worth_its_bytes(tiles, again, result, sizes):
                result = again
            steps.append(("re-plan with duplex links", result.sim_time))
    if (FCP_PLAN_LAST and init is None and world_size > 1
            and (multi_node or result.sim_time > GOOD_ENOUGH * bound)):
        # Last, the fcp strategy's own plan as it is (FCP's homes, every tile on its q-block's home):
        # balancing its tiles away, as the "fcp" / "fcp-docs" starts do, can cost more transfers than
        # the compute it evens out (8 ranks on two nodes, seed 0's Wikipedia causal batches: 1.020 ->
        # 1.010x the bound). Checked last, not with the zigzag baselines above: adopted there, it
        # left the later passes less to gain (two plans 1.025 -> 1.062x). Staged only where its busiest
        # rank's compute leaves it a chance.
        # (its homes, compute floor and plan once per call and its re-plans: no balancer setting enters them)
        if FCP_HOME not in memo:
            fcp_home = strategy_home(tiles, world_size, cost_model=cost_model, num_q_heads=num_q_heads,
                                     head_dim=head_dim)
            flops = cost_model.tile_flops(tiles.pairs, num_q_heads=num_q_heads, head_dim=head_dim)
            memo[FCP_HOME] = fcp_home, _time_floor(fcp_home[tiles.q], flops, world_size, cost_model)
        fcp_home, floor = memo[FCP_HOME]
        if floor < result.sim_time:
            if FCP_PLAN not in memo:
                memo[FCP_PLAN] = _place(tiles, world_size, FCP_PLAN, cost_model, max_stages, sizes,
                                        relays=multi_node, home=fcp_home)[0]
            alt = memo[FCP_PLAN]
            if alt.sim_time < result.sim_time and (multi_node or _worth_its_bytes(tiles, alt, result, sizes)):
                result = alt
            steps.append(("the fcp strategy's plan", result.sim_time))
    return replace(result, search=tuple(steps))


def _polished(tiles: TileSet, placement: Placement, world_size: int, cost_model: CostModel, sizes: dict,
              memo: dict | None = None) -> Placement:
    """``placement`` with its forward, then its backward stages polished (planner/polish.py,
    planner/polish_bwd.py), each where faster. ``memo``: polished plans by content, so a placement a
    re-plan arrives at again is not polished twice (the polishes read neither of the balancer's
    settings that a re-plan changes): 4 of 46 polishes at 32 (32), 1.4 of 22 s; a 70K-token batch on
    64 ranks 3 of 15 s."""
    key = None
    if memo is not None:
        key = (_content_key(placement), placement.sim_time, world_size,
               replace(cost_model, balance_overlap=0.0, balance_duplex=False, balance_level_nodes=False),
               tuple(sorted(sizes.items())))
        if key in memo:
            return memo[key]
    polished = polish_forward(tiles, placement, world_size=world_size, cost_model=cost_model, sizes=sizes)
    polished = polish_backward(tiles, polished, world_size=world_size, cost_model=cost_model, sizes=sizes)
    if key is not None:
        memo[key] = polished
    return polished


def _content_key(placement: Placement) -> bytes:
    """A digest of what a placement decides: homes, tile ranks, both directions' stages, relays."""
    digest = hashlib.blake2b(digest_size=20)
    for part in (placement.block_home, placement.tile_rank, placement.tile_stage, placement.tile_stage_bwd,
                 as_relay_table(placement.kv_relay)):
        part = np.zeros(0, dtype=np.int64) if part is None else np.ascontiguousarray(part, dtype=np.int64)
        digest.update(str(part.shape).encode())
        digest.update(part.tobytes())
    return digest.digest()


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
            if _worth_its_bytes(tiles, alt, result, sizes):
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


def _worth_its_bytes(tiles: TileSet, alt: Placement, result: Placement, sizes: dict) -> bool:
    """Whether ``alt``, faster than ``result``, is worth the bytes it moves: as many or fewer, or a time
    gain over (BYTES_SLACK - 1) x its bytes over ``result``'s (2% for as many, 4% for twice as many). A
    dealt piece's KV is read on every rank of its node: a batch that is one long segment (causal_blockwise
    on one node of 32) dealt whole gained 2% for 4.8x the bytes."""
    ratio = _schedule_bytes(tiles, alt, sizes) / max(_schedule_bytes(tiles, result, sizes), 1.0)
    return ratio <= 1.0 or 1.0 - alt.sim_time / result.sim_time > (BYTES_SLACK - 1.0) * ratio


def _dealt_homes(tiles: TileSet, placement: Placement, world_size: int, cost_model: CostModel, sizes: dict) -> list:
    """The homes of "hierarchical" (on one node "contiguous") and of ``placement`` with their heavy pieces
    dealt over their nodes' ranks (``deal_heavy_pieces``), and on one node ``placement``'s with its widely
    read blocks dealt (WIDELY_READ), each where that changes it and once; dealt as merged blocks where
    the batch is planned on them (the seeds of ``_dcp(second_opinion=...)``)."""
    coarse, kept, of_block = _as_planned(tiles, world_size, placement.block_home)
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


def _as_planned(tiles: TileSet, world_size: int, home: np.ndarray) -> tuple:
    """(the blocks dcp plans this batch on - merged where ``coarsening_factor`` merges them -, ``home`` as
    their homes or None where it does not keep them whole, each real block's merged block)."""
    factor = coarsening_factor(tiles, world_size)
    coarse = coarsen(tiles, factor)[0] if factor > 1 else tiles
    return coarse, merged_home(home, factor, coarse.num_blocks), np.arange(tiles.num_blocks) // factor


def _spread_homes(tiles: TileSet, placement: Placement, world_size: int, topology) -> list:
    """The homes of ``placement`` with, inside each node, the blocks other nodes read dealt over the
    node's ranks (``spread_read_blocks``), and with only those whose KV crosses nodes in the forward's
    first exchange dealt (``deal_blocks``): that exchange has no earlier one to send them ahead through
    a node-mate (a transit rank), so one home's NIC carries them all behind stage 0's compute. Dealt
    as merged blocks where the batch is planned on them (the seeds of ``_dcp(second_opinion=...)``)."""
    coarse, home, of_block = _as_planned(tiles, world_size, placement.block_home)
    if home is None:
        return []  # not whole merged blocks: no seed survives merging
    fwd = placement.schedule.fwd.numpy().astype(np.int64)
    node_of = topology.node_of
    first = (fwd[:, 0] == 1) & (fwd[:, 3] == KIND_KV) & (node_of(fwd[:, 1]) != node_of(fwd[:, 2]))
    crossing = np.zeros(coarse.num_blocks, dtype=bool)
    crossing[of_block[fwd[first, 4]]] = True
    return [spread_read_blocks(coarse, home, topology)[of_block], deal_blocks(home, crossing, topology)[of_block]]


def _dcp_selected(tiles: TileSet, world_size: int, cost_model: CostModel, max_stages: int, sizes: dict,
                  init: str | None, steps: list | None = None) -> Placement:
    """dcp's plan before ``with_deferred_backward``: the candidates planned, compared and refined.
    ``steps``: where the scored steps are appended as (step, simulated fwd + bwd seconds)."""
    steps = [] if steps is None else steps
    one_node = world_size <= cost_model.topology.ranks_per_node
    bound = _lower_bound(tiles, world_size, cost_model, sizes)
    transit = not one_node and init is None
    if transit:
        # several nodes: the finalists within RECHECK of the fastest each get their transit relays before
        # they are compared, as in the second opinion below (transit gains unequally: fwd+bwd over the
        # bound 1.237 -> 1.155 on one 32-rank batch with fp32 partials)
        firsts = [_with_transit(tiles, alt, world_size, cost_model, sizes)
                  for alt in _dcp(tiles, world_size, cost_model, max_stages, sizes, None, every_finalist=True)]
        # as on one node: of those within GOOD_ENOUGH of the bound and BYTES_SLACK of the fastest, the
        # fewest bytes (causal_blockwise, 16 ranks / 8 per node: hot rows pushed per kv-rank at 1.0419x
        # the bound with 4.96 GB, per kv-node 1.0367x with 11.8 GB, mostly KV over NVLink)
        result = _fewest_bytes(tiles, firsts, GOOD_ENOUGH * bound, sizes)
        steps.append(("candidates", result.sim_time))
    else:
        result = _dcp(tiles, world_size, cost_model, max_stages, sizes, init)
    if init is not None or world_size == 1 or (one_node and coarsening_factor(tiles, world_size) > 1):
        return result  # (a large batch on one node: NVLink-bound, the balanced candidates win)
    # Checked at full resolution against the zigzag baselines (ring stages, or all KV in one stage),
    # so dcp is never slower than them in the cost model - also after planning on merged blocks, the
    # candidate preselection, or on batches so small that per-stage latency dominates.
    result = _scored(tiles, result, world_size, cost_model, sizes)
    if one_node:
        steps.append(("candidates", result.sim_time))
    if one_node and result.sim_time <= GOOD_ENOUGH * bound:
        return result  # one node, near the bound: nothing to gain
    if one_node:
        # restaged as the multi-node finalists are, kept where faster (32 ranks on one NVLink domain,
        # Wikipedia batches with bf16 partials: 1.32 -> 1.22, 1.23 -> 1.20, 1.10 -> 1.03 x the bound)
        result = _restaged(tiles, result, world_size, cost_model, max_stages, sizes)
        steps.append(("restaging", result.sim_time))
    factor = coarsening_factor(tiles, world_size)
    for name in BASELINE_INITS:
        if factor > 1:
            # A baseline's time barely depends on the block size (the same chunks, merged): one that is
            # far slower on the merged blocks is not worth planning at full resolution.
            coarse_time = _place(coarsen(tiles, factor)[0], world_size, name, cost_model, max_stages, sizes)[1]
            if coarse_time > BASELINE_MARGIN * result.sim_time:
                continue
        base, base_time = _place(tiles, world_size, name, cost_model, max_stages, sizes)
        if base_time < result.sim_time:
            result = _with_transit(tiles, base, world_size, cost_model, sizes) if transit else base
    steps.append(("zigzag baselines", result.sim_time))
    if not one_node and result.sim_time > SECOND_OPINION * bound:
        # seeded with the homes of the kept plan and of every first-pass finalist: a slower first plan's
        # homes may balance better with spread sends (32 ranks, a long-tail shared-question batch: 1.459x
        # the bound from the kept plan's homes, 1.415x from the runner-up's); every refined finalist gets
        # its transit relays before they are compared: they gain less on homes that already spread a
        # node's sends ("hierarchical-spread")
        seeds = [result.block_home] + [first.block_home for first in firsts]
        result = _second_opinion(tiles, result, world_size, cost_model, max_stages, sizes, seeds)
        steps.append(("second opinion", result.sim_time))
    return result


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
    factor = coarsening_factor(tiles, world_size)
    if factor > 1:
        coarse, of_fine = coarsen(tiles, factor)
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
            fine = Placement(block_home=plan.block_home[np.arange(tiles.num_blocks) // factor],
                             tile_rank=plan.tile_rank[of_fine], tile_stage=plan.tile_stage[of_fine],
                             tile_stage_bwd=plan.tile_stage_bwd[of_fine] if inherit else None)
            # relays found on merged blocks do not carry over (the fine schedule is derived afresh)
            unrelayed = fine
            if relays:
                fine = add_relays(tiles, fine, world_size=world_size, cost_model=cost_model, max_stages=max_stages,
                                  sizes=sizes)
            if inherit and fine is unrelayed:
                fine = _with_merged_schedule(tiles, coarse, of_fine, factor, fine, plan, world_size)
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


def _with_merged_schedule(tiles: TileSet, coarse: TileSet, of_fine: np.ndarray, factor: int, fine: Placement,
                          plan: Placement, world_size: int) -> Placement:
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
                                      world_size=world_size)
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
    work = np.bincount(tiles.q, weights=tiles.pairs, minlength=tiles.num_blocks)
    prefix = prefix_sums(work)
    long = np.diff(bounds) > -(-tiles.num_blocks // world_size)
    return float((prefix[bounds[1:]] - prefix[bounds[:-1]])[long].sum()) > 0.5 * prefix[-1]


def _fewest_bytes(tiles: TileSet, planned: list, good_enough: float, sizes: dict) -> Placement:
    """The fastest of the candidates ``planned`` (scored Placements), or among those within BYTES_SLACK
    of it and within ``good_enough`` (seconds) the one that moves the fewest bytes."""
    fastest = min(planned, key=lambda p: p.sim_time)  # first of equals in candidate order
    near = [p for p in planned if p.sim_time <= min(good_enough, BYTES_SLACK * fastest.sim_time)]
    if len(near) < 2:
        return fastest
    return min(near, key=lambda p: _schedule_bytes(tiles, p, sizes))


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


