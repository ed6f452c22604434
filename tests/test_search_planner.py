"""bench/search_planner.py: its batches are reproducible and its check finds what it is meant to find."""

from __future__ import annotations

import json

import numpy as np

from bench_scripts import load_bench
from blockattn.masks import MaskSpec
from blockattn.planner import candidates, clear_plan_cache, dcp

search = load_bench("search_planner")


def test_the_same_seed_draws_the_same_batches():
    wiki = np.array([5, 300, 1200, 40, 9000])
    assert search.draw_batch(np.random.default_rng(4), wiki)[2] == search.draw_batch(np.random.default_rng(4), wiki)[2]
    rng = np.random.default_rng(5)
    records = [search.draw_batch(rng, wiki)[2] for _ in range(30)]
    assert all(1 <= r["world_size"] <= 64 and r["tokens"] >= 1 for r in records)
    assert len({r["mask"] for r in records}) > 3
    large = [r for r in records if r["large"]]  # (one in eight: one node, planned on merged blocks)
    assert all(r["tokens"] >= 40000 for r in large) and all(r["tokens"] < 40000 for r in records if not r["large"])
    assert large and all(r["ranks_per_node"] == r["world_size"] >= 2 and r["block_size"] in (None, 128) for r in large)
    other = [r["hardware"] for r in records if r["hardware"] is not None]  # (one in four: other link and GPU speeds)
    assert 0 < len(other) < len(records) and all(h["fwd_tflops"] > 0 and h["inter_bw"] > 0 for h in other)


def test_a_batch_on_other_hardware_is_planned_and_scored_for_it():
    spec = MaskSpec.documents([700, 1500, 90, 2200])
    hardware = dict(intra_bw=64e9, inter_bw=12.5e9, intra_lat=0.0, inter_lat=100e-6, fwd_tflops=2000.0, bwd_tflops=40.0)
    args = dict(world_size=6, ranks_per_node=2, block_size=64, num_q_heads=8, num_kv_heads=2, head_dim=64,
                hardware=hardware)
    over, failure = search.check_batch(spec, args)
    assert failure is None and set(over) == {*search.STRATEGIES, search.SHARED_HOMES}, (failure, over)
    assert over != search.check_batch(spec, dict(args, hardware=None))[0]  # (the rates reach the plans)


def test_a_sliding_window_on_several_nodes_passes_and_fails_without_ring_among_the_baselines(monkeypatch):
    # the batch the search found dcp slower than ring on (docs/planner_log.md, session 41)
    spec = MaskSpec.sliding_window(27749, 2000)
    args = dict(world_size=5, ranks_per_node=1, block_size=128, num_q_heads=32, num_kv_heads=8, head_dim=128)
    over, failure = search.check_batch(spec, args)
    assert failure is None, (failure, over)
    for module in (candidates, dcp):  # (dcp.py imports the name)
        monkeypatch.setattr(module, "BASELINE_INITS", ("zigzag-ring", "zigzag-allgather"))
    clear_plan_cache()
    over, failure = search.check_batch(spec, args)
    clear_plan_cache()
    assert failure == "dcp slower than ring", (failure, over)


def test_the_search_writes_its_report(tmp_path, monkeypatch):
    batches = 2
    out = tmp_path / "search.json"
    # a seed whose first batches are small (the search draws up to 40K tokens on 64 ranks)
    lengths = tmp_path / "seqlens.txt"  # (the shared Wikipedia lengths lie outside a fresh clone)
    lengths.write_text("\n".join(str(n) for n in (3, 150, 700, 2400, 90)))
    monkeypatch.setattr("sys.argv", ["search_planner.py", "--seed", "1", "--batches", str(batches), "--out", str(out),
                                     "--seqlens", str(lengths)])
    monkeypatch.setattr(search, "WORLD_SIZES", (2, 3))
    search.main()
    report = json.loads(out.read_text())
    assert report["batches"] == batches and report["failures"] == []
    assert 0 <= report["other_hardware"] <= batches and 0 <= report["large_one_node"] <= batches
