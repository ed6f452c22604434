"""dcp's initial data placements (planner/starts.py): the node packing, and the variants that deal a
node's blocks over its ranks (``spread_read_blocks``, ``deal_heavy_pieces``, ``deal_blocks``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from blockattn.masks import MaskSpec
from blockattn.planner import CostModel, Topology
from blockattn.planner import candidates as candidates_module
from blockattn.planner import starts as starts_module
from blockattn.planner.schedule import KIND_KV, payload_bytes

HEADS = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)  # Llama-3-8B attention: compute-bound tiles


@pytest.mark.parametrize("inter_bw,split", [(5e9, False), (5e13, True)])
def test_node_packing_splits_a_heavy_document_only_when_the_link_pays(inter_bw, split):
    # one causal document ~1.2 nodes' share of compute among 1K-token documents, 4 nodes of 2 ranks:
    # splitting it evens the nodes out but sends the KV before the cut over the inter-node link
    from blockattn.planner.starts import hierarchical_home
    from blockattn.planner.tiles import TileSet

    docs = [4096] + [1024] * 37
    tiles = TileSet.from_block_mask(MaskSpec.documents(docs).block_mask(128))
    cost_model = CostModel(topology=Topology(ranks_per_node=2, inter_bw=inter_bw))
    kv_bytes = payload_bytes(KIND_KV, tiles.block_lengths(), element_size=2, **HEADS).astype(np.float64)
    home = hierarchical_home(tiles, 8, cost_model=cost_model, num_q_heads=32, head_dim=128, inner="fcp",
                             kv_bytes=kv_bytes)
    doc_nodes = cost_model.topology.node_of(home[: 4096 // 128])
    if not split:
        assert np.unique(doc_nodes).size == 1, doc_nodes
    else:
        assert np.unique(doc_nodes).size == 2, doc_nodes
        # contiguous parts: each node reads only the KV before its part
        assert np.count_nonzero(np.diff(doc_nodes)) == 1, doc_nodes
    # every node keeps its memory share (one block of slack)
    tokens = np.bincount(cost_model.topology.node_of(home), minlength=4)
    assert tokens.max() <= -(-tiles.num_blocks // 8) * 2, tokens


@pytest.mark.parametrize("world_size,ranks_per_node", [(8, 4), (6, 4), (9, 3)])
def test_spread_read_blocks_deals_a_nodes_read_blocks_over_its_ranks(world_size, ranks_per_node):
    """``spread_read_blocks`` (the second opinion's "hierarchical-spread" start): a 20K-token document
    crossing nodes; inside each node the blocks other nodes read are dealt over the node's ranks (as
    evenly as their block counts allow), and every rank keeps its block count, every block its node."""
    from blockattn.planner.tiles import TileSet

    tiles = TileSet.from_block_mask(MaskSpec.documents([3000, 20000, 1000, 4000, 500]).block_mask(128))
    topo = Topology(ranks_per_node=ranks_per_node)
    sizes = dict(element_size=2, grad_element_size=4, **HEADS)
    home = candidates_module._initial_home(tiles, world_size, "hierarchical", CostModel(topology=topo), sizes)
    spread = starts_module.spread_read_blocks(tiles, home, topo)
    assert np.array_equal(np.bincount(spread, minlength=world_size), np.bincount(home, minlength=world_size))
    node = home // ranks_per_node
    assert np.array_equal(spread // ranks_per_node, node)
    read = np.zeros(tiles.num_blocks, dtype=bool)
    read[tiles.kv[node[tiles.q] != node[tiles.kv]]] = True
    assert read.any()
    count = np.bincount(home, minlength=world_size)
    for n in np.unique(node):
        ranks = np.arange(n * ranks_per_node, min((n + 1) * ranks_per_node, world_size))
        dealt = np.bincount(spread[read & (node == n)], minlength=world_size)[ranks]
        if dealt.sum():
            # even, unless a rank ran out of blocks
            assert dealt.max() - dealt[dealt < count[ranks]].min(initial=dealt.max()) <= 1, (n, dealt, count[ranks])
    cost_model = CostModel(topology=topo)
    assert np.array_equal(candidates_module._initial_home(tiles, world_size, "hierarchical-spread", cost_model, sizes),
                          spread)


@pytest.mark.parametrize("world_size,ranks_per_node", [(8, 4), (6, 4), (9, 3)])
def test_deal_heavy_pieces_deals_only_the_pieces_heavier_than_a_rank(world_size, ranks_per_node):
    """``deal_heavy_pieces`` (the deal pass's starts): a 20K-token causal document, cut over nodes by
    "hierarchical" into contiguous runs; inside each node the blocks of its piece of the document, which
    holds several ranks' shares of compute there, are dealt round-robin over the node's ranks, so every
    rank holds about as many of them; the short documents' blocks stay where room allows. Every rank
    keeps its block count, every block its node, and homes with no heavy piece come back unchanged."""
    from blockattn.planner.tiles import TileSet

    lens = [3000, 20000, 1000, 4000, 500]
    tiles = TileSet.from_block_mask(MaskSpec.documents(lens).block_mask(128))
    topo = Topology(ranks_per_node=ranks_per_node)
    sizes = dict(element_size=2, grad_element_size=4, **HEADS)
    home = candidates_module._initial_home(tiles, world_size, "hierarchical", CostModel(topology=topo), sizes)
    dealt = starts_module.deal_heavy_pieces(tiles, home, world_size, topo)
    assert np.array_equal(np.bincount(dealt, minlength=world_size), np.bincount(home, minlength=world_size))
    node = home // ranks_per_node
    assert np.array_equal(dealt // ranks_per_node, node)
    long_doc = np.zeros(tiles.num_blocks, dtype=bool)
    long_doc[(3000 + 127) // 128: (23000 - 1) // 128 + 1] = True  # blocks holding its tokens
    row = np.bincount(tiles.q, weights=tiles.pairs, minlength=tiles.num_blocks)
    share = row.sum() / world_size
    count = np.bincount(home, minlength=world_size)
    heavy_nodes = 0
    for n in np.unique(node):
        ranks = np.arange(n * ranks_per_node, min((n + 1) * ranks_per_node, world_size))
        piece = long_doc & (node == n)
        if row[piece].sum() <= 1.5 * share:
            continue  # (a light piece may or may not be dealt: the segments cut at block boundaries)
        heavy_nodes += 1
        held = np.bincount(dealt[piece], minlength=world_size)[ranks]
        assert held.max() - held[held < count[ranks]].min(initial=held.max()) <= 1, (n, held, count[ranks])
        # round-robin: consecutive blocks of the piece on different ranks, where two ranks have room
        assert np.all(np.diff(dealt[piece])[: len(ranks) - 1] != 0)
    assert heavy_nodes >= 1
    # short documents only (each lighter than a rank's share): nothing is dealt
    tiles = TileSet.from_block_mask(MaskSpec.documents([700] * 40).block_mask(128))
    home = candidates_module._initial_home(tiles, world_size, "hierarchical", CostModel(topology=topo), sizes)
    assert np.array_equal(starts_module.deal_heavy_pieces(tiles, home, world_size, topo), home)


@given(lens=st.lists(st.integers(1, 20_000), min_size=1, max_size=10), world_size=st.integers(2, 12),
       ranks_per_node=st.integers(1, 6), block=st.sampled_from([64, 128]))
def test_deal_heavy_pieces_keeps_memory_and_nodes_and_spreads_every_heavy_piece(lens, world_size, ranks_per_node,
                                                                                block):
    """``deal_heavy_pieces`` on any batch: every rank keeps its block count, every block its node; the
    blocks of a piece heavier than a rank's share (by the function's own rule) land on as many of its
    node's ranks as hold room for them, up to the piece's size; a home with none comes back as it was."""
    from blockattn.planner.fcp import segments
    from blockattn.planner.tiles import TileSet

    tiles = TileSet.from_block_mask(MaskSpec.documents(lens).block_mask(block))
    topo = Topology(ranks_per_node=ranks_per_node)
    sizes = dict(element_size=2, grad_element_size=4, **HEADS)
    home = candidates_module._initial_home(tiles, world_size, "hierarchical", CostModel(topology=topo), sizes)
    dealt = starts_module.deal_heavy_pieces(tiles, home, world_size, topo)
    assert np.array_equal(np.bincount(dealt, minlength=world_size), np.bincount(home, minlength=world_size))
    assert np.array_equal(dealt // ranks_per_node, home // ranks_per_node)
    bounds = segments(tiles, documents=True)
    segment = np.searchsorted(bounds, np.arange(tiles.num_blocks), side="right") - 1
    node = home // ranks_per_node
    row = np.bincount(tiles.q, weights=tiles.pairs, minlength=tiles.num_blocks)
    share = row.sum() / world_size
    any_heavy = False
    for s, n in set(zip(segment.tolist(), node.tolist())):
        piece = (segment == s) & (node == n)
        if row[piece].sum() <= starts_module.DEAL_PIECE_FROM * share:
            continue
        any_heavy = True
        with_room = np.count_nonzero(np.bincount(home[node == n], minlength=world_size))
        assert np.unique(dealt[piece]).size >= min(with_room, int(piece.sum()))
    if not any_heavy:
        assert np.array_equal(dealt, home)


def test_deal_blocks_by_hand():
    """``deal_blocks`` (the spread pass's first-exchange start): the marked blocks of each node dealt
    round-robin over its ranks, lowest rank first; the others stay home while their rank has room, the
    overflow filling the others' room in block order. Block counts per rank and nodes are kept."""
    from blockattn.planner.starts import deal_blocks

    topo = Topology(ranks_per_node=2)
    #           node 0: ranks 0, 1                 node 1: ranks 2, 3
    home = np.array([0, 0, 0, 1, 1, 1, 2, 2, 3, 3])
    dealt = np.array([1, 1, 0, 0, 0, 0, 1, 0, 0, 1], dtype=bool)
    # node 0: blocks 0, 1 dealt to ranks 0, 1; rank 0 keeps block 2 (room 3 - 1), rank 1 keeps blocks 3, 4
    # and block 5 overflows to rank 0's room. Node 1: blocks 6, 9 to ranks 2, 3; blocks 7, 8 stay.
    assert deal_blocks(home, dealt, topo).tolist() == [0, 1, 0, 1, 1, 0, 2, 2, 3, 3]
    # without keep_rest the others fill the room left in contiguous runs
    assert deal_blocks(home, dealt, topo, keep_rest=False).tolist() == [0, 1, 0, 0, 1, 1, 2, 2, 3, 3]
    assert deal_blocks(home, np.zeros(10, dtype=bool), topo).tolist() == home.tolist()
