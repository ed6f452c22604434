"""Planning time by step, measured by replay: the most that compiling a step of the planner could save.

A step's results are recorded in a first run over the batches; in the timed runs the step returns the
recorded result at once for the same arguments, so the plans are the same (their fingerprints are
checked against the plans made without replay) and the time left is what the other steps cost. The
difference is an upper bound on what compiling the replayed steps could save: a compiled step still
takes some time, a replayed one almost none (its arguments are hashed to find the record).

Steps (``STEPS``; each replayed wherever the planner's modules reference it):

* ``balancer``: planner/balance.py ``balanced_ranks`` (the Balancer: tile moves off overloaded ranks);
* ``balancing``: planner/candidates.py ``_balanced`` (a start's homes, ``fcp_home`` among them, and
  its balancing);
* ``staging``: planner/candidates.py ``_staged`` (a candidate's stages, schedule, spreads, backward
  staging and simulated time).

Batches: 128K tokens of Wikipedia document lengths and of the long-tail mix (bench/bench_planner.py's
generators, held out by default: seed 777), causal documents, 8 ranks of one node, block 128, planned
cold as bench_planner times them (``clear_plan_cache``; block classification apart).

    python bench/bench_planner_phases.py [--batches 20] [--seed 777] [--repeats 3] [--out PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import pkgutil
import platform
import time
import weakref
from contextlib import contextmanager
from dataclasses import is_dataclass
from pathlib import Path

import numpy as np
import torch

import blockattn.planner
from bench_planner import BLOCK, HEADS, SEQLENS, longtail_batch, wiki_batch
from blockattn.masks import MaskSpec
from blockattn.planner import clear_plan_cache, make_plan
from blockattn.planner.tiles import TileSet

ROOT = Path(__file__).resolve().parents[1]
STEPS = {
    "balancer": ("blockattn.planner.balance", "balanced_ranks"),
    "balancing": ("blockattn.planner.candidates", "_balanced"),
    "staging": ("blockattn.planner.candidates", "_staged"),
}
REPLAY_SETS = (("none", ()), ("balancer", ("balancer",)), ("balancing", ("balancing",)), ("staging", ("staging",)),
               ("balancing+staging", ("balancing", "staging")))
WORLD_SIZE = 8

_tile_digests: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _digest(array: np.ndarray) -> bytes:
    array = np.ascontiguousarray(array)
    return hashlib.sha1(array.view(np.uint8).reshape(-1)).digest() + array.dtype.str.encode() + str(array.shape).encode()


def argument_key(value):
    """A hashable key equal for equal arguments: arrays and TileSets by content (a new batch's TileSet
    is a new object with the same content in every run), frozen dataclasses (CostModel) by value."""
    if isinstance(value, TileSet):
        if value not in _tile_digests:
            _tile_digests[value] = (value.total_len, value.block_size, value.num_blocks,
                                    *(_digest(a) for a in (value.q, value.kv, value.full, value.pairs)))
        return ("tiles", _tile_digests[value])
    if isinstance(value, np.ndarray):
        return ("array", _digest(value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, argument_key(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return ("seq", tuple(argument_key(v) for v in value))
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if is_dataclass(value) and not isinstance(value, type):
        hash(value)  # (a frozen dataclass: compared by value; TypeError for a mutable one)
        return value
    raise TypeError(f"no replay key for an argument of type {type(value).__name__}")


def _fresh(result):
    """The recorded result as the step would return it: arrays copied (a caller may write into them)."""
    if isinstance(result, np.ndarray):
        return result.copy()
    if isinstance(result, tuple):
        return tuple(_fresh(item) for item in result)
    return result


class Replay:
    """Records the results of the named steps (``STEPS``), then serves them: ``recording`` and
    ``replaying`` patch every planner module's reference to each step for the duration."""

    def __init__(self, steps: tuple):
        self.steps = steps
        self.records: dict = {}
        self.hits = 0
        self.misses = 0

    @contextmanager
    def _patched(self, replay: bool):
        patched = []
        for step in self.steps:
            module_name, name = STEPS[step]
            original = getattr(importlib.import_module(module_name), name)

            def wrapper(*args, _original=original, _step=step, **kwargs):
                key = (_step, argument_key(args), argument_key(kwargs))
                if replay and key in self.records:
                    self.hits += 1
                    return _fresh(self.records[key])
                if replay:
                    self.misses += 1
                result = _original(*args, **kwargs)
                if not replay:
                    self.records[key] = _fresh(result)
                return result

            for module in _planner_modules():
                if getattr(module, name, None) is original:
                    setattr(module, name, wrapper)
                    patched.append((module, name, original))
        try:
            yield self
        finally:
            for module, name, original in patched:
                setattr(module, name, original)

    def recording(self):
        return self._patched(replay=False)

    def replaying(self):
        return self._patched(replay=True)


def _planner_modules() -> list:
    return [importlib.import_module(f"blockattn.planner.{info.name}")
            for info in pkgutil.iter_modules(blockattn.planner.__path__)]


def plan_all(specs: list) -> tuple[list, list]:
    """(seconds, fingerprint) of each batch's dcp plan, planned cold (tile extraction and every
    per-batch memo included; the block masks stay classified)."""
    times, prints = [], []
    for spec in specs:
        clear_plan_cache()
        t0 = time.perf_counter()
        plan = make_plan(spec, WORLD_SIZE, block_size=BLOCK, check=False, **HEADS)
        times.append(time.perf_counter() - t0)
        prints.append(plan.fingerprint())
    return times, prints


def measure(specs: list, steps: tuple, repeats: int, reference: list | None) -> dict:
    """Planning time per batch (min of ``repeats`` runs) with ``steps`` replayed; the plans are checked
    against ``reference`` fingerprints (those of the plans without replay)."""
    replay = Replay(steps)
    with replay.recording():
        _, prints = plan_all(specs)
    best = None
    with replay.replaying():
        for _ in range(repeats):
            times, replayed = plan_all(specs)
            if replayed != prints:
                raise AssertionError(f"replaying {steps} changed the plans")
            best = np.array(times) if best is None else np.minimum(best, times)
    if reference is not None and prints != reference:
        raise AssertionError(f"recording {steps} changed the plans")
    return {"steps": list(steps), "plan_ms": (1e3 * best).tolist(), "plan_ms_median": float(1e3 * np.median(best)),
            "plan_ms_mean": float(1e3 * best.mean()), "replayed_calls": replay.hits // repeats,
            "unreplayed_calls": replay.misses // repeats, "fingerprints": prints}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=20, help="batches per source")
    ap.add_argument("--seed", type=int, default=777, help="777: batches held out from bench_planner's draws")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per replay set; each batch's min is kept")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "bench_planner_phases.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(args.seed)
    wiki = np.loadtxt(SEQLENS, dtype=np.int64)
    sources = {"wikipedia": [wiki_batch(rng, wiki, 128 * 1024) for _ in range(args.batches)],
               "longtail": [longtail_batch(rng, 128 * 1024) for _ in range(args.batches)]}
    results = {}
    for source, batches in sources.items():
        specs = [MaskSpec.documents(lens) for lens in batches]
        for spec in specs:
            spec.block_mask(BLOCK)
        reference = None  # (the first set, nothing replayed: its untimed recording run warms up too)
        for name, steps in REPLAY_SETS:
            entry = measure(specs, steps, args.repeats, reference)
            reference = reference or entry["fingerprints"]
            results.setdefault(source, {})[name] = entry
            print(f"{source:10s} replayed {name:18s} median {entry['plan_ms_median']:6.2f} ms  mean "
                  f"{entry['plan_ms_mean']:6.2f} ms  ({entry['replayed_calls']} calls replayed, "
                  f"{entry['unreplayed_calls']} not)", flush=True)
    report = {"config": {"heads": HEADS, "block_size": BLOCK, "world_size": WORLD_SIZE, "tokens": 128 * 1024,
                         "batches_per_source": args.batches, "seed": args.seed, "repeats": args.repeats,
                         "host": platform.node(), "cpu_threads": torch.get_num_threads()},
              "steps": {name: ".".join(where) for name, where in STEPS.items()}, "results": results}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
