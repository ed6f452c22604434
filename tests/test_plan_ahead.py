"""PlanAhead: plans built in a worker process are the plans make_plan builds here, in order, with
errors passed on and bad arguments refused before any work starts."""

from __future__ import annotations

import pytest
import torch

from blockattn.masks import MaskSpec
from blockattn.planner import PlanAhead, Topology, clear_plan_cache, make_plan

HEADS = dict(num_q_heads=4, num_kv_heads=2, head_dim=16)
PLAN = dict(HEADS, block_size=32, topology=Topology(ranks_per_node=2))


def strided_mod(q, k):
    return (k <= q) & ((q - k) % 3 != 1)


def fails_beyond_probe(q, k):
    if q.numel() > 4:  # passes from_mask_mod's 4 x 4 probe, fails when the worker classifies the mask
        raise ValueError("mask_mod failed on the full batch")
    return k <= q


@pytest.fixture(scope="module")
def planner():
    with PlanAhead(3, **PLAN) as pa:  # one spawn (a torch import) for the whole module
        yield pa


def specs():
    docs = [1, 130, 7, 300, 33]
    T = sum(docs)
    return [MaskSpec.documents(docs), MaskSpec.documents(docs) & MaskSpec.lambda_mask(T, 4, 40),
            MaskSpec.shared_question(100, [50, 1, 90]), MaskSpec.causal_blockwise(301, block=64),
            MaskSpec.from_mask_mod(strided_mod, 97) | MaskSpec.causal(97)]


@pytest.mark.parametrize("depth", [1, 3])
def test_map_yields_make_plans_plans_in_order(planner, depth):
    batch = specs()
    plans = list(planner.map(batch, depth=depth))
    assert len(plans) == len(batch)
    for spec, plan in zip(batch, plans):
        clear_plan_cache()
        here = make_plan(spec, 3, **PLAN)
        assert plan.mask_signature == spec.signature()
        assert plan.fingerprint() == here.fingerprint()
        assert plan.stats() == here.stats()


def test_worker_errors_reach_the_caller(planner):
    bad = MaskSpec.from_mask_mod(fails_beyond_probe, 200)
    future = planner.submit(bad)
    with pytest.raises(ValueError, match="failed on the full batch"):
        future.result(timeout=120)
    # the worker survives an error in one batch
    assert planner.submit(MaskSpec.causal(70)).result(timeout=120).total_len == 70


def test_bad_input_is_refused_before_planning(planner):
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        PlanAhead(4, num_q_heads=4, num_kv_heads=3, head_dim=16)
    with pytest.raises(ValueError, match="unknown strategy"):
        PlanAhead(4, strategy="ring-of-fire", **HEADS)
    with pytest.raises(ValueError, match="workers"):
        PlanAhead(4, workers=0, **HEADS)
    with pytest.raises(TypeError, match="module-level function"):
        planner.submit(MaskSpec.from_mask_mod(lambda q, k: k <= q, 50))
    with pytest.raises(TypeError, match="must be a blockattn MaskSpec"):
        planner.submit(torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="depth"):
        next(planner.map(specs(), depth=0))


def test_closed_planner_refuses_work():
    pa = PlanAhead(2, **HEADS)
    pa.close()
    with pytest.raises(RuntimeError, match="closed"):
        pa.submit(MaskSpec.causal(64))


def test_a_dead_worker_is_reported_not_hung():
    import os
    import signal

    with PlanAhead(2, **HEADS) as pa:
        pa.submit(MaskSpec.causal(64)).result(timeout=120)  # the worker is up
        for pid in list(pa._pool._processes):
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="worker process died"):
            for _ in pa.map([MaskSpec.causal(64)] * 3, timeout=120):
                pass
