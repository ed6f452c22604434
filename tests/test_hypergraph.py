"""The "hypergraph" strategy (DCP's formulation solved by Mt-KaHyPar, planner/hypergraph.py)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from blockattn.masks import MaskSpec
from blockattn.planner import Topology, clear_plan_cache, make_plan
from blockattn.planner import hypergraph as hg
from blockattn.planner.schedule import KIND_DKV, KIND_DO, KIND_DQ, KIND_KV, KIND_OUT, KIND_Q, payload_bytes

HEADS = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)
SIZES = dict(HEADS, element_size=2, grad_element_size=4)
DOCS = [1, 2500, 37, 900, 640, 3, 1200, 4000, 77, 300, 2200, 1]  # 11,858 tokens: not a multiple of the block


def _connectivity_bytes(plan) -> int:
    """sum over blocks of (ranks other than the home that read the block) x its round-trip bytes: the
    hypergraph's objective, computed from the plan's tiles."""
    home = plan.block_home.numpy().astype(np.int64)
    rank = plan.tile_rank.numpy().astype(np.int64)
    P, nB = plan.world_size, plan.num_blocks
    block_len = np.minimum(plan.block_size, plan.total_len - np.arange(nB) * plan.block_size)
    trips = ((plan.tile_q.numpy().astype(np.int64), (KIND_Q, KIND_OUT, KIND_DO, KIND_DQ)),
             (plan.tile_kv.numpy().astype(np.int64), (KIND_KV, KIND_DKV)))
    total = 0
    for block_of_tile, kinds in trips:
        per_block = sum(payload_bytes(kind, block_len, **SIZES) for kind in kinds)
        readers = np.unique(block_of_tile * P + rank)
        block, reader = readers // P, readers % P
        total += int(per_block[block][reader != home[block]].sum())
    return total


def test_one_node_plan_is_balanced_and_its_bytes_are_the_objective():
    clear_plan_cache()
    plan = make_plan(MaskSpec.documents(DOCS), 4, block_size=64, strategy="hypergraph", **HEADS)
    stats = plan.stats()
    flops, tokens = np.array(stats["flops_fwd"]), np.array(stats["tokens"])
    largest_tile = 4 * HEADS["head_dim"] * HEADS["num_q_heads"] * 64 * 64
    # compute within the partitioner's epsilon (plus one tile: its weights are rounded), memory alike
    assert flops.max() <= (1 + hg.COMPUTE_EPS) * flops.mean() + largest_tile
    assert tokens.max() <= (1 + hg.MEMORY_EPS) * tokens.mean() + 64
    # one node, no relays: the schedule moves exactly what the connectivity objective counts
    assert stats["bytes_fwd"] + stats["bytes_bwd"] == _connectivity_bytes(plan) > 0


def test_several_nodes_and_a_short_node():
    # 5 ranks, 2 per node: nodes of 2, 2 and 1 rank; the short node gets its share only
    clear_plan_cache()
    spec = MaskSpec.shared_question(700, [1500, 1, 900, 2600, 40])
    plan = make_plan(spec, 5, block_size=64, strategy="hypergraph", topology=Topology(ranks_per_node=2), **HEADS)
    flops = np.array(plan.stats()["flops_fwd"], dtype=np.float64)
    assert flops[4] <= 1.25 * flops.mean()  # a one-rank node is not given a two-rank node's share
    assert sorted(np.concatenate([plan.local_tokens(r).numpy() for r in range(5)]).tolist()) == list(range(
        spec.total_len))


def test_same_plan_twice():
    spec = MaskSpec.documents(DOCS) & MaskSpec.lambda_mask(sum(DOCS), 64, 700)
    clear_plan_cache()
    a = make_plan(spec, 3, block_size=64, strategy="hypergraph", **HEADS).fingerprint()
    clear_plan_cache()
    assert make_plan(spec, 3, block_size=64, strategy="hypergraph", **HEADS).fingerprint() == a


def test_missing_partitioner_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mtkahypar", None)  # "import mtkahypar" now raises ImportError
    clear_plan_cache()
    with pytest.raises(ImportError, match=r"pip install 'blockattn\[hypergraph\]'"):
        make_plan(MaskSpec.causal(1000), 2, block_size=64, strategy="hypergraph", **HEADS)
