"""What bf16 gradient partials cost in accuracy: dQ / dK / dV against float64, fp32 vs bf16 on the wire.

``make_plan(grad_comm_dtype=torch.bfloat16)`` sends the partial dQ / dK / dV of blocks computed away
from their home in bf16 (rounded once per partial and per relay hop, summed in fp32 at the home). This
runs one packed batch (real Wikipedia document lengths) in bf16 on spawned gloo ranks, "nodes" of 2
ranks so that dcp computes many tiles away from their homes, once with each wire dtype, and compares
the gradients with the float64 reference, beside the single-device bf16 run (the same kernels on one
rank: what the distributed result should match). Errors: max |g - g64| and ||g - g64|| / ||g64||.
JSON to bench/results/bench_grad_precision.json. Never a unit test.

    python bench/bench_grad_precision.py [--tokens 4096] [--world-size 6] [--masks documents,shared_question]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import tempfile
from pathlib import Path

import torch

from blockattn.demo import MASKS, free_port, load_seqlens, make_mask, pack_batch

RESULTS = Path(__file__).resolve().parent / "results" / "bench_grad_precision.json"
HEADS = dict(num_q_heads=8, num_kv_heads=2, head_dim=64)
WIRE = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _errors(got: list, ref: list) -> dict:
    out = {}
    for name, g, r in zip(("dq", "dk", "dv"), got, ref):
        diff = g.double() - r
        out[name] = {"max_abs": float(diff.abs().max()), "rel_l2": float(diff.norm() / r.norm().clamp_min(1e-300))}
    return out


def _worker(rank: int, args, port: int, path: str) -> None:
    import torch.distributed as dist

    from blockattn.attention import block_attention
    from blockattn.distributed import distributed_block_attention
    from blockattn.planner import Topology, make_plan
    from blockattn.reference import attention as reference

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world_size,
                            timeout=datetime.timedelta(seconds=900))
    try:
        seqlens, source = load_seqlens(None)
        docs = pack_batch(seqlens, args.tokens, seed=args.seed)
        topo = Topology(ranks_per_node=args.ranks_per_node)
        g = torch.Generator().manual_seed(args.seed + 17)
        rows = []
        for mask in args.masks:
            spec = make_mask(mask, args.tokens, docs)
            T = spec.total_len
            q, k, v, dout = (torch.randn(T, h, HEADS["head_dim"], generator=g).to(torch.bfloat16)
                             for h in (HEADS["num_q_heads"], HEADS["num_kv_heads"], HEADS["num_kv_heads"],
                                       HEADS["num_q_heads"]))
            row = {"mask": mask, "tokens": T, "documents": len(docs)}
            if rank == 0:
                leaves = [t.double().requires_grad_() for t in (q, k, v)]
                out64, _ = reference(*leaves, spec)
                out64.backward(dout.double())
                ref = [t.grad for t in leaves]
                del out64, leaves
                single = [t.clone().requires_grad_() for t in (q, k, v)]
                block_attention(*single, spec, backend="torch").backward(dout)
                row["single_device_bf16"] = _errors([t.grad for t in single], ref)
            for wire_name, wire in WIRE.items():
                plan = make_plan(spec, args.world_size, topology=topo, dtype=torch.bfloat16, grad_comm_dtype=wire,
                                 **HEADS)
                leaves = [plan.shard(t, rank).requires_grad_() for t in (q, k, v)]
                out = distributed_block_attention(*leaves, spec, plan, backend="torch")
                out.backward(plan.shard(dout, rank))
                grads = [plan.unshard(t.grad, group=dist.group.WORLD) for t in leaves]
                bwd = plan.schedule.bwd
                partials = int(((bwd[:, 3] == 4) | (bwd[:, 3] == 5)).sum())
                if rank == 0:
                    row[f"distributed_{wire_name}_partials"] = {
                        **_errors(grads, ref), "gradient_partials_sent": partials,
                        "bytes_bwd": plan.stats()["bytes_bwd"]}
            rows.append(row)
        if rank == 0:
            Path(path).write_text(json.dumps({"rows": rows, "seqlens_source": source}))
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--world-size", type=int, default=6)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--masks", default="documents,shared_question,causal_blockwise")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    args.masks = [m for m in args.masks.split(",") if m]
    unknown = [m for m in args.masks if m not in MASKS]
    if unknown:
        ap.error(f"unknown masks {unknown}; choose from {MASKS}")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(args, free_port(), path), nprocs=args.world_size, join=True)
        result = json.loads(Path(path).read_text())
    for row in result["rows"]:
        single = row["single_device_bf16"]
        for wire in WIRE:
            d = row[f"distributed_{wire}_partials"]
            # how much of the error the wire adds, against the single-device bf16 run
            d["rel_l2_over_single_device"] = {n: d[n]["rel_l2"] / max(single[n]["rel_l2"], 1e-300)
                                              for n in ("dq", "dk", "dv")}
    report = {"config": {**{k: v for k, v in vars(args).items() if k != "out"}, "heads": HEADS, "dtype": "bfloat16",
                         "host": platform.node()}, **result}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"{'mask':18s} {'grad':4s} {'single rel':>10s} {'fp32 wire':>10s} {'bf16 wire':>10s} {'bf16/single':>11s}")
    for row in report["rows"]:
        for n in ("dq", "dk", "dv"):
            s, f, b = (row[key][n]["rel_l2"] for key in ("single_device_bf16", "distributed_float32_partials",
                                                           "distributed_bfloat16_partials"))
            print(f"{row['mask']:18s} {n:4s} {s:10.2e} {f:10.2e} {b:10.2e} {b / s:11.2f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
