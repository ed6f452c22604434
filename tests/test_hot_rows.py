"""Hot rows (planner/starts.py ``dealt_home``, planner/balance.py ``pushed_rows``): q-rows that read far
more KV than the mean row (causal_blockwise's last block reads the whole sequence) are dealt over the
ranks and nodes, and computed where their KV lives, so their Q blocks and OUT partials leave through
every rank's links instead of one rank's."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from blockattn.masks import MaskSpec
from blockattn.planner import Topology, make_plan
from blockattn.planner.balance import Balancer, pushed_rows
from blockattn.planner.cost_model import CostModel
from blockattn.planner.candidates import _balanced, _lower_bound, _scored
from blockattn.planner.dcp import dcp
from blockattn.planner.starts import dealt_home, hot_rows
from blockattn.planner.placement import balanced_bounds
from blockattn.planner.schedule import KIND_KV, KIND_OUT, KIND_Q, payload_bytes
from blockattn.planner.tiles import TileSet

HEADS = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)
SIZES = dict(HEADS, element_size=2)


def _blockwise_tiles():
    # 256 blocks of 128 tokens; the last 4096-token block (8 blocks) reads the whole sequence
    return TileSet.from_block_mask(MaskSpec.causal_blockwise(32768, block=1024, k_local=2).block_mask(128))


def test_hot_rows_are_dealt_over_ranks_and_nodes_with_memory_balanced():
    tiles = _blockwise_tiles()
    hot = hot_rows(tiles)
    assert hot.tolist() == list(range(248, 256))
    # a long document's last rows carry 10x the mean row's pairs, but read only the document's KV
    docs = TileSet.from_block_mask(MaskSpec.documents([12000] + [300] * 200).block_mask(128))
    assert hot_rows(docs).size == 0
    topo = Topology(ranks_per_node=2)
    home = dealt_home(tiles, 6, topology=topo)
    # rank 0 of each node, then rank 1 of each node, ...: consecutive hot rows on different nodes
    assert home[hot].tolist() == [0, 2, 4, 1, 3, 5, 0, 2]
    assert np.bincount(home, minlength=6).tolist() == np.diff(balanced_bounds(256, 6)).tolist()
    cool = np.setdiff1d(np.arange(256), hot)
    assert np.all(np.diff(home[cool]) >= 0)  # the other blocks in contiguous runs


def test_pushed_rows_by_hand():
    """Rank 0 holds blocks 0-5, rank 1 blocks 6-11. q-block 11 reads blocks 0..n-1 of rank 0, q-block 10
    only block 0: block 11's piece moves to rank 0 once its KV - n - 1/2 blocks, block 0 being shared
    by two rows - outweighs its Q block and OUT partial; block 10's piece stays."""
    sizes = dict(num_q_heads=4, num_kv_heads=1, head_dim=8, element_size=2)
    lens = np.array([16])
    kv = int(payload_bytes(KIND_KV, lens, **sizes)[0])
    q_out = int(payload_bytes(KIND_Q, lens, **sizes)[0] + payload_bytes(KIND_OUT, lens, **sizes)[0])
    home = np.repeat([0, 1], 6)
    for n in (q_out // kv, q_out // kv + 2):
        q = np.r_[np.arange(12), np.full(n, 11), 10]
        kvb = np.r_[np.arange(12), np.arange(n), 0]
        order = np.lexsort((kvb, q))
        tiles = TileSet(total_len=192, block_size=16, num_blocks=12, q=q[order], kv=kvb[order],
                        full=np.ones(q.size, dtype=bool), pairs=np.full(q.size, 256))
        rank = pushed_rows(tiles, home, **sizes)
        piece_11 = (tiles.q == 11) & (tiles.kv < 6)
        pushed = (n - 0.5) * kv > q_out
        assert np.all(rank[piece_11] == (0 if pushed else 1)) and pushed == (n > q_out // kv)
        assert np.all(rank[(tiles.q == 10) & (tiles.kv == 0)] == 1)
        assert np.all(rank[tiles.q == tiles.kv] == home[tiles.q[tiles.q == tiles.kv]])


def test_pushed_rows_by_node_by_hand():
    """Three nodes of 3, 3 and 2 ranks, one block per rank, a hot q-block reading every block, the other
    q-blocks reading block 0 and their own. A KV block weighs a little less than a Q block and OUT
    partial (32 against 36 bytes a token): per kv-home every piece is one block and stays home; per kv-node, the
    hot row's piece on another node (three blocks) goes to that node's rank with the q-home's index
    inside its node (modulo a short node's size), so its Q block enters the node once and the KV moves
    over NVLink, and its piece on its own node stays home. The other rows' one-block pieces stay."""
    sizes = dict(num_q_heads=1, num_kv_heads=1, head_dim=8, element_size=2)
    P, rpn = 8, 3
    home = np.arange(P)
    for hot, want in ((7, [1, 1, 1, 4, 4, 4, 7, 7]), (5, [2, 2, 2, 5, 5, 5, 6, 6])):  # 6 + 2 % 2 on the last node
        q = np.r_[np.full(P, hot), np.repeat(np.setdiff1d(np.arange(P), [0, hot]), 2), 0]
        kv = np.r_[np.arange(P), np.tile([0, 1], P - 2), 0]
        kv[P + 1:-1:2] = np.setdiff1d(np.arange(P), [0, hot])  # rows read block 0 and their own
        order = np.lexsort((kv, q))
        tiles = TileSet(total_len=16 * P, block_size=16, num_blocks=P, q=q[order], kv=kv[order],
                        full=np.ones(q.size, dtype=bool), pairs=np.full(q.size, 256))
        by_node = pushed_rows(tiles, home, ranks_per_node=rpn, **sizes)
        by_rank = pushed_rows(tiles, home, **sizes)
        row = tiles.q == hot
        assert by_node[row].tolist() == want
        assert np.all(by_rank[row] == hot)
        assert np.array_equal(by_node[~row], tiles.q[~row]) and np.array_equal(by_rank[~row], tiles.q[~row])


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_balancer_counts_a_given_start_receive_once(seed):
    """From any start assignment the Balancer's per-rank bytes are the receive-once transfers: a Q block
    in and an OUT partial out per (rank, remote q-block), a KV block in per (rank, remote kv-block)."""
    rng = np.random.default_rng(seed)
    tiles = TileSet.from_block_mask(MaskSpec.documents([700, 300, 1100, 150]).block_mask(128))
    P = 4
    home = np.sort(rng.integers(0, P, tiles.num_blocks))
    start = np.where(rng.random(tiles.num_tiles) < 0.3, rng.integers(0, P, tiles.num_tiles), home[tiles.q])
    b = Balancer(tiles, home, np.ones(tiles.num_tiles), P, Topology(ranks_per_node=2), start=start, **SIZES)
    lens = tiles.block_lengths()
    q_b, out_b, kv_b = (payload_bytes(k, lens, **SIZES).astype(np.float64) for k in (KIND_Q, KIND_OUT, KIND_KV))
    send, recv = np.zeros(P), np.zeros(P)
    for r, blk in {(int(r), int(x)) for r, x in zip(start, tiles.q) if home[x] != r}:
        recv[r] += q_b[blk]; send[home[blk]] += q_b[blk]  # noqa: E702
        send[r] += out_b[blk]; recv[home[blk]] += out_b[blk]  # noqa: E702
    for r, blk in {(int(r), int(x)) for r, x in zip(start, tiles.kv) if home[x] != r}:
        recv[r] += kv_b[blk]; send[home[blk]] += kv_b[blk]  # noqa: E702
    assert np.allclose(b.send.sum(axis=1), send) and np.allclose(b.recv.sum(axis=1), recv)
    assert np.array_equal(b.rank, start) and np.allclose(b.C, np.bincount(start, minlength=P))


def test_dcp_deals_the_hot_rows_of_causal_blockwise():
    """Three nodes of two ranks. Homed in one run, the last block's rows push their Q blocks through one
    rank's NIC (or pull the whole sequence's KV to it): dcp was at 2.4x the bound. Dealt over the
    nodes and computed where the KV lives, it comes within 10%."""
    spec = MaskSpec.causal_blockwise(32768, block=1024, k_local=2)
    plan = make_plan(spec, 6, block_size=128, topology=Topology(ranks_per_node=2), **HEADS)  # checked
    assert plan.stats()["sim_over_bound"] < 1.15
    hot = hot_rows(_blockwise_tiles())
    assert len(set(plan.block_home.numpy()[hot].tolist())) == 6  # one hot row per rank at least


def test_balancer_tries_a_target_with_less_transfer_after_one_fails():
    """One NVLink domain of 32 ranks, causal_blockwise over 128K tokens with the hot rows dealt (dcp's
    "dealt" start). The least loaded rank (0.76x the mean compute) is bound by its transfers (1.02x the
    mean compute in time), so every rectangle moved onto it fails; the balancer took that as "every more
    loaded rank of the node fails too" and left six ranks at 1.044x the mean. A rank with less transfer
    time than the one that failed is now still tried: all within the 2% cap."""
    tiles = TileSet.from_block_mask(MaskSpec.causal_blockwise(131072, block=4096, k_local=2).block_mask(128))
    cost_model = CostModel(topology=Topology(ranks_per_node=32))
    _, rank = _balanced(tiles, 32, "dealt", cost_model, dict(SIZES, grad_element_size=4))
    compute = cost_model.tile_flops(tiles.pairs, num_q_heads=32, head_dim=128)
    load = np.bincount(rank, weights=compute, minlength=32)
    assert load.max() / load.mean() <= 1.02 + 1e-9  # (measured: 1.0436 before, 1.0199 now)


def test_dcp_pushes_hot_rows_per_node_on_several_nodes():
    """Four nodes of two ranks. Pushed to every kv-home, each hot Q block enters every rank through its
    NIC (1.12x the bound); pushed per kv-node it enters each node once and its KV moves over NVLink
    (1.04x). dcp plans both candidates and keeps the faster; its plan passes check_plan."""
    tiles = _blockwise_tiles()
    cm = CostModel(topology=Topology(ranks_per_node=2))
    sizes = dict(SIZES, grad_element_size=4)
    bound = _lower_bound(tiles, 8, cm, sizes)

    def time_of(init):
        placement = dcp(tiles, 8, cost_model=cm, max_stages=4, init=init, **sizes)
        return _scored(tiles, placement, 8, cm, sizes).sim_time / bound

    per_rank, per_node = time_of("dealt"), time_of("dealt-nodes")
    assert per_node < 0.95 * per_rank
    plan = make_plan(MaskSpec.causal_blockwise(32768, block=1024, k_local=2), 8, block_size=128,
                     topology=Topology(ranks_per_node=2), **HEADS)  # checked
    assert plan.stats()["sim_over_bound"] <= per_node + 1e-9


@settings(max_examples=12, deadline=None)
@given(total=st.integers(300, 3000), block=st.integers(40, 700), k_local=st.integers(1, 3),
       world_size=st.sampled_from([3, 5, 6, 7]), ranks_per_node=st.sampled_from([1, 2, 4]))
def test_dcp_plans_with_hot_rows_are_consistent(total, block, k_local, world_size, ranks_per_node):
    """causal_blockwise at awkward sizes (hot rows or not, any number of nodes): the plan passes
    check_plan (every tile once, inputs present by their stage, sends and receives matched) and holds
    every token once; no rank holds more than one block over its rounded-up share (peak memory)."""
    spec = MaskSpec.causal_blockwise(total, block=block, k_local=k_local)
    plan = make_plan(spec, world_size, block_size=32, topology=Topology(ranks_per_node=ranks_per_node),
                     num_q_heads=4, num_kv_heads=2, head_dim=16)  # check_plan runs inside
    tokens = np.sort(np.concatenate([plan.local_tokens(r).numpy() for r in range(world_size)]))
    assert np.array_equal(tokens, np.arange(total))
    blocks = np.bincount(plan.block_home.numpy(), minlength=world_size)
    assert blocks.max() <= -(-plan.num_blocks // world_size) + 1
