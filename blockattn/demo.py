"""`make demo`: a realistic packed batch, planned by dcp and the baselines, run distributed on 4 ranks.

Packs real document lengths (../shared/data/wikipedia_seqlens.txt, else a generated long-tail mix) into
one batch with a causal per-document mask, plans it with every strategy, runs distributed block attention
forward and backward on `--world-size` processes (gloo on CPU; NCCL and the Triton kernels when that many
GPUs are present), checks output and q/k/v gradients against the single-device result and prints, per
strategy: compute imbalance, bytes moved (planned and measured on the wire), the simulated H200
attention time of the plan's cost model, and the measured wall time here.

Notation (docs/design.md): T tokens, B block size, P ranks, Hq / Hkv / D heads and head dim.
`run_comparison(config)` is shared with bench/bench_distributed.py.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

SEQLENS_FILE = Path(__file__).resolve().parent.parent / ".." / "shared" / "data" / "wikipedia_seqlens.txt"
STRATEGIES = ("dcp", "fcp", "ring", "zigzag", "allgather")
MASKS = ("documents", "lambda", "shared_question", "causal_blockwise")


@dataclass
class DemoConfig:
    world_size: int = 4
    tokens: int = 8192
    mask: str = "documents"
    num_q_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "bfloat16"
    grad_comm_dtype: str = "float32"  # dQ/dK/dV partials on the wire (make_plan's grad_comm_dtype)
    block_size: int | None = None  # planner default (128 at these sizes)
    strategies: tuple = STRATEGIES
    repeats: int = 1  # timed runs after one warm-up run per strategy
    comm_method: str = "p2p"
    backend: str | None = None  # None: "triton" on GPUs, "torch" on CPU (unless TRITON_INTERPRET=1)
    seqlens_file: str | None = None
    max_doc_len: int | None = None  # documents longer than this are split (default: no limit)
    seed: int = 0
    progress: bool = True
    extra: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- the batch
def load_seqlens(path: str | os.PathLike | None = None) -> tuple[np.ndarray, str]:
    """Document lengths from the Wikipedia file; a generated long-tail mix (said so) when it is absent."""
    p = Path(path) if path else SEQLENS_FILE
    if p.is_file():
        lens = np.array(p.read_text().split(), dtype=np.int64)
        lens = lens[lens > 0]
        if lens.size == 0:
            raise ValueError(f"{p} holds no positive document lengths (one integer per line expected)")
        return lens, str(p.resolve())
    if path is not None:
        raise FileNotFoundError(f"document length file {p} not found (one integer length per line expected)")
    rng = np.random.default_rng(1234)
    # Long tail like real corpora: mostly short documents, a few very long ones (lognormal, median ~500).
    lens = np.clip(np.rint(rng.lognormal(mean=6.2, sigma=1.3, size=100_000)), 1, 131072).astype(np.int64)
    return lens, f"generated long-tail mix (lognormal; {p} not found)"


def pack_batch(seqlens: np.ndarray, tokens: int, *, seed: int = 0, max_doc_len: int | None = None) -> list[int]:
    """Documents drawn at random (seeded) until `tokens` are filled; the last one is cut to fit."""
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    rng = np.random.default_rng(seed)
    docs, total = [], 0
    while total < tokens:
        n = int(seqlens[rng.integers(0, seqlens.size)])
        if max_doc_len:
            n = min(n, max_doc_len)
        n = min(n, tokens - total)
        docs.append(n)
        total += n
    return docs


def make_mask(kind: str, tokens: int, doc_lens: list[int]):
    """The demo's MaskSpec of `kind` over the packed batch."""
    from blockattn import MaskSpec

    if kind == "documents":
        return MaskSpec.documents(doc_lens)
    if kind == "lambda":
        return MaskSpec.lambda_mask(tokens, 64, min(4096, max(1, tokens // 8)))
    if kind == "shared_question":
        q = max(1, doc_lens[0])
        answers = [n for n in doc_lens[1:]] or [1]
        return MaskSpec.shared_question(q, answers)
    if kind == "causal_blockwise":
        return MaskSpec.causal_blockwise(tokens, block=256, k_local=2)
    raise ValueError(f"unknown mask {kind!r}; choose one of {MASKS}")


# ----------------------------------------------------------------------------- the run
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _device_setup(world: int) -> tuple[str, bool]:
    """(process-group backend, use GPUs): NCCL when every rank can have its own GPU."""
    use_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= world
    return ("nccl" if use_gpu else "gloo"), use_gpu


def _global_tensors(cfg: DemoConfig, T: int, dtype, device):
    g = torch.Generator().manual_seed(cfg.seed + 17)
    shapes = [(T, cfg.num_q_heads, cfg.head_dim), (T, cfg.num_kv_heads, cfg.head_dim),
              (T, cfg.num_kv_heads, cfg.head_dim), (T, cfg.num_q_heads, cfg.head_dim)]
    return [torch.randn(s, generator=g).to(dtype=dtype, device=device) for s in shapes]


def _timed(fn, device):
    """fn() timed wall-clock between two barriers (every rank waits for the slowest)."""
    import torch.distributed as dist

    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    return result, time.perf_counter() - t0


def _worker(rank: int, cfg: DemoConfig, port: int, result_path: str) -> None:
    import torch.distributed as dist

    pg_backend, use_gpu = _device_setup(cfg.world_size)
    if use_gpu:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.world_size))
    dist.init_process_group(pg_backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=cfg.world_size, timeout=datetime.timedelta(seconds=600))
    try:
        result = _compare(rank, cfg, pg_backend, torch.device("cuda", rank) if use_gpu else torch.device("cpu"))
        if rank == 0:
            Path(result_path).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _compare(rank: int, cfg: DemoConfig, pg_backend: str, device: torch.device) -> dict:
    import torch.distributed as dist
    from tqdm import tqdm

    from blockattn.attention import block_attention
    from blockattn.comms import count_bytes
    from blockattn.distributed import distributed_block_attention
    from blockattn.planner import make_plan

    dtype = getattr(torch, cfg.dtype)
    # Triton where it runs (GPU, or the interpreter when asked for); the torch backend on a plain CPU
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    backend = cfg.backend or ("triton" if device.type == "cuda" or interpreted else "torch")
    seqlens, source = load_seqlens(cfg.seqlens_file)
    docs = pack_batch(seqlens, cfg.tokens, seed=cfg.seed, max_doc_len=cfg.max_doc_len)
    spec = make_mask(cfg.mask, cfg.tokens, docs)
    T = spec.total_len
    q, k, v, dout = _global_tensors(cfg, T, dtype, device)
    heads = dict(num_q_heads=cfg.num_q_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=dtype,
                 grad_comm_dtype=getattr(torch, cfg.grad_comm_dtype))

    steps = len(cfg.strategies) * (2 + cfg.repeats) + 1
    bar = tqdm(total=steps, desc=f"{cfg.mask} T={T} P={cfg.world_size}", disable=rank != 0 or not cfg.progress,
               file=sys.stderr, leave=False)
    # The single-device result, on rank 0 only (the others wait at the barrier inside _timed).
    ref = None
    single_block = make_plan(spec, cfg.world_size, strategy="dcp", **heads, block_size=cfg.block_size).block_size

    def single_device():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = block_attention(*leaves, spec, backend=backend, block_size=single_block)
        out.backward(dout)
        return [out.detach()] + [t.grad for t in leaves]

    ref, single_s = _timed(single_device if rank == 0 else (lambda: None), device)
    bar.update()

    rows = []
    for strategy in cfg.strategies:
        bar.set_postfix_str(strategy)
        t0 = time.perf_counter()
        plan = make_plan(spec, cfg.world_size, strategy=strategy, block_size=cfg.block_size, **heads)
        plan_s = time.perf_counter() - t0
        stats = plan.stats()
        bar.update()

        def run():
            leaves = [plan.shard(t, rank).requires_grad_() for t in (q, k, v)]
            local_dout = plan.shard(dout, rank)
            with count_bytes() as sent_fwd:
                out, fwd_s = _timed(lambda: distributed_block_attention(
                    *leaves, spec, plan, backend=backend, comm_method=cfg.comm_method), device)
            with count_bytes() as sent_bwd:
                _, bwd_s = _timed(lambda: out.backward(local_dout), device)
            return out.detach(), [t.grad for t in leaves], sent_fwd.sent, sent_bwd.sent, fwd_s, bwd_s

        out, grads, sent_fwd, sent_bwd, _, _ = run()  # warm-up: builds the rank program, checks
        measured = torch.tensor([sent_fwd, sent_bwd], dtype=torch.int64, device=device)
        dist.all_reduce(measured)
        gathered = [plan.unshard(t, group=dist.group.WORLD) for t in [out] + grads]
        err = None
        if rank == 0:
            err = max(float((a.double() - b.double()).abs().max()) for a, b in zip(gathered, ref))
        bar.update()
        fwd_times, bwd_times = [], []
        for _ in range(cfg.repeats):
            *_, fwd_s, bwd_s = run()
            fwd_times.append(fwd_s)
            bwd_times.append(bwd_s)
            bar.update()
        rows.append({
            "strategy": strategy,
            "num_stages": plan.num_stages,
            "compute_imbalance": stats["compute_imbalance"],
            "memory_imbalance": stats["memory_imbalance"],
            "bytes_planned_fwd": stats["bytes_fwd"],
            "bytes_planned_bwd": stats["bytes_bwd"],
            "bytes_measured_fwd": int(measured[0]),
            "bytes_measured_bwd": int(measured[1]),
            "bytes_match": bool(int(measured[0]) == stats["bytes_fwd"] and int(measured[1]) == stats["bytes_bwd"]),
            "sim_h200_fwd_ms": stats["sim_time_fwd"] * 1e3,
            "sim_h200_bwd_ms": stats["sim_time_bwd"] * 1e3,
            "lower_bound_fwd_ms": stats["lower_bound_fwd"] * 1e3,
            "lower_bound_bwd_ms": stats["lower_bound_bwd"] * 1e3,
            "wall_fwd_ms": 1e3 * float(np.median(fwd_times)),
            "wall_bwd_ms": 1e3 * float(np.median(bwd_times)),
            "plan_ms": plan_s * 1e3,
            "max_abs_err_vs_single_device": err,
        })
    bar.close()
    return {
        "config": {**asdict(cfg), "strategies": list(cfg.strategies)},
        "total_len": T, "num_documents": len(docs), "longest_document": max(docs), "seqlens_source": source,
        "block_size": plan.block_size if cfg.strategies else None, "kernel_backend": backend,
        "process_group_backend": pg_backend, "device": str(device),
        "single_device_fwd_bwd_ms": single_s * 1e3, "strategies": rows,
    }


def run_comparison(cfg: DemoConfig) -> dict:
    """Spawn `cfg.world_size` processes, run every strategy, return rank 0's results."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(cfg, free_port(), path), nprocs=cfg.world_size, join=True)
        return json.loads(Path(path).read_text())


def tolerance(dtype: str) -> float:
    """Largest accepted max-abs difference from the single-device run (same backend, same dtype)."""
    return {"float32": 1e-4, "bfloat16": 6e-2, "float16": 1e-2}[dtype]


def format_table(result: dict) -> str:
    mib = 1 / 2**20
    head = (f"{'strategy':<10} {'stages':>6} {'imbal':>6} {'MiB fwd':>8} {'(meas.)':>8} {'MiB bwd':>8} {'(meas.)':>8} "
            f"{'H200 sim ms':>11} {'wall fwd ms':>11} {'wall bwd ms':>11} {'max err':>9}")
    lines = [head, "-" * len(head)]
    for r in result["strategies"]:
        sim = r["sim_h200_fwd_ms"] + r["sim_h200_bwd_ms"]
        err = "-" if r["max_abs_err_vs_single_device"] is None else f"{r['max_abs_err_vs_single_device']:.2e}"
        lines.append(
            f"{r['strategy']:<10} {r['num_stages']:>6} {r['compute_imbalance']:>6.3f} "
            f"{r['bytes_planned_fwd'] * mib:>8.2f} {r['bytes_measured_fwd'] * mib:>8.2f} "
            f"{r['bytes_planned_bwd'] * mib:>8.2f} {r['bytes_measured_bwd'] * mib:>8.2f} "
            f"{sim:>11.4f} {r['wall_fwd_ms']:>11.1f} {r['wall_bwd_ms']:>11.1f} {err:>9}")
    first = result["strategies"][0] if result["strategies"] else {"lower_bound_fwd_ms": 0, "lower_bound_bwd_ms": 0}
    lb = first["lower_bound_fwd_ms"] + first["lower_bound_bwd_ms"]
    lines.append(f"imbal = max/mean per-rank attention FLOPs; H200 sim = planner cost model fwd+bwd "
                 f"(lower bound {lb:.4f} ms); wall = measured here, {result['process_group_backend']} + "
                 f"{result['kernel_backend']} backend on {result['device']}")
    return "\n".join(lines)


def check_result(result: dict) -> list[str]:
    """Problems found (empty when every strategy matched the single-device result and its planned bytes)."""
    tol = tolerance(result["config"]["dtype"])
    problems = []
    for r in result["strategies"]:
        if not r["bytes_match"]:
            problems.append(f"{r['strategy']}: measured bytes {r['bytes_measured_fwd']}/{r['bytes_measured_bwd']} "
                            f"!= planned {r['bytes_planned_fwd']}/{r['bytes_planned_bwd']}")
        err = r["max_abs_err_vs_single_device"]
        if err is None or not math.isfinite(err) or err > tol:
            problems.append(f"{r['strategy']}: max |distributed - single device| = {err} > {tol}")
    return problems


def parse_args(argv=None) -> DemoConfig:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = DemoConfig()
    p.add_argument("--world-size", type=int, default=d.world_size)
    p.add_argument("--tokens", type=int, default=d.tokens)
    p.add_argument("--mask", choices=MASKS, default=d.mask)
    p.add_argument("--heads", type=int, nargs=2, default=(d.num_q_heads, d.num_kv_heads), metavar=("HQ", "HKV"))
    p.add_argument("--head-dim", type=int, default=d.head_dim)
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=d.dtype)
    p.add_argument("--grad-comm-dtype", choices=("float32", "bfloat16", "float16"), default=d.grad_comm_dtype,
                   help="dtype of the dQ/dK/dV partials sent between ranks")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--comm-method", choices=("p2p", "a2a"), default=d.comm_method)
    p.add_argument("--backend", choices=("triton", "torch"), default=None)
    p.add_argument("--seqlens-file", default=None)
    p.add_argument("--max-doc-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args(argv)
    strategies = tuple(s for s in a.strategies.split(",") if s)
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        p.error(f"unknown strategies {unknown}; choose from {STRATEGIES}")
    if a.world_size < 1 or a.tokens < 1 or a.repeats < 1:
        p.error("--world-size, --tokens and --repeats must be >= 1")
    cfg = DemoConfig(world_size=a.world_size, tokens=a.tokens, mask=a.mask, num_q_heads=a.heads[0],
                     num_kv_heads=a.heads[1], head_dim=a.head_dim, dtype=a.dtype, grad_comm_dtype=a.grad_comm_dtype,
                     block_size=a.block_size,
                     strategies=strategies, repeats=a.repeats, comm_method=a.comm_method, backend=a.backend,
                     seqlens_file=a.seqlens_file, max_doc_len=a.max_doc_len, seed=a.seed)
    cfg.extra["json"] = a.json
    return cfg


def main(argv=None) -> int:
    cfg = parse_args(argv)
    pg, use_gpu = _device_setup(cfg.world_size)
    where = f"{cfg.world_size} GPUs, NCCL" if use_gpu else f"{cfg.world_size} CPU processes, gloo"
    print(f"blockattn demo: {cfg.mask} mask over {cfg.tokens} packed tokens, "
          f"Hq={cfg.num_q_heads} Hkv={cfg.num_kv_heads} "
          f"D={cfg.head_dim} {cfg.dtype} (gradient partials {cfg.grad_comm_dtype}), {where}", flush=True)
    t0 = time.perf_counter()
    result = run_comparison(cfg)
    print(f"batch: {result['num_documents']} documents (longest {result['longest_document']}) from "
          f"{result['seqlens_source']}; block size {result['block_size']}; single device fwd+bwd "
          f"{result['single_device_fwd_bwd_ms']:.0f} ms ({result['kernel_backend']} backend)")
    print(format_table(result))
    if cfg.extra.get("json"):
        Path(cfg.extra["json"]).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.extra["json"]).write_text(json.dumps(result, indent=2))
    problems = check_result(result)
    for msg in problems:
        print("MISMATCH:", msg)
    print(f"{'FAILED' if problems else 'OK'}: every strategy " +
          ("matched" if not problems else "did not match") + f" the single-device result and its planned bytes "
          f"({time.perf_counter() - t0:.0f} s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
