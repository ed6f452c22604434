"""bench/bench_cost_model.py: its summary computes what its JSON says, and it scores a plan under another
cost model as make_plan would have simulated that plan there."""
import dataclasses

import pytest

from bench_scripts import load_bench
from blockattn.masks import MaskSpec
from blockattn.planner import CostModel, Topology, make_plan


def test_summary_geomeans_counts_and_extremes():
    bench = load_bench("bench_cost_model")
    model = next(iter(bench.MODELS))
    rows = [{model: {"own": own, "default_plan": default, "plan_s": s}}
            for own, default, s in ((1.0, 1.0, 1.0), (1.2, 1.8, 5.0), (1.1, 1.0, 2.0))]
    s = bench.summarize(rows, model)
    assert s["cases"] == 3 and s["default_plan_slower"] == 1 and s["default_plan_faster"] == 1
    assert s["own_over_bound_geomean"] == pytest.approx((1.2 * 1.1) ** (1 / 3))
    assert s["default_plan_over_bound_geomean"] == pytest.approx(1.8 ** (1 / 3))
    assert s["own_over_bound_max"] == pytest.approx(1.2) and s["default_plan_over_bound_max"] == pytest.approx(1.8)
    assert s["default_plan_over_own_max"] == pytest.approx(1.5)
    assert s["default_plan_over_own_min"] == pytest.approx(1.0 / 1.1)
    assert s["own_plan_s_median"] == pytest.approx(2.0)


def test_a_plan_scored_under_another_cost_model():
    bench = load_bench("bench_cost_model")
    spec = MaskSpec.documents([400, 1300, 60, 900])
    topology = Topology(ranks_per_node=2)
    heads = dict(num_q_heads=8, num_kv_heads=2, head_dim=64)
    plan = make_plan(spec, 4, block_size=64, topology=topology, **heads)
    model = CostModel.from_kernel_tflops(1500, 1200, topology=topology)
    rescored = dataclasses.replace(plan, cost_model=model).stats()
    assert bench.over_bound_under(plan, model) == pytest.approx(rescored["sim_over_bound"])
    # the same placement on 3x faster GPUs: its compute shrinks, its transfers do not
    assert rescored["lower_bound_fwd"] == pytest.approx(plan.stats()["lower_bound_fwd"] / 3)
    assert rescored["sim_time_fwd"] >= rescored["lower_bound_fwd"]
    assert bench.over_bound_under(plan, plan.cost_model) == pytest.approx(plan.stats()["sim_over_bound"])
