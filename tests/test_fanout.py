"""Widely read KV on one node: fanned out through its first readers (planner/fanout.py) and dealt over
the ranks by the deal pass (planner/passes.py WIDELY_READ)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_relay import replay

from blockattn.masks import MaskSpec
from blockattn.planner import Topology, check_plan, clear_plan_cache, make_plan
from blockattn.planner.fanout import fanout_candidates
from blockattn.planner.schedule import KIND_DKV, KIND_KV

from batches import shared_question_answers
from dcp_modules import set_dcp

HEADS = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)


def _over_bound(plan) -> float:
    return plan.stats()["sim_over_bound"]


def _question_kv_from_homes(plan, blocks) -> int:
    """KV rows of ``blocks`` that their homes send."""
    fwd = plan.schedule.fwd.numpy().astype(np.int64)
    kv = fwd[(fwd[:, 3] == KIND_KV) & np.isin(fwd[:, 4], blocks)]
    return int((kv[:, 1] == plan.block_home.numpy()[kv[:, 4]]).sum())


def _one_node_plan(monkeypatch, spec, world_size: int, **flags):
    """dcp's plan of ``spec`` on one node of ``world_size`` ranks (block 64, checked), with planner/dcp.py
    constants set from ``flags``."""

    with monkeypatch.context() as patch:
        for name, value in flags.items():
            set_dcp(patch, name, value)
        clear_plan_cache()
        plan = make_plan(spec, world_size, block_size=64, topology=Topology(ranks_per_node=world_size), **HEADS)
    clear_plan_cache()
    return plan


@settings(max_examples=60, deadline=None)
@given(data=st.data(), degree=st.integers(1, 4), min_readers=st.integers(1, 6))
def test_fanout_candidates_deal_a_blocks_later_readers_to_its_first_ones(data, degree, min_readers):
    P, nB = 9, 5
    pairs = data.draw(st.lists(st.tuples(st.integers(0, P - 1), st.integers(0, nB - 1)), unique=True, max_size=40))
    r = np.array([p[0] for p in pairs], dtype=np.int64)
    b = np.array([p[1] for p in pairs], dtype=np.int64)
    first = np.array(data.draw(st.lists(st.integers(1, 4), min_size=len(pairs), max_size=len(pairs))), dtype=np.int64)
    order = np.argsort(r * nB + b)  # receive groups come sorted by (rank, block)
    groups = (r[order], b[order], first[order], first[order])
    cand = fanout_candidates(np.zeros(nB, dtype=np.int64), groups, degree=degree, min_readers=min_readers)
    expected = 0
    for block in range(nB):
        readers = np.flatnonzero(groups[1] == block)
        if readers.size < max(min_readers, 2):
            assert cand is None or not np.any(cand.block == block), "a block with too few readers keeps its home"
            continue
        ranked = readers[np.lexsort((groups[0][readers], groups[2][readers]))]  # by first need, then rank
        proxies = groups[0][ranked[: -(-readers.size // (degree + 1))]]
        mine = cand.block == block
        expected += readers.size - proxies.size
        assert sorted(cand.dst[mine].tolist()) == sorted(set(groups[0][readers].tolist()) - set(proxies.tolist()))
        assert set(cand.proxy[mine].tolist()) <= set(proxies.tolist())
        assert np.bincount(cand.proxy[mine]).max() <= degree, "a proxy forwards to at most `degree` readers"
        assert np.all(cand.first[mine] >= cand.proxy_first[mine]), "a proxy needs the block no later"
        # each entry points at its own receive group
        assert np.array_equal(groups[0][cand.group[mine]], cand.dst[mine])
        assert np.all(groups[1][cand.group[mine]] == block)
    assert (0 if cand is None else cand.block.size) == expected
    with pytest.raises(ValueError, match="degree"):
        fanout_candidates(np.zeros(nB, dtype=np.int64), groups, degree=0)


def test_one_node_fans_a_widely_read_question_out_through_its_first_readers(monkeypatch):
    # 16K tokens, a question and its answers on 16 ranks of one node: the question's homes sent it to every
    # rank; through its first readers, each forwarding it to three others, the plan runs 1.40 -> 1.28x the bound
    question, answers = shared_question_answers(30, 16384)
    spec = MaskSpec.shared_question(question, answers)
    plain = _one_node_plan(monkeypatch, spec, 16, FANOUT=False)
    fanned = _one_node_plan(monkeypatch, spec, 16)
    assert plain.kv_relay.shape[0] == 0
    relay = fanned.kv_relay.numpy().astype(np.int64)
    assert relay.shape[0] > 0 and _over_bound(fanned) < 0.95 * _over_bound(plain)
    check_plan(fanned)
    replay(fanned)  # (test_relay.py: every source holds what it sends, every partial reaches its home once)
    home = fanned.block_home.numpy().astype(np.int64)
    fwd = fanned.schedule.fwd.numpy().astype(np.int64)
    kv = fwd[fwd[:, 3] == KIND_KV]
    from_home = {(int(b), int(d)) for _, s, d, _, b in kv if s == home[b]}
    for b, dst, src in relay.tolist():
        assert src != home[b] and (b, src) in from_home, "a proxy is a reader that got the block from its home"
    # the question's homes send fewer copies (105 -> 73 here); the readers' dK/dV partials go back up the tree
    question_blocks = np.arange(-(-question // 64))
    assert _question_kv_from_homes(fanned, question_blocks) < _question_kv_from_homes(plain, question_blocks)
    bwd = fanned.schedule.bwd.numpy().astype(np.int64)
    dkv = bwd[bwd[:, 3] == KIND_DKV]
    assert np.any(dkv[:, 2] != home[dkv[:, 4]]), "some partials reduce at a proxy before going home"


def test_deal_pass_deals_a_one_node_question_over_the_ranks(monkeypatch):
    # 8K tokens on 16 ranks of one node: the question's 5 blocks on 2 homes, which send them to every rank;
    # dealt one per rank, 3.60 -> 2.70x the bound (the fan-out adds nothing here)
    question, answers = shared_question_answers(27, 8192)
    spec = MaskSpec.shared_question(question, answers)
    plain = _one_node_plan(monkeypatch, spec, 16, FANOUT=False, WIDELY_READ=0)
    dealt = _one_node_plan(monkeypatch, spec, 16, FANOUT=False)
    assert _over_bound(dealt) < 0.8 * _over_bound(plain)
    question_blocks = -(-question // 64)
    homes = lambda plan: np.unique(plan.block_home[:question_blocks].numpy()).size  # noqa: E731
    assert homes(dealt) == question_blocks > homes(plain)
    tokens = [plan.stats()["tokens"] for plan in (plain, dealt)]
    assert max(tokens[1]) - min(tokens[1]) <= max(tokens[0]) - min(tokens[0]) + 64, "memory stays as balanced"
