"""Static sm_90a check of the main kernel configs (D=128, bf16): no register spills, tensor-core HGMMA.

AOT compilation needs Triton's compiler (not the interpreter) and the CUDA tools shipped in the Triton
wheel (ptxas, cuobjdump); it runs in a subprocess with TRITON_INTERPRET unset and skips only when that
toolchain is missing from this installation.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _toolchain_missing():
    try:
        import triton
    except ImportError:
        return "triton is not installed"
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    missing = [t for t in ("cuobjdump", "ptxas") if not (bin_dir / t).exists()]
    return f"AOT toolchain missing from the triton wheel: {missing} in {bin_dir}" if missing else None


@pytest.mark.skipif(_toolchain_missing() is not None, reason=str(_toolchain_missing()))
def test_main_configs_have_no_spills_and_use_hgmma(tmp_path):
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_report.py"), "--quick", "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    attention = [r for r in rows if r["kernel"] in ("fwd", "dq", "dkdv")]
    kinds = {(r["kernel"], r["mask"]) for r in attention}
    variants = ("intervals", "bits", "ragged", "softcap", "softcap-bits", "softcap-ragged")
    assert kinds == {(k, m) for k in ("fwd", "dq", "dkdv") for m in variants}
    for r in attention:
        assert (r["dtype"], r["head_dim"]) == ("bf16", 128)
        name = f"{r['kernel']}/{r['mask']}"
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, f"{name} spills: {r}"
        assert r["hgmma"] > 0, f"{name} has no HGMMA (tensor cores unused): {r}"
        assert r["registers"] <= 255 and r["shared_bytes"] <= 227 * 1024, f"{name} over sm_90 limits: {r}"
    small = {r["kernel"]: r for r in rows if r["kernel"] not in ("fwd", "dq", "dkdv")}
    assert set(small) == {"merge", "merge_into", "preprocess", "add_grad_rows"}
    assert all(r["spill_stores"] == 0 for r in small.values())
