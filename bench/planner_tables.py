"""The README's planner tables, printed from bench_planner's, bench_hypergraph's and bench_shared_homes'
JSON (so the README quotes the committed runs, and tests/test_readme.py checks that it still does).

    python bench/planner_tables.py [configurations|masks|held-out|hypergraph|shared-homes] [JSON]

- ``configurations`` (default; bench/results/bench_planner.json): per world size / ranks per node, dcp
  over the lower bound, its speedup over zigzag and zigzag-ring, and its bytes against theirs.
- ``masks``: per mask and configuration, dcp's speedup over zigzag-ring (geomean, min) and over zigzag,
  next to the DCP paper's low end for that kind of mask.
- ``held-out`` (bench/results/bench_planner_seed1.json): the shorter table of another draw.
- ``hypergraph`` (bench/results/bench_hypergraph.json): dcp against the hypergraph partitioner.
- ``shared-homes`` (bench/results/bench_shared_homes.json): plans of a global and a local mask on one data
  placement against the two planned apart.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ORDER = ("8/8", "8/4", "16/8", "16/4", "32/8", "32/32")  # one node first, then by ranks
MASKS = (("causal_docs", "causal documents"), ("lambda_docs", "lambda"), ("shared_question", "shared question"),
         ("causal_blockwise", "causal_blockwise"))


def _label(cfg: str) -> str:
    P, rpn = cfg.split("/")
    return f"{P} ({rpn})"


def _one_node(cfg: str) -> bool:
    P, rpn = cfg.split("/")
    return int(rpn) >= int(P)


def _between_nodes(cfg: str, c: dict) -> str:
    return "-" if _one_node(cfg) else f"{c['inter_node_bytes_over_zigzag_geomean']:.2f}x"


def _speedup(x: float) -> str:
    """Three significant figures: 2.22, 11.8."""
    return f"{x:.2f}" if x < 10 else f"{x:.1f}"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _rows(by_cfg: dict):
    for cfg in ORDER:
        if cfg in by_cfg:
            yield cfg, by_cfg[cfg]


def configurations(report: dict) -> str:
    out = [_row(["ranks (per node)", "dcp / lower bound", "dcp vs zigzag", "dcp vs zigzag-ring",
                 "dcp bytes vs zigzag-ring", "dcp bytes vs zigzag: all / between nodes"]),
           _row(["---"] * 6)]
    for cfg, c in _rows(report["by_configuration"]):
        out.append(_row([
            _label(cfg),
            f"{c['dcp_over_lower_bound_geomean']:.3f} geomean, {c['dcp_over_lower_bound_max']:.2f} max, "
            f"{c['dcp_over_lower_bound_time_weighted']:.2f} weighted; imbalance <= {c['dcp_imbalance_max']:.2f}",
            f"{c['speedup_vs_zigzag_geomean']:.2f}x (min {c['speedup_vs_zigzag_min']:.2f}x)",
            f"{_speedup(c['speedup_vs_zigzag_ring_geomean'])}x",
            f"{c['bytes_over_zigzag_ring_geomean']:.2f}x",
            f"{c['bytes_over_zigzag_geomean']:.2f}x / {_between_nodes(cfg, c)}"]))
    return "\n".join(out)


def masks(report: dict) -> str:
    per_mask = report["by_mask_and_configuration"]
    cfgs = [cfg for cfg in ORDER if any(cfg in per_mask[m] for m, _ in MASKS if m in per_mask)]
    out = [_row(["mask (paper's low end)"] + [_label(cfg) for cfg in cfgs]), _row(["---"] * (len(cfgs) + 1))]
    for mask, name in MASKS:
        if mask not in per_mask:
            continue
        cells = [f"{name} ({per_mask[mask]['dcp_paper_low_end']:.2f}x)"]
        for cfg in cfgs:
            c = per_mask[mask].get(cfg)
            if c is None:
                cells.append("-")
                continue
            ring, low = _speedup(c["speedup_vs_zigzag_ring_geomean"]), _speedup(c["speedup_vs_zigzag_ring_min"])
            # one batch's cases that all tie (causal_blockwise: the same mask on every batch) show no min
            ring = f"{ring}x" if low == ring else f"{ring}x ({low})"
            cells.append(f"{ring} / {c['speedup_vs_zigzag_geomean']:.2f}x")
        out.append(_row(cells))
    return "\n".join(out)


def held_out(report: dict) -> str:
    out = [_row(["ranks (per node)", "dcp / lower bound", "dcp vs zigzag", "dcp bytes vs zigzag: all / between nodes"]),
           _row(["---"] * 4)]
    for cfg, c in _rows(report["by_configuration"]):
        out.append(_row([
            _label(cfg), f"{c['dcp_over_lower_bound_geomean']:.3f} / {c['dcp_over_lower_bound_max']:.2f}",
            f"{c['speedup_vs_zigzag_geomean']:.2f}x (min {c['speedup_vs_zigzag_min']:.2f}x)",
            f"{c['bytes_over_zigzag_geomean']:.2f}x / {_between_nodes(cfg, c)}"]))
    return "\n".join(out)


def _two_figures(x: float) -> str:
    """Two significant figures, no exponent: 0.28, 2.7, 15, 540."""
    return f"{float(f'{x:.2g}'):g}"


def _planning(ms: float, max_ms: float) -> str:
    """A median planning time and its max, in ms under 0.1 s: '15 ms (25)', '2.7 s (15)'."""
    if ms < 100:
        return f"{_two_figures(ms)} ms ({_two_figures(max_ms)})"
    return f"{_two_figures(ms / 1e3)} s ({_two_figures(max_ms / 1e3)})"


def hypergraph(report: dict) -> str:
    """bench_hypergraph's summary: dcp and the hypergraph partitioner over the bound, the partitioner's bytes
    against dcp's, the planning times of both."""
    out = [_row(["ranks (per node)", "dcp / bound: geomean (max)", "hypergraph / bound: geomean (max)",
                 "hypergraph bytes vs dcp: all / between nodes", "planning, median (max): dcp / hypergraph"]),
           _row(["---"] * 5)]
    by_cfg = {f"{e['world_size']}/{e['ranks_per_node']}": e for e in report["by_configuration"]}
    for cfg, e in _rows(by_cfg):
        dcp, hyper = e["dcp"], e["hypergraph"]
        inter = "-" if _one_node(cfg) else f"{hyper['bytes_inter_node_over_dcp_geomean']:.2f}x"
        out.append(_row([
            _label(cfg),
            f"{dcp['step_over_lower_bound_geomean']:.3f} ({dcp['step_over_lower_bound_max']:.2f})",
            f"{hyper['step_over_lower_bound_geomean']:.3f} ({hyper['step_over_lower_bound_max']:.3g})",
            f"{hyper['bytes_over_dcp_geomean']:.2f}x / {inter}",
            f"{_planning(dcp['plan_ms_median'], dcp['plan_ms_max'])} / "
            f"{_planning(hyper['plan_ms_median'], hyper['plan_ms_max'])}"]))
    return "\n".join(out)


def shared_homes(report: dict) -> str:
    """bench_shared_homes' summary: per configuration and global : local layers, the weighted time of the
    kept plans and of each candidate's over the masks planned apart, geomean (max), and make_plans' time."""
    first = next(iter(report["summary"].values()))
    names = [name for name, cell in first.items() if name != "kept" and isinstance(cell, dict) and "geomean" in cell]
    out = [_row(["ranks (per node), global : local layers", "kept", *names, "make_plans, median"]),
           _row(["---"] * (3 + len(names)))]
    for key, row in report["summary"].items():
        cfg, weights = key.rsplit(" ", 1)
        cells = [f"{row[name]['geomean']:.3f} ({row[name]['max']:.2f})" for name in ("kept", *names)]
        out.append(_row([f"{cfg}, {weights}", *cells, f"{_two_figures(row['make_plans_s_median'])} s"]))
    return "\n".join(out)


TABLES = {"configurations": (configurations, "bench_planner.json"), "masks": (masks, "bench_planner.json"),
          "held-out": (held_out, "bench_planner_seed1.json"), "hypergraph": (hypergraph, "bench_hypergraph.json"),
          "shared-homes": (shared_homes, "bench_shared_homes.json")}


def table(kind: str, path: str | Path | None = None) -> str:
    """The markdown table ``kind`` (a key of TABLES) of the JSON at ``path`` (default: its committed run)."""
    if kind not in TABLES:
        raise ValueError(f"unknown table {kind!r}; choose one of {sorted(TABLES)}")
    make, default = TABLES[kind]
    return make(json.loads(Path(path or RESULTS / default).read_text()))


if __name__ == "__main__":
    args = sys.argv[1:]
    print(table(args[0] if args else "configurations", args[1] if len(args) > 1 else None))
