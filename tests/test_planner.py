"""Planner invariants over random masks, lengths, block sizes, world sizes and every strategy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockattn.masks import MaskSpec
from blockattn.planner import STRATEGIES, CostModel, Topology, check_plan, make_plan, payload_bytes
from blockattn.planner.schedule import KIND_KV, KIND_OUT, KIND_Q

HEADS = dict(num_q_heads=4, num_kv_heads=2, head_dim=16)
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def masks(draw, max_len: int = 700):
    """Every structured MaskSpec kind, a composition and a mask_mod, with awkward lengths."""
    kind = draw(st.sampled_from(["causal", "full", "window", "lambda", "documents", "documents_full",
                                 "shared_question", "causal_blockwise", "docs_window", "mask_mod"]))
    if kind in ("documents", "documents_full", "docs_window"):
        lens = draw(st.lists(st.integers(1, 160), min_size=1, max_size=12))
        spec = MaskSpec.documents(lens, causal=kind != "documents_full")
        if kind == "docs_window":
            spec = spec & MaskSpec.sliding_window(spec.total_len, draw(st.integers(1, 64)))
        return spec
    if kind == "shared_question":
        return MaskSpec.shared_question(draw(st.integers(1, 200)), draw(st.lists(st.integers(1, 120), min_size=1, max_size=5)))
    T = draw(st.integers(1, max_len))
    if kind == "causal":
        return MaskSpec.causal(T)
    if kind == "full":
        return MaskSpec.full(T)
    if kind == "window":
        return MaskSpec.sliding_window(T, draw(st.integers(1, 100)))
    if kind == "lambda":
        return MaskSpec.lambda_mask(T, draw(st.integers(1, 40)), draw(st.integers(1, 100)))
    if kind == "causal_blockwise":
        return MaskSpec.causal_blockwise(T, block=draw(st.integers(1, 64)), k_local=draw(st.integers(1, 3)))
    T = min(T, 300)
    stride = draw(st.integers(2, 7))
    return MaskSpec.from_mask_mod(lambda q, k: (k <= q) & ((q - k) % stride != 1), T)


def _check_invariants(spec: MaskSpec, plan, world_size: int) -> None:
    T, B = spec.total_len, plan.block_size
    bm = spec.block_mask(B)
    check_plan(plan)  # inputs present by stage, receive-once, schedule == derived, per-rank views match

    # every non-empty tile exactly once
    tq, tk, tf = bm.tiles()
    assert torch.equal(plan.tile_q, tq) and torch.equal(plan.tile_kv, tk) and torch.equal(plan.tile_full, tf)
    assert plan.tile_rank.shape == tq.shape and plan.tile_stage.shape == tq.shape

    # every token on exactly one rank
    tokens = torch.cat([plan.local_tokens(r) for r in range(world_size)])
    assert torch.equal(torch.sort(tokens).values, torch.arange(T))

    # stats agree with the tile list and with the schedule rows recomputed by hand
    s = plan.stats()
    dense_pairs = int(spec.to_dense().sum())
    assert sum(s["flops_fwd"]) == pytest.approx(4 * HEADS["head_dim"] * HEADS["num_q_heads"] * dense_pairs)
    assert s["tokens"] == [plan.local_len(r) for r in range(world_size)] and sum(s["tokens"]) == T
    esize = torch.empty((), dtype=plan.dtype).element_size()
    for direction in ("fwd", "bwd"):
        table = plan.schedule.table(direction).numpy().astype(np.int64)
        block_len = np.minimum(B, T - table[:, 4] * B)
        nbytes = payload_bytes(table[:, 3], block_len, element_size=esize, **HEADS)
        sent = np.bincount(table[:, 1], weights=nbytes, minlength=world_size)
        recv = np.bincount(table[:, 2], weights=nbytes, minlength=world_size)
        assert s[f"bytes_sent_{direction}"] == sent.astype(np.int64).tolist()
        assert s[f"bytes_recv_{direction}"] == recv.astype(np.int64).tolist()
        assert s[f"sim_time_{direction}"] >= s[f"lower_bound_{direction}"] * (1 - 1e-9)
    assert s["sim_over_bound"] == pytest.approx((s["sim_time_fwd"] + s["sim_time_bwd"])
                                                / (s["lower_bound_fwd"] + s["lower_bound_bwd"]))

    # backward mirrors forward: one DO and one DQ per OUT, one DKV per received KV
    fwd, bwd = plan.schedule.fwd, plan.schedule.bwd
    assert (bwd[:, 3] == 3).sum() == (fwd[:, 3] == KIND_OUT).sum() == (bwd[:, 3] == 4).sum()
    assert (bwd[:, 3] == 5).sum() == (fwd[:, 3] == KIND_KV).sum()
    assert (fwd[:, 3] == KIND_Q).sum() == (fwd[:, 3] == KIND_OUT).sum()


@SETTINGS
@given(spec=masks(), world_size=st.sampled_from([1, 2, 3, 4, 5, 7, 8]), block_size=st.sampled_from([None, 16, 32, 48]),
       strategy=st.sampled_from(STRATEGIES))
def test_plan_invariants(spec, world_size, block_size, strategy):
    plan = make_plan(spec, world_size, strategy=strategy, block_size=block_size, **HEADS)
    _check_invariants(spec, plan, world_size)
    if strategy != "fcp":  # fcp sizes groups by compute; the others keep memory within two blocks
        lens = plan.stats()["tokens"]
        assert max(lens) - min(lens) <= 2 * plan.block_size


@SETTINGS
@given(spec=masks(), world_size=st.integers(2, 9), ranks_per_node=st.integers(1, 3),
       strategy=st.sampled_from(["dcp", "fcp", "hypergraph"]))
def test_multi_node_plan_invariants(spec, world_size, ranks_per_node, strategy):
    # several nodes (also a partial last node): dcp tries all its initial placements here
    plan = make_plan(spec, world_size, strategy=strategy, topology=Topology(ranks_per_node=ranks_per_node), **HEADS)
    _check_invariants(spec, plan, world_size)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_world_size_64_and_multi_node(strategy):
    spec = MaskSpec.documents([1, 700, 33, 2000, 5, 900, 1])
    plan = make_plan(spec, 64, strategy=strategy, block_size=16, topology=Topology(ranks_per_node=4), **HEADS)
    _check_invariants(spec, plan, 64)


def test_more_ranks_than_blocks():
    spec = MaskSpec.causal(50)
    plan = make_plan(spec, 7, block_size=32, **HEADS)
    _check_invariants(spec, plan, 7)
    assert sum(n == 0 for n in plan.stats()["tokens"]) == 5


@SETTINGS
@given(spec=masks(), world_size=st.integers(1, 6), strategy=st.sampled_from(STRATEGIES))
def test_shard_unshard_roundtrip(spec, world_size, strategy):
    plan = make_plan(spec, world_size, strategy=strategy, **HEADS)
    x = torch.randn(spec.total_len, 3, 2)
    parts = [plan.shard(x, r) for r in range(world_size)]
    for r, part in enumerate(parts):
        assert torch.equal(part, x[plan.local_tokens(r)])
    assert torch.equal(plan.unshard(parts), x)
    lse = torch.randn(3, spec.total_len)  # token axis last, as LSE [H, T]
    assert torch.equal(plan.unshard([plan.shard(lse, r, dim=1) for r in range(world_size)], dim=1), lse)


def test_local_tokens_are_whole_blocks_in_ascending_order():
    spec = MaskSpec.causal(1000)
    plan = make_plan(spec, 3, strategy="zigzag", block_size=64, **HEADS)
    for r in range(3):
        tokens = plan.local_tokens(r)
        blocks = plan.local_blocks[r].long()
        assert torch.equal(torch.unique_consecutive(tokens // 64), blocks)
        assert torch.all(tokens[1:] > tokens[:-1])
    assert plan.local_tokens(int(plan.block_home[-1]))[-1] == 999  # last block is short, not padded


def test_cache_returns_same_plan_and_keys_on_every_argument():
    spec = MaskSpec.causal(300)
    a = make_plan(spec, 3, **HEADS)
    assert make_plan(MaskSpec.causal(300), 3, **HEADS) is a
    assert make_plan(spec, 3, dtype=torch.float32, **HEADS) is not a
    assert make_plan(spec, 3, strategy="ring", **HEADS).strategy == "ring"


def test_the_plan_cache_keeps_to_its_byte_budget_and_always_the_newest_plan(monkeypatch):
    from blockattn.planner import api, clear_plan_cache

    clear_plan_cache()
    specs = [MaskSpec.causal(600 + i) for i in range(3)]
    first = make_plan(specs[0], 2, **HEADS)
    size = api._nbytes(first)
    import dataclasses

    tensors = [getattr(first, f.name) for f in dataclasses.fields(first)]
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)] + list(first.local_blocks)
    tables = [first.schedule.fwd, first.schedule.bwd]
    assert tables[0].numel() > 0
    assert size == sum(t.numel() * t.element_size() for t in tensors + tables)  # (the schedule's tables too)
    monkeypatch.setattr(api, "_CACHE_BYTES", int(2.5 * size))
    second, third = (make_plan(spec, 2, **HEADS) for spec in specs[1:])
    assert make_plan(specs[2], 2, **HEADS) is third and make_plan(specs[1], 2, **HEADS) is second
    assert make_plan(specs[0], 2, **HEADS) is not first  # the oldest went over the budget
    monkeypatch.setattr(api, "_CACHE_BYTES", 1)
    newest = make_plan(MaskSpec.causal(700), 2, **HEADS)
    assert make_plan(MaskSpec.causal(700), 2, **HEADS) is newest and len(api._cache) == 1


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(world_size=0), ValueError, "world_size"),
        (dict(world_size=2.0), TypeError, "world_size"),
        (dict(strategy="metis"), ValueError, "unknown strategy"),
        (dict(effort="quality"), ValueError, "unknown effort 'quality'; choose \"full\""),
        (dict(effort=None), ValueError, "unknown effort"),
        (dict(block_size=0), ValueError, "block_size"),
        (dict(block_size=-16), ValueError, "block_size"),
        (dict(num_q_heads=6, num_kv_heads=4), ValueError, "multiple of num_kv_heads"),
        (dict(head_dim=0), ValueError, "head_dim"),
        (dict(dtype=torch.int32), TypeError, "dtype"),
        (dict(topology="nvlink"), TypeError, "topology"),
        (dict(cost_model="h100"), TypeError, "cost_model must be a blockattn.planner.CostModel, got str"),
        (dict(cost_model=CostModel(), topology=Topology(ranks_per_node=2)), ValueError, "disagree"),
        (dict(cost_model=CostModel(balance_duplex=True)), ValueError, "internal search settings"),
        (dict(cost_model=CostModel(balance_priced_rows=False)), ValueError, "balance_priced_rows"),
        (dict(cost_model=CostModel(home_memory_slack=0.05)), ValueError, "make_plan's memory_slack"),
        (dict(cost_model=CostModel(balance_slack=0.01)), ValueError, "balance_slack"),
        (dict(memory_slack=-0.01), ValueError, r"memory_slack must be in \[0, 0.5\]"),
        (dict(memory_slack=0.75), ValueError, "memory_slack must be in"),
        (dict(memory_slack="5%"), TypeError, "memory_slack must be a number"),
        (dict(memory_slack=True), TypeError, "memory_slack must be a number"),
        (dict(memory_slack=np.float32("nan")), ValueError, "memory_slack must be in"),
        (dict(mask_spec="causal"), TypeError, "MaskSpec"),
    ],
)
def test_bad_arguments(kwargs, exc, words):
    args = dict(mask_spec=MaskSpec.causal(100), world_size=2, **HEADS)
    args.update(kwargs)
    with pytest.raises(exc, match=words):
        make_plan(args.pop("mask_spec"), args.pop("world_size"), **args)


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(fwd_rate=0.0), ValueError, "fwd_rate must be a finite number > 0"),
        (dict(fwd_rate=float("inf")), ValueError, "fwd_rate"),
        (dict(fwd_rate="500e12"), TypeError, "fwd_rate must be a number"),
        (dict(bwd_flops_factor=-2.5), ValueError, "bwd_flops_factor"),
        (dict(bwd_flops_factor=True), TypeError, "bwd_flops_factor"),
        (dict(topology=8), TypeError, "CostModel.topology must be"),
        (dict(balance_overlap=-1.0), ValueError, "balance_overlap"),
        (dict(balance_slack=-0.01), ValueError, "balance_slack must be >= 0"),
        (dict(home_memory_slack=float("nan")), ValueError, "home_memory_slack"),
    ],
)
def test_bad_cost_models(kwargs, exc, words):
    with pytest.raises(exc, match=words):
        CostModel(**kwargs)


def test_from_kernel_tflops_refuses_what_is_not_a_speed():
    for fwd, bwd, exc in ((0, 400, ValueError), (600, float("nan"), ValueError), ("600", 400, TypeError)):
        with pytest.raises(exc, match="TFLOP/s"):
            CostModel.from_kernel_tflops(fwd, bwd)


def test_a_cost_model_sets_the_rates_plans_are_made_and_simulated_for():
    """``make_plan(cost_model=...)``: its compute rates give the stats' bounds and simulated times, and
    key the cache; the topology alone is the default rates' cost model."""
    spec = MaskSpec.documents([900, 2500, 40, 1700])
    topology = Topology(ranks_per_node=2)
    plain = make_plan(spec, 5, topology=topology, **HEADS)
    assert make_plan(spec, 5, cost_model=CostModel(topology=topology), **HEADS) is plain
    assert make_plan(spec, 5, cost_model=CostModel(topology=topology), topology=topology, **HEADS) is plain
    slow = CostModel.from_kernel_tflops(250, 200, topology=topology)  # backward less efficient than forward
    assert slow.fwd_rate == 250e12 and slow.bwd_flops_factor == pytest.approx(2.5 * 250 / 200)
    plan = make_plan(spec, 5, cost_model=slow, **HEADS)
    assert plan is not plain and plan.cost_model == slow and plan.fingerprint() != plain.fingerprint()
    stats, flops = plan.stats(), sum(plan.stats()["flops_fwd"])
    assert stats["lower_bound_fwd"] == pytest.approx(flops / (5 * 250e12))
    assert stats["lower_bound_bwd"] == pytest.approx(flops * 2.5 * 250 / 200 / (5 * 250e12))
    assert stats["sim_time_fwd"] >= stats["lower_bound_fwd"] and stats["sim_time_bwd"] >= stats["lower_bound_bwd"]
    assert "250 TFLOP/s" in plan.explain() and "H200 model" in plain.explain()
    check_plan(plan)


@SETTINGS
@given(spec=masks(), world_size=st.integers(3, 9), ranks_per_node=st.integers(1, 4),
       fwd_tflops=st.sampled_from([50, 500, 5000]), bwd_tflops=st.sampled_from([100, 500]),
       links=st.sampled_from([{}, dict(intra_bw=64e9, inter_bw=12.5e9), dict(inter_bw=450e9, inter_lat=0.0),
                              dict(intra_lat=0.0, inter_lat=200e-6)]))
def test_dcp_keeps_its_promise_under_any_cost_model(spec, world_size, ranks_per_node, fwd_tflops, bwd_tflops, links):
    """On several nodes dcp is never slower than a baseline or the fcp strategy under the cost model it is
    given, whatever the GPUs' speed against the links (compute-bound to transfer-bound) and the links'
    (PCIe-class to NICs as fast as NVLink, latencies from none to 200 us)."""
    if world_size <= ranks_per_node:
        world_size = ranks_per_node + 1
    topology = Topology(ranks_per_node=ranks_per_node, **links)
    cost_model = CostModel.from_kernel_tflops(fwd_tflops, bwd_tflops, topology=topology)
    over = {strategy: make_plan(spec, world_size, strategy=strategy, block_size=32, cost_model=cost_model,
                                **HEADS).stats()["sim_over_bound"]
            for strategy in ("dcp", "zigzag", "allgather", "ring", "fcp")}
    assert over["dcp"] <= min(over.values()) * (1 + 1e-9), over


def test_the_default_block_size_grows_where_the_mask_has_millions_of_tiles():
    from blockattn.planner import api, default_block_size

    T = 1 << 20
    causal = MaskSpec.causal(T)
    assert default_block_size(T, 64) == 128  # the kernels' tile, without the mask
    # one 1M-token document on 64 ranks: 33.6M tiles at 128, 2.1M at 512
    B = default_block_size(T, 64, causal)
    assert B == 512 and causal.num_tiles(B) <= api.MAX_AUTO_TILES < causal.num_tiles(B // 2)
    # 256 ranks: 8 blocks of 512 each
    assert default_block_size(T, 256, causal) == 512
    # 1024 ranks: past the 8 blocks per rank while the tiles exceed what make_plan plans
    assert default_block_size(T, 1024, causal) == 512
    assert causal.num_tiles(256) > api.MAX_PLAN_TILES >= causal.num_tiles(512)
    # short documents: few tiles at 128
    docs = MaskSpec.documents([1000] * 1000 + [T - 1_000_000])
    assert docs.num_tiles(128) < api.MAX_AUTO_TILES and default_block_size(T, 64, docs) == 128


@SETTINGS
@given(masks(), st.integers(1, 9), st.integers(0, 400), st.integers(0, 800))
def test_the_default_block_size_is_the_smallest_within_the_tile_limits(spec, world_size, soft, hard):
    """Under any limits (scaled down to these masks' sizes): a power of two whose tile count make_plan
    accepts, grown only past a size whose tiles exceed the limits."""
    from unittest import mock

    from blockattn.planner import api, default_block_size

    hard = max(hard, soft)
    T = spec.total_len
    with mock.patch.multiple(api, MAX_AUTO_TILES=soft, MAX_PLAN_TILES=hard, MAX_AUTO_BLOCK_SIZE=64,
                             MIN_AUTO_BLOCKS_PER_RANK=1):
        B = default_block_size(T, world_size, spec)
        base = default_block_size(T, world_size)
        assert B >= base and B & (B - 1) == 0
        assert spec.num_tiles(B) <= hard or B >= T  # (one block: a single tile)
        if B > base:
            half = B // 2
            roomy = half < 64 and -(-T // B) >= api.MIN_AUTO_BLOCKS_PER_RANK * world_size
            assert spec.num_tiles(half) > hard or (roomy and spec.num_tiles(half) > soft)
        if spec.num_tiles(B) <= hard:
            api.check_tile_count(spec, B, world_size)  # accepted


def test_make_plan_takes_the_mask_aware_default_block_size(monkeypatch):
    from blockattn.planner import api

    monkeypatch.setattr(api, "MAX_AUTO_TILES", 2000)
    spec = MaskSpec.causal(8192)  # 2080 tiles at 128, 528 at 256 (32 blocks on one rank)
    plan = make_plan(spec, 1, **HEADS)
    assert plan.block_size == 256 and plan.tile_q.numel() == spec.num_tiles(256) == 528
    check_plan(plan)


def test_a_mask_with_too_many_tiles_is_refused_with_the_block_size_to_use():
    spec = MaskSpec.causal(1 << 20)
    with pytest.raises(ValueError, match=r"33,558,528 non-empty tiles at block_size=128 .* use block_size=512 "):
        make_plan(spec, 64, block_size=128, **HEADS)


def test_bad_shard_and_unshard_arguments():
    plan = make_plan(MaskSpec.causal(100), 3, **HEADS)
    with pytest.raises(ValueError, match="rank"):
        plan.local_tokens(3)
    with pytest.raises(ValueError, match="100"):
        plan.shard(torch.zeros(99, 2), 0)
    with pytest.raises(ValueError, match="3 per-rank"):
        plan.unshard([torch.zeros(1)])
    with pytest.raises(TypeError, match="group"):
        plan.unshard(torch.zeros(10))
    with pytest.raises(ValueError, match="Topology"):
        Topology(ranks_per_node=0)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=masks(), world_size=st.integers(1, 7), block=st.sampled_from([16, 32, 64]), seed=st.integers(0, 2**16))
def test_input_groups_grouped_once_match_the_dense_groups_under_any_staging(spec, world_size, block, seed):
    """``InputGroups`` (the tiles of each (rank, block) input found once, per staging two segment
    reductions) gives exactly the dense ``receive_groups`` of the remote q- and kv-blocks under random
    homes, tile ranks and stagings."""
    from blockattn.planner.schedule import InputGroups, receive_groups
    from blockattn.planner.tiles import TileSet

    tiles = TileSet.from_block_mask(spec.block_mask(block))
    rng = np.random.default_rng(seed)
    home = rng.integers(0, world_size, tiles.num_blocks)
    rank = rng.integers(0, world_size, tiles.num_tiles)
    remote_q, remote_kv = home[tiles.q] != rank, home[tiles.kv] != rank
    grouped = InputGroups(rank, tiles.q, tiles.kv, remote_q, remote_kv)
    for _ in range(3):
        stage = rng.integers(0, 5, tiles.num_tiles)
        expected = [receive_groups(rank[remote], block[remote], stage[remote], tiles.num_blocks)
                    for block, remote in ((tiles.q, remote_q), (tiles.kv, remote_kv))]
        for got, want in zip(grouped(stage), expected):
            assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want))


@SETTINGS
@given(spec=masks(), block=st.sampled_from([16, 32, 48]), factor=st.integers(2, 9))
def test_coarsen_merges_tiles_as_a_dictionary_of_merged_pairs_does(spec, block, factor):
    """``coarsen`` (a dense presence table over each merged row's kv span; powers of two by a shift)
    equals merging by brute force: each merged tile's pairs summed, FULL only when all factor**2 real
    tiles exist and are FULL, (q, kv)-sorted, and every real tile mapped to its merged tile."""
    from blockattn.planner.tiles import TileSet, _coarsen

    tiles = TileSet.from_block_mask(spec.block_mask(block))
    merged, of_fine = _coarsen(tiles, factor)
    pairs, full = {}, {}
    for q, kv, p, f in zip(tiles.q.tolist(), tiles.kv.tolist(), tiles.pairs.tolist(), tiles.full.tolist()):
        key = (q // factor, kv // factor)
        pairs[key] = pairs.get(key, 0) + p
        full[key] = full.get(key, 0) + int(f)
    keys = sorted(pairs)
    assert merged.num_blocks == -(-tiles.num_blocks // factor) and merged.block_size == block * factor
    assert [(q, kv) for q, kv in zip(merged.q.tolist(), merged.kv.tolist())] == keys
    assert merged.pairs.tolist() == [pairs[k] for k in keys]
    assert merged.full.tolist() == [full[k] == factor * factor for k in keys]
    assert np.array_equal(merged.q[of_fine], tiles.q // factor)
    assert np.array_equal(merged.kv[of_fine], tiles.kv // factor)


@SETTINGS
@given(spec=masks(), world_size=st.integers(1, 7), block=st.sampled_from([16, 32]), factor=st.sampled_from([2, 4, 8]),
       seed=st.integers(0, 2**16))
def test_a_schedule_derived_from_merged_tiles_equals_the_one_derived_from_every_real_tile(
        spec, world_size, block, factor, seed):
    """``derive_schedule_merged`` (a one-node plan on merged blocks: each real (rank, block) input from
    the merged tiles that cover its row or column) gives exactly ``derive_schedule``'s tables for the real
    tiles under random merged homes, ranks and both stages, lengths not a multiple of the merged block."""
    from blockattn.planner.schedule import derive_schedule, derive_schedule_merged
    from blockattn.planner.tiles import TileSet, _coarsen

    tiles = TileSet.from_block_mask(spec.block_mask(block))
    merged, of_fine = _coarsen(tiles, factor)
    rng = np.random.default_rng(seed)
    home = rng.integers(0, world_size, merged.num_blocks)
    rank = rng.integers(0, world_size, merged.num_tiles)
    stage, stage_bwd = rng.integers(0, 4, merged.num_tiles), rng.integers(0, 4, merged.num_tiles)
    got = derive_schedule_merged(tiles, merged, of_fine, factor, home, rank, stage, stage_bwd, num_stages=4,
                                 world_size=world_size)
    want = derive_schedule(home[np.arange(tiles.num_blocks) // factor], tiles.q, tiles.kv, rank[of_fine],
                           stage[of_fine], num_blocks=tiles.num_blocks, num_stages=4, world_size=world_size,
                           tile_stage_bwd=stage_bwd[of_fine])
    assert torch.equal(got.fwd, want.fwd) and torch.equal(got.bwd, want.bwd)
    assert got.num_stages == want.num_stages and got.world_size == want.world_size


def test_a_schedule_from_merged_tiles_needs_blocks_merged_by_a_power_of_two():
    from blockattn.planner.schedule import derive_schedule_merged
    from blockattn.planner.tiles import TileSet, _coarsen

    tiles = TileSet.from_block_mask(MaskSpec.causal(1000).block_mask(32))
    merged, of_fine = _coarsen(tiles, 3)
    zeros = np.zeros(merged.num_tiles, dtype=np.int64)
    with pytest.raises(ValueError, match="power of two, got factor=3"):
        derive_schedule_merged(tiles, merged, of_fine, 3, np.zeros(merged.num_blocks, dtype=np.int64), zeros, zeros,
                               zeros, num_stages=1, world_size=1)


@SETTINGS
@given(spec=masks(), world_size=st.integers(2, 9), ranks_per_node=st.integers(1, 4),
       block_size=st.sampled_from([16, 32]))
def test_dcp_on_several_nodes_is_never_slower_than_a_baseline_or_the_fcp_strategy(spec, world_size, ranks_per_node,
                                                                                  block_size):
    # dcp weighs zigzag (ring stages and all KV in one stage), ring's contiguous shards and the fcp
    # strategy's plan as they are (planner/dcp.py), so on several nodes it is never slower in the cost model
    # (a random search found ring faster on sliding windows before ring was among them: docs/planner_log.md)
    if world_size <= ranks_per_node:
        world_size = ranks_per_node + 1
    topology = Topology(ranks_per_node=ranks_per_node)
    times = {}
    for strategy in ("dcp", "zigzag", "allgather", "ring", "fcp"):
        stats = make_plan(spec, world_size, strategy=strategy, block_size=block_size, topology=topology,
                          **HEADS).stats()
        times[strategy] = stats["sim_time_fwd"] + stats["sim_time_bwd"]
    assert times["dcp"] <= min(times.values()) * (1 + 1e-9), times


@st.composite
def long_masks(draw):
    """Causal documents of up to 8K tokens (one to four), alone or with a sliding window: batches whose
    plans on a few ranks with compute-bound heads come near the bound."""
    spec = MaskSpec.documents(draw(st.lists(st.integers(1, 8192), min_size=1, max_size=4)))
    if draw(st.booleans()):
        spec = spec & MaskSpec.sliding_window(spec.total_len, draw(st.integers(64, 4096)))
    return spec


@SETTINGS
@given(spec=long_masks(), world_size=st.integers(2, 8), block_size=st.sampled_from([32, 64, 128]))
def test_dcp_on_one_node_is_never_slower_than_a_baseline_by_more_than_rival_gain(spec, world_size, block_size):
    # On one node a plan over GOOD_ENOUGH of the bound is checked against the baselines; one within it
    # against those whose busiest rank computes for RIVAL_GAIN less than it takes (planner/dcp.py): no
    # baseline is faster than dcp, or at most by RIVAL_GAIN near the bound (these small masks are planned
    # on their real blocks; a batch planned on merged blocks is tested in test_planner_quality.py).
    # Compute-bound heads, so that the plans come near the bound.
    from blockattn.planner.dcp import RIVAL_GAIN
    from blockattn.planner.first_pass import GOOD_ENOUGH

    topology = Topology(ranks_per_node=8)
    over = {}
    for strategy in ("dcp", "zigzag", "allgather", "ring"):
        over[strategy] = make_plan(spec, world_size, strategy=strategy, block_size=block_size, topology=topology,
                                   num_q_heads=32, num_kv_heads=8, head_dim=128).stats()["sim_over_bound"]
    slack = 1e-9 if over["dcp"] > GOOD_ENOUGH else RIVAL_GAIN + 1e-9
    assert over["dcp"] <= min(over["zigzag"], over["allgather"], over["ring"]) * (1 + slack), over
