"""dcp's placement against DCP's own method, a hypergraph partitioner (strategy="hypergraph", Mt-KaHyPar).

The benchmark batches of bench/bench_planner.py (the same seed: 128K tokens, three Wikipedia and
three long-tail batches; causal-document, lambda, shared-question and causal-blockwise masks) at
8 ranks (one node), 16 (8 and 4 per node) and 32 (8 per node). Per case and strategy (dcp,
hypergraph, zigzag): simulated forward + backward time over the lower bound, compute imbalance,
bytes in all and between nodes, and the planning time of one cold plan. Both placements are staged
and completed by the same code (planner/stages.py, planner/finish.py, relays on several nodes), so only the placement
differs. Summary per configuration: geomeans of the time over the bound and of the bytes against
dcp's, median planning time.

    python bench/bench_hypergraph.py [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

from bench_planner import BLOCK, HEADS, SEQLENS, _geomean, cases, draw_batches, warm_up_planner
from blockattn.planner import Topology, clear_plan_cache, make_plan

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = ("dcp", "hypergraph", "zigzag")


def measure(spec, world_size: int, topology: Topology, strategy: str) -> dict:
    """One cold plan: its time over the lower bound, imbalance, bytes and planning time."""
    clear_plan_cache()
    t0 = time.perf_counter()
    plan = make_plan(spec, world_size, strategy=strategy, block_size=BLOCK, topology=topology, check=False, **HEADS)
    plan_ms = 1e3 * (time.perf_counter() - t0)
    st = plan.stats()
    return {"step_over_lower_bound": st["sim_over_bound"],
            "compute_imbalance": st["compute_imbalance"], "memory_imbalance": st["memory_imbalance"],
            "bytes": st["bytes_fwd"] + st["bytes_bwd"],
            "bytes_inter_node": st["bytes_inter_node_fwd"] + st["bytes_inter_node_bwd"], "plan_ms": plan_ms}


def by_configuration(results: list) -> list:
    """Per (ranks, ranks per node): geomean of each strategy's time over the bound, geomean of its bytes
    (all, between nodes) over dcp's, median planning time."""
    groups = {}
    for r in results:
        groups.setdefault((r["world_size"], r["ranks_per_node"]), []).append(r["strategies"])
    out = []
    for (P, rpn), rows in groups.items():
        entry = {"world_size": P, "ranks_per_node": rpn, "cases": len(rows)}
        for name in STRATEGIES:
            col = [row[name] for row in rows]
            entry[name] = {
                "step_over_lower_bound_geomean": _geomean([c["step_over_lower_bound"] for c in col]),
                "step_over_lower_bound_max": max(c["step_over_lower_bound"] for c in col),
                "compute_imbalance_max": max(c["compute_imbalance"] for c in col),
                "bytes_over_dcp_geomean": _geomean([max(c["bytes"], 1) / max(row["dcp"]["bytes"], 1)
                                                    for c, row in zip(col, rows)]),
                "plan_ms_median": float(np.median([c["plan_ms"] for c in col])),
                "plan_ms_max": max(c["plan_ms"] for c in col),
            }
            if P > rpn:
                entry[name]["bytes_inter_node_over_dcp_geomean"] = _geomean(
                    [max(c["bytes_inter_node"], 1) / max(row["dcp"]["bytes_inter_node"], 1)
                     for c, row in zip(col, rows)])
        out.append(entry)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one batch per source, 8 and 16 ranks")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "bench_hypergraph.json"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(args.seed)
    wiki = np.loadtxt(SEQLENS, dtype=np.int64)
    T = 128 * 1024
    n_batches = 1 if args.quick else 3
    configs = [(8, 8), (16, 8)] + ([] if args.quick else [(16, 4), (32, 8)])
    warm_up_planner(STRATEGIES)
    results = []
    for b, src, _lens, mask_name, spec, P, rpn in cases(draw_batches(rng, wiki, T, n_batches), configs, "cases"):
        topo = Topology(ranks_per_node=rpn)
        results.append({"source": src, "batch": b, "mask": mask_name, "world_size": P, "ranks_per_node": rpn,
                        "strategies": {name: measure(spec, P, topo, name) for name in STRATEGIES}})
    from importlib.metadata import version

    report = {"config": {"heads": HEADS, "dtype": "bfloat16", "grad_comm_dtype": "float32", "block_size": BLOCK,
                         "tokens": T, "quick": args.quick, "seed": args.seed, "host": platform.node(),
                         "mtkahypar": version("mtkahypar")},
              "by_configuration": by_configuration(results), "results": results}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    for entry in report["by_configuration"]:
        print(f"{entry['world_size']} ranks, {entry['ranks_per_node']} per node ({entry['cases']} cases):")
        for name in STRATEGIES:
            s = entry[name]
            inter = (f", between nodes {s['bytes_inter_node_over_dcp_geomean']:.2f}x"
                     if "bytes_inter_node_over_dcp_geomean" in s else "")
            print(f"  {name:10s} time/bound geomean {s['step_over_lower_bound_geomean']:.3f} "
                  f"max {s['step_over_lower_bound_max']:.2f}; bytes vs dcp {s['bytes_over_dcp_geomean']:.2f}x{inter}; "
                  f"plan median {s['plan_ms_median']:.0f} ms (max {s['plan_ms_max']:.0f})")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
