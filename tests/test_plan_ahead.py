"""PlanAhead: plans built in a worker process are the plans make_plan builds here, in order, with
errors passed on and bad arguments refused before any work starts."""

from __future__ import annotations

import pytest
import torch
from spawn_gloo import spawn

from blockattn.masks import MaskSpec
from blockattn.planner import CostModel, PlanAhead, Topology, clear_plan_cache, make_plan, make_plans

HEADS = dict(num_q_heads=4, num_kv_heads=2, head_dim=16)
# (a cost model other than the default H200's: the workers plan for the one given)
PLAN = dict(HEADS, block_size=32,
            cost_model=CostModel.from_kernel_tflops(300, 200, topology=Topology(ranks_per_node=2)))


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
    with pytest.raises(ValueError, match="unknown effort"):
        PlanAhead(4, effort="thorough", **HEADS)
    with pytest.raises(TypeError, match="cost_model must be"):
        PlanAhead(4, cost_model=Topology(), **HEADS)
    with pytest.raises(ValueError, match="memory_slack must be in"):
        PlanAhead(4, memory_slack=-0.05, **HEADS)
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


# ----------------------------------------------------------------------------- planning shared by a group
def _shared_planning_world3(rank: int, world: int) -> None:
    """On every rank of a 3-rank gloo group: ``map(group=...)`` yields make_plan's plans in order while
    this rank plans only its batches (k % 3 == rank); disagreements and a failing batch raise the same
    error on every rank and leave the group usable."""
    import torch.distributed as dist

    docs = [[1, 130, 7, 300, 33], [64] * 8, [500, 12], [3, 3, 3, 400], [257], [100, 100, 100, 100], [37, 290]]
    batch = [MaskSpec.documents(d) for d in docs]
    with PlanAhead(3, **PLAN) as pa:
        planned_here = []
        submit = pa._submit_pickled
        pa._submit_pickled = lambda spec: planned_here.append(spec.signature()) or submit(spec)
        plans = list(pa.map(batch, depth=2, group=dist.group.WORLD))
        assert [plan.mask_signature for plan in plans] == [spec.signature() for spec in batch]
        for spec, plan in zip(batch, plans):
            clear_plan_cache()
            assert plan.fingerprint() == make_plan(spec, 3, **PLAN).fingerprint()
        assert planned_here == [spec.signature() for spec in batch[rank::world]]
        pa._submit_pickled = submit
        dist.barrier()

        # batches of two layer masks (tuples): each planned on shared homes by its owner, handed over whole
        layered = [(spec, spec & MaskSpec.sliding_window(spec.total_len, 64)) for spec in batch[:3]]
        for masks, got in zip(layered, pa.map(layered, group=dist.group.WORLD)):
            assert isinstance(got, tuple) and torch.equal(got[0].block_home, got[1].block_home)
            assert [p.fingerprint() for p in got] == [p.fingerprint() for p in make_plans(list(masks), 3, **PLAN)]
        dist.barrier()

        # batch 1's planning fails on its owner (rank 1): every rank raises it, after batch 0
        failing = [batch[0], MaskSpec.from_mask_mod(fails_beyond_probe, 200), batch[2]]
        got = []
        with pytest.raises(ValueError, match=r"failed on the full batch \(batch 1, planned by rank 1 of the group\)"):
            for plan in pa.map(failing, group=dist.group.WORLD):
                got.append(plan.mask_signature)
        assert got == [batch[0].signature()]
        dist.barrier()

        # rank 2 passes another batch 1: every rank raises, naming the ranks per mask
        mine = list(batch[:3])
        if rank == 2:
            mine[1] = MaskSpec.documents([64] * 7 + [63])
        with pytest.raises(ValueError, match=r"at batch 1 the ranks of the group pass different mask specs "
                                             r"\(ranks by mask signature: \[\[0, 1\], \[2\]\]\)"):
            list(pa.map(mine, group=dist.group.WORLD))
        dist.barrier()

        # rank 0 has one batch more than the others
        with pytest.raises(ValueError, match=r"at batch 2, ranks \[1, 2\] of the group have no batch left while "
                                             r"ranks \[0\] do"):
            list(pa.map(batch[:3] if rank == 0 else batch[:2], group=dist.group.WORLD))
        dist.barrier()

        # the owner of batch 0 gives up waiting: every rank raises TimeoutError
        with pytest.raises(TimeoutError, match=r"no plan after 1e-06 s.*\(batch 0, planned by rank 0 of the group\)"):
            list(pa.map([MaskSpec.documents([3000, 1000, 5])], timeout=1e-6, group=dist.group.WORLD))
        dist.barrier()

        # every rank stops consuming after the first plan and maps again: the first iteration ends
        # on every rank at the same batch, and the second one starts cleanly
        for plan in pa.map(batch, group=dist.group.WORLD):
            break
        assert [p.fingerprint() for p in pa.map(batch[:4], group=dist.group.WORLD)] == [
            p.fingerprint() for p in plans[:4]]

        # a subgroup (ranks 0 and 2): batches alternate between them, broadcast by global rank
        sub = dist.new_group([0, 2])
        if rank != 1:
            assert [p.fingerprint() for p in pa.map(batch[:3], group=sub)] == [p.fingerprint() for p in plans[:3]]
        else:
            with pytest.raises(ValueError, match=r"this rank \(1\) is not a member of the group \(ranks \[0, 2\]\)"):
                next(pa.map(batch[:3], group=sub))
        dist.barrier()

        # a group of one plans on this rank, as without a group
        alone = dist.new_group([rank], use_local_synchronization=True)
        assert [p.fingerprint() for p in pa.map(batch[:2], group=alone)] == [p.fingerprint() for p in plans[:2]]
        dist.barrier()

        # rank 1's worker dies: batch 1's planning is lost, and every rank says so
        if rank == 1:
            import os
            import signal

            for pid in list(pa._pool._processes):
                os.kill(pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match=r"worker process died.*\(batch 1, planned by rank 1 of the group\)"):
            list(pa.map(batch[:3], group=dist.group.WORLD))
    dist.barrier()

    # another PlanAhead over the same ranks (it hung while each PlanAhead made its own hand-over group),
    # closed while its shared iteration still runs (every rank leaves after the first plan)
    with PlanAhead(3, **PLAN) as pb:
        running = pb.map(batch, group=dist.group.WORLD)
        assert next(running).fingerprint() == plans[0].fingerprint()
    dist.barrier()
    with PlanAhead(3, **PLAN) as pc:
        assert [p.fingerprint() for p in pc.map(batch[:4], group=dist.group.WORLD)] == [
            p.fingerprint() for p in plans[:4]]
    dist.barrier()


def test_map_shares_planning_over_a_group_and_fails_alike_on_every_rank():
    spawn(_shared_planning_world3, 3)


def test_map_with_a_group_needs_torch_distributed(planner):
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="init_process_group first"):
        next(planner.map(specs(), group=object()))
