"""notebooks/tour.ipynb runs as committed: its code cells, in order, in a fresh interpreter started in
notebooks/ (as Jupyter would), and what it prints says what its text claims. A renamed function or a
changed stats key then fails here instead of in a reader's first session.

The tour reads real document lengths from ``../../shared/data/wikipedia_seqlens.txt`` (the
workplace's shared data, beside the checkout). Where that file is not there (a clone elsewhere), the
cells read a file of log-normal lengths written here instead: the same code runs either way."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "tour.ipynb"
DATA = "../../shared/data/wikipedia_seqlens.txt"  # as the notebook names it, relative to notebooks/


def _code(lengths_file: Path | None) -> str:
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    code = "\n\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "code")
    assert DATA in code, "the tour no longer reads the shared Wikipedia lengths: update this test"
    return code if lengths_file is None else code.replace(DATA, str(lengths_file))


def test_the_tour_runs_and_dcp_is_at_least_as_fast_as_every_baseline(tmp_path):
    lengths_file = None
    if not (NOTEBOOK.parent / DATA).is_file():
        lengths_file = tmp_path / "seqlens.txt"
        rng = np.random.default_rng(0)
        np.savetxt(lengths_file, np.maximum(1, rng.lognormal(6.5, 1.3, size=20000)).astype(np.int64), fmt="%d")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", _code(lengths_file)], cwd=NOTEBOOK.parent, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"the tour failed:\n{done.stderr[-3000:]}"
    out = done.stdout
    for strategy in ("dcp", "fcp", "zigzag", "ring", "allgather"):
        assert f"Plan[{strategy}] P=8 T=131072" in out, f"no explain() of {strategy}:\n{out[-3000:]}"
    # the side-by-side table: strategy, time / bound, compute max / mean, GB moved, GB between nodes
    rows = {m.group(1): [float(x) for x in m.group(2).split()]
            for m in re.finditer(r"^(dcp|fcp|zigzag|ring|allgather)\s+([-0-9. ]+)$", out, flags=re.M)}
    assert set(rows) == {"dcp", "fcp", "zigzag", "ring", "allgather"}, out[-3000:]
    assert all(len(row) == 4 for row in rows.values()), rows
    for strategy, (over, imbalance, moved, between) in rows.items():
        assert over >= 1.0 and imbalance >= 1.0 and 0 <= between <= moved, (strategy, rows[strategy])
    # dcp weighs every baseline's plan as it is (planner/candidates.py BASELINE_INITS): never slower
    for strategy in ("fcp", "zigzag", "ring", "allgather"):
        assert rows["dcp"][0] <= rows[strategy][0] + 1e-3, (rows["dcp"], strategy, rows[strategy])
    # planning for the hardware: dcp's plan for GPUs 3x faster than the H200 is no slower on them than the
    # H200's plan (bench/bench_cost_model.py: slower in every case on several nodes)
    fit = re.search(r"planned for them ([0-9.]+)x the bound, the H200's plan ([0-9.]+)x", out)
    assert fit and 1.0 <= float(fit.group(1)) <= float(fit.group(2)), out[-3000:]
    # planning ahead: three plans, each the plan make_plan builds in the notebook's own process
    ahead = [line for line in out.splitlines() if "same as make_plan here:" in line]
    assert len(ahead) == 3 and all(line.endswith("True") for line in ahead), ahead
