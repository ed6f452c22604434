"""What the executor's in-place accumulation saves: memory traffic, transient memory and launches per rank.

The distributed executor (blockattn/distributed.py) used to run each backward stage's dQ and dK/dV kernels
into fresh full-size fp32 buffers (zero-filled: every buffer row, not only the stage's), gather the
stage's work rows out of them and ``index_add_`` those into the accumulators; and to fold each received
OUT partial by gathering the running rows, stacking them with the partial, merging and scattering the
result back; and to sum each received dQ / dK / dV partial as ``index_add_`` of an fp32 copy of it. The
kernels now add in place (``accumulate=True``; ``merge_into``; ``add_grad_rows``), bit for bit the same
results. This benchmark counts, from the rank programs of real plans (the bench_planner batches: 128K
tokens, Llama-3-8B heads, bf16, blocks of 128, dcp's plans), the device-memory bytes those passes moved,
the fresh buffers they held and the launches they took, and prices the bytes at H200 HBM bandwidth
against the plan's simulated forward + backward attention time (which does not count them).

Per backward stage with tiles on the rank, with Z = every buffer row and W = the stage's work rows, in
elements of one fp32 gradient tensor (rows x heads x head dim): before, a zero fill (Z), the kernel's
store (W), a gather (read W, write W) and ``index_add_`` (read W, read W, write W) per gradient (dQ over
q rows, dK and dV over kv rows); now the kernel's read-add-write (2W): Z + 4W fewer, 4 bytes each. Per
received OUT partial of n rows, with U = n x heads x head dim elements of the activation dtype and L = n x
heads fp32: before, gather (2U, 2L), stack (4U, 4L), merge (3U, 3L), scatter (2U, 2L); now one pass (3U,
3L): 8U + 8L fewer. Per received gradient partial sent in bf16 (``--grad-comm-dtype bfloat16``), the
fp32 copy written and read again: 8 bytes per element fewer (none with fp32 partials, whose
``.to(float32)`` was no copy). Transient memory: the three fresh fp32 buffers of a backward stage (a floor: the
gathered rows came on top). Launches: per backward stage 3 fills, 3 gathers, 3 index_adds; per OUT
section 2 gathers, 2 stacks, 2 scatters; per bf16 gradient partial tensor its conversion.

    python bench/bench_executor_traffic.py [--quick] [--grad-comm-dtype bfloat16] [--out PATH]
"""
from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from bench_planner import BLOCK, HEADS, SEQLENS, draw_batches, make_masks
from blockattn.distributed import build_rank_program
from blockattn.planner import Topology, clear_plan_cache, make_plan
from blockattn.planner.schedule import KIND_DKV, KIND_DQ, KIND_OUT

RESULTS = Path(__file__).resolve().parent / "results" / "bench_executor_traffic.json"
HBM_BW = 4.8e12  # H200 HBM3e, bytes/s
DTYPE = torch.bfloat16


def _work_tokens(tiles, block: int, total: int) -> int:
    """Tokens of a tile list's work blocks (the last block may be short)."""
    glob = tiles.work_glob.to(torch.int64)
    return int((total - glob).clamp(max=block).sum())


def rank_savings(plan, rank: int, block_mask) -> dict:
    """Bytes, transient bytes and launches that rank ``rank``'s step no longer spends (module docstring)."""
    prog = build_rank_program(plan, rank, block_mask, torch.device("cpu"))
    hq, hkv, d = plan.num_q_heads, plan.num_kv_heads, plan.head_dim
    z_q, z_kv = prog.q_buf_rows * hq * d, prog.kv_buf_rows * hkv * d
    bwd_bytes, bwd_stages = 0, 0
    for stage in prog.stages_bwd:
        if stage.q_tiles is None:
            continue
        bwd_stages += 1
        w_q = _work_tokens(stage.q_tiles, plan.block_size, plan.total_len) * hq * d
        w_kv = _work_tokens(stage.kv_tiles, plan.block_size, plan.total_len) * hkv * d
        bwd_bytes += 4 * ((z_q + 4 * w_q) + 2 * (z_kv + 4 * w_kv))
    fwd_bytes, launches = 0, 9 * bwd_stages
    for exchange in prog.exchanges["fwd"]:
        for secs in exchange.recvs.values():
            for sec in secs:
                if sec.kind == KIND_OUT:
                    n = sec.rows.numel()
                    launches += 6
                    fwd_bytes += 8 * n * hq * d * DTYPE.itemsize + 8 * n * hq * 4
    if plan.grad_comm_dtype != torch.float32:
        for exchange in prog.exchanges["bwd"]:
            for secs in exchange.recvs.values():
                for sec in secs:
                    if sec.kind in (KIND_DQ, KIND_DKV):
                        tensors = 1 if sec.kind == KIND_DQ else 2
                        launches += tensors
                        bwd_bytes += 8 * sec.rows.numel() * (hq if sec.kind == KIND_DQ else hkv) * d * tensors
    return {"fwd_bytes": fwd_bytes, "bwd_bytes": bwd_bytes, "transient_bytes": 4 * (z_q + 2 * z_kv) if bwd_stages else 0,
            "launches": launches, "buffer_rows": [prog.q_buf_rows, prog.kv_buf_rows]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one batch per source, 8 ranks only")
    ap.add_argument("--grad-comm-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="dtype of the plans' dQ/dK/dV partials on the wire")
    ap.add_argument("--out", default=None, help="default bench/results/bench_executor_traffic.json "
                    "(bench_executor_traffic_bf16grad.json with --grad-comm-dtype bfloat16)")
    args = ap.parse_args(argv)
    grad = getattr(torch, args.grad_comm_dtype)
    if args.out is None:
        args.out = str(RESULTS if grad == torch.float32 else RESULTS.with_name("bench_executor_traffic_bf16grad.json"))
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    batches = draw_batches(rng, np.loadtxt(SEQLENS, dtype=np.int64), 128 * 1024, 1 if args.quick else 3)
    configs = [(8, 8)] + ([] if args.quick else [(32, 8)])
    masks = ("causal_docs", "lambda_docs")
    cases = []
    progress = tqdm(total=len(batches) * len(masks) * len(configs), desc="plans")
    for b, (src, lens) in enumerate(batches):
        specs = make_masks(lens)
        for mask in masks:
            spec = specs[mask]
            bm = spec.block_mask(BLOCK)
            for P, rpn in configs:
                progress.update(1)
                plan = make_plan(spec, P, block_size=BLOCK, topology=Topology(ranks_per_node=rpn), dtype=DTYPE,
                                 grad_comm_dtype=grad, **HEADS)
                per_rank = [rank_savings(plan, r, bm) for r in range(P)]
                stats = plan.stats()
                step = stats["sim_time_fwd"] + stats["sim_time_bwd"]
                busiest = max(per_rank, key=lambda x: x["fwd_bytes"] + x["bwd_bytes"])
                cases.append({
                    "source": src, "batch": b, "mask": mask, "world_size": P, "ranks_per_node": rpn,
                    "sim_step_ms": 1e3 * step,
                    "saved_gb_per_rank_max": (busiest["fwd_bytes"] + busiest["bwd_bytes"]) / 1e9,
                    "saved_fwd_gb_per_rank_max": max(x["fwd_bytes"] for x in per_rank) / 1e9,
                    "saved_bwd_gb_per_rank_max": max(x["bwd_bytes"] for x in per_rank) / 1e9,
                    "saved_hbm_ms_per_rank_max": 1e3 * (busiest["fwd_bytes"] + busiest["bwd_bytes"]) / HBM_BW,
                    "saved_over_step": (busiest["fwd_bytes"] + busiest["bwd_bytes"]) / HBM_BW / step,
                    "transient_gb_per_rank_max": max(x["transient_bytes"] for x in per_rank) / 1e9,
                    "launches_per_rank_max": max(x["launches"] for x in per_rank),
                    "buffer_rows_max": [max(x["buffer_rows"][i] for x in per_rank) for i in (0, 1)],
                })
                clear_plan_cache()
    progress.close()
    summary = {}
    for P, rpn in configs:
        rows = [c for c in cases if c["world_size"] == P]
        over = np.array([c["saved_over_step"] for c in rows])
        summary[f"{P} ({rpn})"] = {
            "saved_over_step_geomean": float(np.exp(np.log(over).mean())), "saved_over_step_max": float(over.max()),
            "saved_over_step_min": float(over.min()),
            "saved_gb_per_rank_median": float(np.median([c["saved_gb_per_rank_max"] for c in rows])),
            "transient_gb_per_rank_max": float(max(c["transient_gb_per_rank_max"] for c in rows)),
            "launches_per_rank_median": float(np.median([c["launches_per_rank_max"] for c in rows]))}
    report = {"config": {"heads": HEADS, "dtype": "bfloat16", "grad_comm_dtype": args.grad_comm_dtype,
                         "block_size": BLOCK, "tokens": 128 * 1024,
                         "hbm_bytes_per_s": HBM_BW, "quick": args.quick, "host": platform.node()},
              "cases": cases, "summary": summary}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    for c in cases:
        print(f"{c['source']:9s} {c['batch']} {c['mask']:11s} {c['world_size']:2d}  step {c['sim_step_ms']:6.2f} ms  "
              f"saved {c['saved_gb_per_rank_max']:5.2f} GB = {c['saved_hbm_ms_per_rank_max']:5.2f} ms "
              f"({100 * c['saved_over_step']:4.1f}% of the step)  transient {c['transient_gb_per_rank_max']:4.2f} GB  "
              f"launches {c['launches_per_rank_max']}")
    for name, s in summary.items():
        print(name, {k: round(v, 4) for k, v in s.items()})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
