"""A compiled function for tests/test_jit.py's processes (a helper module, like spawn_gloo.py: no tests here)."""

from __future__ import annotations

import numpy as np

from blockattn.planner.jit import compiled


@compiled
def running_total(values):
    """Sum of ``values`` in a loop (something for numba to compile and cache)."""
    total = 0.0
    for v in values:
        total += v
    return total


def compile_and_report(_rank: int, out_dir: str, barrier) -> None:
    """Call it once, all processes at once (``barrier``), and write how numba got it: 'hit' (loaded from
    the cache) or 'miss' (compiled)."""
    import os

    barrier.wait()
    assert running_total(np.arange(4.0)) == 6.0
    stats = running_total.stats
    kind = "hit" if sum(stats.cache_hits.values()) else "miss"
    with open(os.path.join(out_dir, f"{os.getpid()}.txt"), "w") as f:
        f.write(kind)
