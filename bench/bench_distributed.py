"""Distributed block attention benchmark: dcp vs the baselines at larger sizes, and p2p vs all_to_all.

For each (mask, tokens) it runs blockattn.demo.run_comparison (spawned ranks, fwd + bwd, checked against
the single-device result, planned vs measured bytes, simulated H200 time, measured wall time), and, per
comm method, times the plan's exchanges alone (the same per-peer messages, no compute), which is how the
default wire method was chosen. JSON goes to bench/results/bench_distributed.json. Never a unit test.

    python bench/bench_distributed.py --tokens 16384 --masks documents,lambda --repeats 2
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from blockattn.demo import MASKS, STRATEGIES, DemoConfig, free_port, check_result, format_table, load_seqlens, \
    make_mask, pack_batch, run_comparison

RESULTS = Path(__file__).resolve().parent / "results" / "bench_distributed.json"


def _comm_worker(rank: int, cfg: DemoConfig, methods, repeats: int, port: int, out_path: str) -> None:
    """Time every forward and backward exchange of each strategy's plan with empty compute."""
    import torch.distributed as dist

    from blockattn.comms import StageExchange
    from blockattn.distributed import rank_program
    from blockattn.planner import make_plan

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cfg.world_size,
                            timeout=datetime.timedelta(seconds=600))
    try:
        seqlens, _ = load_seqlens(cfg.seqlens_file)
        spec = make_mask(cfg.mask, cfg.tokens, pack_batch(seqlens, cfg.tokens, seed=cfg.seed))
        rows = []
        for strategy in cfg.strategies:
            plan = make_plan(spec, cfg.world_size, strategy=strategy, num_q_heads=cfg.num_q_heads,
                             num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=getattr(torch, cfg.dtype),
                             grad_comm_dtype=getattr(torch, cfg.grad_comm_dtype),
                             block_size=cfg.block_size)
            prog = rank_program(plan, rank, spec.block_mask(plan.block_size), torch.device("cpu"))
            for method in methods:
                times = []
                for _ in range(repeats):
                    dist.barrier()
                    t0 = time.perf_counter()
                    for direction in ("fwd", "bwd"):
                        for j, ex in enumerate(prog.exchanges[direction]):
                            send = {p: [torch.empty(n, dtype=torch.uint8)] for p, n in ex.send_nbytes.items()}
                            StageExchange(send, ex.recv_nbytes, method=method, tag=j).post().wait()
                    dist.barrier()
                    times.append(time.perf_counter() - t0)
                rows.append({"strategy": strategy, "method": method, "comm_only_ms": 1e3 * float(np.median(times))})
        if rank == 0:
            Path(out_path).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def comm_only(cfg: DemoConfig, methods, repeats: int) -> list[dict]:
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "comm.json")
        mp.spawn(_comm_worker, args=(cfg, methods, repeats, free_port(), path), nprocs=cfg.world_size, join=True)
        return json.loads(Path(path).read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--tokens", type=int, nargs="+", default=[16384])
    p.add_argument("--masks", default="documents,lambda")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--heads", type=int, nargs=2, default=(8, 2))
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--comm-methods", default="p2p,a2a")
    p.add_argument("--backend", default=None, choices=("triton", "torch"))
    p.add_argument("--out", default=str(RESULTS))
    a = p.parse_args(argv)
    masks = [m for m in a.masks.split(",") if m]
    for m in masks:
        if m not in MASKS:
            p.error(f"unknown mask {m!r}; choose from {MASKS}")
    methods = [m for m in a.comm_methods.split(",") if m]
    results = {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
               "started": datetime.datetime.now(datetime.timezone.utc).isoformat(), "runs": []}
    failures = 0
    for tokens in a.tokens:
        for mask in masks:
            cfg = DemoConfig(world_size=a.world_size, tokens=tokens, mask=mask, num_q_heads=a.heads[0],
                             num_kv_heads=a.heads[1], head_dim=a.head_dim, dtype=a.dtype, repeats=a.repeats,
                             strategies=tuple(a.strategies.split(",")), backend=a.backend, comm_method=methods[0])
            print(f"\n== {mask}, {tokens} tokens, {a.world_size} ranks ==", flush=True)
            run = run_comparison(cfg)
            print(format_table(run))
            problems = check_result(run)
            failures += bool(problems)
            for msg in problems:
                print("MISMATCH:", msg)
            run["comm_only"] = comm_only(cfg, methods, a.repeats + 1)
            for row in run["comm_only"]:
                print(f"  exchanges only: {row['strategy']:<10} {row['method']}: {row['comm_only_ms']:.1f} ms")
            results["runs"].append(run)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
