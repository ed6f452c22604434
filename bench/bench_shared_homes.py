"""What sharing one data placement costs: a global and a local (sliding-window) layer's plans on one batch.

A model that alternates global layers (causal documents) with local ones (the same documents under a
4096-token sliding window: Gemma 2 / 3, GPT-OSS, Mistral) shards its activations once per batch, so both
masks' plans need the same block homes (planner/shared_homes.py). On bench_planner's 128K-token batches
(seed 0: three Wikipedia, three long-tail) and configurations, for 1 local layer per global one and for
5 (Gemma 3), this prints and writes, per plan set, the weighted fwd + bwd time (layers x simulated time)
over that of the two masks planned apart (each on its own homes: the time without the constraint):
on the global plan's homes, on the local plan's, on dcp's homes for the joint mask, and what
``make_plans`` keeps (the least of the three), with its planning time (cold).

    python bench/bench_shared_homes.py [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from blockattn.masks import MaskSpec
from blockattn.planner import Topology, clear_plan_cache, make_plan, make_plans
from blockattn.planner.shared_homes import plan_candidates

from bench_planner import BLOCK, HEADS, SEQLENS, _geomean, draw_batches, warm_up_planner

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 4096
WEIGHTS = ((1, 1), (1, 5))  # (global layers, local layers)
CANDIDATES = ("global's homes", "local's homes", "joint homes")  # (plan_candidates' order: mask 0, mask 1, joint)


def _seconds(plan) -> float:
    stats = plan.stats()
    return float(stats["sim_time_fwd"] + stats["sim_time_bwd"])


def one_case(masks: list, world_size: int, ranks_per_node: int) -> dict:
    """Every candidate's weighted time over the separate plans', and make_plans' choice and planning time."""
    kw = dict(topology=Topology(ranks_per_node=ranks_per_node), block_size=BLOCK, check=False, **HEADS)
    alone = [make_plan(spec, world_size, **kw) for spec in masks]
    entry = {"world_size": world_size, "ranks_per_node": ranks_per_node,
             "over_bound_alone": [p.stats()["sim_over_bound"] for p in alone], "by_weights": {}}
    for weights in WEIGHTS:
        separate = sum(w * _seconds(p) for w, p in zip(weights, alone))
        candidates = plan_candidates(masks, world_size, weights=list(weights), **kw)
        clear_plan_cache()
        t0 = time.perf_counter()
        kept = make_plans(masks, world_size, weights=list(weights), **kw)
        planning = time.perf_counter() - t0
        chosen = next(i for i, (_, plans, _) in enumerate(candidates)
                      if torch.equal(plans[0].block_home, kept[0].block_home))
        entry["by_weights"][f"{weights[0]}:{weights[1]}"] = {
            "candidates_over_separate": {name: cost / separate for name, (_, _, cost) in zip(CANDIDATES, candidates)},
            "kept_over_separate": sum(w * _seconds(p) for w, p in zip(weights, kept)) / separate,
            "kept": CANDIDATES[chosen],
            "make_plans_s": planning, "kept_over_bound": [p.stats()["sim_over_bound"] for p in kept]}
    return entry


def summary(results: list) -> dict:
    """Per configuration and weights: geomean and max of each candidate's and the kept ratio, wins."""
    out = {}
    for r in results:
        for wkey, row in r["by_weights"].items():
            key = f"{r['world_size']} ({r['ranks_per_node']}) {wkey}"
            agg = out.setdefault(key, {"kept": [], "planning_s": [], "wins": {}, **{c: [] for c in CANDIDATES}})
            agg["kept"].append(row["kept_over_separate"])
            agg["planning_s"].append(row["make_plans_s"])
            agg["wins"][row["kept"]] = agg["wins"].get(row["kept"], 0) + 1
            for c in CANDIDATES:
                agg[c].append(row["candidates_over_separate"][c])
    table = {}
    for key, agg in out.items():
        table[key] = {name: {"geomean": _geomean(np.array(agg[name])), "max": float(np.max(agg[name]))}
                      for name in ("kept", *CANDIDATES)}
        table[key]["wins"] = agg["wins"]
        table[key]["make_plans_s_median"] = float(np.median(agg["planning_s"]))
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one batch per source, 8 and 16 ranks")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "bench_shared_homes.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    wiki = np.loadtxt(SEQLENS, dtype=np.int64)
    batches = draw_batches(rng, wiki, 128 * 1024, 1 if args.quick else 3)
    configs = [(8, 8), (16, 8)] + ([] if args.quick else [(16, 4), (32, 8)])
    warm_up_planner()
    results = []
    for (b, (src, lens)), (P, rpn) in tqdm([(bb, c) for bb in enumerate(batches) for c in configs], desc="plan sets"):
        T = sum(lens)
        docs = MaskSpec.documents(lens)
        entry = one_case([docs, docs & MaskSpec.sliding_window(T, WINDOW)], P, rpn)
        results.append({"source": src, "batch": b, **entry})
        clear_plan_cache()
    report = {"config": {"heads": HEADS, "block_size": BLOCK, "window": WINDOW, "weights": WEIGHTS,
                         "quick": args.quick, "host": platform.node()},
              "results": results, "summary": summary(results)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    for key, row in report["summary"].items():
        cells = "  ".join(f"{name} {row[name]['geomean']:.3f} ({row[name]['max']:.3f})" for name in ("kept", *CANDIDATES))
        print(f"{key:12s} {cells}  wins {row['wins']}  make_plans {row['make_plans_s_median']:.2f} s")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
