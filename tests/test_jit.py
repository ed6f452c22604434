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


def test_the_compiled_planner_plans_as_its_python_source_does():
    """With NUMBA_DISABLE_JIT=1 numba runs the same functions as Python: a one-node and a multi-node dcp
    plan are the same there (a check on numba's typing: integer widths, division, stable sorts)."""
    import subprocess
    import sys

    script = (
        "from blockattn.masks import MaskSpec\n"
        "from blockattn.planner import Topology, make_plan\n"
        "spec = MaskSpec.documents([3000, 9000, 500, 7000, 1200])\n"
        "kw = dict(block_size=128, num_q_heads=32, num_kv_heads=8, head_dim=128)\n"
        "print(make_plan(spec, 8, **kw).fingerprint(), make_plan(spec, 6, topology=Topology(ranks_per_node=3), **kw)"
        ".fingerprint())\n")
    prints = []
    for disable in ("0", "1"):
        env = dict(os.environ, NUMBA_DISABLE_JIT=disable)
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        prints.append(done.stdout.split())
    assert prints[0] == prints[1] and len(prints[0]) == 2, prints


def test_read_only_int64_gives_one_numba_type_for_any_index_array():
    """A writable, a read-only and a strided array (and int32) reach the compiled loops as one argument
    type, so each loop compiles one version; the caller's array keeps its flags and values."""
    import numba

    from blockattn.planner.jit import read_only_int64

    writable = np.arange(6, dtype=np.int64)
    read_only = np.arange(6, dtype=np.int64)
    read_only.setflags(write=False)
    strided = np.arange(12, dtype=np.int64).reshape(6, 2)[:, 0]
    narrow = np.arange(6, dtype=np.int32)
    views = [read_only_int64(a) for a in (writable, read_only, strided, narrow)]
    assert len({numba.typeof(v) for v in views}) == 1
    assert all(v.dtype == np.int64 and v.flags.c_contiguous and not v.flags.writeable for v in views)
    assert np.array_equal(views[2], [0, 2, 4, 6, 8, 10]) and np.array_equal(views[0], np.arange(6))
    assert writable.flags.writeable and np.shares_memory(views[0], writable)  # (a view, not a copy)


def test_a_cache_filled_from_other_sources_is_emptied_once(tmp_path):
    """numba checks a cached version against its own file only, though it holds the compiled functions
    it calls from other files: ``forget_stale_cache`` empties a cache folder whose sources' digest
    differs from the one it was filled under, and keeps it while the sources stay the same."""
    from blockattn.planner.jit import SOURCES_STAMP, forget_stale_cache, sources_digest

    sources, cache = tmp_path / "src", tmp_path / "cache"
    sources.mkdir()
    (sources / "loops.py").write_text("x = 1\n")
    (sources / "notes.txt").write_text("not a source\n")

    def fill():
        cache.mkdir(exist_ok=True)
        for name in ("loops.f-3.py311.nbi", "loops.f-3.py311.1.nbc", "other.txt"):
            (cache / name).write_text("cached")

    fill()
    assert forget_stale_cache(str(cache), str(sources))  # (no stamp: filled from unknown sources)
    assert sorted(p.name for p in cache.iterdir()) == sorted(["other.txt", SOURCES_STAMP])
    assert (cache / SOURCES_STAMP).read_text() == sources_digest(str(sources))
    fill()
    assert not forget_stale_cache(str(cache), str(sources))  # (the same sources: kept)
    assert len(list(cache.iterdir())) == 4
    (sources / "notes.txt").write_text("changed, but not a source\n")
    assert not forget_stale_cache(str(cache), str(sources))
    (sources / "loops.py").write_text("x = 2\n")  # (an edit, or an upgrade)
    assert forget_stale_cache(str(cache), str(sources))
    assert sorted(p.name for p in cache.iterdir()) == sorted(["other.txt", SOURCES_STAMP])
    assert forget_stale_cache(str(tmp_path / "new"), str(sources))  # (a folder numba has not made yet)
    assert (tmp_path / "new" / SOURCES_STAMP).exists()


def test_the_planners_cache_was_checked_against_its_sources():
    """Importing the planner compared its numba cache with its sources: the stamp there is the digest of
    planner/*.py as they are now."""
    from blockattn.planner import jit, tile_loops

    cache_path = tile_loops.merge_tiles._cache.cache_path
    assert cache_path in jit._checked_caches
    with open(os.path.join(cache_path, jit.SOURCES_STAMP)) as f:
        assert f.read() == jit.sources_digest(os.path.dirname(tile_loops.__file__))
