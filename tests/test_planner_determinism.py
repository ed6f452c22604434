"""Plans are identical across processes (hash seeds, import order) and unshard works over gloo."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from blockattn.masks import MaskSpec
from blockattn.planner import STRATEGIES, Topology, check_plan, make_plan
from blockattn.planner.check import PlanConsistencyError

HEADS = dict(num_q_heads=8, num_kv_heads=2, head_dim=32)

_SCRIPT = """
import sys
from blockattn.masks import MaskSpec
from blockattn.planner import make_plan, Topology
docs = [1, 700, 33, 2000, 5, 900, 1, 3000, 64]
specs = [MaskSpec.documents(docs), MaskSpec.documents(docs) & MaskSpec.lambda_mask(sum(docs), 16, 300),
         MaskSpec.shared_question(500, [300, 1, 900]), MaskSpec.causal_blockwise(3001, block=256)]
for strategy in sys.argv[1].split(","):
    for spec in specs:
        for P in (3, 5, 8):
            p = make_plan(spec, P, strategy=strategy, block_size=32, topology=Topology(ranks_per_node=4),
                          num_q_heads=8, num_kv_heads=2, head_dim=32)
            print(strategy, P, p.fingerprint())
"""


def _fingerprints_in_subprocess(hash_seed: str) -> list[str]:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _SCRIPT, ",".join(STRATEGIES)], env=env, capture_output=True,
                         text=True, timeout=300, check=True)
    return out.stdout.split("\n")


def test_fingerprint_identical_across_processes_and_hash_seeds():
    a = _fingerprints_in_subprocess("1")
    b = _fingerprints_in_subprocess("12345")
    assert len([line for line in a if line]) == len(STRATEGIES) * 4 * 3
    assert a == b
    # and equal to this process's plans
    docs = [1, 700, 33, 2000, 5, 900, 1, 3000, 64]
    p = make_plan(MaskSpec.documents(docs), 5, strategy="dcp", block_size=32, topology=Topology(ranks_per_node=4),
                  **HEADS)
    assert f"dcp 5 {p.fingerprint()}" in a


def test_fingerprint_changes_with_placement():
    spec = MaskSpec.documents([100, 900, 5, 400])
    fps = {make_plan(spec, 3, strategy=s, block_size=32, **HEADS).fingerprint() for s in STRATEGIES}
    assert len(fps) >= 4  # allgather may equal zigzag's placement but not its stages


def test_check_plan_detects_corruption():
    import dataclasses

    spec = MaskSpec.causal(700)
    plan = make_plan(spec, 3, strategy="dcp", block_size=32, **HEADS)
    check_plan(plan)
    moved_rank = plan.tile_rank.clone()
    i = int(torch.nonzero(plan.tile_stage > 0)[0])
    moved_rank[i] = (moved_rank[i] + 1) % 3
    with pytest.raises(PlanConsistencyError):
        check_plan(dataclasses.replace(plan, tile_rank=moved_rank))
    early = plan.tile_stage.clone()
    early[i] = 0
    with pytest.raises(PlanConsistencyError):
        check_plan(dataclasses.replace(plan, tile_stage=early))
    with pytest.raises(PlanConsistencyError):
        check_plan(dataclasses.replace(plan, local_blocks=tuple(reversed(plan.local_blocks))))


def test_check_plan_rejects_corrupted_schedules_with_a_message():
    """Rows naming a rank, block or kind that cannot exist, or out of wire order (the order both ends
    of a transfer read their slice in), are PlanConsistencyErrors saying so, not IndexErrors."""
    import dataclasses

    from blockattn.planner.schedule import KIND_DO, KIND_KV, CommSchedule

    plan = make_plan(MaskSpec.documents([300, 41, 500]), 3, strategy="dcp", block_size=32, **HEADS)
    fwd = plan.schedule.fwd
    assert fwd.shape[0] >= 2 and bool((fwd[:, 3] == KIND_KV).any())

    def with_fwd(table):
        sched = CommSchedule(fwd=table, bwd=plan.schedule.bwd, num_stages=plan.num_stages,
                             world_size=plan.world_size)
        return dataclasses.replace(plan, schedule=sched)

    for column, value, message in ((2, plan.world_size, "rank outside"), (4, plan.num_blocks, "block outside"),
                                   (3, KIND_DO, "kind other than Q, KV, OUT")):
        bad = fwd.clone()
        bad[0, column] = value
        with pytest.raises(PlanConsistencyError, match=message):
            check_plan(with_fwd(bad))
    with pytest.raises(PlanConsistencyError, match="differs from the one derived"):
        check_plan(with_fwd(fwd.flip(0)))  # same rows, not in wire order


def _unshard_worker(rank: int, world_size: int, init_file: str, result_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        spec = MaskSpec.documents([1, 130, 7, 300, 45])
        plan = make_plan(spec, world_size, strategy="dcp", block_size=32, **HEADS)
        g = torch.Generator().manual_seed(0)
        full = torch.randn(spec.total_len, 2, 3, generator=g)
        lse = torch.randn(2, spec.total_len, generator=g)
        out = plan.unshard(plan.shard(full, rank), group=dist.group.WORLD)
        out_lse = plan.unshard(plan.shard(lse, rank, dim=1), group=dist.group.WORLD, dim=1)
        ok = torch.equal(out, full) and torch.equal(out_lse, lse)
        sizes = {plan.local_len(r) for r in range(world_size)}
        if rank == 0:
            with open(result_file, "w") as f:
                f.write(f"{ok} {len(sizes) > 1}")
    finally:
        dist.destroy_process_group()


def test_unshard_collective_with_unequal_local_sizes():
    with tempfile.TemporaryDirectory() as tmp:
        init_file, result_file = os.path.join(tmp, "init"), os.path.join(tmp, "result")
        mp.spawn(_unshard_worker, args=(3, init_file, result_file), nprocs=3, join=True)
        with open(result_file) as f:
            assert f.read() == "True True"
