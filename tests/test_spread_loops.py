"""planner/spread_loops.py's compiled spreads against their numpy forms (the planner's code before they
were compiled, kept here), on random placements and transfer times: the same stages, the same floats."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from blockattn.planner.stages import LocalWork
from blockattn.planner.tile_loops import pour, stage_loads


def _pour(stage, local, gaps, movable, fill):
    P, F = gaps.shape
    if local.tiles.size == 0 or F == 0 or not gaps.any() or not (movable > 0).any():
        return stage
    order, ranks, end = local.grouped
    return pour(stage, order, ranks, end, local.total, np.ascontiguousarray(gaps, dtype=np.float64),
                np.asarray(movable, dtype=np.float64), np.asarray(fill, dtype=np.int64))[0]


def numpy_spread_local_tiles(stage, flops, rank, is_local, comm_time, *, world_size, num_stages, fwd_rate,
                             extra_stage=False):
    S = num_stages
    if S < 2:
        return stage
    seconds = flops / fwd_rate
    compute = stage_loads(rank, stage, seconds, world_size, S + 1)
    last = S if extra_stage else S - 1
    gaps = np.maximum(0.0, comm_time[:, 1:last + 1] - compute[:, 1:last + 1])
    if not gaps.any():
        return stage
    local0 = is_local & (stage == 0)
    movable = np.bincount(rank[local0], weights=seconds[local0], minlength=world_size) - comm_time[:, 0]
    fill = np.arange(last, 0, -1)
    return _pour(stage, LocalWork(np.flatnonzero(local0)[::-1], rank, seconds, world_size), gaps[:, fill - 1],
                 movable, fill)


def numpy_spread_own_rows(stage, seconds, rank, movable_of, comm_time, *, world_size, num_stages, extra_stage=False):
    S, P = num_stages, world_size
    if S < 2:
        return stage
    width = S + 1 if extra_stage else S
    ranks = np.arange(P)
    per = movable = None
    for source in range(S - 1, 0, -1):
        if per is None:
            per = stage_loads(rank, stage, seconds, P, width)
        gaps = np.maximum(0.0, comm_time[:, :width] - per)
        gaps[:, : source + 1] = 0.0
        if not gaps.any():
            continue
        if movable is None:
            movable = movable_of()
        cand = np.flatnonzero(movable & (stage == source))[::-1]
        if cand.size == 0:
            continue
        surplus = per[ranks, source] - comm_time[ranks, source]
        fill = np.arange(source + 1, width)
        poured = _pour(stage, LocalWork(cand, rank, seconds, world_size), gaps[:, fill], surplus, fill)
        if poured is not stage:
            stage, per = poured, None
    return stage


def numpy_backward_time(stage, compute, rank, local, comm_time, *, world_size, num_stages):
    S, P = num_stages, world_size
    per = stage_loads(rank, stage, compute, P, S)
    spread = stage
    if S >= 2:
        home_stage = min(2, S - 1)
        gaps = np.maximum(0.0, comm_time[:, :S] - per)
        movable = np.minimum(per[:, home_stage] - comm_time[:, home_stage], local.total)
        fill = np.array([s for s in range(S) if s != home_stage], dtype=np.int64)
        spread = _pour(stage, local, gaps[:, fill], movable, fill)
    if spread is not stage:
        per = stage_loads(rank, spread, compute, P, S)
    return spread, float((np.maximum(per, comm_time[:, :-1]).sum(axis=1) + comm_time[:, -1]).max())


def _case(seed, num_tiles, world_size, num_stages):
    """Tiles on random ranks and stages with random seconds, some flagged local / movable, and transfer
    times [P, S + 1] of the same scale as the compute (many gaps exposed, some not)."""
    rng = np.random.default_rng(seed)
    rank = rng.integers(0, world_size, num_tiles)
    stage = rng.integers(0, num_stages, num_tiles)
    seconds = rng.random(num_tiles) * 1e-4
    flags = rng.random(num_tiles) < 0.5
    scale = max(seconds.sum(), 1e-9) / (world_size * num_stages)
    comm = rng.random((world_size, num_stages + 1)) * 2 * scale * (rng.random((world_size, num_stages + 1)) < 0.8)
    return rank, stage, seconds, flags, comm


CASES = dict(seed=st.integers(0, 2**31 - 1), num_tiles=st.integers(0, 300), world_size=st.integers(1, 9),
             num_stages=st.integers(1, 7))


@settings(max_examples=150, deadline=None)
@given(extra=st.booleans(), **CASES)
def test_forward_spreads_are_their_numpy_forms(seed, num_tiles, world_size, num_stages, extra):
    from blockattn.planner.stages import spread_local_tiles, spread_own_rows

    rank, stage, seconds, flags, comm = _case(seed, num_tiles, world_size, num_stages)
    kwargs = dict(world_size=world_size, num_stages=num_stages, extra_stage=extra)
    calls = []

    def movable_of():
        calls.append(1)
        return flags

    got = spread_own_rows(stage, seconds, rank, movable_of, comm, **kwargs)
    want = numpy_spread_own_rows(stage, seconds, rank, lambda: flags, comm, **kwargs)
    assert np.array_equal(got, want) and (got is stage) == (want is stage)
    assert len(calls) <= 1
    flops, rate = seconds * 3e14, 3e14
    got = spread_local_tiles(stage, flops, rank, flags, comm, fwd_rate=rate, **kwargs)
    want = numpy_spread_local_tiles(stage, flops, rank, flags, comm, fwd_rate=rate, **kwargs)
    assert np.array_equal(got, want)


@settings(max_examples=150, deadline=None)
@given(**CASES)
def test_backward_spread_and_time_are_their_numpy_forms(seed, num_tiles, world_size, num_stages):
    from blockattn.planner import CostModel
    from blockattn.planner.stages_bwd import backward_time, spread_backward_local

    rank, stage, seconds, flags, comm = _case(seed, num_tiles, world_size, num_stages)
    local = LocalWork(np.flatnonzero(flags), rank, seconds, world_size)
    got = backward_time(stage, seconds, rank, local, comm, world_size=world_size, num_stages=num_stages,
                        cost_model=CostModel())
    want = numpy_backward_time(stage, seconds, rank, local, comm, world_size=world_size, num_stages=num_stages)
    assert np.array_equal(got[0], want[0]) and got[1] == want[1]  # (bit for bit)
    assert (got[0] is stage) == (want[0] is stage)
    spread = spread_backward_local(stage, seconds, rank, local, comm, world_size=world_size, num_stages=num_stages)
    assert np.array_equal(spread, want[0])


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), world_size=st.integers(1, 9), num_stages=st.integers(1, 40))
def test_overlapped_times_sum_rows_as_numpy_does(seed, world_size, num_stages):
    from blockattn.planner import CostModel

    rng = np.random.default_rng(seed)
    compute = rng.random((world_size, num_stages)) * rng.choice([1e-6, 1.0, 1e6], (world_size, num_stages))
    comm = rng.random((world_size, num_stages + 1)) * rng.choice([1e-6, 1.0, 1e6], (world_size, num_stages + 1))
    want = np.maximum(compute, comm[:, :-1]).sum(axis=1) + comm[:, -1]
    assert np.array_equal(CostModel.overlapped_time(compute, comm), want)  # (bit for bit)
