"""Planner benchmark: strategies side by side on realistic packed batches (simulated H200 cluster).

For batches of 128K tokens drawn from real Wikipedia document lengths and from a long-tail
(LongAlign-like, 8K-64K) mix, and for causal-document, per-document lambda (sink 64, window 4096),
shared-question and causal-blockwise masks, at world sizes 8, 16, 32 (8 ranks per node, plus 8 and
16 at 4 per node and 32 on one NVLink domain), it plans every strategy and records compute imbalance,
bytes, simulated attention time (planner/cost_model.py) and the lower bound. It also times planning,
cold as for a new batch, at 128K tokens / 8 ranks (every batch) and 1M tokens / 64 ranks (block
classification, the lead's BlockMask, timed separately).

"zigzag-ring" is literal ring attention over the zigzag placement (every KV shard forwarded P-1
times, one peer per step), the baseline DCP reports its speedups against; "zigzag" is the same
placement inside this framework (each rank receives only the KV blocks it reads).

With ``--grad-comm-dtype bfloat16`` every plan (dcp and the baselines alike, and zigzag-ring's
rotating dK/dV accumulator) sends its gradient partials in bf16 instead of fp32
(``make_plan(grad_comm_dtype=...)``); the results go to bench_planner_bf16grad.json.

    python bench/bench_planner.py [--quick] [--grad-comm-dtype float32|bfloat16] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from blockattn.masks import MaskSpec
from blockattn.planner import Topology, clear_plan_cache, make_plan
from blockattn.planner.baselines import ring_rotation_bytes
from blockattn.planner.dcp import SEARCH_STEPS
from blockattn.planner.tiles import TileSet

ROOT = Path(__file__).resolve().parents[1]
SEQLENS = ROOT.parent / "shared" / "data" / "wikipedia_seqlens.txt"
HEADS = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)  # Llama-3-8B attention, bf16
STRATEGIES = ("ring", "zigzag", "allgather", "fcp", "dcp")
BLOCK = 128


def pack(lengths: np.ndarray, total: int) -> list[int]:
    """Consecutive documents until ``total`` tokens; the last one is truncated to fit."""
    out, used = [], 0
    for n in lengths.tolist():
        n = min(int(n), total - used)
        if n <= 0:
            break
        out.append(n)
        used += n
    if used < total:
        out.append(total - used)
    return out


def wiki_batch(rng, wiki: np.ndarray, total: int) -> list[int]:
    start = int(rng.integers(0, wiki.size - 1))
    return pack(np.roll(wiki, -start)[: max(64, total // 16)], total)


def longtail_batch(rng, total: int) -> list[int]:
    lengths = np.exp(rng.uniform(math.log(8192), math.log(65536), size=total // 8192 + 1)).astype(np.int64)
    return pack(lengths, total)


def draw_batches(rng, wiki: np.ndarray, total: int, n_batches: int) -> list:
    """(source, document lengths) of n Wikipedia then n long-tail batches: with the same seed, the same
    batches in every benchmark that draws them this way."""
    batches = [("wikipedia", wiki_batch(rng, wiki, total)) for _ in range(n_batches)]
    return batches + [("longtail", longtail_batch(rng, total)) for _ in range(n_batches)]


def cases(batches: list, configs: list, desc: str):
    """Yields (batch index, source, lengths, mask name, MaskSpec, world size, ranks per node) for every
    batch, mask of ``make_masks`` and (world size, ranks per node) of ``configs``, with a progress bar;
    causal_blockwise once per Wikipedia batch, as it does not depend on the document lengths."""
    progress = tqdm(total=len(batches) * 4 * len(configs), desc=desc)
    for b, (src, lens) in enumerate(batches):
        for mask_name, spec in make_masks(lens).items():
            for P, rpn in configs:
                progress.update(1)
                if mask_name == "causal_blockwise" and src != "wikipedia":
                    continue
                yield b, src, lens, mask_name, spec, P, rpn
    progress.close()


def warm_up_planner(strategies=("dcp",)) -> None:
    """Plan a small batch once with each strategy, on one node and on two, untimed: the first plan of a
    process loads the planner's compiled loops from numba's cache (~0.5 s), which a benchmark timing
    single plans would count in its first case."""
    spec = MaskSpec.documents([3000, 700, 9000, 2500, 1184])
    for strategy in strategies:
        for ranks_per_node in (8, 4):
            make_plan(spec, 8, strategy=strategy, block_size=BLOCK, topology=Topology(ranks_per_node=ranks_per_node),
                      check=False, **HEADS)
    clear_plan_cache()


def make_masks(lens: list[int]) -> dict:
    T = sum(lens)
    docs = MaskSpec.documents(lens)
    question = min(max(lens[0], 1024), 16384, T - 1)
    return {
        "causal_docs": docs,
        "lambda_docs": docs & MaskSpec.lambda_mask(T, 64, 4096),
        "shared_question": MaskSpec.shared_question(question, pack(np.asarray(lens[1:] + [T]), T - question)),
        "causal_blockwise": MaskSpec.causal_blockwise(T, block=4096, k_local=2),
    }


def literal_zigzag_ring(plan_zigzag, topology: Topology) -> dict:
    """Ring attention on the zigzag placement: P-1 steps, each forwarding a whole KV shard to the next
    rank while computing the tiles of the shard held (paper baseline)."""
    p, cm = plan_zigzag, plan_zigzag.cost_model
    P = p.world_size
    home = p.block_home.numpy().astype(np.int64)
    q, kv = p.tile_q.numpy().astype(np.int64), p.tile_kv.numpy().astype(np.int64)
    flops = cm.tile_flops(p.tile_pairs.numpy(), num_q_heads=p.num_q_heads, head_dim=p.head_dim)
    dist = (home[q] - home[kv]) % P
    compute = np.bincount(home[q] * P + dist, weights=flops, minlength=P * P).reshape(P, P) / cm.fwd_rate
    esize = torch.empty((), dtype=p.dtype).element_size()
    shard = max(p.local_len(r) for r in range(P)) * 2 * p.num_kv_heads * p.head_dim * esize
    crosses_node = P > topology.ranks_per_node
    step = shard / (topology.inter_bw if crosses_node else topology.intra_bw) + (
        topology.inter_lat if crosses_node else topology.intra_lat)
    # exchange j overlaps step j's compute and carries the shard of step j + 1 (planner/cost_model.py)
    comm = np.zeros((P, P + 1))
    comm[:, : P - 1] = step
    fwd = cm.overlapped_time(compute, comm).max()
    # backward: the dK/dV accumulator (fp32, or the plan's grad_comm_dtype) follows the KV shard around
    # the ring, one exchange behind (computed in step j, sent in exchange j + 1), and makes one last hop
    # home after the last step
    grad_esize = p.grad_comm_dtype.itemsize
    comm_bwd = comm.copy()
    comm_bwd[:, 1:] += step * grad_esize / esize
    bwd = cm.overlapped_time(compute * cm.bwd_flops_factor, comm_bwd).max()
    fwd_bytes = ring_rotation_bytes(p.total_len, P, num_kv_heads=p.num_kv_heads, head_dim=p.head_dim, element_size=esize)
    return {"sim_time_fwd": float(fwd), "sim_time_bwd": float(bwd), "bytes_fwd": fwd_bytes,
            "bytes_bwd": int(fwd_bytes * (1 + grad_esize / esize)), "compute_imbalance": float(compute.sum(1).max() / compute.sum(1).mean())}


def summarize(stats: dict) -> dict:
    keys = ("compute_imbalance", "memory_imbalance", "bytes_fwd", "bytes_bwd", "bytes_inter_node_fwd",
            "bytes_inter_node_bwd", "sim_time_fwd", "sim_time_bwd",
            "lower_bound_fwd", "lower_bound_bwd", "num_stages", "transfers")
    return {k: stats[k] for k in keys}


def search_by_configuration(results: list) -> dict:
    """Per world size / ranks per node and per step of dcp's search (in the order they run, SEARCH_STEPS): the
    plans it ran on, those it made faster, and its gain on those (geomean of the kept plan's time
    before over after, minus one)."""
    out = {}
    for P, rpn in sorted({(r["world_size"], r["ranks_per_node"]) for r in results}):
        steps = {}
        for r in results:
            if (r["world_size"], r["ranks_per_node"]) != (P, rpn):
                continue
            before = None
            for step, ratio in r.get("dcp_search", []):
                e = steps.setdefault(step, {"ran": 0, "faster": 0, "log_gain": 0.0})
                e["ran"] += 1
                if before is not None and ratio < before * (1 - 1e-9):
                    e["faster"] += 1
                    e["log_gain"] += math.log(before / ratio)
                before = ratio
        order = sorted(steps, key=lambda step: SEARCH_STEPS.index(step) if step in SEARCH_STEPS else len(SEARCH_STEPS))
        out[f"{P}/{rpn}"] = {step: {"ran": steps[step]["ran"], "faster": steps[step]["faster"],
                                    "gain_when_faster": (math.exp(steps[step]["log_gain"] / steps[step]["faster"]) - 1
                                                         if steps[step]["faster"] else 0.0)}
                             for step in order}
    return out


def time_planning(spec: MaskSpec, world_size: int, strategy: str, repeats: int, grad_comm_dtype) -> dict:
    t0 = time.perf_counter()
    bm = spec.block_mask(BLOCK)
    classify = time.perf_counter() - t0
    t0 = time.perf_counter()
    TileSet.from_block_mask(bm)
    extract = time.perf_counter() - t0
    times, cpu_times = [], []
    for _ in range(repeats):
        # cold, as a new batch: clear_plan_cache also forgets the TileSet (so tile extraction, the merged
        # copies and every per-batch memo count in the plan time); the BlockMask stays classified
        clear_plan_cache()
        t0, c0 = time.perf_counter(), time.process_time()
        plan = make_plan(spec, world_size, strategy=strategy, block_size=BLOCK, check=False,
                         grad_comm_dtype=grad_comm_dtype, **HEADS)
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)  # excludes time the shared CPU spent on others
    t0 = time.perf_counter()
    from blockattn.planner import check_plan

    check_plan(plan)
    check = time.perf_counter() - t0
    stats = plan.stats()
    return {"tokens": spec.total_len, "world_size": world_size, "strategy": strategy, "tiles": int(plan.tile_q.numel()),
            "step_over_lower_bound": stats["sim_over_bound"], "compute_imbalance": stats["compute_imbalance"],
            "plan_ms_min": 1e3 * min(times), "plan_ms_median": 1e3 * float(np.median(times)),
            "plan_cpu_ms_min": 1e3 * min(cpu_times),
            "block_classification_ms": 1e3 * classify, "tile_extraction_ms": 1e3 * extract, "check_plan_ms": 1e3 * check}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one batch per source, fewer configurations")
    ap.add_argument("--grad-comm-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="dtype of the dQ/dK/dV partials on the wire, for every strategy")
    ap.add_argument("--out", default=None, help="default bench/results/bench_planner.json "
                    "(bench_planner_bf16grad.json with --grad-comm-dtype bfloat16)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    grad = getattr(torch, args.grad_comm_dtype)
    if args.out is None:
        name = "bench_planner.json" if grad == torch.float32 else "bench_planner_bf16grad.json"
        args.out = str(ROOT / "bench" / "results" / name)
    torch.set_num_threads(1)
    rng = np.random.default_rng(args.seed)
    wiki = np.loadtxt(SEQLENS, dtype=np.int64)
    T = 128 * 1024
    n_batches = 1 if args.quick else 3
    # (32 ranks on one NVLink domain, as GH200 NVL32: the single-node planner at scale)
    configs = [(8, 8), (16, 8), (32, 8)] + ([] if args.quick else [(8, 4), (16, 4), (32, 32)])
    batches = draw_batches(rng, wiki, T, n_batches)

    results = []
    for b, src, lens, mask_name, spec, P, rpn in cases(batches, configs, "plans"):
        topo = Topology(ranks_per_node=rpn)
        entry = {"source": src, "batch": b, "mask": mask_name, "world_size": P, "ranks_per_node": rpn,
                 "documents": len(lens), "strategies": {}}
        for strategy in STRATEGIES:
            plan = make_plan(spec, P, strategy=strategy, block_size=BLOCK, topology=topo,
                             grad_comm_dtype=grad, **HEADS)
            entry["strategies"][strategy] = summarize(plan.stats())
            if strategy == "dcp":
                entry["dcp_search"] = plan.search_over_bound()
            if strategy == "zigzag":
                entry["strategies"]["zigzag-ring"] = literal_zigzag_ring(plan, topo)
        clear_plan_cache()
        results.append(entry)

    # What limits 4 nodes: the long-tail causal batches at 32 ranks / 8 per node, planned again with a
    # NIC as fast as NVLink (bandwidth and latency): the gap to the bound that is left is the planner's.
    nic = []
    for b, (src, lens) in enumerate(batches):
        if src != "longtail":
            continue
        spec = make_masks(lens)["causal_docs"]
        entry = {"batch": b, "mask": "causal_docs", "world_size": 32, "ranks_per_node": 8}
        for name, topo in (("nic_400gbps", Topology(ranks_per_node=8)),
                           ("nic_as_nvlink", Topology(ranks_per_node=8, inter_bw=450e9, inter_lat=5e-6))):
            st = make_plan(spec, 32, block_size=BLOCK, topology=topo, grad_comm_dtype=grad, **HEADS).stats()
            entry[name] = st["sim_over_bound"]
        clear_plan_cache()
        nic.append(entry)

    # planning time: 128K / 8 ranks (every batch of both sources: one batch alone misleads, a Wikipedia
    # batch with no document over a rank's share plans one candidate, most plan three) and 1M / 64 ranks
    timing = []
    repeats = 3 if args.quick else 5
    for b, (src, lens) in enumerate(batches):
        for strategy in ("dcp", "fcp", "zigzag"):
            timing.append({"source": src, "batch": b, **time_planning(MaskSpec.documents(lens), 8, strategy, repeats, grad)})
    big = wiki_batch(rng, wiki, 1 << 20)
    for strategy in ("dcp", "fcp", "zigzag"):
        timing.append({"source": "wikipedia", "batch": len(batches),
                       **time_planning(MaskSpec.documents(big), 64, strategy, repeats, grad)})

    report = {"config": {"heads": HEADS, "dtype": "bfloat16", "grad_comm_dtype": args.grad_comm_dtype, "block_size": BLOCK, "tokens": T, "quick": args.quick,
                         "seed": args.seed, "host": platform.node(), "cpu_threads": torch.get_num_threads()},
              "results": results, "planning_time": timing, "planning_time_by_source": planning_summary(timing),
              "summary": summary(results),
              "by_configuration": by_configuration(results),
              "by_mask_and_configuration": by_mask_and_configuration(results),
              "dcp_search_by_configuration": search_by_configuration(results),
              "step_over_lower_bound_by_nic_speed": nic}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print_report(report)
    print(f"wrote {out}")


def planning_summary(timing: list) -> list:
    """Per (source, tokens, ranks, strategy): the median and max over batches of each batch's fastest
    plan (``plan_ms_min``), and the batches' count."""
    groups = {}
    for t in timing:
        groups.setdefault((t["source"], t["tokens"], t["world_size"], t["strategy"]), []).append(t["plan_ms_min"])
    return [{"source": src, "tokens": tokens, "world_size": P, "strategy": strategy, "batches": len(ms),
             "plan_ms_median": float(np.median(ms)), "plan_ms_max": float(np.max(ms))}
            for (src, tokens, P, strategy), ms in groups.items()]


def _geomean(x: np.ndarray) -> float:
    return float(np.exp(np.mean(np.log(x))))


def _bytes_over_zigzag(s, key: str) -> np.ndarray:
    """dcp's ``key`` bytes over zigzag's per case (each at least 1, so a plan moving nothing counts as 1)."""
    return np.maximum(1, s("dcp", key)) / np.maximum(1, s("zigzag", key))


def _columns(rows: list):
    """(value, step) for these results: ``value(strategy, key)`` as a float array over the rows, and
    ``step(strategy)`` its forward + backward simulated time."""
    def value(name: str, key: str) -> np.ndarray:
        return np.array([r["strategies"][name][key] for r in rows], dtype=np.float64)

    def step(name: str) -> np.ndarray:
        return value(name, "sim_time_fwd") + value(name, "sim_time_bwd")

    return value, step


def summary(results: list) -> dict:
    """Per mask (and overall): geometric-mean speedup of dcp over zigzag and zigzag-ring, worst dcp
    time / lower bound, worst dcp imbalance, and dcp bytes relative to the baselines."""
    out = {}
    for mask in sorted({r["mask"] for r in results}) + ["all"]:
        rows = [r for r in results if mask in ("all", r["mask"])]
        s, step = _columns(rows)
        dcp_t, zz_t, ring_t = s("dcp", "sim_time_fwd"), s("zigzag", "sim_time_fwd"), s("zigzag-ring", "sim_time_fwd")
        out[mask] = {
            "cases": len(rows),
            # a training step's attention (forward + backward): what dcp minimizes
            "step_speedup_vs_zigzag_geomean": _geomean(step("zigzag") / step("dcp")),
            "step_speedup_vs_zigzag_min": float((step("zigzag") / step("dcp")).min()),
            "step_speedup_vs_zigzag_ring_geomean": _geomean(step("zigzag-ring") / step("dcp")),
            "step_dcp_over_lower_bound_max": float(
                (step("dcp") / (s("dcp", "lower_bound_fwd") + s("dcp", "lower_bound_bwd"))).max()),
            "speedup_vs_zigzag_geomean": _geomean(zz_t / dcp_t),
            "speedup_vs_zigzag_min": float((zz_t / dcp_t).min()),
            "speedup_vs_zigzag_ring_geomean": _geomean(ring_t / dcp_t),
            "speedup_vs_zigzag_ring_min": float((ring_t / dcp_t).min()),
            # the most any plan could gain over zigzag: zigzag's time over the lower bound
            "zigzag_over_lower_bound_geomean": _geomean(zz_t / s("zigzag", "lower_bound_fwd")),
            "speedup_bwd_vs_zigzag_geomean": _geomean(s("zigzag", "sim_time_bwd") / s("dcp", "sim_time_bwd")),
            "dcp_over_lower_bound_max": float((dcp_t / s("dcp", "lower_bound_fwd")).max()),
            "dcp_bwd_over_lower_bound_max": float((s("dcp", "sim_time_bwd") / s("dcp", "lower_bound_bwd")).max()),
            "dcp_imbalance_max": float(s("dcp", "compute_imbalance").max()),
            "dcp_bytes_over_zigzag_geomean": _geomean(_bytes_over_zigzag(s, "bytes_fwd")),
            "dcp_bytes_over_zigzag_max": float((s("dcp", "bytes_fwd") / np.maximum(1, s("zigzag", "bytes_fwd"))).max()),
            "dcp_bytes_over_zigzag_ring_max": float((s("dcp", "bytes_fwd") / s("zigzag-ring", "bytes_fwd")).max()),
            "fcp_speedup_vs_zigzag_geomean": _geomean(zz_t / s("fcp", "sim_time_fwd")),
        }
    return out


def by_configuration(results: list) -> dict:
    """Per world size / ranks per node (the README's tables), forward + backward: dcp time over the
    lower bound (geomean, max, and time-weighted: the sum of dcp's times over the sum of the bounds,
    what a run over these batches spends in attention), speedups over zigzag and zigzag-ring
    (geomean), and dcp's forward bytes over theirs (geomean); on several nodes also its forward bytes
    between nodes over zigzag's (geomean, max)."""
    out = {}
    for P, rpn in sorted({(r["world_size"], r["ranks_per_node"]) for r in results}):
        rows = [r for r in results if (r["world_size"], r["ranks_per_node"]) == (P, rpn)]
        s, step = _columns(rows)
        bound = s("dcp", "lower_bound_fwd") + s("dcp", "lower_bound_bwd")
        out[f"{P}/{rpn}"] = {
            "cases": len(rows),
            "dcp_over_lower_bound_geomean": _geomean(step("dcp") / bound),
            "dcp_over_lower_bound_max": float((step("dcp") / bound).max()),
            "dcp_over_lower_bound_time_weighted": float(step("dcp").sum() / bound.sum()),
            "dcp_imbalance_max": float(s("dcp", "compute_imbalance").max()),
            "speedup_vs_zigzag_geomean": _geomean(step("zigzag") / step("dcp")),
            "speedup_vs_zigzag_min": float((step("zigzag") / step("dcp")).min()),
            "speedup_vs_zigzag_ring_geomean": _geomean(step("zigzag-ring") / step("dcp")),
            "bytes_over_zigzag_geomean": _geomean(_bytes_over_zigzag(s, "bytes_fwd")),
            "bytes_over_zigzag_ring_geomean": _geomean(s("dcp", "bytes_fwd") / s("zigzag-ring", "bytes_fwd")),
        }
        if P > rpn:  # the slow links: NIC bytes (a relay's NVLink hop counts in the bytes above only)
            inter = _bytes_over_zigzag(s, "bytes_inter_node_fwd")
            out[f"{P}/{rpn}"]["inter_node_bytes_over_zigzag_geomean"] = _geomean(inter)
            out[f"{P}/{rpn}"]["inter_node_bytes_over_zigzag_max"] = float(inter.max())
    return out


# DCP's reported attention speedups over static context parallelism at the low end of its ranges:
# causal masks 1.19x, sparse masks (here lambda, shared question, causal_blockwise) 2.15x
DCP_PAPER_LOW_END = {"causal_docs": 1.19, "lambda_docs": 2.15, "shared_question": 2.15, "causal_blockwise": 2.15}


def by_mask_and_configuration(results: list) -> dict:
    """Per mask, per world size / ranks per node, forward + backward: dcp's speedup over zigzag (this
    framework's, receiving only the KV it reads) and over zigzag-ring (ring attention on the zigzag
    placement, the static CP the DCP paper compares with), geomean and min over the batches, next to
    the paper's low-end speedup for that kind of mask (``DCP_PAPER_LOW_END``), and zigzag-ring's time
    over the lower bound (the most any plan could gain over it)."""
    out = {}
    for mask in sorted({r["mask"] for r in results}):
        out[mask] = {"dcp_paper_low_end": DCP_PAPER_LOW_END.get(mask)}
        for P, rpn in sorted({(r["world_size"], r["ranks_per_node"]) for r in results}):
            rows = [r for r in results if r["mask"] == mask and (r["world_size"], r["ranks_per_node"]) == (P, rpn)]
            if not rows:
                continue
            s, step = _columns(rows)
            zz, ring = step("zigzag") / step("dcp"), step("zigzag-ring") / step("dcp")
            bound = s("dcp", "lower_bound_fwd") + s("dcp", "lower_bound_bwd")
            out[mask][f"{P}/{rpn}"] = {"cases": len(rows),
                                       "speedup_vs_zigzag_geomean": _geomean(zz), "speedup_vs_zigzag_min": float(zz.min()),
                                       "speedup_vs_zigzag_ring_geomean": _geomean(ring),
                                       "speedup_vs_zigzag_ring_min": float(ring.min()),
                                       # the most any plan could gain over zigzag-ring
                                       "zigzag_ring_over_lower_bound_geomean": _geomean(step("zigzag-ring") / bound)}
    return out


def print_report(report: dict) -> None:
    print("forward + backward (a training step), per configuration:")
    print(f"{'P/per node':10s} {'cases':>5s} {'dcp/LB':>7s} {'max':>6s} {'weighted':>8s} {'zz/dcp':>7s} {'min':>6s} "
          f"{'zzR/dcp':>8s} {'B/zz':>6s} {'B/zzR':>6s} {'nodeB/zz':>8s}")
    for cfg, c in report["by_configuration"].items():
        print(f"{cfg:10s} {c['cases']:5d} {c['dcp_over_lower_bound_geomean']:7.3f} {c['dcp_over_lower_bound_max']:6.2f} "
              f"{c['dcp_over_lower_bound_time_weighted']:8.3f} {c['speedup_vs_zigzag_geomean']:7.2f} "
              f"{c['speedup_vs_zigzag_min']:6.2f} {c['speedup_vs_zigzag_ring_geomean']:8.2f} "
              f"{c['bytes_over_zigzag_geomean']:6.2f} {c['bytes_over_zigzag_ring_geomean']:6.2f} "
              f"{c.get('inter_node_bytes_over_zigzag_geomean', float('nan')):8.2f}")
    print("forward + backward (a training step), per mask:")
    print(f"{'mask':18s} {'cases':>5s} {'zz/dcp':>7s} {'min':>6s} {'zzR/dcp':>8s} {'dcp/LB':>7s}")
    for mask, s in report["summary"].items():
        print(f"{mask:18s} {s['cases']:5d} {s['step_speedup_vs_zigzag_geomean']:7.2f} {s['step_speedup_vs_zigzag_min']:6.2f} "
              f"{s['step_speedup_vs_zigzag_ring_geomean']:8.2f} {s['step_dcp_over_lower_bound_max']:7.3f}")
    print("forward only:")
    print(f"{'mask':18s} {'cases':>5s} {'dcp/zz':>7s} {'min':>6s} {'zz/LB':>6s} {'dcp/zzR':>8s} {'min':>6s} {'dcp/LB':>7s} "
          f"{'imb':>6s} {'B/zz':>6s} {'B/zzR':>6s} {'fcp/zz':>7s}")
    for mask, s in report["summary"].items():
        print(f"{mask:18s} {s['cases']:5d} {s['speedup_vs_zigzag_geomean']:7.2f} {s['speedup_vs_zigzag_min']:6.2f} "
              f"{s['zigzag_over_lower_bound_geomean']:6.2f} "
              f"{s['speedup_vs_zigzag_ring_geomean']:8.2f} {s['speedup_vs_zigzag_ring_min']:6.2f} "
              f"{s['dcp_over_lower_bound_max']:7.3f} {s['dcp_imbalance_max']:6.3f} {s['dcp_bytes_over_zigzag_max']:6.2f} "
              f"{s['dcp_bytes_over_zigzag_ring_max']:6.2f} {s['fcp_speedup_vs_zigzag_geomean']:7.2f}")
    print("forward + backward, per mask and configuration: dcp over zigzag / zigzag-ring, geomean (min), "
          "against the DCP paper's low end")
    for mask, per_cfg in report["by_mask_and_configuration"].items():
        cells = [f"{cfg} {c['speedup_vs_zigzag_geomean']:.2f} ({c['speedup_vs_zigzag_min']:.2f}) / "
                 f"{c['speedup_vs_zigzag_ring_geomean']:.2f} ({c['speedup_vs_zigzag_ring_min']:.2f})"
                 for cfg, c in per_cfg.items() if cfg != "dcp_paper_low_end"]
        print(f"{mask:18s} paper {per_cfg['dcp_paper_low_end']}: " + "; ".join(cells))
    print("dcp's search, per configuration: step faster / ran (gain when faster)")
    for cfg, steps in report["dcp_search_by_configuration"].items():
        print(f"{cfg:10s} " + "; ".join(f"{step} {e['faster']}/{e['ran']}"
                                         + (f" (+{100 * e['gain_when_faster']:.1f}%)" if e["faster"] else "")
                                         for step, e in steps.items()))
    for e in report["step_over_lower_bound_by_nic_speed"]:
        print(f"long-tail batch {e['batch']} causal_docs 32/8: fwd+bwd / bound {e['nic_400gbps']:.3f} at 400 Gb/s, "
              f"{e['nic_as_nvlink']:.3f} with the NIC as fast as NVLink")
    for t in report["planning_time"]:
        print(f"plan {t['source']:9s} batch {t['batch']} T={t['tokens']:8d} P={t['world_size']:2d} {t['strategy']:7s} "
              f"tiles={t['tiles']:7d} plan {t['plan_ms_min']:7.2f} ms (median {t['plan_ms_median']:7.2f}, "
              f"cpu {t['plan_cpu_ms_min']:7.2f}), classification "
              f"{t['block_classification_ms']:8.1f} ms, tile extraction {t['tile_extraction_ms']:6.1f} ms, check {t['check_plan_ms']:6.1f} ms; "
              f"fwd+bwd / bound {t['step_over_lower_bound']:.2f}")
    for t in report["planning_time_by_source"]:
        print(f"plan {t['source']:9s} T={t['tokens']:8d} P={t['world_size']:2d} {t['strategy']:7s} over {t['batches']} "
              f"batch(es): median {t['plan_ms_median']:8.2f} ms, max {t['plan_ms_max']:8.2f} ms")


if __name__ == "__main__":
    main()
