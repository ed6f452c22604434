"""Static sm_90a report of the attention kernels: registers, spills, shared memory, HGMMA count.

AOT-compiles each kernel configuration with ``triton.compile`` for an H100/H200 target (no GPU needed),
then reads the cubin with the ``cuobjdump`` shipped in the Triton wheel: ``--dump-resource-usage`` for
registers / spill stores / spill loads, ``--dump-sass`` for the HGMMA (warpgroup tensor-core MMA) count.
Writes bench/results/kernel_report.json and prints a table.

Usage: python bench/kernel_report.py [--quick] [--out PATH]
(must run without TRITON_INTERPRET=1: the interpreter has no compiler.)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TORCH_TO_TT = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}
# one row each, bf16 D=128: kind -> warps (blockattn.kernels.launch on CUDA, 64-row tiles)
SMALL_KERNELS = {"merge": 8, "merge_into": 8, "preprocess": 4, "add_grad_rows": 4}


def cuobjdump_path() -> Path | None:
    """cuobjdump from the Triton wheel (or PATH)."""
    import triton

    cand = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if cand.exists():
        return cand
    from shutil import which

    found = which("cuobjdump")
    return Path(found) if found else None


def _signature(kind: str, dtype: str, D: int, B: int, cfg, group: int, even: bool, has_iv: bool, has_bits: bool,
               accumulate: bool = False, softcap: bool = False):
    """(kernel fn, signature, constexprs) for one kernel configuration."""
    from blockattn.kernels.backward import attention_bwd_dkdv_kernel, attention_bwd_dq_kernel
    from blockattn.kernels.forward import attention_fwd_kernel
    from blockattn.kernels.launch import block_d

    p = TORCH_TO_TT[dtype]
    tiles = {n: "*i32" for n in ("WorkOrder", "WorkRow", "WorkGlob", "FullPtr", "FullRow", "FullGlob",
                                  "PartPtr", "PartRow", "PartGlob", "PartBits")}
    masks = {"Intervals": "*i32", "Bits": "*u8"}
    const = dict(GROUP=group, BLOCK=B, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=D, BLOCK_D=block_d(D),
                 EVEN_T=even, HAS_INTERVALS=has_iv, HAS_BITS=has_bits, DOT_PREC="ieee" if dtype == "fp32" else "tf32",
                 SOFTCAP=softcap, ACCUMULATE=accumulate)
    if kind == "fwd":
        fn = attention_fwd_kernel
        sig = {"Q": p, "K": p, "V": p, "Out": p, "Lse": "*fp32", **tiles, **masks}
        strides = ["stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh",
                   "stride_ot", "stride_oh", "stride_lh"]
        scalars = {"T": "i32", "num_heads": "i32", "qk_scale": "fp32", "cap": "fp32"}
    elif kind == "dq":
        fn = attention_bwd_dq_kernel
        sig = {"Q": p, "K": p, "V": p, "DOut": p, "Lse": "*fp32", "Delta": "*fp32", "DQ": "*fp32", **tiles, **masks}
        strides = ["stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_dot",
                   "stride_doh", "stride_dqt", "stride_dqh", "stride_lh"]
        scalars = {"T": "i32", "num_heads": "i32", "qk_scale": "fp32", "sm_scale": "fp32", "cap": "fp32"}
    else:
        fn = attention_bwd_dkdv_kernel
        sig = {"Q": p, "K": p, "V": p, "DOut": p, "Lse": "*fp32", "Delta": "*fp32", "DK": "*fp32", "DV": "*fp32",
               **tiles, **masks}
        strides = ["stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_dot",
                   "stride_doh", "stride_dkt", "stride_dkh", "stride_dvt", "stride_dvh", "stride_lh"]
        scalars = {"T": "i32", "num_heads": "i32", "qk_scale": "fp32", "sm_scale": "fp32", "cap": "fp32"}
    sig.update({s: "i32" for s in strides})
    sig.update(scalars)
    sig.update({c: "constexpr" for c in const})
    missing = [a for a in fn.arg_names if a not in sig]
    if missing:
        raise RuntimeError(f"kernel_report signature out of date for {fn.__name__}: missing {missing}")
    return fn, {a: sig[a] for a in fn.arg_names}, const


def _small_kernel_signature(kind: str, dtype: str, D: int):
    """(fn, signature, constexprs) of the merge, in-place merge, delta-preprocess and partial-add kernels."""
    from blockattn.kernels.backward import add_grad_rows_kernel, attention_bwd_preprocess_kernel
    from blockattn.kernels.launch import block_d
    from blockattn.kernels.merge import merge_into_kernel, merge_partials_kernel

    p = TORCH_TO_TT[dtype]
    if kind == "merge":
        fn = merge_partials_kernel
        sig = {"Outs": p, "Lses": "*fp32", "Out": p, "Lse": "*fp32", "N": "i32", "R": "i32"}
    elif kind == "merge_into":
        fn = merge_into_kernel
        sig = {"Out": p, "Lse": "*fp32", "Rows": "*i64", "PartOut": p, "PartLse": "*fp32", "R": "i32"}
    elif kind == "add_grad_rows":
        fn = add_grad_rows_kernel
        sig = {"Dst": "*fp32", "Rows": "*i64", "Src": p, "R": "i32"}
    else:
        fn = attention_bwd_preprocess_kernel
        sig = {"Out": p, "DOut": p, "Delta": "*fp32", "R": "i32"}
    sig.update({a: "i32" for a in fn.arg_names if a.startswith("stride_")})
    const = {"BLOCK_R": 64, "HEAD_DIM": D, "BLOCK_D": block_d(D)}
    sig.update({c: "constexpr" for c in const})
    return fn, {a: sig[a] for a in fn.arg_names}, const


def compile_one(kind, dtype, D, B, cfg, group=4, even=True, has_iv=True, has_bits=False, accumulate=False,
                softcap=False):
    """Compile one configuration for sm_90a; returns the CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if kind in SMALL_KERNELS:
        fn, sig, const = _small_kernel_signature(kind, dtype, D)
    else:
        fn, sig, const = _signature(kind, dtype, D, B, cfg, group, even, has_iv, has_bits, accumulate, softcap)
    # the hints Triton's JIT derives at launch for contiguous THD tensors with D a multiple of 16:
    # pointers 16-byte aligned, row/head strides divisible by 16 (lets loads vectorize to 16 bytes)
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items()
             if t.startswith("*") or a.startswith("stride_")}
    src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


def resource_usage(cubin: bytes, tool: Path) -> dict:
    """Registers, spills, shared memory and HGMMA count from cuobjdump on the cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        res = subprocess.run([str(tool), "--dump-resource-usage", path], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([str(tool), "--dump-sass", path], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(path)
    grab = lambda key: int(m.group(1)) if (m := re.search(rf"\b{key}:(\d+)", res)) else None  # noqa: E731
    return {
        "registers": grab("REG"),
        "stack": grab("STACK"),
        "local": grab("LOCAL"),
        "shared_static": grab("SHARED"),
        # the kernels keep no local arrays, so every local-memory access in the SASS is a spill
        "spill_stores": len(re.findall(r"\bSTL(?:\.\w+)*\b", sass)),
        "spill_loads": len(re.findall(r"\bLDL(?:\.\w+)*\b", sass)),
        "hgmma": len(re.findall(r"\bHGMMA\b", sass)),
        "hmma": len(re.findall(r"\bHMMA\b", sass)),
        "sass_lines": sass.count("\n"),
    }


def configs(quick: bool):
    """(kind, dtype, D, B) grid: main configs first (D=128 bf16)."""
    main = [(k, "bf16", 128, 128) for k in ("fwd", "dq", "dkdv")]
    if quick:
        return main
    extra = [(k, dt, D, 128) for k in ("fwd", "dq", "dkdv") for dt in ("bf16", "fp16") for D in (64, 256)
             ] + [(k, "fp16", 128, 128) for k in ("fwd", "dq", "dkdv")] + [("fwd", "bf16", 128, 64)]
    # head dims that are not powers of two run in the next power of two's tiles (kernels/tile_io.py)
    extra += [(k, "bf16", D, 128) for k in ("fwd", "dq", "dkdv") for D in (80, 96)]
    return main + extra


def _report_row(kind, dtype, D, B, cfg, variant, kw, tool):
    t0 = time.time()
    ck = compile_one(kind, dtype, D, B, cfg, **kw)
    usage = resource_usage(ck.asm["cubin"], tool)
    row = dict(kernel=kind, dtype=dtype, head_dim=D, block=B, mask=variant, block_m=cfg.block_m,
               block_n=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
               shared_bytes=int(ck.metadata.shared), compile_s=round(time.time() - t0, 2), **usage)
    print(f"{kind:10s} {dtype:5s} D={D:3d} B={B:3d} {variant:9s} m={cfg.block_m:3d} n={cfg.block_n:3d} "
          f"w={cfg.num_warps} s={cfg.num_stages}  regs={row['registers']} spill_st={row['spill_stores']} "
          f"spill_ld={row['spill_loads']} smem={row['shared_bytes']} hgmma={row['hgmma']} "
          f"({row['compile_s']}s)", flush=True)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="only the main D=128 bf16 configs")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "kernel_report.json"))
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("kernel_report: unset TRITON_INTERPRET (the interpreter cannot AOT-compile)")
    import torch

    from blockattn.kernels.launch import KernelConfig, kernel_config

    tool = cuobjdump_path()
    if tool is None:
        sys.exit("kernel_report: cuobjdump not found (expected in triton/backends/nvidia/bin)")
    rows = []
    # every configuration in every mask variant: a spill can hide in any of them (D=96 spilled on
    # bitmask tiles alone, D=256 on ragged ones)
    variants = {"intervals": dict(has_iv=True, has_bits=False), "bits": dict(has_iv=False, has_bits=True),
                # T not a multiple of the block (masked loads) and accumulate=True (the forward's fused
                # merge, the backward's gradients added in place: how a distributed run launches them)
                "ragged": dict(has_iv=True, has_bits=False, even=False, accumulate=True),
                # logit soft-capping (kernels/mask_tile.py tanh), its own compiled variant and tiles
                "softcap": dict(has_iv=True, has_bits=False, softcap=True),
                "softcap-bits": dict(has_iv=False, has_bits=True, softcap=True),
                "softcap-ragged": dict(has_iv=True, has_bits=False, even=False, accumulate=True, softcap=True)}
    for kind, dtype, D, B in configs(args.quick):
        for variant, kw in variants.items():
            cfg = kernel_config(kind, B, D, torch.device("cuda"), softcap=kw.get("softcap", False))
            rows.append(_report_row(kind, dtype, D, B, cfg, variant, kw, tool))
    for kind, warps in SMALL_KERNELS.items():
        cfg = KernelConfig(64, 64, warps, 1)
        rows.append(_report_row(kind, "bf16", 128, 128, cfg, "-", {}, tool))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    import triton

    out.write_text(json.dumps({"target": "sm_90a", "triton": triton.__version__, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    main()
