"""Small helpers shared by the strategies: balanced block runs, stage compaction, first occurrences,
the result type.

Notation (docs/design.md): nB blocks, P ranks, a tile (qb, kb) is placed on a rank in a stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import tile_loops
from .tile_loops import key_sums, renumbered, stage_loads


@dataclass(frozen=True)
class Placement:
    """What a strategy decides; ``make_plan`` turns it into a Plan (schedule derived, checked)."""

    # (tile columns int64; a one-node plan inherited from merged blocks, which is final, hands make_plan
    # int32 columns, the Plan's own dtype: planner/first_pass.py ``_inherited``)
    block_home: np.ndarray  # int64 [nB]
    tile_rank: np.ndarray  # int64 [ntiles]
    tile_stage: np.ndarray  # int64 [ntiles]
    schedule: object = None  # CommSchedule already derived for exactly these arrays (stages compact)
    kv_relay: np.ndarray | None = None  # int64 [m, 3] (block, dst, src) KV relays (planner/relay.py)
    sim_time: float | None = None  # simulated fwd + bwd time (cost model), when the maker scored it
    tile_stage_bwd: np.ndarray | None = None  # int64 [ntiles] backward stages (None: chosen by make_plan)
    # The relay-free backward staging finish_placement chose for these homes, tile ranks and number of
    # stages, before its local tiles were spread: a ``BackwardChoice`` (planner/stages_bwd.py), or None. The
    # relay scorer starts from it instead of choosing it again, where it fits (a later step may have
    # changed the stages).
    bwd_choice: object = None
    # dcp: the search's steps that ran, in order, as (step, simulated fwd + bwd seconds of the plan kept
    # after it, or None where not scored); planner/dcp.py ``dcp``, shown by ``Plan.explain``
    search: tuple = ()
    # one node, planned on merged blocks: the merged plan's simulated fwd + bwd time (its fine copy is
    # scored by make_plan unless that time calls for the checks a full-resolution plan gets)
    merged_time: float | None = None


def balanced_bounds(num_blocks: int, parts: int) -> np.ndarray:
    """int64 [parts + 1] boundaries splitting ``num_blocks`` blocks into ``parts`` contiguous runs whose
    sizes differ by at most one block (runs may be empty when parts > num_blocks)."""
    return (np.arange(parts + 1, dtype=np.int64) * num_blocks) // parts


def runs_to_home(bounds: np.ndarray, owner_of_run: np.ndarray, num_blocks: int) -> np.ndarray:
    """Home rank of each block when run i = [bounds[i], bounds[i+1]) belongs to ``owner_of_run[i]``."""
    run = np.searchsorted(bounds, np.arange(num_blocks), side="right") - 1
    return np.asarray(owner_of_run, dtype=np.int64)[run]


def compact_stages(stage: np.ndarray) -> tuple[np.ndarray, int]:
    """Renumber the used stages >= 1 as 1, 2, ... (stage 0 keeps its meaning: all inputs at home).
    Returns (stages, num_stages), a new array; num_stages >= 1 even for an empty tile list."""
    stage = np.asarray(stage, dtype=np.int64)
    remap, num_stages, _ = stage_renumbering(stage)
    return (stage if remap is None else renumbered(stage, remap)), num_stages


def stage_renumbering(stage: np.ndarray) -> tuple:
    """(remap, num_stages, changed) of int64 or int32 ``stage``: ``compact_stages(stage)[0]`` is
    ``remap[stage]``, and differs from ``stage`` exactly where ``changed``; remap None for no tiles."""
    if stage.size == 0:
        return None, 1, False
    remap, num_stages, changed, low = tile_loops.stage_renumbering(stage)
    if low < 0:
        raise ValueError(f"stages must be >= 0, got {int(low)}")
    return remap, int(num_stages), bool(changed)


def first_occurrence(values: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """bool mask: True at the first position of each distinct value (values index ``scratch``).

    O(k): writing positions in reverse makes the earliest position the surviving write."""
    k = values.size
    pos = np.arange(k)
    scratch[values[::-1]] = pos[::-1]
    return scratch[values] == pos


def run_heads(key: np.ndarray) -> np.ndarray:
    """bool [n]: True where a run of equal keys starts (position 0, and wherever a key differs from
    the one before). ``np.r_[True, key[1:] != key[:-1]]`` without np.r_'s per-call overhead."""
    heads = np.empty(key.size, dtype=bool)
    if key.size:
        heads[0] = True
        np.not_equal(key[1:], key[:-1], out=heads[1:])
    return heads


def positions_by_key(keys: np.ndarray, n: int) -> list:
    """For each value 0..n-1 of the small ints ``keys``, the positions where ``keys`` holds it, ascending."""
    order = np.argsort(keys, kind="stable")
    return np.split(order, np.cumsum(np.bincount(keys, minlength=n))[:-1])


def concatenated_ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """int64: the ranges [start, start + len) concatenated (blocks' tokens or buffer rows, in block order)."""
    starts, lens = np.asarray(starts, dtype=np.int64), np.asarray(lens, dtype=np.int64)
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    return np.repeat(starts - (np.cumsum(lens) - lens), lens) + np.arange(total, dtype=np.int64)


def prefix_sums(values: np.ndarray) -> np.ndarray:
    """float64 [n + 1]: 0, then the running sums of ``values`` (``np.r_[0.0, np.cumsum(values)]``)."""
    out = np.empty(values.size + 1, dtype=np.float64)
    out[0] = 0.0
    out[1:] = np.cumsum(values)
    return out


def per_rank_and_stage(rank: np.ndarray, stage: np.ndarray, seconds: np.ndarray, world_size: int,
                       width: int) -> np.ndarray:
    """float64 [P, width]: per-tile ``seconds`` summed per rank and stage (compiled ``stage_loads``;
    the same floats as a bincount over ``rank * width + stage``)."""
    return stage_loads(np.asarray(rank, dtype=np.int64), np.asarray(stage, dtype=np.int64),
                       np.asarray(seconds, dtype=np.float64), int(world_size), int(width))


def weighted_bincount(keys: np.ndarray, weights: np.ndarray, size: int) -> np.ndarray:
    """``np.bincount(keys, weights=weights, minlength=size)`` for keys in [0, size), compiled
    (``key_sums``; the same floats); a key out of range raises ValueError."""
    return key_sums(np.asarray(keys, dtype=np.int64), np.asarray(weights, dtype=np.float64), int(size))
