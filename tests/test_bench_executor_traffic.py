"""bench/bench_executor_traffic.py counts, from a rank program, what the plan itself says: buffer rows,
each backward stage's work rows and the OUT partials a rank receives (a random plan, so tiles run away
from their q-homes and OUT partials travel)."""
import pytest
import torch

from bench_scripts import load_bench
from blockattn import MaskSpec
from blockattn.planner.schedule import KIND_DKV, KIND_DQ, KIND_KV, KIND_OUT, KIND_Q
from test_distributed import random_plan


def _tokens(blocks, block_size, total_len):
    blocks = torch.as_tensor(blocks, dtype=torch.int64)
    return int((total_len - blocks * block_size).clamp(max=block_size).sum())


@pytest.mark.parametrize("grad_comm_dtype", [torch.float32, torch.bfloat16])
def test_rank_savings_follow_the_plans_buffers_stages_and_partials(grad_comm_dtype):
    bench = load_bench("bench_executor_traffic")
    T, B, world = 300, 32, 3
    spec = MaskSpec.documents([120, 37, 143]) & MaskSpec.sliding_window(T, 90)
    plan = random_plan(spec, world, seed=0, num_q_heads=4, num_kv_heads=2, head_dim=24, dtype=torch.bfloat16,
                       block_size=B, grad_comm_dtype=grad_comm_dtype)
    hq, hkv, d = 4, 2, 24
    fwd, bwd = plan.schedule.fwd.to(torch.int64), plan.schedule.bwd.to(torch.int64)
    rank, stage_bwd = plan.tile_rank.to(torch.int64), plan.tile_stage_bwd.to(torch.int64)
    tq, tkv = plan.tile_q.to(torch.int64), plan.tile_kv.to(torch.int64)
    received_out = 0
    for r in range(world):
        got = bench.rank_savings(plan, r, spec.block_mask(B))
        local = plan.local_len(r)
        q_rows = local + _tokens(fwd[(fwd[:, 2] == r) & (fwd[:, 3] == KIND_Q), 4], B, T)
        kv_rows = local + _tokens(fwd[(fwd[:, 2] == r) & (fwd[:, 3] == KIND_KV), 4], B, T)
        assert got["buffer_rows"] == [q_rows, kv_rows]
        want_bwd, stages = 0, 0
        for s in range(plan.num_stages):
            mine = (rank == r) & (stage_bwd == s)
            if not bool(mine.any()):
                continue
            stages += 1
            w_q = _tokens(torch.unique(tq[mine]), B, T) * hq * d
            w_kv = _tokens(torch.unique(tkv[mine]), B, T) * hkv * d
            want_bwd += 4 * (q_rows * hq * d + 4 * w_q + 2 * (kv_rows * hkv * d + 4 * w_kv))
        # received gradient partials: their fp32 copies, where they travel in bf16
        dq_in = bwd[(bwd[:, 2] == r) & (bwd[:, 3] == KIND_DQ)]
        dkv_in = bwd[(bwd[:, 2] == r) & (bwd[:, 3] == KIND_DKV)]
        bf16 = grad_comm_dtype == torch.bfloat16
        if bf16:
            want_bwd += 8 * (_tokens(dq_in[:, 4], B, T) * hq * d + 2 * _tokens(dkv_in[:, 4], B, T) * hkv * d)
        assert got["bwd_bytes"] == want_bwd
        out_rows = fwd[(fwd[:, 2] == r) & (fwd[:, 3] == KIND_OUT)]
        n = _tokens(out_rows[:, 4], B, T)
        assert got["fwd_bytes"] == 8 * n * hq * d * 2 + 8 * n * hq * 4
        sections = len({(int(s), int(src)) for s, src in out_rows[:, :2].tolist()})
        grad_sections = len({(int(s), int(src)) for s, src in dq_in[:, :2].tolist()}) + \
            2 * len({(int(s), int(src)) for s, src in dkv_in[:, :2].tolist()})
        assert got["launches"] == 9 * stages + 6 * sections + (grad_sections if bf16 else 0)
        assert got["transient_bytes"] == 4 * (q_rows * hq * d + 2 * kv_rows * hkv * d)
        received_out += n
    assert received_out > 0  # (the case exercises the forward's partials)
