"""Plans of several masks over one batch on one data placement (planner/shared_homes.py): make_plans and
make_plan(homes_from=...) keep the homes, every plan passes check_plan, the kept homes are the cheapest
candidate by the weighted time, and bad arguments name what is wrong."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from blockattn import MaskSpec, make_plan, make_plans
from blockattn.planner import PlanAhead, Topology, check_plan
from blockattn.planner.shared_homes import joint_tiles
from blockattn.planner.tiles import TileSet

HEADS = dict(num_q_heads=4, num_kv_heads=2, head_dim=32)
LENS = [700, 1, 2400, 333, 900, 64, 1500]
T = sum(LENS)


def _masks():
    docs = MaskSpec.documents(LENS)
    return [docs, docs & MaskSpec.sliding_window(T, 256), docs & MaskSpec.lambda_mask(T, 16, 128)]


def _seconds(plan) -> float:
    stats = plan.stats()
    return stats["sim_time_fwd"] + stats["sim_time_bwd"]


@pytest.mark.parametrize("world, per_node", [(3, 8), (8, 4)])
def test_make_plans_share_homes_and_each_plan_is_its_masks(world, per_node):
    masks = _masks()
    plans = make_plans(masks, world, topology=Topology(ranks_per_node=per_node), block_size=64, **HEADS)
    assert len(plans) == 3
    for spec, plan in zip(masks, plans):
        check_plan(plan)
        assert plan.mask_signature == spec.signature() and plan.block_size == 64
        assert torch.equal(plan.block_home, plans[0].block_home)
        for r in range(world):
            assert torch.equal(plan.local_tokens(r), plans[0].local_tokens(r))


def test_kept_homes_are_no_slower_in_weighted_time_than_any_masks_own():
    """Each mask's own homes are candidates: the kept set takes no longer, weighted, than planning every
    mask on any one of them; a set of one mask is make_plan's plan."""
    masks = _masks()[:2]
    kw = dict(topology=Topology(ranks_per_node=4), block_size=64, **HEADS)
    for weights in ([1, 1], [1, 5]):
        plans = make_plans(masks, 8, weights=weights, **kw)
        kept = sum(w * _seconds(p) for w, p in zip(weights, plans))
        for own in masks:
            base = make_plan(own, 8, **kw)
            on_it = [base if spec is own else make_plan(spec, 8, homes_from=base, **kw) for spec in masks]
            assert kept <= sum(w * _seconds(p) for w, p in zip(weights, on_it)) * (1 + 1e-12)
    (alone,) = make_plans(masks[:1], 8, **kw)
    assert alone.fingerprint() == make_plan(masks[0], 8, **kw).fingerprint()


def test_homes_from_plans_on_the_given_homes():
    docs, window, _ = _masks()
    kw = dict(block_size=64, **HEADS)
    base = make_plan(docs, 5, **kw)
    plan = make_plan(window, 5, homes_from=base, **HEADS)  # (the block size is base's)
    check_plan(plan)
    assert torch.equal(plan.block_home, base.block_home) and plan.block_size == 64
    assert make_plan(window, 5, homes_from=base, **HEADS) is plan  # cached, with the homes in the key
    own = make_plan(window, 5, **kw)
    assert own is not plan and own.fingerprint() != plan.fingerprint()
    assert [step for step, _ in plan.search][0] == "given homes" and "given homes" in plan.explain()


def test_baselines_place_every_mask_on_the_same_homes():
    for strategy in ("ring", "zigzag", "allgather"):
        plans = make_plans(_masks(), 5, strategy=strategy, block_size=64, **HEADS)
        assert all(p.strategy == strategy and torch.equal(p.block_home, plans[0].block_home) for p in plans)


def test_joint_tiles_sum_the_weighted_pairs_over_the_union():
    docs, window, _ = _masks()
    a, b = (TileSet.from_block_mask(m.block_mask(64)) for m in (docs, window))
    joint = joint_tiles([a, b], [1.0, 3.0])
    assert joint.num_tiles == a.num_tiles  # (the window's tiles are a subset of the documents')
    assert int(joint.pairs.sum()) == int(a.pairs.sum()) + 3 * int(b.pairs.sum())
    key = joint.q * joint.num_blocks + joint.kv
    assert (np.diff(key) > 0).all()


@pytest.mark.parametrize("call, error, message", [
    (lambda base, w: make_plan(w, 5, homes_from="plan", **HEADS), TypeError, "homes_from must be a Plan"),
    (lambda base, w: make_plan(w, 4, homes_from=base, **HEADS), ValueError, "planned for .* on 5 ranks"),
    (lambda base, w: make_plan(MaskSpec.causal(T + 1), 5, homes_from=base, **HEADS), ValueError, "tokens"),
    (lambda base, w: make_plan(w, 5, homes_from=base, block_size=32, **HEADS), ValueError, "block_size=32"),
    (lambda base, w: make_plan(w, 5, homes_from=base, strategy="fcp", **HEADS), ValueError, "strategy='fcp'"),
    (lambda base, w: make_plans([], 5, **HEADS), ValueError, "non-empty"),
    (lambda base, w: make_plans(w, 5, **HEADS), ValueError, "non-empty list or tuple"),
    (lambda base, w: make_plans([w, MaskSpec.causal(T + 1)], 5, **HEADS), ValueError, "different token counts"),
    (lambda base, w: make_plans([w, w], 5, weights=[1], **HEADS), ValueError, "weights"),
    (lambda base, w: make_plans([w, w], 5, weights=[1, 0], **HEADS), ValueError, "weights"),
    (lambda base, w: make_plans([w, w], 5, strategy="hypergraph", **HEADS), ValueError, "fcp and hypergraph"),
    (lambda base, w: make_plans(["causal"], 5, **HEADS), TypeError, "MaskSpec"),
    (lambda base, w: PlanAhead(world_size=5, weights=[1, -1], **HEADS), ValueError, "positive numbers"),
])
def test_bad_arguments_name_what_is_wrong(call, error, message):
    docs, window, _ = _masks()
    base = make_plan(docs, 5, block_size=64, **HEADS)
    with pytest.raises(error, match=message):
        call(base, window)


@settings(max_examples=8, deadline=None)
@given(lens=st.lists(st.integers(1, 600), min_size=1, max_size=6), window=st.integers(1, 300),
       world=st.sampled_from([1, 3, 5, 7]), per_node=st.sampled_from([2, 3, 8]), block=st.sampled_from([16, 32]))
def test_any_batch_and_world_size_plans_valid_on_shared_homes(lens, window, world, per_node, block):
    total = sum(lens)
    masks = [MaskSpec.documents(lens), MaskSpec.documents(lens) & MaskSpec.sliding_window(total, window)]
    plans = make_plans(masks, world, topology=Topology(ranks_per_node=per_node), block_size=block, **HEADS)
    for plan in plans:
        check_plan(plan)
        assert torch.equal(plan.block_home, plans[0].block_home)


def test_plan_ahead_plans_a_tuple_of_masks_on_shared_homes():
    masks = tuple(_masks()[:2])
    kw = dict(block_size=64, **HEADS)
    with PlanAhead(world_size=4, weights=[1, 2], **kw) as planner:
        got = planner.submit(masks).result(timeout=600)
        (single,) = list(planner.map([masks[0]], depth=1))
    expect = make_plans(list(masks), 4, weights=[1, 2], **kw)
    assert isinstance(got, tuple) and [p.fingerprint() for p in got] == [p.fingerprint() for p in expect]
    assert single.fingerprint() == make_plan(masks[0], 4, **kw).fingerprint()
