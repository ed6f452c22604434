"""GPU benchmark: one rank's executor passes, as session 50 ran them and as they run now.

bench/bench_executor_traffic.py counts the device-memory bytes the in-place passes remove; this measures
them. For a rank of dcp's plan of a bench_planner batch (its rank program; random data of the plan's
sizes on the device: Llama-3-8B heads, bf16, blocks of 128), it times with CUDA events, median of
``--repeats``:

- every backward stage's dQ and dK/dV kernels: before, into fresh full-size fp32 buffers whose stage
  rows were then gathered and ``index_add_``-ed into the accumulators; now ``accumulate=True``;
- every received OUT partial: before, the running rows gathered, stacked with the partial, merged
  (``merge_partials``) and scattered back; now ``merge_into``;
- every received gradient partial (plans with bf16 partials): before ``index_add_`` of its fp32 copy;
  now ``add_grad_rows``;

and the peak of device memory each way. Both ways must give the same bits (checked on every case).
Writes bench/results/bench_executor_gpu.json.

    python bench/bench_executor_gpu.py            # CUDA: two 128K batches on 8 and 32 ranks
    python bench/bench_executor_gpu.py --smoke    # CPU, torch backend, a 4K-token batch: every path, once
    (--seqlens PATH: document lengths to draw from, default ../shared/data/wikipedia_seqlens.txt)
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from bench_planner import BLOCK, HEADS, SEQLENS, draw_batches, make_masks
from blockattn.backend import get_backend
from blockattn.distributed import _kernel_mask
from blockattn.planner import Topology, make_plan
from blockattn.planner.schedule import KIND_DKV, KIND_DQ, KIND_OUT
from blockattn.planner.placement import concatenated_ranges
from blockattn.rank_program import build_rank_program

RESULTS = Path(__file__).resolve().parent / "results" / "bench_executor_gpu.json"


def _timer(device: torch.device):
    """fn -> milliseconds of one call (CUDA events on a GPU, the wall clock on the CPU)."""
    def run(fn) -> float:
        if device.type != "cuda":
            t0 = time.perf_counter()
            fn()
            return 1e3 * (time.perf_counter() - t0)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)
    return run


def _work_rows(tiles, block: int, total: int, device) -> torch.Tensor:
    """Token rows of a tile list's work blocks (what the old path gathered and index-added)."""
    glob = tiles.work_glob.cpu().numpy().astype(np.int64)
    rows = concatenated_ranges(tiles.work_row.cpu().numpy(), np.minimum(block, total - glob))
    return torch.from_numpy(rows).to(device)


def _sections(prog, direction: str, kinds) -> list:
    return [sec for ex in prog.exchanges[direction] for secs in ex.recvs.values() for sec in secs if sec.kind in kinds]


def measure(plan, spec, rank: int, device: torch.device, backend, repeats: int) -> dict:
    """Before / after times (ms) and peak memory of one rank's passes (module docstring)."""
    bm = spec.block_mask(plan.block_size)
    prog = build_rank_program(plan, rank, bm, device)
    kmask = _kernel_mask(bm, device)
    hq, hkv, d, dtype = plan.num_q_heads, plan.num_kv_heads, plan.head_dim, plan.dtype
    g = torch.Generator(device="cpu").manual_seed(rank)
    rand = lambda *shape, dt=dtype: torch.randn(*shape, generator=g).to(device=device, dtype=dt)  # noqa: E731
    qb, dout = rand(prog.q_buf_rows, hq, d), rand(prog.q_buf_rows, hq, d)
    kb, vb = rand(prog.kv_buf_rows, hkv, d), rand(prog.kv_buf_rows, hkv, d)
    lse = rand(hq, prog.q_buf_rows, dt=torch.float32).abs() + 8.0  # (row sums of exp(s) above 1)
    delta = rand(hq, prog.q_buf_rows, dt=torch.float32) * 0.1
    stages = [st for st in prog.stages_bwd if st.q_tiles is not None]
    rows = [(_work_rows(st.q_tiles, plan.block_size, plan.total_len, device),
             _work_rows(st.kv_tiles, plan.block_size, plan.total_len, device)) for st in stages]
    args = (qb, kb, vb, dout, lse, delta)

    def grads():
        return (torch.zeros(prog.q_buf_rows, hq, d, dtype=torch.float32, device=device),
                torch.zeros(prog.kv_buf_rows, hkv, d, dtype=torch.float32, device=device),
                torch.zeros(prog.kv_buf_rows, hkv, d, dtype=torch.float32, device=device))

    def backward_before(dq, dk, dv):
        for st, (rq, rkv) in zip(stages, rows):
            dq_s = backend.attention_bwd_dq(*args, st.q_tiles, kmask)
            dq.index_add_(0, rq, dq_s[rq].to(torch.float32))
            dk_s, dv_s = backend.attention_bwd_dkdv(*args, st.kv_tiles, kmask)
            dk.index_add_(0, rkv, dk_s[rkv].to(torch.float32))
            dv.index_add_(0, rkv, dv_s[rkv].to(torch.float32))

    def backward_now(dq, dk, dv):
        for st in stages:
            backend.attention_bwd_dq(*args, st.q_tiles, kmask, out=dq, accumulate=True)
            backend.attention_bwd_dkdv(*args, st.kv_tiles, kmask, out=(dk, dv), accumulate=True)

    outs = _sections(prog, "fwd", (KIND_OUT,))
    parts = [(sec.rows, rand(sec.rows.numel(), hq, d), rand(hq, sec.rows.numel(), dt=torch.float32) + 8.0) for sec in outs]

    def merges_before(out, run_lse):
        for r, p, pl in parts:
            o, lo = backend.merge_partials([out[r], p], [run_lse[:, r], pl])
            out[r], run_lse[:, r] = o, lo

    def merges_now(out, run_lse):
        for r, p, pl in parts:
            backend.merge_into(out, run_lse, r, p, pl)

    grad_in = _sections(prog, "bwd", (KIND_DQ, KIND_DKV))
    grad_parts = [(sec.rows, rand(sec.rows.numel(), hq if sec.kind == KIND_DQ else hkv, d, dt=plan.grad_comm_dtype),
                   sec.kind) for sec in grad_in]

    def adds_before(dq, dk, dv):
        for r, p, kind in grad_parts:
            for dst in ((dq,) if kind == KIND_DQ else (dk, dv)):
                dst.index_add_(0, r, p.to(torch.float32))

    def adds_now(dq, dk, dv):
        for r, p, kind in grad_parts:
            for dst in ((dq,) if kind == KIND_DQ else (dk, dv)):
                backend.add_grad_rows(dst, r, p)

    timer = _timer(device)
    result = {"rank": rank, "q_buf_rows": prog.q_buf_rows, "kv_buf_rows": prog.kv_buf_rows,
              "backward_stages": len(stages), "out_sections": len(parts), "grad_sections": len(grad_parts)}
    for name, before, now, state in (
            ("backward", backward_before, backward_now, grads),
            ("out_merges", merges_before, merges_now,
             lambda: (rand(prog.q_buf_rows, hq, d), rand(hq, prog.q_buf_rows, dt=torch.float32) + 8.0)),
            ("grad_adds", adds_before, adds_now, grads)):
        start = state()
        results, times, peaks = [], {}, {}
        for label, fn in (("before", before), ("now", now)):
            samples = []
            for _ in range(repeats):
                bufs = tuple(t.clone() for t in start)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats(device)
                    base = torch.cuda.memory_allocated(device)
                samples.append(timer(lambda: fn(*bufs)))
                if device.type == "cuda":
                    peaks[label] = (torch.cuda.max_memory_allocated(device) - base) / 1e9
            results.append(bufs)
            times[label] = float(np.median(samples))
        # the same bits on the CPU; on a GPU the compiler may contract a multiply-add differently in the two
        # merge kernels, and fp32 atomics flush subnormals: recorded, and only a real difference raises
        same = all(torch.equal(a, b) for a, b in zip(*results))
        worst = max(float((a.float() - b.float()).abs().max()) / max(float(a.float().abs().max()), 1e-30)
                    for a, b in zip(*results) if a.numel())
        if worst > 1e-2:
            raise AssertionError(f"{name}: the passes of now differ from before by {worst:.3g} (relative)")
        result[name] = {"ms_before": times["before"], "ms_now": times["now"], "same_bits": same,
                        "max_relative_difference": worst,
                        **({"peak_gb_before": peaks["before"], "peak_gb_now": peaks["now"]} if peaks else {})}
    return result


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, torch backend, a 4K-token batch on 4 ranks")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--seqlens", default=str(SEQLENS), help="document lengths to draw from, one per line")
    args = ap.parse_args(argv)
    if args.smoke:
        device, backend, tokens, configs, repeats = torch.device("cpu"), get_backend("torch"), 4096, [(4, 4)], 1
        heads = dict(num_q_heads=4, num_kv_heads=2, head_dim=16)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_executor_gpu needs a CUDA GPU (or --smoke for the CPU check of every path)")
        device, backend, tokens, configs, repeats = torch.device("cuda"), get_backend("triton"), 128 * 1024, \
            [(8, 8), (32, 8)], args.repeats
        heads = HEADS
    batches = draw_batches(np.random.default_rng(0), np.loadtxt(args.seqlens, dtype=np.int64, ndmin=1), tokens, 1)
    rows = []
    for src, lens in batches:
        spec = make_masks(lens)["causal_docs"]
        for P, rpn in configs:
            for grad in (torch.float32, torch.bfloat16):
                plan = make_plan(spec, P, block_size=None if args.smoke else BLOCK, dtype=torch.bfloat16,
                                 topology=Topology(ranks_per_node=rpn), grad_comm_dtype=grad, **heads)
                row = {"source": src, "world_size": P, "ranks_per_node": rpn, "grad_comm_dtype": str(grad),
                       **measure(plan, spec, 0, device, backend, repeats)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                               "smoke": args.smoke, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    main()
