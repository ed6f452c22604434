"""planner/jit.py: numba's compiles and cache loads hold a lock across processes, so processes that plan
their first batch together (torchrun's ranks) do not fill numba's cache at the same time."""

from __future__ import annotations

import os

import numpy as np


def test_only_compiles_and_cache_loads_take_the_lock(monkeypatch):
    """The lock is taken where numba compiles or loads a version for new argument types, and not on
    calls that find theirs."""
    from blockattn.planner import jit

    from jit_probe import running_total

    opened = []
    real_open = jit._open_lock
    monkeypatch.setattr(jit, "_open_lock", lambda: opened.append(1) or real_open())
    before = len(running_total.overloads)
    running_total(np.arange(3.0))
    running_total(np.arange(5.0))
    assert len(opened) == (1 if len(running_total.overloads) > before else 0)
    running_total(np.arange(3, dtype=np.int32))  # new argument types: a compile (or a cache load)
    assert len(opened) == (1 if before else 2) and len(running_total.overloads) == max(before, 1) + 1


def test_processes_compiling_at_once_fill_the_cache_once(tmp_path):
    """Three processes call the same compiled function for the first time at once, with an empty cache:
    one compiles it (under the lock) and the others load what it cached."""
    import multiprocessing

    import torch.multiprocessing as mp

    from jit_probe import compile_and_report

    cache, out = tmp_path / "cache", tmp_path / "out"
    out.mkdir()
    env = dict(os.environ)
    os.environ["NUMBA_CACHE_DIR"] = str(cache)  # (read by numba at import, in the spawned processes)
    try:
        barrier = multiprocessing.get_context("spawn").Barrier(3)
        mp.spawn(compile_and_report, args=(str(out), barrier), nprocs=3, join=True)
    finally:
        os.environ.clear()
        os.environ.update(env)
    kinds = sorted(p.read_text() for p in out.iterdir())
    assert kinds == ["hit", "hit", "miss"], kinds
