"""The planner benchmark's per-configuration summary (the README's tables) computes what it says."""
import pytest

from bench_scripts import load_bench


def _bench_planner():
    return load_bench("bench_planner")


def _case(P, rpn, dcp_fwd, dcp_bwd, bound_fwd, bound_bwd, zigzag, ring, dcp_bytes, zz_bytes, ring_bytes,
          dcp_inter=0, zz_inter=0):
    def strategy(fwd, bwd, nbytes, imbalance=1.0, inter=0):
        return {"sim_time_fwd": fwd, "sim_time_bwd": bwd, "lower_bound_fwd": bound_fwd, "lower_bound_bwd": bound_bwd,
                "bytes_fwd": nbytes, "bytes_inter_node_fwd": inter, "compute_imbalance": imbalance}

    return {"world_size": P, "ranks_per_node": rpn, "strategies": {
        "dcp": strategy(dcp_fwd, dcp_bwd, dcp_bytes, 1.1, dcp_inter), "zigzag": strategy(zigzag, 0.0, zz_bytes, inter=zz_inter),
        "zigzag-ring": strategy(ring, 0.0, ring_bytes)}}


def test_by_configuration_geomean_max_and_time_weighted():
    bench = _bench_planner()
    results = [
        # a small batch 2x off its bound and a large one 1.1x off: geomean sqrt(2.2), weighted 12 / 10.5
        _case(16, 4, 0.5, 0.5, 0.25, 0.25, zigzag=2.0, ring=4.0, dcp_bytes=100, zz_bytes=50, ring_bytes=400,
              dcp_inter=10, zz_inter=40),
        _case(16, 4, 4.0, 7.0, 3.0, 7.0, zigzag=22.0, ring=44.0, dcp_bytes=400, zz_bytes=400, ring_bytes=1600,
              dcp_inter=100, zz_inter=100),
        _case(8, 8, 1.0, 1.0, 1.0, 1.0, zigzag=4.0, ring=4.0, dcp_bytes=1, zz_bytes=1, ring_bytes=1),
    ]
    summary = bench.by_configuration(results)
    assert list(summary) == ["8/8", "16/4"]
    c = summary["16/4"]
    assert c["cases"] == 2
    assert c["dcp_over_lower_bound_geomean"] == pytest.approx(2.2 ** 0.5)
    assert c["dcp_over_lower_bound_max"] == pytest.approx(2.0)
    assert c["dcp_over_lower_bound_time_weighted"] == pytest.approx(12.0 / 10.5)
    assert c["speedup_vs_zigzag_geomean"] == pytest.approx(2.0)  # 2 / 1 and 22 / 11
    assert c["speedup_vs_zigzag_min"] == pytest.approx(2.0)
    assert c["speedup_vs_zigzag_ring_geomean"] == pytest.approx(4.0)
    assert c["bytes_over_zigzag_geomean"] == pytest.approx(2.0 ** 0.5)
    assert c["bytes_over_zigzag_ring_geomean"] == pytest.approx(0.25)
    assert c["dcp_imbalance_max"] == pytest.approx(1.1)
    assert c["inter_node_bytes_over_zigzag_geomean"] == pytest.approx(0.5)  # 1/4 and 1
    assert c["inter_node_bytes_over_zigzag_max"] == pytest.approx(1.0)
    assert summary["8/8"]["dcp_over_lower_bound_time_weighted"] == pytest.approx(1.0)
    assert "inter_node_bytes_over_zigzag_geomean" not in summary["8/8"]  # (one node: no slow link)


def test_planning_summary_is_the_median_and_max_over_batches():
    bench = _bench_planner()
    rows = [{"source": "wikipedia", "tokens": 131072, "world_size": 8, "strategy": "dcp", "plan_ms_min": ms}
            for ms in (4.0, 30.0, 20.0)]
    rows.append({"source": "longtail", "tokens": 131072, "world_size": 8, "strategy": "dcp", "plan_ms_min": 9.0})
    by_source = {t["source"]: t for t in bench.planning_summary(rows)}
    assert by_source["wikipedia"] == {"source": "wikipedia", "tokens": 131072, "world_size": 8, "strategy": "dcp",
                                      "batches": 3, "plan_ms_median": 20.0, "plan_ms_max": 30.0}
    assert by_source["longtail"]["batches"] == 1 and by_source["longtail"]["plan_ms_median"] == 9.0


def test_by_mask_and_configuration_speedups_per_mask_and_configuration():
    bench = _bench_planner()
    results = [dict(_case(16, 4, 1.0, 1.0, 1.0, 1.0, zigzag=zz, ring=ring, dcp_bytes=1, zz_bytes=1, ring_bytes=1),
                    mask=mask)
               for mask, zz, ring in (("lambda_docs", 2.0, 8.0), ("lambda_docs", 8.0, 32.0), ("causal_docs", 3.0, 3.0))]
    results.append(dict(_case(8, 8, 1.0, 1.0, 1.0, 1.0, zigzag=4.0, ring=4.0, dcp_bytes=1, zz_bytes=1, ring_bytes=1),
                        mask="causal_docs"))
    out = bench.by_mask_and_configuration(results)
    assert list(out) == ["causal_docs", "lambda_docs"]
    assert out["lambda_docs"]["dcp_paper_low_end"] == 2.15 and out["causal_docs"]["dcp_paper_low_end"] == 1.19
    assert "8/8" not in out["lambda_docs"]  # (no lambda case there)
    c = out["lambda_docs"]["16/4"]  # dcp's step is 2: speedups 1 and 4, 4 and 16
    assert c["cases"] == 2
    assert c["speedup_vs_zigzag_geomean"] == pytest.approx(2.0) and c["speedup_vs_zigzag_min"] == pytest.approx(1.0)
    assert c["speedup_vs_zigzag_ring_geomean"] == pytest.approx(8.0)
    assert c["speedup_vs_zigzag_ring_min"] == pytest.approx(4.0)
    assert c["zigzag_ring_over_lower_bound_geomean"] == pytest.approx(8.0)  # 8 / 2 and 32 / 2
    assert out["causal_docs"]["8/8"]["speedup_vs_zigzag_geomean"] == pytest.approx(2.0)


def test_search_by_configuration_counts_the_steps_that_made_a_plan_faster():
    bench = _bench_planner()
    results = [
        {"world_size": 16, "ranks_per_node": 4,
         "dcp_search": [["candidates", 1.5], ["backward deferral", 1.2], ["polish", 1.2]]},
        {"world_size": 16, "ranks_per_node": 4,
         "dcp_search": [["candidates", 1.1], ["backward deferral", 1.1], ["polish", 1.0]]},
        {"world_size": 16, "ranks_per_node": 4,  # (a step first seen later still takes its place)
         "dcp_search": [["candidates", 1.0], ["backward deferral", 1.0], ["deal pass", 1.0], ["polish", 1.0]]},
        {"world_size": 8, "ranks_per_node": 8, "dcp_search": [["candidates", 1.02]]},
    ]
    summary = bench.search_by_configuration(results)
    assert list(summary) == ["8/8", "16/4"]
    steps = summary["16/4"]
    assert list(steps) == ["candidates", "backward deferral", "deal pass", "polish"]  # in the order they run
    assert steps["candidates"] == {"ran": 3, "faster": 0, "gain_when_faster": 0.0}
    assert steps["backward deferral"]["ran"] == 3 and steps["backward deferral"]["faster"] == 1
    assert steps["backward deferral"]["gain_when_faster"] == pytest.approx(0.25)  # 1.5 / 1.2
    assert steps["polish"]["faster"] == 1 and steps["polish"]["gain_when_faster"] == pytest.approx(0.1)
    assert summary["8/8"] == {"candidates": {"ran": 1, "faster": 0, "gain_when_faster": 0.0}}


def test_warm_up_plans_each_strategy_on_one_node_and_two_and_leaves_no_plan_cached(monkeypatch):
    """``warm_up_planner`` (the benches that time single plans call it first) plans its small batch with
    every strategy named, on one node of 8 ranks and on two of 4, and clears the plan cache after, so the
    timed plans start cold."""
    bench = _bench_planner()
    import blockattn.planner.api as api

    seen = []
    make_plan = bench.make_plan
    monkeypatch.setattr(bench, "make_plan", lambda spec, P, **kw: seen.append(
        (kw["strategy"], P, kw["topology"].ranks_per_node)) or make_plan(spec, P, **kw))
    bench.warm_up_planner(("zigzag", "fcp"))
    assert seen == [("zigzag", 8, 8), ("zigzag", 8, 4), ("fcp", 8, 8), ("fcp", 8, 4)]
    assert len(api._cache) == 0
