"""The forward polish (planner/polish.py): only the forward stages change, only where faster, the
incremental state equals the cost model's, and relays stay valid."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from blockattn.masks import MaskSpec
from blockattn.planner import Topology, clear_plan_cache, make_plan
from blockattn.planner import first_pass as first_pass_module
from blockattn.planner.placement import Placement
from blockattn.planner.polish import ForwardPolish, polish_forward
from blockattn.planner.polish_bwd import BackwardPolish
from blockattn.planner.tiles import TileSet

from batches import long_tail_docs
from dcp_modules import set_dcp

HEADS = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)
SIZES = dict(HEADS, element_size=2, grad_element_size=4)  # make_plan's defaults: bf16 inputs, fp32 partials


def _unpolished(monkeypatch, spec, world_size: int, topology: Topology, block: int, keep: str = ""):
    """dcp's plan with the polishes switched off (but ``keep``: "forward" / "backward"), and the
    Placement it was built from."""

    with monkeypatch.context() as patch:
        for direction in ("forward", "backward"):
            if direction != keep:
                set_dcp(patch, f"polish_{direction}", lambda tiles, placement, **kwargs: placement)
        clear_plan_cache()
        plan = make_plan(spec, world_size, block_size=block, topology=topology, check=bool(keep), **HEADS)
    clear_plan_cache()
    stats = plan.stats()
    placement = Placement(block_home=plan.block_home.numpy().astype(np.int64),
                          tile_rank=plan.tile_rank.numpy().astype(np.int64),
                          tile_stage=plan.tile_stage.numpy().astype(np.int64), schedule=plan.schedule,
                          kv_relay=plan.kv_relay.numpy().astype(np.int64),
                          sim_time=stats["sim_time_fwd"] + stats["sim_time_bwd"],
                          tile_stage_bwd=plan.tile_stage_bwd.numpy().astype(np.int64))
    return plan, placement


def _forward_times(plan) -> np.ndarray:
    """Per-rank forward time of a plan, from scratch (``Plan.stats()``, planner/cost_model.py)."""
    return np.asarray(plan.stats()["sim_time_fwd_per_rank"])


def _assert_only_changed(direction: str, before, after, *, faster: float) -> None:
    """``after`` differs from ``before`` only in ``direction``'s ("fwd" / "bwd") stages and transfers,
    and simulates that direction at most ``faster`` times as long."""
    stages = {"fwd": "tile_stage", "bwd": "tile_stage_bwd"}
    other = "bwd" if direction == "fwd" else "fwd"
    for name in ("block_home", "tile_rank", "kv_relay", stages[other]):
        assert np.array_equal(getattr(before, name).numpy(), getattr(after, name).numpy()), name
    assert np.array_equal(before.schedule.table(other).numpy(), after.schedule.table(other).numpy())
    assert not np.array_equal(getattr(before, stages[direction]).numpy(), getattr(after, stages[direction]).numpy())
    sb, sa = before.stats(), after.stats()
    assert sa[f"sim_time_{other}"] == pytest.approx(sb[f"sim_time_{other}"], rel=1e-12)
    assert sa[f"sim_time_{direction}"] < faster * sb[f"sim_time_{direction}"]


CASE = dict(lens=long_tail_docs(3, 16384), world_size=8, topology=Topology(ranks_per_node=4), block=64)


def test_polish_changes_only_the_forward_stages_and_only_where_faster(monkeypatch):
    spec = MaskSpec.documents(CASE["lens"])
    before, _ = _unpolished(monkeypatch, spec, CASE["world_size"], CASE["topology"], CASE["block"])
    after, _ = _unpolished(monkeypatch, spec, CASE["world_size"], CASE["topology"], CASE["block"], keep="forward")
    _assert_only_changed("fwd", before, after, faster=0.97)  # (measured: fwd + bwd 1.047 -> 1.031x the bound)


def test_incremental_state_equals_the_cost_model_and_undo_restores_it(monkeypatch):
    spec = MaskSpec.documents(CASE["lens"])
    plan, placement = _unpolished(monkeypatch, spec, CASE["world_size"], CASE["topology"], CASE["block"])
    tiles = TileSet.from_block_mask(spec.block_mask(CASE["block"]))
    search = ForwardPolish(tiles, placement, world_size=plan.world_size, cost_model=plan.cost_model, sizes=SIZES)
    np.testing.assert_allclose(search.time, _forward_times(plan), rtol=1e-12)

    def state():
        return [a.copy() for a in (search.stage, search.load, search.rows_at, search.first, search.last,
                                   search.row_ex, search.hist)]

    start, compute, time = state(), search.compute.copy(), search.time.copy()
    moves = 0
    for g in range(search.g_rank.size):
        unit = search._unit(g, int(search.first[g]))
        to = int(search.stage[unit[0]]) + 1
        if to > search.S - 1:
            continue
        undo = []
        search.apply(unit, to, undo)
        moves += 1
        search.undo(undo)
    assert moves > 10
    for a, b in zip(state(), start):
        assert np.array_equal(a, b)
    # (exactly: undo restores the recorded values rather than subtracting what a move added)
    assert np.array_equal(search.compute, compute) and np.array_equal(search.time, time)

    assert search.run()
    # the state the search ended in is what the cost model says of the stages it chose
    fresh = ForwardPolish(tiles, replace(placement, tile_stage=search.stage), world_size=plan.world_size,
                          cost_model=plan.cost_model, sizes=SIZES)
    np.testing.assert_allclose(search.time, fresh.time, rtol=1e-12)
    assert search.time.max() < _forward_times(plan).max()


@pytest.mark.parametrize("seed", [0, 1])
def test_polished_plans_with_relays_stay_consistent(monkeypatch, seed):
    # every answer reads the question: relays forward it inside nodes, and a polished move of a proxy's
    # tiles must take its relay receivers along (check_plan: a relayed block is held a stage before)

    seen = []

    def recording(tiles, placement, **kwargs):
        out = polish_forward(tiles, placement, **kwargs)
        relays = placement.kv_relay is not None and len(placement.kv_relay) > 0
        seen.append((relays, out is not placement))
        return out

    set_dcp(monkeypatch, "polish_forward", recording)
    rng = np.random.default_rng(seed)
    answers = [int(n) for n in rng.integers(64, 900, size=24)]
    for world_size, per_node in ((6, 2), (9, 3), (8, 4)):
        clear_plan_cache()
        make_plan(MaskSpec.shared_question(1024, answers), world_size, block_size=64,
                  topology=Topology(ranks_per_node=per_node, inter_bw=10e9), check=True, **HEADS)
    assert any(relays and changed for relays, changed in seen), seen


# backward polish (planner/polish_bwd.py) ------------------------------------------------------------------


def test_backward_polish_changes_only_the_backward_stages_and_only_where_faster(monkeypatch):
    # a shared-question batch over 3 nodes of 2: answers read the question's KV through reduce trees
    answers = [int(n) for n in np.random.default_rng(0).integers(64, 900, size=24)]
    spec, topology = MaskSpec.shared_question(1024, answers), Topology(ranks_per_node=2)
    before, _ = _unpolished(monkeypatch, spec, 6, topology, 64)
    after, _ = _unpolished(monkeypatch, spec, 6, topology, 64, keep="backward")  # (make_plan checks it)
    # (measured: backward 1.23 -> 1.16x its bound, fwd + bwd 1.128 -> 1.089x the bound)
    _assert_only_changed("bwd", before, after, faster=0.95)


@pytest.mark.parametrize("world_size, per_node, inter_bw", [(6, 2, None), (8, 4, 10e9)])
def test_backward_state_follows_every_move_and_undo_restores_it(monkeypatch, world_size, per_node, inter_bw):
    # every unit moved one stage either way, and every relay child's whole group to the last stage (too
    # late for its proxy to forward its partial: it goes home instead, or around its transit rank), one
    # at a time: the incremental loads equal a fresh state's at every 20th move, and undoing restores
    # the start exactly
    answers = [int(n) for n in np.random.default_rng(0).integers(64, 900, size=24)]
    spec = MaskSpec.shared_question(1024, answers)
    topology = Topology(ranks_per_node=per_node, **({} if inter_bw is None else dict(inter_bw=inter_bw)))
    plan, placement = _unpolished(monkeypatch, spec, world_size, topology, 64)
    tiles = TileSet.from_block_mask(spec.block_mask(64))
    fresh = lambda stage_bwd: BackwardPolish(tiles, replace(placement, tile_stage_bwd=stage_bwd),  # noqa: E731
                                             world_size=world_size, cost_model=plan.cost_model, sizes=SIZES)
    search = fresh(placement.tile_stage_bwd)
    np.testing.assert_allclose(search.time, plan.stats()["sim_time_bwd_per_rank"], rtol=1e-12)

    def state():
        return [a.copy() for a in (search.stage, search.load, search.rows_at, search.first, search.last,
                                   search.row_ex, search.row_dst, search.row_on, search.hist, search.compute)]

    moves = []
    for g in range(search.g_rank.size):
        for at in sorted({int(search.first[g]), int(search.last[g])}):
            unit = search._unit(g, at)
            moves += [(unit, to) for to in (at - 1, at + 1) if search._lowest(unit) <= to <= search.S - 1]
    Gq, G = search.num_q_groups, search.num_groups
    children = Gq + np.flatnonzero(search.kv_src != search.home[search.g_block[Gq:G]])
    moves += [(search.members[search.starts[g]:search.starts[g + 1]], search.S - 1) for g in children.tolist()]
    start, time = state(), search.time.copy()
    rerouted = 0
    for k, (unit, to) in enumerate(moves):
        undo, dst, on = [], search.row_dst.copy(), search.row_on.copy()
        assert search.apply(unit, to, undo)
        rerouted += not (np.array_equal(dst, search.row_dst) and np.array_equal(on, search.row_on))
        if k % 20 == 0:
            other = fresh(search.stage)
            assert np.array_equal(other.load, search.load) and np.array_equal(other.rows_at, search.rows_at)
            np.testing.assert_allclose(search.time, other.time, rtol=1e-12)
        search.undo(undo)
    assert len(moves) > 100 and rerouted > 5, (len(moves), rerouted)
    for a, b in zip(state(), start):
        assert np.array_equal(a, b)
    assert np.array_equal(search.time, time)
    assert search.run()
    assert search.time.max() < time.max()
    np.testing.assert_allclose(search.time, fresh(search.stage).time, rtol=1e-12)


def test_the_runner_up_is_polished_too_and_kept_where_it_ends_faster(monkeypatch):
    # 8 ranks on 2 nodes, 30K tokens of long-tail documents: a NIC / deal pass beats a plan (1.48 vs 1.45
    # ms), but polished it ends faster than the kept plan polished (1.398 vs 1.408 ms): dcp keeps it
    import blockattn.planner.dcp as dcp_module

    polished = []
    original = dcp_module._polished

    def recording(tiles, placement, *args, **kwargs):
        out = original(tiles, placement, *args, **kwargs)
        polished.append((placement.sim_time, out.sim_time))
        return out

    set_dcp(monkeypatch, "_polished", recording)
    clear_plan_cache()
    plan = make_plan(MaskSpec.documents(long_tail_docs(3, 30_000)), 8, block_size=128,
                     topology=Topology(ranks_per_node=4), check=True, **HEADS)
    clear_plan_cache()
    (kept_in, kept_out), (runner_in, runner_out) = polished[:2]
    assert kept_in < runner_in < (1 + dcp_module.POLISH_RUNNER_UP) * kept_in  # (beaten, but close)
    assert runner_out < kept_out
    stats = plan.stats()
    assert stats["sim_time_fwd"] + stats["sim_time_bwd"] == pytest.approx(min(out for _, out in polished), rel=1e-12)
    assert min(out for _, out in polished) == runner_out


def test_a_plan_turned_down_for_its_bytes_is_polished_too_and_kept_where_it_then_wins_by_the_bytes_rule(monkeypatch):
    # 8 ranks on 2 nodes, 32K tokens of long-tail documents: the deal pass finds a faster plan that moves
    # too many more bytes for its gain (``_worth_its_bytes``); polished, it beats the polished kept plan by
    # enough (1.218 -> 1.121x the bound), and dcp keeps it
    import blockattn.planner.dcp as dcp_module

    spec = MaskSpec.documents(long_tail_docs(3, 32768))
    topology = Topology(ranks_per_node=4)
    worth = []
    original = dcp_module._worth_its_bytes

    def recording(tiles, alt, result, sizes, topology=None):
        out = original(tiles, alt, result, sizes, topology)
        worth.append(out)
        return out

    def step(plan):
        stats = plan.stats()
        return stats["sim_time_fwd"] + stats["sim_time_bwd"], stats["bytes_fwd"] + stats["bytes_bwd"]

    with monkeypatch.context() as patch:
        set_dcp(patch, "POLISH_BYTES_REJECTED", False)
        clear_plan_cache()
        without, without_bytes = step(make_plan(spec, 8, block_size=64, topology=topology, check=True,
                                                memory_slack=0, **HEADS))
    set_dcp(monkeypatch, "_worth_its_bytes", recording)
    clear_plan_cache()
    # (no re-plan with memory slack: it finds a plan as fast without the polish)
    plan = make_plan(spec, 8, block_size=64, topology=topology, check=True, memory_slack=0, **HEADS)
    clear_plan_cache()
    time, nbytes = step(plan)
    assert worth[0] is False and worth[-1] is True  # turned down in the deal pass, kept after the polish
    assert time < 0.95 * without
    # it moves more bytes (1.20x), and gains more than the bytes rule asks for them (8% against 2.4%)
    assert nbytes > without_bytes
    assert 1 - time / without > (first_pass_module.BYTES_SLACK - 1) * nbytes / without_bytes
