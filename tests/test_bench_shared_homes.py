"""bench/bench_shared_homes.py: one plan set's entry (every candidate no faster than the kept one, the kept
one named) and the summary's geomeans, maxima and wins."""
import pytest

from bench_scripts import load_bench
from blockattn import MaskSpec


def test_one_case_names_the_kept_candidate_and_no_candidate_beats_it():
    bench = load_bench("bench_shared_homes")
    lens = [3000, 1, 5000, 700, 2500]
    docs = MaskSpec.documents(lens)
    entry = bench.one_case([docs, docs & MaskSpec.sliding_window(sum(lens), 512)], 8, 4)
    assert set(entry["by_weights"]) == {"1:1", "1:5"}
    for row in entry["by_weights"].values():
        ratios = row["candidates_over_separate"]
        assert set(ratios) == set(bench.CANDIDATES) and row["kept"] in bench.CANDIDATES
        assert row["kept_over_separate"] == pytest.approx(min(ratios.values()))
        assert row["kept_over_separate"] == pytest.approx(ratios[row["kept"]])


def test_summary_geomean_max_and_wins():
    bench = load_bench("bench_shared_homes")
    row = lambda kept, ratios, s: {"kept": kept, "kept_over_separate": min(ratios), "make_plans_s": s,  # noqa: E731
                                   "candidates_over_separate": dict(zip(bench.CANDIDATES, ratios))}
    results = [{"world_size": 16, "ranks_per_node": 8, "by_weights": {"1:1": row("joint homes", (1.2, 1.5, 1.1), 2.0)}},
               {"world_size": 16, "ranks_per_node": 8, "by_weights": {"1:1": row("global's homes", (1.0, 1.3, 1.4), 4.0)}}]
    s = bench.summary(results)["16 (8) 1:1"]
    assert s["kept"]["geomean"] == pytest.approx((1.1 * 1.0) ** 0.5) and s["kept"]["max"] == pytest.approx(1.1)
    assert s["local's homes"]["max"] == pytest.approx(1.5)
    assert s["wins"] == {"joint homes": 1, "global's homes": 1} and s["make_plans_s_median"] == pytest.approx(3.0)
