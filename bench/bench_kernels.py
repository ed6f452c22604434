"""GPU benchmark: blockattn kernels vs compiled FlexAttention, forward and backward TFLOP/s.

FLOPs count only unmasked (q, k) pairs (exact, from the BlockMask): forward 4 * pairs * D * Hq,
backward 2.5x that (5 matmuls instead of 2). Both libraries get the same bf16 THD inputs, D = 128 (or --head-dim),
GQA Hq:Hkv = 8:2, block 128; times are triton.testing.do_bench medians. Outputs are cross-checked
(max |ours - flex|). Writes bench/results/bench_kernels.json.

    python bench/bench_kernels.py            # full: 8K, 32K, 128K tokens (CUDA)
    python bench/bench_kernels.py --quick    # 8K and 32K only
    python bench/bench_kernels.py --dry-run  # CPU: build masks, tile lists, flex mask_mods; no kernels
    python bench/bench_kernels.py --head-dim 96   # another head dim (bench_kernels_d96.json)
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
SEQLENS = ROOT.parent / "shared" / "data" / "wikipedia_seqlens.txt"
HQ, HKV, D, BLOCK = 8, 2, 128, 128  # (D: the default of --head-dim)
SINK, WINDOW = 64, 4096   # DCP's lambda mask; the sliding window uses the same width


def document_lengths(T: int, seed: int = 0) -> list[int]:
    """Real Wikipedia document lengths packed up to T (seeded draw); a long-tail mix if the file is absent."""
    rng = np.random.default_rng(seed)
    if SEQLENS.exists():
        pool = np.loadtxt(SEQLENS, dtype=np.int64)
    else:  # the data file does not travel to every machine: lognormal lengths of similar shape
        pool = np.clip(rng.lognormal(6.5, 1.2, 100_000).astype(np.int64), 1, 32_768)
    lens, total = [], 0
    while total < T:
        n = int(min(pool[rng.integers(len(pool))], T - total))
        if n > 0:
            lens.append(n)
            total += n
    return lens


def build_cases(T: int):
    """(name, MaskSpec, flex mask_mod factory) per mask kind at T tokens."""
    from blockattn import MaskSpec

    docs = document_lengths(T)
    q_len = T // 8
    answers = [(T - q_len) // 4] * 3
    answers.append(T - q_len - sum(answers))

    def doc_ids(lens, device, question=0):
        ids = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))
        if question:
            ids = torch.cat([torch.full((question,), -1, device=device, dtype=ids.dtype), ids])
        return ids

    def causal(device):
        return lambda b, h, q, k: q >= k

    def documents(device):
        ids = doc_ids(docs, device)
        return lambda b, h, q, k: (ids[q] == ids[k]) & (q >= k)

    def window(device):
        return lambda b, h, q, k: (q >= k) & (q - k < WINDOW)

    def lam(device):
        return lambda b, h, q, k: (q >= k) & ((k < SINK) | (q - k < WINDOW))

    def shared_q(device):
        ids = doc_ids(answers, device, question=q_len)
        return lambda b, h, q, k: (q >= k) & ((ids[k] < 0) | (ids[k] == ids[q]))

    return [
        ("causal", MaskSpec.causal(T), causal),
        ("documents", MaskSpec.documents(docs), documents),
        ("sliding_window", MaskSpec.sliding_window(T, WINDOW), window),
        ("lambda", MaskSpec.lambda_mask(T, SINK, WINDOW), lam),
        ("shared_question", MaskSpec.shared_question(q_len, answers), shared_q),
    ]


def unmasked_pairs(spec) -> int:
    return int(spec.block_mask(BLOCK).tile_pairs().sum())


def dry_run(T: int = 2048):
    """CPU check: masks, tile lists and the flex mask_mods agree (dense comparison at small T)."""
    from blockattn.kernels import KernelMask, TileList

    small = 512
    for (name, spec, flex_mod), (_, spec_small, mod_small) in zip(build_cases(T), build_cases(small)):
        bm = spec.block_mask(BLOCK)
        tiles, tiles_t = TileList.from_block_mask(bm), TileList.from_block_mask(bm, transposed=True)
        KernelMask.from_block_mask(bm)
        q = torch.arange(small)[:, None]
        dense = mod_small("cpu")(0, 0, q, q.t())
        assert torch.equal(dense, spec_small.to_dense()), f"flex mask_mod of {name} differs from the MaskSpec"
        pairs = unmasked_pairs(spec)
        print(f"{name:16s} T={T} tiles full={tiles.num_full} partial={tiles.num_partial} "
              f"(kv-major {tiles_t.num_full}/{tiles_t.num_partial}) density={pairs / T / T:.3f} "
              f"fwd GFLOP={4 * pairs * D * HQ / 1e9:.2f}")
    print("dry run ok")


def bench(sizes, out_path: Path, head_dim: int = D, softcap: float | None = None):
    import triton
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from blockattn.attention import _device_tiles
    from blockattn.backend import get_backend

    dev = torch.device("cuda")
    kernels = get_backend("triton")
    # every (mask, length) is a new specialization of flex; past dynamo's recompile limit it would
    # silently run uncompiled and the comparison would be unfair to it
    for knob in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(256, getattr(torch._dynamo.config, knob)))
    flex = torch.compile(flex_attention, dynamic=False)

    def soft_cap(score, b, h, q_idx, kv_idx):  # (flex's scores arrive scaled: the same cap as ours)
        return softcap * torch.tanh(score / softcap)

    rows = []
    for T in sizes:
        for name, spec, flex_mod in build_cases(T):
            t0 = time.time()
            g = torch.Generator(device=dev).manual_seed(0)
            q = torch.randn(T, HQ, head_dim, device=dev, dtype=torch.bfloat16, generator=g)
            k = torch.randn(T, HKV, head_dim, device=dev, dtype=torch.bfloat16, generator=g)
            v = torch.randn(T, HKV, head_dim, device=dev, dtype=torch.bfloat16, generator=g)
            dout = torch.randn_like(q)
            scale = 1.0 / math.sqrt(head_dim)
            pairs = unmasked_pairs(spec)
            fwd_flops = 4.0 * pairs * head_dim * HQ
            tiles, tiles_t, km = _device_tiles(spec.block_mask(BLOCK), dev)

            cap = {} if softcap is None else {"softcap": softcap}
            ours_fwd = lambda: kernels.attention_fwd(q, k, v, tiles, km, scale, **cap)  # noqa: E731
            out, lse = ours_fwd()
            delta = kernels.attention_bwd_preprocess(out, dout)

            def ours_bwd():
                d = kernels.attention_bwd_preprocess(out, dout)
                kernels.attention_bwd_dq(q, k, v, dout, lse, d, tiles, km, scale, **cap)
                kernels.attention_bwd_dkdv(q, k, v, dout, lse, d, tiles_t, km, scale, **cap)

            bmask = create_block_mask(flex_mod(dev), None, None, T, T, device=dev, BLOCK_SIZE=BLOCK)
            fq, fk, fv = (t.transpose(0, 1).unsqueeze(0).contiguous().requires_grad_() for t in (q, k, v))
            fdo = dout.transpose(0, 1).unsqueeze(0).contiguous()
            flex_fwd = lambda: flex(fq, fk, fv, block_mask=bmask, scale=scale, enable_gqa=True,  # noqa: E731
                                    score_mod=None if softcap is None else soft_cap)
            with torch.no_grad():
                f_out = flex_fwd()
            f_out_g = flex_fwd()
            flex_bwd = lambda: torch.autograd.grad(f_out_g, (fq, fk, fv), fdo, retain_graph=True)  # noqa: E731
            max_diff = (f_out[0].transpose(0, 1).float() - out.float()).abs().max().item()
            dq = kernels.attention_bwd_dq(q, k, v, dout, lse, delta, tiles, km, scale, **cap)
            f_dq = flex_bwd()[0][0].transpose(0, 1).float()
            dq_diff = (f_dq - dq).abs().max().item()

            def ms(fn):
                return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))

            with torch.no_grad():
                t_of, t_ff = ms(ours_fwd), ms(flex_fwd)
            t_ob, t_fb = ms(ours_bwd), ms(flex_bwd)
            row = dict(mask=name, tokens=T, density=pairs / T / T, unmasked_pairs=pairs,
                       ours_fwd_ms=t_of, flex_fwd_ms=t_ff, ours_bwd_ms=t_ob, flex_bwd_ms=t_fb,
                       ours_fwd_tflops=fwd_flops / t_of / 1e9, flex_fwd_tflops=fwd_flops / t_ff / 1e9,
                       ours_bwd_tflops=2.5 * fwd_flops / t_ob / 1e9, flex_bwd_tflops=2.5 * fwd_flops / t_fb / 1e9,
                       max_abs_diff_out=max_diff, max_abs_diff_dq=dq_diff, wall_s=time.time() - t0)
            rows.append(row)
            print(f"{name:16s} T={T:6d} fwd ours {row['ours_fwd_tflops']:6.1f} flex {row['flex_fwd_tflops']:6.1f} | "
                  f"bwd ours {row['ours_bwd_tflops']:6.1f} flex {row['flex_bwd_tflops']:6.1f} TFLOP/s | "
                  f"diff out {max_diff:.3g} dq {dq_diff:.3g} ({row['wall_s']:.0f}s)", flush=True)
            rates = planner_rates(rows)
            out_path.parent.mkdir(parents=True, exist_ok=True)
            out_path.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), hq=HQ, hkv=HKV, head_dim=head_dim,
                                                softcap=softcap, block=BLOCK, dtype="bf16", cost_model=rates,
                                                rows=rows), indent=1))
    print(f"wrote {out_path}; plan for these kernels with make_plan(..., cost_model="
          f"CostModel.from_kernel_tflops({rates['fwd_tflops']:.0f}, {rates['bwd_tflops']:.0f}, topology=...))")
    return rows


def planner_rates(rows: list[dict]) -> dict:
    """The TFLOP/s to give the planner's cost model (``CostModel.from_kernel_tflops``): our kernels'
    median forward and backward rates over the masks at the largest size measured, the long-context
    regime the planner splits."""
    largest = max(row["tokens"] for row in rows)
    at = [row for row in rows if row["tokens"] == largest]
    return dict(tokens=largest, fwd_tflops=float(np.median([row["ours_fwd_tflops"] for row in at])),
                bwd_tflops=float(np.median([row["ours_bwd_tflops"] for row in at])))


def main(argv=None):
    ap = argparse.ArgumentParser(description="blockattn vs FlexAttention (bf16, GQA 8:2, D=128 or --head-dim)")
    ap.add_argument("--quick", action="store_true", help="8K and 32K tokens only")
    ap.add_argument("--dry-run", action="store_true", help="CPU: build masks and tile lists, run no kernel")
    ap.add_argument("--sizes", type=int, nargs="*", help="token counts (default 8192 32768 131072)")
    ap.add_argument("--head-dim", type=int, default=D, help="head dim (default 128; e.g. 96 or 80 run in the "
                    "next power of two's tiles)")
    ap.add_argument("--softcap", type=float, default=None, help="logit soft-capping (e.g. 50, Gemma 2), flex "
                    "given the same as a score_mod")
    ap.add_argument("--out", default=None, help="default bench/results/bench_kernels.json "
                    "(bench_kernels_d<D>.json for another --head-dim, _softcap added with --softcap)")
    args = ap.parse_args(argv)
    if args.out is None:
        name = "bench_kernels" + ("" if args.head_dim == D else f"_d{args.head_dim}")
        name += "" if args.softcap is None else "_softcap"
        args.out = str(ROOT / "bench" / "results" / f"{name}.json")
    if args.dry_run:
        dry_run()
        return
    if not torch.cuda.is_available():
        sys.exit("bench_kernels needs a CUDA GPU (use --dry-run on CPU)")
    sizes = args.sizes or ([8192, 32768] if args.quick else [8192, 32768, 131072])
    bench(sizes, Path(args.out), head_dim=args.head_dim, softcap=args.softcap)


if __name__ == "__main__":
    main()
