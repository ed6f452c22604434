# Two commands on a fresh machine: `make demo` and `make test` (each creates/reuses .venv).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch by default; on a GPU machine: `make TORCH_SPEC=torch test`.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed-stamp

.PHONY: install test demo bench-planner bench-planner-phases bench-hypergraph bench-effort bench-cost-model kernel-report clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	@touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

demo: $(STAMP)
	$(BIN)/python -m blockattn.demo

bench-planner: $(STAMP)
	$(BIN)/python bench/bench_planner.py

bench-planner-phases: $(STAMP)
	$(BIN)/python bench/bench_planner_phases.py

bench-hypergraph: $(STAMP)
	$(BIN)/python bench/bench_hypergraph.py

bench-effort: $(STAMP)
	$(BIN)/python bench/bench_effort.py

bench-cost-model: $(STAMP)
	$(BIN)/python bench/bench_cost_model.py

kernel-report: $(STAMP)
	$(BIN)/python bench/kernel_report.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
