"""bench/bench_executor_gpu.py stays runnable without a GPU: its passes before and after give the same bits
on a plan whose tiles run away from their q-homes (OUT partials merged, bf16 gradient partials added),
with the torch backend, and its CPU smoke run writes its JSON."""
import json

import numpy as np
import torch

from bench_scripts import load_bench
from blockattn import MaskSpec
from blockattn.backend import get_backend
from test_distributed import random_plan


def test_before_and_now_give_the_same_bits_on_every_pass():
    bench = load_bench("bench_executor_gpu")
    spec = MaskSpec.documents([120, 37, 143]) & MaskSpec.sliding_window(300, 90)
    plan = random_plan(spec, 3, seed=1, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16,
                       block_size=32, grad_comm_dtype=torch.bfloat16)
    counts = []
    for rank in range(3):
        got = bench.measure(plan, spec, rank, torch.device("cpu"), get_backend("torch"), repeats=1)
        assert got["backward_stages"] > 0
        for name in ("backward", "out_merges", "grad_adds"):
            assert got[name]["same_bits"] and got[name]["max_relative_difference"] == 0.0, (rank, name, got)
        counts.append(got)
    assert sum(c["out_sections"] for c in counts) > 0 and sum(c["grad_sections"] for c in counts) > 0


def test_smoke_run_writes_its_json(tmp_path):
    # (document lengths of its own: the workplace's shared Wikipedia lengths are not beside every clone)
    bench = load_bench("bench_executor_gpu")
    out, lengths = tmp_path / "executor_gpu.json", tmp_path / "seqlens.txt"
    rng = np.random.default_rng(0)
    np.savetxt(lengths, np.maximum(1, rng.lognormal(6.5, 1.3, size=2000)).astype(np.int64), fmt="%d")
    rows = bench.main(["--smoke", "--out", str(out), "--seqlens", str(lengths)])
    saved = json.loads(out.read_text())
    assert saved["smoke"] and saved["device"] == "cpu" and len(saved["rows"]) == len(rows) == 4
    assert all(r[name]["same_bits"] for r in rows for name in ("backward", "out_merges", "grad_adds"))
