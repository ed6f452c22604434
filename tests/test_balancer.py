"""The Balancer (planner/balance.py): its estimates of a rank's time (summed, overlap-aware, duplex), its
relay-aware and spread-send pricing, and ``balanced_ranks``, dcp's entry to it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockattn.masks import MaskSpec
from blockattn.planner import CostModel, Topology
from blockattn.planner import candidates as candidates_module
from blockattn.planner.schedule import KIND_KV, payload_bytes

from batches import long_tail_docs

HEADS = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)  # Llama-3-8B attention: compute-bound tiles
SIZES = dict(HEADS, element_size=2, grad_element_size=4)  # dcp's payload sizes: bf16 inputs, fp32 partials


def test_overlap_estimate_sheds_compute_where_max_of_compute_and_transfers_sees_no_gain():
    """Two documents over two nodes of four with a slow NIC: contiguous homes leave the first ranks of
    each document with its most compute and most of its transfers. Weighing a rank's time as
    max(C, X) the Balancer stops once a donor's transfers catch up with its compute; with part of
    min(C, X) counted as exposed (``overlap``) it keeps evening out the compute."""
    from blockattn.planner.balance import Balancer
    from blockattn.planner.tiles import TileSet

    tiles = TileSet.from_block_mask(MaskSpec.documents([2775, 2914]).block_mask(64))
    topology = Topology(ranks_per_node=4, inter_bw=5e9)
    cost_model = CostModel(topology=topology)
    home = (np.arange(tiles.num_blocks) * 8) // tiles.num_blocks
    flops = cost_model.tile_flops(tiles.pairs, num_q_heads=HEADS["num_q_heads"], head_dim=HEADS["head_dim"])
    seconds = flops / cost_model.fwd_rate
    sizes = dict(element_size=2, grad_element_size=4, **HEADS)
    imbalance = {}
    for overlap in (0.0, 0.5):
        rank = Balancer(tiles, home, seconds, 8, topology, overlap=overlap, **sizes).run()
        load = np.bincount(rank, weights=seconds, minlength=8)
        imbalance[overlap] = load.max() / load.mean()
    assert imbalance[0.5] < 0.8 * imbalance[0.0], imbalance


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), ranks_per_node=st.sampled_from([2, 6]))
def test_duplex_balancer_predicts_each_prefix_of_a_move_exactly(seed, ranks_per_node):
    """With ``duplex`` the Balancer's per-prefix comm times of a move (``_move_comm``) are the comm times
    its bookkeeping gives after making that prefix of the move, for the donor and the target, on one
    node and on several (every byte count a whole number: the float sums are exact)."""
    import copy

    from blockattn.planner.balance import Balancer
    from blockattn.planner.tiles import TileSet

    rng = np.random.default_rng(seed)
    tiles = TileSet.from_block_mask(MaskSpec.documents([700, 300, 1100, 150, 900]).block_mask(64))
    P = 6
    home = np.sort(rng.integers(0, P, tiles.num_blocks))
    start = np.where(rng.random(tiles.num_tiles) < 0.3, rng.integers(0, P, tiles.num_tiles), home[tiles.q])
    balancer = Balancer(tiles, home, np.ones(tiles.num_tiles), P, Topology(ranks_per_node=ranks_per_node),
                        start=start, duplex=True, **SIZES)
    r, t = rng.choice(P, size=2, replace=False).tolist()
    cand = rng.permutation(np.flatnonzero(start == r))[:30]
    if cand.size == 0:
        return
    comm_r, comm_t = balancer._move_comm(cand, r, t)
    for k in sorted({0, cand.size // 2, cand.size - 1}):
        moved = copy.deepcopy(balancer)
        moved._apply(cand[: k + 1], r, t)
        assert moved.comm_time(r) == comm_r[k] and moved.comm_time(t) == comm_t[k], (k, comm_r[k], comm_t[k])
        sends, recvs = moved.send[r], moved.recv[r]  # (duplex: each link's busier direction)
        assert moved.comm_time(r) == (np.maximum(sends, recvs) / moved.bw).max()


def test_duplex_estimate_lets_the_homes_many_ranks_read_shed_their_compute():
    """One node of 16, 32K tokens of long-tail documents from "fcp-docs" homes: summing a rank's sends
    and receives, the homes whose KV the long documents' later rows read stop shedding compute once
    their transfers reach it (1.07x the mean compute; 1.13x while rows went to kv-homes in pieces of any
    length, before ``priced_rows``); taking each link's busier direction, as the cost model prices an
    exchange (``duplex``), they shed it to the 2% the Balancer aims at."""
    from blockattn.planner.balance import Balancer
    from blockattn.planner.candidates import _initial_home
    from blockattn.planner.tiles import TileSet

    tiles = TileSet.from_block_mask(MaskSpec.documents(long_tail_docs(2, 32768)).block_mask(64))
    topology = Topology(ranks_per_node=16)
    cost_model = CostModel(topology=topology)
    seconds = cost_model.tile_flops(tiles.pairs, num_q_heads=HEADS["num_q_heads"], head_dim=HEADS["head_dim"])
    seconds = seconds / cost_model.fwd_rate
    home = _initial_home(tiles, 16, "fcp-docs", cost_model, SIZES)
    imbalance = {}
    for duplex in (False, True):
        load = np.bincount(Balancer(tiles, home, seconds, 16, topology, duplex=duplex, **SIZES).run(),
                           weights=seconds, minlength=16)
        imbalance[duplex] = load.max() / load.mean()
    assert imbalance[False] > 1.05 and imbalance[True] < 1.03, imbalance


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=12), st.integers(1, 9), st.integers(1, 4),
       st.booleans(), st.booleans())
def test_balanced_ranks_skips_only_a_balancer_that_would_move_nothing(lens, world_size, per_node, dealt, aware):
    """``balanced_ranks`` (dcp's entry to the Balancer) gives the Balancer's tile ranks on any batch:
    where the start is already within the cap, without building it."""
    from blockattn.planner.balance import Balancer, balanced_ranks
    from blockattn.planner.starts import contiguous_cut_home
    from blockattn.planner.tiles import TileSet

    tiles = TileSet.from_block_mask(MaskSpec.documents(lens).block_mask(64))
    home = contiguous_cut_home(tiles, world_size)
    compute = tiles.pairs.astype(np.float64)
    start = np.arange(tiles.num_tiles) % world_size if dealt else None
    topology = Topology(ranks_per_node=per_node)
    sizes = dict(element_size=2, grad_element_size=4, relay_aware=aware, **HEADS)
    expected = Balancer(tiles, home, compute, world_size, topology, start=start, **sizes).run()
    assert np.array_equal(balanced_ranks(tiles, home, compute, world_size, topology, start=start, **sizes), expected)


def _two_nodes_reading_block_0():
    """4 blocks of 8 tokens on 4 ranks (block r on rank r), two nodes of two; every block reads
    block 0 and itself. Returns tiles, home, topology, sizes and one block's KV bytes."""
    from blockattn.planner.tiles import TileSet

    spec = MaskSpec.from_mask_mod(lambda q, k: (k < 8) | (k // 8 == q // 8), 32)
    sizes = dict(num_q_heads=2, num_kv_heads=1, head_dim=8, element_size=2)
    kv = float(payload_bytes(KIND_KV, np.array([8]), **sizes)[0])
    return TileSet.from_block_mask(spec.block_mask(8)), np.arange(4), Topology(ranks_per_node=2), sizes, kv


def test_relay_aware_balancer_prices_kv_held_on_the_node_as_nvlink():
    """Two nodes of two ranks. Ranks 2 and 3 (node 1) both read KV block 0 (home rank 0, node 0): the
    per-rank view pays the NIC twice; the relay-aware view once, into the proxy the block rotates to
    (rank 2 for block 0), plus one NVLink copy to rank 3."""
    from blockattn.planner.balance import Balancer

    tiles, home, topo, sizes, kv = _two_nodes_reading_block_0()
    plain = Balancer(tiles, home, np.ones(tiles.num_tiles), 4, topo, **sizes)
    aware = Balancer(tiles, home, np.ones(tiles.num_tiles), 4, topo, relay_aware=True, **sizes)
    # link columns: 0 NVLink, 1 NIC
    assert plain.send[0, 1] == 2 * kv and plain.recv[2, 1] == kv and plain.recv[3, 1] == kv
    assert aware.send[0, 1] == kv and aware.recv[:, 1].sum() == kv
    assert aware.send[:, 0].sum() == kv + plain.send[:, 0].sum()  # one NVLink copy on node 1
    assert aware.node_kv[1, 0] == 2 and aware.node_kv[0, 3] == -1


def test_spread_sends_prices_a_homes_inter_node_kv_on_a_node_mate():
    """The batch above, with the sending side spread too: block 0's one NIC copy into node 1 leaves
    node 0 through rank 1 (the node-mate it rotates to), after an NVLink hop from its home, rank 0."""
    from blockattn.planner.balance import Balancer

    tiles, home, topo, sizes, kv = _two_nodes_reading_block_0()
    aware = Balancer(tiles, home, np.ones(tiles.num_tiles), 4, topo, relay_aware=True, **sizes)
    spread = Balancer(tiles, home, np.ones(tiles.num_tiles), 4, topo, relay_aware=True, spread_sends=True, **sizes)
    assert aware.send[:, 1].tolist() == [kv, 0, 0, 0]
    assert spread.send[:, 1].tolist() == [0, kv, 0, 0]  # link columns: 0 NVLink, 1 NIC
    assert spread.recv[:, 1].tolist() == aware.recv[:, 1].tolist()
    assert spread.send[0, 0] == aware.send[0, 0] + kv and spread.recv[1, 0] == aware.recv[1, 0] + kv
    # one node: nothing crosses, nothing to spread
    single = Balancer(tiles, home, np.ones(tiles.num_tiles), 4, Topology(ranks_per_node=4), relay_aware=True,
                      spread_sends=True, **sizes)
    assert not single.spread_sends and single.send[:, 1].sum() == 0


def test_spread_sends_let_the_homes_of_a_long_document_shed_it_to_other_nodes():
    """A 16K-token causal document over two of four nodes (two ranks each): the relay-aware balancer
    prices its homes' KV sends to other nodes on their own NICs and stops shedding; priced over their
    node's NICs, as home-side transit relays then send them, they shed more."""
    docs = [16000] + [500] * 32
    spread = _balanced_peak(docs, 2, relay_aware=True, spread_sends=True)
    assert spread < 0.95 * _balanced_peak(docs, 2, relay_aware=True)


@pytest.mark.parametrize("spread", [False, True])
def test_a_donor_bound_by_its_nic_sheds_compute_to_a_node_mate_only_with_spread_sends(spread):
    """Rank 0 holds q-blocks 0-1 of a causal 32-token sequence (3 tiles of 1 s; mean 2.5 s) and its NIC
    is busy for 20 s: max(C, X) sees no gain in moving a tile to its idle node-mate (the NIC stays the
    bound), so the plain relay-aware balancer keeps it; with spread_sends the move is taken, since it
    leaves the NIC as it is and the stages hide transfers behind only part of the compute."""
    from blockattn.planner.balance import Balancer
    from blockattn.planner.tiles import TileSet

    tiles = TileSet.from_block_mask(MaskSpec.causal(32).block_mask(8))
    home = np.array([0, 0, 2, 3])
    sizes = dict(num_q_heads=2, num_kv_heads=1, head_dim=8, element_size=2)
    b = Balancer(tiles, home, np.ones(tiles.num_tiles), 4, Topology(ranks_per_node=2), relay_aware=True,
                 spread_sends=spread, **sizes)
    assert b.C.tolist() == [3, 0, 3, 4]
    b.send[0, 1] = 20 * Topology().inter_bw  # 20 s of NIC sends (column 1)
    mine = np.flatnonzero(b.rank == 0)[::-1]  # latest row first
    moved = b.try_move(mine, 0, 1)
    assert moved == spread
    assert b.C.tolist() == ([2, 1, 3, 4] if spread else [3, 0, 3, 4])
    assert b.send[0, 1] == 20 * Topology().inter_bw  # the NIC untouched either way


def test_relay_aware_balancing_lets_a_hot_rank_shed_to_its_node_mates():
    """A long causal document over two nodes, in contiguous runs ("hierarchical"): the rank holding its
    end carries most of its compute. Priced per rank, every node-mate it could shed rows to would pull
    the document's other-node KV over its own NIC, so it keeps them; priced per node (KV already on the
    node travels over NVLink, as relays then make it), it sheds them."""
    docs = [9000] + [300] * 30
    assert _balanced_peak(docs, 4) > 2.5 and _balanced_peak(docs, 4, relay_aware=True) < 2.0


def _balanced_peak(docs: list, ranks_per_node: int, **pricing) -> float:
    """Max / mean compute over 8 ranks after the Balancer (``pricing``: relay_aware, spread_sends), from
    the "hierarchical" homes of these causal documents (blocks of 128, Llama-3-8B heads)."""
    from blockattn.planner.balance import Balancer
    from blockattn.planner.tiles import TileSet

    tiles = TileSet.from_block_mask(MaskSpec.documents(docs).block_mask(128))
    cm = CostModel(topology=Topology(ranks_per_node=ranks_per_node))
    sizes = dict(element_size=2, **HEADS)
    home = candidates_module._initial_home(tiles, 8, "hierarchical", cm, sizes)
    compute = cm.tile_flops(tiles.pairs, num_q_heads=32, head_dim=128) / cm.fwd_rate
    rank = Balancer(tiles, home, compute, 8, cm.topology, **pricing, **sizes).run()
    load = np.bincount(rank, weights=compute, minlength=8)
    return load.max() / load.mean()


def test_a_node_over_the_cap_levels_its_own_ranks_with_level_nodes():
    """A 12K-token document fills the first of two nodes, whose NICs are too slow to shed any of it to
    the other node. Its contiguous homes leave the node's last rank with ~1.4x the node's mean compute;
    with ``level_nodes`` the node's ranks even out among themselves over NVLink (the busiest within 3%
    of the node's mean), and no tile changes node."""
    from blockattn.planner.balance import Balancer
    from blockattn.planner.tiles import TileSet

    tiles = TileSet.from_block_mask(MaskSpec.documents([12000] + [300] * 40).block_mask(128))
    topology = Topology(ranks_per_node=4, inter_bw=1e9)
    cost_model = CostModel(topology=topology)
    home = (np.arange(tiles.num_blocks) * 8) // tiles.num_blocks
    seconds = cost_model.tile_flops(tiles.pairs, num_q_heads=HEADS["num_q_heads"],
                                    head_dim=HEADS["head_dim"]) / cost_model.fwd_rate
    ranks = {level: Balancer(tiles, home, seconds, 8, topology, level_nodes=level, **SIZES).run()
             for level in (False, True)}
    node_load = {level: np.bincount(rank, weights=seconds, minlength=8).reshape(2, 4)
                 for level, rank in ranks.items()}
    node_mean = node_load[True][0].mean()
    assert node_load[False][0].max() > 1.3 * node_mean, node_load[False]
    assert node_load[True][0].max() < 1.03 * node_mean, node_load[True]
    assert np.allclose(node_load[True].sum(axis=1), node_load[False].sum(axis=1))
    assert np.array_equal(ranks[True] // 4, ranks[False] // 4)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 3000), st.integers(0, 2**32 - 1), st.floats(-12, 3))
def test_compiled_sum_is_numpys_bit_for_bit(size, seed, scale):
    """The compiled moves sum a move's compute in numpy's pairwise order (planner/float_sums.py
    ``numpy_sum``), so the Balancer's per-rank loads, and the plans, are those of numpy's ``sum``."""
    from blockattn.planner.float_sums import numpy_sum

    values = np.random.default_rng(seed).random(size) * 10.0 ** scale
    assert numpy_sum(values) == values.sum()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=10), st.integers(2, 9), st.integers(1, 4),
       st.sampled_from(["plain", "relay_aware", "spread_sends", "duplex", "overlap", "level_nodes"]), st.booleans())
def test_balancer_bookkeeping_holds_every_input_and_conserves_bytes(lens, world_size, per_node, setting, dealt):
    """After the Balancer's moves (compiled, planner/balance_moves.py), under every setting: each tile's
    rank holds its Q and KV blocks and owes its OUT partial where the q-block is homed elsewhere, each
    link's bytes sent equal its bytes received, and the per-rank loads are those of the tile ranks."""
    from blockattn.planner.balance import Balancer
    from blockattn.planner.starts import contiguous_cut_home
    from blockattn.planner.tiles import TileSet

    tiles = TileSet.from_block_mask(MaskSpec.documents(lens).block_mask(64))
    home = contiguous_cut_home(tiles, world_size)
    compute = tiles.pairs.astype(np.float64) * 1e-9
    start = np.arange(tiles.num_tiles) % world_size if dealt else None
    flags = {"plain": {}, "relay_aware": dict(relay_aware=True), "spread_sends": dict(relay_aware=True, spread_sends=True),
             "duplex": dict(duplex=True), "overlap": dict(overlap=0.5), "level_nodes": dict(level_nodes=True)}[setting]
    balancer = Balancer(tiles, home, compute, world_size, Topology(ranks_per_node=per_node, inter_bw=5e9),
                        start=start, element_size=2, grad_element_size=4, **flags, **HEADS)
    rank = balancer.run()
    assert rank.min() >= 0 and rank.max() < world_size
    assert balancer.have_kv[rank, tiles.kv].all() and balancer.have_q[rank, tiles.q].all()
    off_home = home[tiles.q] != rank
    assert balancer.has_out[rank[off_home], tiles.q[off_home]].all()
    np.testing.assert_array_equal(balancer.send.sum(axis=0), balancer.recv.sum(axis=0))
    np.testing.assert_allclose(balancer.C, np.bincount(rank, weights=compute, minlength=world_size), rtol=1e-9)


def test_block_payloads_are_each_blocks_bytes_once_per_tile_set_and_sizes():
    """The Balancers of one plan's starts share their blocks' Q / KV / OUT bytes (``_block_payloads``):
    the payload sizes of each block (the last one short), kept per TileSet and sizes."""
    from blockattn.planner.balance import _block_payloads
    from blockattn.planner.schedule import KIND_OUT, KIND_Q
    from blockattn.planner.tiles import TileSet

    tiles = TileSet.from_block_mask(MaskSpec.causal(1000).block_mask(64))
    names = ("num_q_heads", "num_kv_heads", "head_dim", "element_size", "grad_element_size")
    key = tuple(SIZES[name] for name in names)
    q, kv, out, row_over_column = _block_payloads(tiles, key)
    lens = tiles.block_lengths()
    for kind, got in ((KIND_Q, q), (KIND_KV, kv), (KIND_OUT, out)):
        assert got.dtype == np.float64 and np.array_equal(got, payload_bytes(kind, lens, **SIZES))
    assert lens[-1] == 1000 - 15 * 64 and row_over_column == (q.max() + out.max()) / kv.max()
    assert _block_payloads(tiles, key)[0] is q
    assert not np.array_equal(_block_payloads(tiles, key[:3] + (4, 4))[0], q)


def test_one_node_rows_go_to_a_kv_home_only_in_pieces_no_dearer_than_a_rectangle():
    """On one node (``priced_rows``) a donor sheds rows to a kv-home only in pieces whose Q + OUT cost no
    more bytes a tile than a rectangle of what it must shed: here a causal document's first two blocks
    are homed on rank 1 and the rest on rank 0, so every row's piece on rank 1's KV is two tiles. Priced,
    the Balancer balances as well and moves fewer bytes, and no row it moves brings only such a piece."""
    from blockattn.planner.balance import Balancer
    from blockattn.planner.tiles import TileSet

    tiles = TileSet.from_block_mask(MaskSpec.documents([32 * 64, 6 * 64]).block_mask(64))
    home = np.zeros(tiles.num_blocks, dtype=np.int64)
    home[:2] = 1
    home[32:] = 1
    compute = tiles.pairs.astype(np.float64) * 1e-9
    runs = {}
    for priced in (True, False):
        balancer = Balancer(tiles, home, compute, 2, Topology(ranks_per_node=2), element_size=2,
                            grad_element_size=4, **HEADS)
        assert balancer._rule.priced_rows  # one node
        balancer._rule = balancer._rule._replace(priced_rows=priced)
        rank = balancer.run()
        moved = rank != home[tiles.q]
        rows, piece = np.unique(tiles.q[moved], return_counts=True)
        runs[priced] = dict(bytes=balancer.send.sum(), busiest=balancer.C.max(), shortest=piece.min(), rows=rows.size)
    priced, plain = runs[True], runs[False]
    assert plain["shortest"] <= 2 < priced["shortest"], runs
    assert priced["bytes"] < 0.9 * plain["bytes"], runs
    assert priced["busiest"] <= 1.005 * plain["busiest"], runs


def test_slack_sets_where_donors_stop_shedding():
    """A donor sheds compute until it is within ``slack`` of the mean (the cap): from the contiguous homes
    of one causal document on 6 ranks of one node (the last ranks hold most of the compute), the busiest
    rank ends just under the mean times 1 + slack, for 2% (BALANCE_SLACK, the default) and for 1% (what
    dcp gives one node's merged blocks)."""
    from blockattn.planner.balance import BALANCE_SLACK, balanced_ranks
    from blockattn.planner.tiles import TileSet

    tiles = TileSet.from_block_mask(MaskSpec.causal(16384).block_mask(256))
    home = (np.arange(tiles.num_blocks) * 6) // tiles.num_blocks
    seconds = tiles.pairs.astype(np.float64)
    busiest = {}
    for slack in (BALANCE_SLACK, 0.01):
        rank = balanced_ranks(tiles, home, seconds, 6, Topology(ranks_per_node=8), slack=slack, **SIZES)
        load = np.bincount(rank, weights=seconds, minlength=6)
        busiest[slack] = load.max() / load.mean()
        assert 1 + slack / 2 < busiest[slack] <= 1 + slack, (slack, busiest[slack])
    assert BALANCE_SLACK == 0.02


def test_one_node_merged_blocks_are_balanced_with_their_own_slack(monkeypatch):
    """dcp plans one node's merged blocks with ``CostModel.balance_slack`` = ONE_NODE_MERGED_SLACK (1%), and
    real blocks, on one node or several, with the default BALANCE_SLACK (2%)."""
    from blockattn import make_plan
    from blockattn.planner import balance as balance_module
    from blockattn.planner import clear_plan_cache
    from blockattn.planner.first_pass import ONE_NODE_MERGED_SLACK

    seen = set()
    original = balance_module.Balancer.__init__

    def recording(self, *args, slack, **kwargs):
        seen.add((args[0].block_size, slack))  # (args[0]: the tiles, merged ones in larger blocks)
        original(self, *args, slack=slack, **kwargs)

    monkeypatch.setattr(balance_module.Balancer, "__init__", recording)
    spec = MaskSpec.documents(long_tail_docs(3, 65536))
    for world_size, ranks_per_node in ((8, 8), (8, 4)):
        seen.clear()
        clear_plan_cache()
        make_plan(spec, world_size, block_size=64, topology=Topology(ranks_per_node=ranks_per_node), check=False,
                  **HEADS)
        merged = {slack for block, slack in seen if block > 64}
        real = {slack for block, slack in seen if block == 64}
        if ranks_per_node == world_size:
            assert merged == {ONE_NODE_MERGED_SLACK} and real <= {balance_module.BALANCE_SLACK}, seen
        else:
            assert merged | real == {balance_module.BALANCE_SLACK}, seen
    clear_plan_cache()
