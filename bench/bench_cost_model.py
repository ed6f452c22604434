"""Planning for the hardware: dcp's plans made for a cost model against its plans made for the default one.

``make_plan(cost_model=...)`` plans for GPUs (or kernels) other than the default H200 ones. For the 128K
benchmark cases (seed 0's six batches, every mask) on 8 ranks of one node, 16 of 4 per node and 32 of
8 per node, and for each model of ``MODELS`` (the H200's links with slower attention kernels, 150 / 100
TFLOP/s forward / backward, or faster GPUs, 1500 / 1200, against the default 500 / 500), this plans dcp
once for that model and once for the default, and scores both under that model (the default's plan as
it is: its placement, stages and relays, timed on the other hardware). Fwd + bwd time over the lower
bound, bytes and the model's planning time (cold, no consistency check) per plan.

    python bench/bench_cost_model.py [--quick] [--out bench/results/bench_cost_model.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from bench_planner import BLOCK, HEADS, SEQLENS, _geomean, draw_batches, make_masks
from blockattn.planner import CostModel, Topology, clear_plan_cache, make_plan

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ((8, 8), (16, 4), (32, 8))  # (ranks, ranks per node)
# (forward, backward attention TFLOP/s) on the default links; the default is 500 / 500 (backward 2.5x as long)
MODELS = {"slower kernels (150 / 100 TFLOP/s)": (150.0, 100.0), "faster GPUs (1500 / 1200 TFLOP/s)": (1500.0, 1200.0)}


def over_bound_under(plan, cost_model: CostModel) -> float:
    """``plan``'s fwd + bwd simulated time over the lower bound, both under ``cost_model``."""
    return dataclasses.replace(plan, cost_model=cost_model).stats()["sim_over_bound"]


def plan_case(spec, world_size: int, ranks_per_node: int) -> dict:
    """{model: its own plan's and the default plan's time over the bound under it, their bytes, the own
    plan's planning seconds} of one case."""
    topology = Topology(ranks_per_node=ranks_per_node)
    spec.block_mask(BLOCK)  # (classified once, apart from the planning time)
    clear_plan_cache()
    default = make_plan(spec, world_size, block_size=BLOCK, topology=topology, check=False, **HEADS)
    default_stats = default.stats()
    default_bytes = default_stats["bytes_fwd"] + default_stats["bytes_bwd"]
    out = {}
    for name, (fwd, bwd) in MODELS.items():
        model = CostModel.from_kernel_tflops(fwd, bwd, topology=topology)
        clear_plan_cache()
        t0 = time.perf_counter()
        own = make_plan(spec, world_size, block_size=BLOCK, cost_model=model, check=False, **HEADS)
        seconds = time.perf_counter() - t0
        own_stats = own.stats()
        out[name] = {"own": own_stats["sim_over_bound"], "default_plan": over_bound_under(default, model),
                     "own_bytes": own_stats["bytes_fwd"] + own_stats["bytes_bwd"],
                     "default_plan_bytes": default_bytes, "plan_s": seconds}
    clear_plan_cache()
    return out


def summarize(rows: list, model: str) -> dict:
    """Geomean / max over the bound of the model's own plans and of the default's plans under it, and in how
    many cases the default's plan is slower / faster (and by how much at most)."""
    own = np.array([r[model]["own"] for r in rows])
    default = np.array([r[model]["default_plan"] for r in rows])
    ratio = default / own
    return {"cases": len(rows), "own_over_bound_geomean": _geomean(own), "own_over_bound_max": float(own.max()),
            "default_plan_over_bound_geomean": _geomean(default), "default_plan_over_bound_max": float(default.max()),
            "default_plan_slower": int((ratio > 1 + 1e-9).sum()), "default_plan_faster": int((ratio < 1 - 1e-9).sum()),
            "default_plan_over_own_max": float(ratio.max()), "default_plan_over_own_min": float(ratio.min()),
            "own_plan_s_median": float(np.median([r[model]["plan_s"] for r in rows]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one batch per source")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "bench_cost_model.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    wiki = np.loadtxt(SEQLENS, dtype=np.int64)
    batches = draw_batches(np.random.default_rng(0), wiki, 128 * 1024, 1 if args.quick else 3)
    cases = [(b, src, name, spec, P, rpn) for b, (src, lens) in enumerate(batches)
             for name, spec in make_masks(lens).items() if name != "causal_blockwise" or b == 0
             for P, rpn in CONFIGS]
    rows = []
    for b, src, name, spec, P, rpn in tqdm(cases, desc="cases"):
        rows.append({"batch": b, "source": src, "mask": name, "world_size": P, "ranks_per_node": rpn,
                     **plan_case(spec, P, rpn)})
    summary = {model: {f"{P}/{rpn}": summarize([r for r in rows if (r["world_size"], r["ranks_per_node"]) == (P, rpn)],
                                               model) for P, rpn in CONFIGS} for model in MODELS}
    report = {"machine": platform.platform(), "block_size": BLOCK, "heads": HEADS, "models_tflops": MODELS,
              "summary": summary, "cases": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    for model, per_config in summary.items():
        for config, s in per_config.items():
            print(f"{model}, {config:>5}: own plans {s['own_over_bound_geomean']:.3f} "
                  f"(max {s['own_over_bound_max']:.3f}), the default's "
                  f"{s['default_plan_over_bound_geomean']:.3f} (max {s['default_plan_over_bound_max']:.3f}) "
                  f"x the bound; the default's slower in {s['default_plan_slower']}, faster in "
                  f"{s['default_plan_faster']} of {s['cases']} (its time over the own plan's "
                  f"{s['default_plan_over_own_min']:.3f}-{s['default_plan_over_own_max']:.3f})")


if __name__ == "__main__":
    main()
