"""grad_comm_dtype: the dtype the dQ / dK / dV partials travel in, counted by the plan and the planner.

(The executed bf16 partials, with their error bound and bytes on the wire, are in test_distributed.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from test_distributed import random_plan

from blockattn.masks import MaskSpec
from blockattn.planner import PlanAhead, Topology, check_plan, clear_plan_cache, make_plan
from blockattn.planner.schedule import KIND_DKV, KIND_DQ

HEADS = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=16)


def test_gradient_partials_are_counted_in_grad_comm_dtype():
    spec = MaskSpec.documents([70, 13, 120, 1, 55, 40])
    # one random placement (tiles away from their q-block's home too, so dO rows travel beside the
    # partials), priced with both dtypes: the same rows
    f32, bf16 = (random_plan(spec, 4, seed=0, dtype=torch.bfloat16, grad_comm_dtype=g, **HEADS)
                 for g in (torch.float32, torch.bfloat16))  # (check_plan runs inside)
    assert torch.equal(f32.schedule.fwd, bf16.schedule.fwd) and torch.equal(f32.schedule.bwd, bf16.schedule.bwd)
    kinds = f32.schedule.bwd[:, 3].numpy()
    grads = np.isin(kinds, (KIND_DQ, KIND_DKV))
    assert grads.any() and (~grads).any(), "the case should send gradient partials and dO rows"
    b32, b16 = f32.transfer_bytes("bwd"), bf16.transfer_bytes("bwd")
    np.testing.assert_array_equal(b16[grads] * 2, b32[grads])
    np.testing.assert_array_equal(b16[~grads], b32[~grads])  # dO + lse + delta: unchanged
    np.testing.assert_array_equal(f32.transfer_bytes("fwd"), bf16.transfer_bytes("fwd"))
    assert bf16.stats()["sim_time_bwd"] < f32.stats()["sim_time_bwd"]
    assert f32.fingerprint() != bf16.fingerprint()  # ranks with different settings must not agree
    assert "gradient partials in bfloat16" in bf16.explain()


def test_dcp_plans_with_bf16_partials_are_consistent_and_cached_apart():
    clear_plan_cache()
    spec = MaskSpec.documents([300, 41, 500, 1, 170, 90])
    topo = Topology(ranks_per_node=2)
    f32 = make_plan(spec, 6, topology=topo, **HEADS)
    bf16 = make_plan(spec, 6, topology=topo, grad_comm_dtype=torch.bfloat16, **HEADS)
    assert bf16 is not f32 and bf16.grad_comm_dtype == torch.bfloat16 and f32.grad_comm_dtype == torch.float32
    check_plan(bf16)
    assert make_plan(spec, 6, topology=topo, grad_comm_dtype=torch.bfloat16, **HEADS) is bf16


@pytest.mark.parametrize("bad", [torch.float64, torch.int8, "bfloat16", None])
def test_unsupported_grad_comm_dtype_is_refused(bad):
    with pytest.raises(TypeError, match="grad_comm_dtype must be one of torch.float32"):
        make_plan(MaskSpec.causal(64), 2, grad_comm_dtype=bad, **HEADS)
    with pytest.raises(TypeError, match="grad_comm_dtype"):
        PlanAhead(2, grad_comm_dtype=bad, num_q_heads=4, num_kv_heads=2, head_dim=16)


def test_fp16_partials_only_for_fp16_models():
    with pytest.raises(ValueError, match="grad_comm_dtype=torch.float16 needs dtype=torch.float16"):
        make_plan(MaskSpec.causal(64), 2, dtype=torch.bfloat16, grad_comm_dtype=torch.float16, **HEADS)
    plan = make_plan(MaskSpec.causal(64), 2, dtype=torch.float16, grad_comm_dtype=torch.float16, **HEADS)
    assert plan.grad_comm_dtype == torch.float16
