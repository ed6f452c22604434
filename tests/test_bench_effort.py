"""bench/bench_effort.py's summary computes what its JSON says."""
import pytest

from bench_scripts import load_bench


def _row(full_over, fast_over, full_s, fast_s, same=False):
    plan = lambda over, s, fp: {"over_bound": over, "plan_s": s, "fingerprint": fp}  # noqa: E731
    return {"full": plan(full_over, full_s, "a"), "fast": plan(fast_over, fast_s, "a" if same else "b")}


def test_summary_geomean_max_differing_plans_and_per_case_speedup():
    bench = load_bench("bench_effort")
    rows = [_row(1.0, 1.0, 2.0, 2.0, same=True), _row(1.21, 1.44, 9.0, 1.0), _row(1.0, 1.1, 4.0, 1.0)]
    s = bench.summarize(rows)
    assert s["cases"] == 3 and s["plans_differ"] == 2
    assert s["full_over_bound_geomean"] == pytest.approx(1.21 ** (1 / 3))
    assert s["fast_over_bound_geomean"] == pytest.approx((1.44 * 1.1) ** (1 / 3))
    assert s["full_over_bound_max"] == pytest.approx(1.21) and s["fast_over_bound_max"] == pytest.approx(1.44)
    assert s["fast_over_full_max"] == pytest.approx(1.44 / 1.21)
    assert s["full_plan_s_median"] == pytest.approx(4.0) and s["fast_plan_s_median"] == pytest.approx(1.0)
    assert s["speedup_median"] == pytest.approx(4.0)  # per case 1, 9 and 4
