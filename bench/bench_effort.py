"""dcp's planning effort: ``make_plan(effort="fast")`` against the full search, plan for plan.

For the 1M-token / 64-rank Wikipedia batches (the planning benchmark's, drawn after its 128K batches
by seed, fp32 partials) and the 128K benchmark cases on several nodes (16 / 8, 32 / 8, 16 / 4) and on
32 ranks of one NVLink domain, it plans dcp with each effort, cold as for a new batch (tile extraction
included, block classification apart, no consistency check), and records the simulated fwd + bwd time
over the lower bound, the bytes and the planning time of each. Planning times are single runs on this
VM, which is noisy: compare the two efforts of one case, not runs.

    python bench/bench_effort.py [--seeds 0 1 2 3 4 5] [--quick] [--out bench/results/bench_effort.json]
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

from bench_planner import BLOCK, HEADS, SEQLENS, _geomean, draw_batches, make_masks, warm_up_planner, wiki_batch
from blockattn.masks import MaskSpec
from blockattn.planner import Topology, clear_plan_cache, make_plan

ROOT = Path(__file__).resolve().parents[1]
EFFORTS = ("full", "fast")
CONFIGS = ((16, 8), (32, 8), (16, 4), (32, 32))  # (ranks, ranks per node) of the 128K cases


def plan_both(spec: MaskSpec, world_size: int, ranks_per_node: int) -> dict:
    """{effort: over the bound, bytes, planning seconds, fingerprint, the search's steps with their plans'
    time over the bound} of one batch."""
    spec.block_mask(BLOCK)  # (classified once, apart from the planning time)
    out = {}
    for effort in EFFORTS:
        clear_plan_cache()
        t0 = time.perf_counter()
        plan = make_plan(spec, world_size, block_size=BLOCK, topology=Topology(ranks_per_node=ranks_per_node),
                         effort=effort, check=False, **HEADS)
        seconds = time.perf_counter() - t0
        s = plan.stats()
        out[effort] = {"over_bound": s["sim_over_bound"], "bytes": s["bytes_fwd"] + s["bytes_bwd"],
                       "plan_s": seconds, "fingerprint": plan.fingerprint()[:16],
                       "search": plan.search_over_bound()}
    clear_plan_cache()
    return out


def summarize(rows: list) -> dict:
    """Geomean / max over the bound per effort, how many plans differ, median planning time and the median
    per-case ratio of full to fast planning time."""
    over = {e: np.array([r[e]["over_bound"] for r in rows]) for e in EFFORTS}
    secs = {e: np.array([r[e]["plan_s"] for r in rows]) for e in EFFORTS}
    return {"cases": len(rows),
            "plans_differ": int(sum(r["full"]["fingerprint"] != r["fast"]["fingerprint"] for r in rows)),
            **{f"{e}_over_bound_geomean": _geomean(over[e]) for e in EFFORTS},
            **{f"{e}_over_bound_max": float(over[e].max()) for e in EFFORTS},
            "fast_over_full_max": float((over["fast"] / over["full"]).max()),
            **{f"{e}_plan_s_median": float(np.median(secs[e])) for e in EFFORTS},
            **{f"{e}_plan_s_max": float(secs[e].max()) for e in EFFORTS},
            "speedup_median": float(np.median(secs["full"] / secs["fast"]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5],
                    help="1M batches: the one drawn after the 128K batches of each seed (0: the bench's)")
    ap.add_argument("--quick", action="store_true", help="two 1M batches, one 128K batch per source")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "bench_effort.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    wiki = np.loadtxt(SEQLENS, dtype=np.int64)
    seeds = args.seeds[:2] if args.quick else args.seeds
    warm_up_planner()

    big = []
    for seed in tqdm(seeds, desc="1M / 64"):
        rng = np.random.default_rng(seed)
        draw_batches(rng, wiki, 128 * 1024, 3)  # (the bench's 128K batches come first from its rng)
        big.append({"seed": seed, **plan_both(MaskSpec.documents(wiki_batch(rng, wiki, 1 << 20)), 64, 8)})

    batches = draw_batches(np.random.default_rng(0), wiki, 128 * 1024, 1 if args.quick else 3)
    cases = [(b, src, name, spec, P, rpn) for b, (src, lens) in enumerate(batches)
             for name, spec in make_masks(lens).items() if name != "causal_blockwise" or src == "wikipedia"
             for P, rpn in CONFIGS]
    small = []
    for b, src, name, spec, P, rpn in tqdm(cases, desc="128K"):
        small.append({"batch": b, "source": src, "mask": name, "world_size": P, "ranks_per_node": rpn,
                      **plan_both(spec, P, rpn)})

    report = {"machine": platform.platform(), "block_size": BLOCK, "heads": HEADS,
              "summary": {"1M/64": summarize(big),
                          **{f"{P}/{rpn}": summarize([r for r in small if (r["world_size"], r["ranks_per_node"])
                                                      == (P, rpn)]) for P, rpn in CONFIGS}},
              "1M": big, "128K": small}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    for name, s in report["summary"].items():
        print(f"{name:>6}: over the bound full {s['full_over_bound_geomean']:.4f} (max {s['full_over_bound_max']:.3f}), "
              f"fast {s['fast_over_bound_geomean']:.4f} (max {s['fast_over_bound_max']:.3f}); "
              f"{s['plans_differ']} of {s['cases']} plans differ; planning median full {s['full_plan_s_median']:.3f} s, "
              f"fast {s['fast_plan_s_median']:.3f} s, per case {s['speedup_median']:.2f}x faster")


if __name__ == "__main__":
    main()
