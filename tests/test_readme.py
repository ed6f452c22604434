"""The README's code runs as printed: its API example (the first Python block under "## The API") in a
fresh interpreter, the planning-ahead snippet at least compiled against that example's names. A
renamed function or argument in the library then fails here instead of in a user's first session. Its
planner tables are the committed benchmark runs' (bench/planner_tables.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _python_blocks(section: str) -> list[str]:
    """The ```python blocks of the README section whose heading is ``section``, in order."""
    text = (ROOT / "README.md").read_text()
    start = text.index(f"\n{section}\n")
    end = text.find("\n## ", start + 1)
    body = text[start:end if end >= 0 else None]
    return re.findall(r"```python\n(.*?)```", body, flags=re.S)


def test_the_api_example_runs_and_matches_the_float64_reference():
    example = _python_blocks("## The API")[0]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", example], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"the README's API example failed:\n{done.stderr[-3000:]}"
    lines = done.stdout.splitlines()
    # first print: the largest difference from the dense float64 reference (fp32 inputs: ~1e-7)
    error = float(re.fullmatch(r"tensor\(([-+0-9.e]+), dtype=torch.float64\)", lines[0]).group(1))
    assert 0 <= error < 1e-5, lines[0]
    # then plan.explain() of the 4-rank plan
    assert lines[1].startswith("Plan[dcp] P=4 T=228 "), lines[1]
    assert any(line.strip().startswith("sim time (H200 model)") for line in lines[2:]), done.stdout


def test_the_planning_ahead_snippet_compiles_with_the_examples_names():
    first, ahead = _python_blocks("## The API")[:2]
    assert "PlanAhead" in ahead
    namespace: dict = {}
    # the first block's imports (not its computation), then the snippet: it defines training_loop
    imports = "\n".join(line for line in first.splitlines() if line.startswith(("import ", "from ")))
    exec(compile(imports + "\n" + ahead, "README.md", "exec"), namespace)
    assert callable(namespace["training_loop"])
    assert namespace["PlanAhead"].__name__ == "PlanAhead"


def test_the_shared_homes_snippet_runs_on_a_small_batch():
    first, _, shared = _python_blocks("## The API")[:3]
    assert "make_plans" in shared
    imports = "\n".join(line for line in first.splitlines() if line.startswith(("import ", "from ")))
    import torch

    seqlens = [3000, 1, 5000, 700, 2500]
    namespace = {"seqlens": seqlens, "T": sum(seqlens), "x": torch.randn(sum(seqlens), 8), "rank": 5}
    exec(compile(imports + "\n" + shared, "README.md", "exec"), namespace)
    plan_global, plan_local = namespace["plan_global"], namespace["plan_local"]
    assert torch.equal(plan_global.local_tokens(5), plan_local.local_tokens(5))
    assert torch.equal(namespace["x_local"], namespace["x"][plan_local.local_tokens(5)])


def test_the_planner_tables_quote_the_committed_benchmark_runs():
    """Each of the README's planner tables is bench/planner_tables.py's print of a committed JSON: a
    re-run benchmark whose README was not updated fails here (refresh: the script prints the tables)."""
    from bench_scripts import load_bench

    tables = load_bench("planner_tables")
    readme = (ROOT / "README.md").read_text()
    for kind, json_name in (("configurations", "bench_planner.json"), ("configurations", "bench_planner_bf16grad.json"),
                            ("masks", "bench_planner.json"), ("held-out", "bench_planner_seed1.json"),
                            ("hypergraph", "bench_hypergraph.json"), ("shared-homes", "bench_shared_homes.json")):
        table = tables.table(kind, ROOT / "bench" / "results" / json_name)
        assert table in readme, (f"the README's {kind} table of {json_name} is not the committed run's; "
                                 f"print it with: python bench/planner_tables.py {kind} bench/results/{json_name}\n{table}")


def test_planner_tables_refuse_an_unknown_table():
    from bench_scripts import load_bench

    with pytest.raises(ValueError, match="unknown table 'bytes'"):
        load_bench("planner_tables").table("bytes")
