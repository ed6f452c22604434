"""The GPU benchmark stays runnable: its CPU dry run builds every mask, tile list and FlexAttention
mask_mod, and checks each mask_mod against the MaskSpec's dense mask."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_kernels_dry_run(capsys):
    spec = importlib.util.spec_from_file_location("bench_kernels", ROOT / "bench" / "bench_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.dry_run(T=1024)
    out = capsys.readouterr().out
    for name in ("causal", "documents", "sliding_window", "lambda", "shared_question"):
        assert name in out
    assert "dry run ok" in out
    lens = mod.document_lengths(5000)
    assert sum(lens) == 5000 and min(lens) >= 1


def test_the_kernel_rates_for_the_planners_cost_model():
    """bench_kernels' ``planner_rates``: the medians at the largest size, which
    ``CostModel.from_kernel_tflops`` turns into the planner's rates."""
    from blockattn.planner import CostModel

    spec = importlib.util.spec_from_file_location("bench_kernels", ROOT / "bench" / "bench_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = [dict(tokens=8192, ours_fwd_tflops=100.0, ours_bwd_tflops=50.0)] + [
        dict(tokens=131072, ours_fwd_tflops=f, ours_bwd_tflops=b) for f, b in ((400, 300), (600, 500), (500, 200))]
    rates = mod.planner_rates(rows)
    assert rates == dict(tokens=131072, fwd_tflops=500.0, bwd_tflops=300.0)
    model = CostModel.from_kernel_tflops(rates["fwd_tflops"], rates["bwd_tflops"])
    assert model.fwd_rate == 500e12 and abs(model.bwd_flops_factor - 2.5 * 500 / 300) < 1e-12
