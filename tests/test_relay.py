"""Node-level KV relays (planner/relay.py): relayed plans are valid, cheaper on the NIC, deterministic,
and check_plan rejects broken relays / DKV chains.

Invariants are checked twice: by check_plan and by an independent replay of the schedule below
(who holds which block when, and which ranks' dK/dV contributions reach each home).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_planner import HEADS, masks

from blockattn.masks import MaskSpec
from blockattn.planner import CostModel, Topology, check_plan, clear_plan_cache, make_plan, payload_bytes
from blockattn.planner.api import build_plan
from blockattn.planner.placement import Placement
from blockattn.planner.relay import add_relays, relay_candidates, relay_variants
from blockattn.planner.check import PlanConsistencyError
from blockattn.planner.schedule import KIND_DKV, KIND_DO, KIND_KV, KIND_Q, CommSchedule, as_relay_table
from blockattn.planner.tiles import TileSet

SIZES = dict(HEADS, element_size=2)
SLOW_NIC = dict(inter_bw=2e9)  # inter-node link 225x slower than NVLink: relays clearly pay off
SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _placement_of(plan) -> Placement:
    """The plan's placement without relays (a plan dcp already relayed keeps its stages, loses its relays)."""
    as64 = lambda t: t.numpy().astype(np.int64)  # noqa: E731
    schedule = plan.schedule if plan.kv_relay.numel() == 0 else None
    return Placement(as64(plan.block_home), as64(plan.tile_rank), as64(plan.tile_stage), schedule=schedule)


def _build(spec, tiles, placement, world_size, topology, strategy="dcp+relay"):
    plan = build_plan(tiles, placement, strategy=strategy, world_size=world_size, dtype=torch.bfloat16,
                      mask_signature=spec.signature(), cost_model=CostModel(topology=topology), **HEADS)
    check_plan(plan)
    return plan


def dcp_placement_without_relays(tiles, world_size, cost_model, sizes, max_stages=4, init=None) -> Placement:
    """dcp's own balanced placement before any relay (make_plan adds relays itself, and on small
    batches may return a baseline placement instead), so tests can relay it themselves; ``init``
    forces dcp's initial data placement."""
    from blockattn.planner.first_pass import _dcp

    own = _dcp(tiles, world_size, cost_model, max_stages, sizes, init, relays=False)
    return Placement(own.block_home, own.tile_rank, own.tile_stage)


def relayed_plans(spec, world_size, topology, block_size=None, max_stages=4, init=None):
    """(dcp plan, [every relayed candidate of it as a Plan], add_relays' choice as a Plan); ``init``
    forces dcp's initial data placement."""
    block_size = make_plan(spec, world_size, block_size=block_size, topology=topology, max_stages=max_stages,
                           **HEADS).block_size
    tiles = TileSet.from_block_mask(spec.block_mask(block_size))
    own = dcp_placement_without_relays(tiles, world_size, CostModel(topology=topology), SIZES, max_stages, init)
    base = _build(spec, tiles, own, world_size, topology, strategy="dcp")
    kw = dict(world_size=world_size, cost_model=base.cost_model, max_stages=max_stages, sizes=SIZES)
    _, variants = relay_variants(tiles, _placement_of(base), **kw)
    chosen = add_relays(tiles, _placement_of(base), **kw)
    plans = [_build(spec, tiles, v, world_size, topology) for v in variants]
    return base, plans, _build(spec, tiles, chosen, world_size, topology)


def replay(plan) -> None:
    """Independent of check_plan: walk the rows in stage order and assert that every source holds what
    it sends (KV relays: received in an earlier stage), every tile finds its inputs by its forward and
    its backward stage, and every rank's dK/dV contribution to a kv-block reaches the block's home
    exactly once, each hop leaving only after the sender computed its last (backward) tile of the
    block and heard from all its children."""
    P, S = plan.world_size, plan.num_stages
    home = plan.block_home.tolist()
    held = {}  # (rank, kind, block) -> stage from which the rank holds it
    for r in range(P):
        for b in plan.local_blocks[r].tolist():
            held[(r, KIND_Q, b)] = held[(r, KIND_KV, b)] = -1
    for s, src, dst, kind, b in plan.schedule.fwd.tolist():
        if kind in (KIND_Q, KIND_KV):
            assert held.get((src, kind, b), S + 1) < s, f"rank {src} sends block {b} in stage {s} before holding it"
            assert (dst, kind, b) not in held
            held[(dst, kind, b)] = s
    for s, src, dst, kind, b in plan.schedule.bwd.tolist():
        if kind == KIND_DO:
            assert src == home[b] and 0 < s and (dst, KIND_DO, b) not in held
            held[(dst, KIND_DO, b)] = s
    last = {}  # (rank, kv-block) -> last backward compute stage
    for q, kv, r, s, sb in zip(plan.tile_q.tolist(), plan.tile_kv.tolist(), plan.tile_rank.tolist(),
                               plan.tile_stage.tolist(), plan.tile_stage_bwd.tolist()):
        assert held.get((r, KIND_Q, q), S + 1) <= s and held.get((r, KIND_KV, kv), S + 1) <= s
        # backward: Q and KV are kept from the forward; dO of a remote q-block arrives by the stage
        assert home[q] == r or held.get((r, KIND_DO, q), S + 1) <= sb
        last[(r, kv)] = max(last.get((r, kv), -1), sb)
    # DKV: each rank's contribution set travels with its partial, in stage (= table) order
    gathered = {key: {key[0]} for key in last}
    arrived = {}  # (rank, block) -> latest stage a child's partial arrived
    for s, src, dst, kind, b in plan.schedule.bwd.tolist():
        if kind != KIND_DKV:
            continue
        assert (src, b) in gathered, f"rank {src} sends a DKV partial of block {b} it does not have (or twice)"
        # (a transit rank computes nothing with the block: only its children's arrivals bound it)
        assert last.get((src, b), -1) < s and arrived.get((src, b), -1) < s, f"rank {src} sends DKV {b} too early"
        gathered.setdefault((dst, b), set()).update(gathered.pop((src, b)))
        arrived[(dst, b)] = max(arrived.get((dst, b), -1), s)
    for b in range(plan.num_blocks):
        contributors = {r for (r, kv) in last if kv == b}
        assert gathered.get((home[b], b), set()) == contributors, f"DKV of block {b} misses contributions"
    assert all(r == home[b] for (r, b) in gathered), "a DKV partial is stranded away from its home"


def _check_relayed(plan, base) -> None:
    """Relayed plan vs the plan it came from: same homes and tile ranks, tiles only later, bytes ==
    sum of rows, and one inter-node KV copy per (block, remote node) where a relay applies."""
    replay(plan)
    assert torch.equal(plan.block_home, base.block_home) and torch.equal(plan.tile_rank, base.tile_rank)
    s = plan.stats()
    for direction in ("fwd", "bwd"):
        table = plan.schedule.table(direction).numpy().astype(np.int64)
        block_len = np.minimum(plan.block_size, plan.total_len - table[:, 4] * plan.block_size)
        nbytes = payload_bytes(table[:, 3], block_len, **SIZES)
        for what, col in (("sent", 1), ("recv", 2)):
            expect = np.bincount(table[:, col], nbytes, plan.world_size).astype(np.int64).tolist()
            assert s[f"bytes_{what}_{direction}"] == expect
    relay = plan.kv_relay.numpy().astype(np.int64)
    assert s["kv_relays"] == relay.shape[0] > 0
    rpn = plan.topology.ranks_per_node
    fwd = plan.schedule.fwd.numpy().astype(np.int64)
    kv = fwd[fwd[:, 3] == KIND_KV]
    inter = kv[kv[:, 1] // rpn != kv[:, 2] // rpn]
    for b, node in {(int(b), int(d) // rpn) for b, d, _ in relay}:
        # one copy crosses to the node (the proxy's); receivers that need the block in that same stage
        # may keep their own copy from home (the cost model's choice), later ones all get it relayed
        into = inter[(inter[:, 4] == b) & (inter[:, 2] // rpn == node)]
        assert into.shape[0] >= 1 and np.all(into[:, 0] == into[:, 0].min())
    assert np.all(relay[:, 1] // rpn == relay[:, 2] // rpn), "relays stay inside a node"


@SETTINGS
@given(spec=masks(), world_size=st.integers(4, 9), ranks_per_node=st.integers(2, 3),
       block_size=st.sampled_from([None, 16, 32]), max_stages=st.sampled_from([2, 4, 8]))
def test_relay_variants_are_valid_plans(spec, world_size, ranks_per_node, block_size, max_stages):
    topology = Topology(ranks_per_node=ranks_per_node, **SLOW_NIC)
    base, variants, chosen = relayed_plans(spec, world_size, topology, block_size=block_size, max_stages=max_stages)
    for plan in variants:
        _check_relayed(plan, base)
        assert torch.all(plan.tile_stage >= base.tile_stage), "delays only move tiles later"
    assert chosen.stats()["sim_time_fwd"] + chosen.stats()["sim_time_bwd"] <= (
        base.stats()["sim_time_fwd"] + base.stats()["sim_time_bwd"]) * (1 + 1e-9)


def _inter_kv_bytes(plan) -> int:
    fwd = plan.schedule.fwd.numpy().astype(np.int64)
    rpn = plan.topology.ranks_per_node
    return int(plan.transfer_bytes("fwd")[(fwd[:, 3] == KIND_KV) & (fwd[:, 1] // rpn != fwd[:, 2] // rpn)].sum())


@pytest.mark.parametrize("mask", ["shared_question", "causal_blockwise"])
def test_relays_cut_inter_node_traffic(mask):
    # every relayed candidate sends fewer KV bytes over the inter-node links, one copy per
    # (block, node) with two ranks per node; add_relays keeps one only when it is faster
    spec = (MaskSpec.shared_question(1024, [900, 1200, 800, 1000, 1100, 950, 1000, 1100])
            if mask == "shared_question" else MaskSpec.causal_blockwise(8192, block=1024, k_local=2))
    base, variants, chosen = relayed_plans(spec, 8, Topology(ranks_per_node=2), block_size=64)
    assert variants
    for plan in variants:
        _check_relayed(plan, base)
        assert _inter_kv_bytes(plan) < _inter_kv_bytes(base)
        fwd = plan.schedule.fwd.numpy().astype(np.int64)
        kv = fwd[fwd[:, 3] == KIND_KV]
        inter = kv[kv[:, 1] // 2 != kv[:, 2] // 2]
        relayed = np.unique(plan.kv_relay[:, 0].numpy() * 8 + plan.kv_relay[:, 1].numpy() // 2)
        copies = np.bincount(inter[:, 4] * 8 + inter[:, 2] // 2, minlength=relayed.max() + 1)[relayed]
        assert np.all(copies == 1)
    time = lambda p: p.stats()["sim_time_fwd"] + p.stats()["sim_time_bwd"]  # noqa: E731
    assert time(chosen) <= time(base) * (1 + 1e-9)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_relay_proxies_are_earliest_receivers_and_rotation_spreads_them(data):
    """Per (block, remote node): the proxy is a receiver there with the earliest first stage, and every
    other receiver is a candidate; rotating picks the (b mod n)-th of the n earliest receivers."""
    P, rpn = data.draw(st.sampled_from([(6, 3), (8, 4), (9, 3)]))
    nB = 12
    pairs = sorted(set(data.draw(st.lists(st.tuples(st.integers(0, P - 1), st.integers(0, nB - 1)), min_size=2,
                                          max_size=60))))
    r = np.array([p[0] for p in pairs], dtype=np.int64)
    b = np.array([p[1] for p in pairs], dtype=np.int64)
    first = np.array(data.draw(st.lists(st.integers(1, 3), min_size=len(pairs), max_size=len(pairs))), dtype=np.int64)
    home = np.array(data.draw(st.lists(st.integers(0, P - 1), min_size=nB, max_size=nB)), dtype=np.int64)
    keep = home[b] != r  # receive groups are remote by definition
    groups = (r[keep], b[keep], first[keep], first[keep])
    for rotate in (False, True):
        cand = relay_candidates(home, groups, ranks_per_node=rpn, rotate=rotate)
        expected = 0
        for block in range(nB):
            for node in range(P // rpn):
                here = (groups[1] == block) & (groups[0] // rpn == node) & (node != home[block] // rpn)
                if here.sum() < 2:
                    continue
                expected += int(here.sum()) - 1
                earliest = np.sort(groups[0][here & (groups[2] == groups[2][here].min())])
                proxy = earliest[block % earliest.size] if rotate else earliest[0]
                mine = (cand.block == block) & (cand.dst // rpn == node)
                assert np.all(cand.proxy[mine] == proxy)
                assert sorted(cand.dst[mine].tolist()) == sorted(set(groups[0][here].tolist()) - {proxy})
                assert np.all(cand.first[mine] >= cand.proxy_first[mine])
        assert (cand.block.size if cand is not None else 0) == expected


def test_relays_win_when_the_inter_node_link_is_the_bottleneck():
    # a shared question read by every rank, over a 2 GB/s inter-node link: relaying it inside the
    # nodes saves more forward time than the dK/dV reduction through the proxies adds backward. The
    # question is homed in one run ("contiguous"): dcp's default now scatters its blocks over every
    # rank (shared blocks do not join segments, planner/fcp.py), a faster plan that needs fewer relays
    spec = MaskSpec.shared_question(1024, [900, 1200, 800, 1000, 1100, 950, 1000, 1100])
    base, _, chosen = relayed_plans(spec, 8, Topology(ranks_per_node=2, **SLOW_NIC), block_size=64,
                                    init="contiguous")
    assert chosen.kv_relay.shape[0] > 0
    _check_relayed(chosen, base)
    b, c = base.stats(), chosen.stats()
    assert c["sim_time_fwd"] + c["sim_time_bwd"] < b["sim_time_fwd"] + b["sim_time_bwd"]
    assert _inter_kv_bytes(chosen) < _inter_kv_bytes(base)


def test_relays_are_deterministic_and_in_the_fingerprint():
    spec = MaskSpec.shared_question(1024, [900, 1200, 800, 1000, 1100, 950, 1000, 1100])
    topology = Topology(ranks_per_node=2, **SLOW_NIC)
    _, _, a = relayed_plans(spec, 8, topology, block_size=64, init="contiguous")  # (relays pay: see above)
    clear_plan_cache()
    _, _, b = relayed_plans(spec, 8, topology, block_size=64, init="contiguous")
    assert a.kv_relay.shape[0] > 0 and a.fingerprint() == b.fingerprint()
    stripped = dataclasses.replace(a, kv_relay=torch.zeros((0, 3), dtype=torch.int32))
    assert stripped.fingerprint() != a.fingerprint()
    with pytest.raises(PlanConsistencyError, match="kv_relay has 0 rows"):
        check_plan(stripped)


def test_one_node_and_relay_free_placements_come_back_unchanged():
    spec = MaskSpec.shared_question(256, [300, 200, 400])
    for world_size, topology in ((4, Topology(ranks_per_node=8)), (4, Topology(ranks_per_node=1))):
        plan = make_plan(spec, world_size, block_size=32, topology=topology, **HEADS)
        tiles = TileSet.from_block_mask(spec.block_mask(32))
        placement = _placement_of(plan)
        out = add_relays(tiles, placement, world_size=world_size, cost_model=plan.cost_model, max_stages=4,
                         sizes=SIZES)
        assert out is placement  # one node / one rank per node: nothing to relay
    with pytest.raises(ValueError, match="max_stages"):
        add_relays(tiles, placement, world_size=4, cost_model=CostModel(Topology(ranks_per_node=2)), max_stages=0,
                   sizes=SIZES)
    with pytest.raises(ValueError, match="does not fit"):
        add_relays(tiles, Placement(placement.block_home[:-1], placement.tile_rank, placement.tile_stage),
                   world_size=4, cost_model=CostModel(Topology(ranks_per_node=2)), max_stages=4, sizes=SIZES)


# ----------------------------------------------------------------------------- hand-made relays
def hand_relay_plan(relay=((0, 3, 2),), extra_stage=False):
    """4 ranks on 2 nodes ({0, 1}, {2, 3}), causal mask over 4 blocks of 16 tokens (block i at home i),
    every tile on its q-block's home. Remote kv-blocks arrive in stage 1, except that rank 3 reads
    block 0 in stage 2 - from rank 2 with the default relay row ``(block 0, dst 3, src 2)``.
    ``extra_stage``: rank 3 reads block 1 in stage 3, so the plan has room for a DKV reduce 3 -> 2 -> 0."""
    spec = MaskSpec.causal(64)
    tiles = TileSet.from_block_mask(spec.block_mask(16))
    home = np.arange(4)
    rank = home[tiles.q]
    stage = np.where(rank == tiles.kv, 0, 1)
    stage[(rank == 3) & (tiles.kv == 0)] = 2
    if extra_stage:
        stage[(rank == 3) & (tiles.kv == 1)] = 3
    # backward stages = forward stages, so the DKV reduce tree follows the forward's stage numbers
    placement = Placement(home, rank, stage, kv_relay=np.array(relay), tile_stage_bwd=stage)
    plan = build_plan(tiles, placement, strategy="hand-relay", world_size=4, dtype=torch.float32,
                      mask_signature=spec.signature(), cost_model=CostModel(Topology(ranks_per_node=2)), **HEADS)
    return spec, plan


def test_hand_made_relay_and_dkv_tree():
    _, plan = hand_relay_plan()
    check_plan(plan)
    replay(plan)
    fwd, bwd = plan.schedule.fwd.tolist(), plan.schedule.bwd.tolist()
    assert [1, 0, 2, KIND_KV, 0] in fwd and [2, 2, 3, KIND_KV, 0] in fwd
    # S = 3: the child's partial would reach the proxy in exchange 3, too late to forward: straight home
    assert [3, 3, 0, KIND_DKV, 0] in bwd and [2, 2, 0, KIND_DKV, 0] in bwd
    _, plan = hand_relay_plan(extra_stage=True)
    check_plan(plan)
    replay(plan)
    # S = 4: child 3 -> proxy 2 at its last stage + 1 = 3, the proxy sends the sum home at 4
    bwd = plan.schedule.bwd.tolist()
    assert [3, 3, 2, KIND_DKV, 0] in bwd and [4, 2, 0, KIND_DKV, 0] in bwd
    assert not any(r[3] == KIND_DKV and r[1] == 3 and r[4] == 0 and r[2] == 0 for r in bwd)


def test_check_plan_rejects_relaying_before_receiving():
    _, plan = hand_relay_plan(relay=((1, 3, 2),))  # rank 2 receives block 1 in stage 1 = rank 3's need
    with pytest.raises(PlanConsistencyError, match="relays KV block 1 in stage 1 but holds it only from stage 1"):
        check_plan(plan)
    # rank 0 computes nothing with block 1: a transit source, which would have to receive it in stage 0
    _, plan = hand_relay_plan(relay=((1, 3, 0),))
    with pytest.raises(PlanConsistencyError, match="rank 0 is a transit source of KV block 1"):
        check_plan(plan)
    _, plan = hand_relay_plan(relay=((0, 3, 0),))
    with pytest.raises(PlanConsistencyError, match="source other than the home"):
        check_plan(plan)


def _with_bwd(plan, rows):
    table = torch.tensor(sorted(rows), dtype=torch.int32)
    sched = CommSchedule(fwd=plan.schedule.fwd, bwd=table, num_stages=plan.num_stages, world_size=plan.world_size)
    return dataclasses.replace(plan, schedule=sched)


def test_check_plan_rejects_dkv_cycles_wrong_order_and_q_relays():
    _, plan = hand_relay_plan(extra_stage=True)
    bwd = [r for r in plan.schedule.bwd.tolist() if not (r[3] == KIND_DKV and r[4] == 0 and r[1] in (2, 3))]
    # cycle: 3 -> 2 and 2 -> 3, neither reaches home 0
    with pytest.raises(PlanConsistencyError, match="does not forward it in a later stage"):
        check_plan(_with_bwd(plan, bwd + [[2, 3, 2, KIND_DKV, 0], [3, 2, 3, KIND_DKV, 0]]))
    # wrong order: the child's partial reaches the proxy in the stage the proxy already sends home
    with pytest.raises(PlanConsistencyError, match="does not forward it in a later stage"):
        check_plan(_with_bwd(plan, bwd + [[3, 3, 2, KIND_DKV, 0], [3, 2, 0, KIND_DKV, 0]]))
    # a well-ordered chain that the placement does not imply is still caught by the derivation
    with pytest.raises(PlanConsistencyError, match="bwd schedule differs"):
        check_plan(_with_bwd(plan, bwd + [[2, 3, 2, KIND_DKV, 0], [3, 2, 0, KIND_DKV, 0]]))
    fwd = plan.schedule.fwd.clone()
    # Q is never relayed (only KV): no such row is derivable, and check_plan names it
    tiles_q_remote = (fwd[:, 3] == KIND_Q).nonzero()
    assert tiles_q_remote.numel() == 0  # every tile sits on its q home in this plan: make one up
    fake = torch.tensor([[1, 2, 1, KIND_Q, 1]], dtype=torch.int32)
    sched = CommSchedule(fwd=torch.cat([fake, fwd])[np.lexsort(torch.cat([fake, fwd]).numpy().T[::-1])],
                         bwd=plan.schedule.bwd, num_stages=plan.num_stages, world_size=plan.world_size)
    with pytest.raises(PlanConsistencyError, match="Q transfer does not come from the block's home"):
        check_plan(dataclasses.replace(plan, schedule=sched))


def _reads_block_zero_from_ranks_1_and_3(q, k):
    return (k // 16 == q // 16) | (((q // 16 == 1) | (q // 16 == 3)) & (k // 16 == 0))


def _reads_block_zero_from_ranks_1_and_3_and_one_from_2(q, k):
    return _reads_block_zero_from_ranks_1_and_3(q, k) | ((q // 16 == 2) & (k // 16 == 1))


def _four_ranks_by_hand(mask_mod, stage_of):
    """A 64-token mask of 16-token blocks on 4 ranks, block i at home i and every tile at its q-block's
    home, in the stages ``stage_of(tiles)``: (spec, tiles, home, tile ranks, stages, KV receive groups)."""
    from blockattn.planner.schedule import receive_groups

    spec = MaskSpec.from_mask_mod(mask_mod, 64)
    tiles = TileSet.from_block_mask(spec.block_mask(16))
    home = np.arange(4)
    rank = home[tiles.q]
    stage = stage_of(tiles)
    remote = home[tiles.kv] != rank
    return spec, tiles, home, rank, stage, receive_groups(rank[remote], tiles.kv[remote], stage[remote], 4)


def _checked_transit_plan(spec, tiles, home, rank, stage, relay):
    """The Plan of a hand-made transit placement on 2 nodes of 2 ranks (backward stages = forward),
    after check_plan and replay."""
    plan = build_plan(tiles, Placement(home, rank, stage, kv_relay=relay, tile_stage_bwd=stage),
                      strategy="hand-transit", world_size=4, dtype=torch.float32, mask_signature=spec.signature(),
                      cost_model=CostModel(Topology(ranks_per_node=2)), **HEADS)
    check_plan(plan)
    replay(plan)
    return plan


def test_hand_made_transit_relay():
    """4 ranks on 2 nodes ({0, 1}, {2, 3}), block i at home i, diagonal tiles plus (1, 0) in stage 1 and
    (3, 0) in stage 2: only rank 3 of its node reads block 0. Relayed through rank 2, which computes
    nothing with it (a transit source), block 0 enters node 1 through rank 2's NIC in stage 1 and
    reaches rank 3 over NVLink in stage 2; rank 3's dK/dV partial goes home directly (no stage is left
    to pass it through rank 2)."""
    from blockattn.planner.relay import transit_relays
    from blockattn.planner.schedule import KIND_DKV, receive_groups

    spec, tiles, home, rank, stage, groups = _four_ranks_by_hand(
        _reads_block_zero_from_ranks_1_and_3, lambda t: np.where(t.q == t.kv, 0, np.where(t.q == 1, 1, 2)))
    remote = home[tiles.kv] != rank
    relay = transit_relays(home, groups, np.zeros((0, 3), np.int64), ranks_per_node=2, world_size=4)
    assert relay.tolist() == [[0, 3, 2]]  # block 0 rotates to rank 0 of node 1 (rank 2), which reads nothing
    plan = _checked_transit_plan(spec, tiles, home, rank, stage, relay)
    fwd, bwd = plan.schedule.fwd.tolist(), plan.schedule.bwd.tolist()
    assert fwd == [[1, 0, 1, KIND_KV, 0], [1, 0, 2, KIND_KV, 0], [2, 2, 3, KIND_KV, 0]]
    assert bwd == [[2, 1, 0, KIND_DKV, 0], [3, 3, 0, KIND_DKV, 0]]
    # one more stage (rank 2 reads block 1 in stage 3): rank 3's partial now goes through rank 2, which
    # forwards it home a stage later (rank 2's own row for block 1 is a partial of its own)
    spec4 = MaskSpec.from_mask_mod(_reads_block_zero_from_ranks_1_and_3_and_one_from_2, 64)
    tiles4 = TileSet.from_block_mask(spec4.block_mask(16))
    rank4 = home[tiles4.q]
    stage4 = np.where(tiles4.q == tiles4.kv, 0, np.where(tiles4.q == 1, 1, np.where(tiles4.q == 3, 2, 3)))
    plan = _checked_transit_plan(spec4, tiles4, home, rank4, stage4, relay)
    bwd = plan.schedule.bwd.tolist()
    assert [3, 3, 2, KIND_DKV, 0] in bwd and [4, 2, 0, KIND_DKV, 0] in bwd and [4, 2, 1, KIND_DKV, 1] in bwd
    assert not any(row[1] == 3 and row[2] == 0 for row in bwd)
    # needed in stage 1, nothing comes earlier: no transit, and a hand-made one is rejected
    early = np.where(tiles.q == tiles.kv, 0, 1)  # (stages 0 and 1 only)
    groups = receive_groups(rank[remote], tiles.kv[remote], early[remote], 4)
    assert transit_relays(home, groups, np.zeros((0, 3), np.int64), ranks_per_node=2, world_size=4).size == 0
    # and a block already relayed, or read on its home's node, gets no transit either
    assert transit_relays(home, receive_groups(rank[remote], tiles.kv[remote], stage[remote], 4), relay,
                          ranks_per_node=2, world_size=4).size == 0
    assert transit_relays(home, groups, np.zeros((0, 3), np.int64), ranks_per_node=4, world_size=4).size == 0


def test_dcp_keeps_transit_relays_where_they_are_faster(monkeypatch, skip_backward_deferral, skip_polish):
    """Documents of 6000, 5000 and 800 tokens on 3 nodes of 2 ranks: dcp's plan relays KV through ranks
    that compute nothing with it, and is faster for it (1.585 -> 1.526x the bound; without the second
    opinion's "hierarchical-spread" start, whose homes already spread the sends over the NICs, 1.71 with
    transit relays on the final plan alone, 1.64 with them on every finalist). Without the final
    backward deferral and the polishes, which are decided after the relays and would change both plans
    compared (with the polishes the plan without transit relays ends faster, 1.386 against 1.437: the
    relays are chosen on unpolished plans)."""
    from blockattn.planner import candidates as candidates_module

    skip_backward_deferral()
    skip_polish()

    spec = MaskSpec.documents([6000, 5000, 800])
    topology = Topology(ranks_per_node=2)
    kw = dict(block_size=128, topology=topology, num_q_heads=32, num_kv_heads=8, head_dim=128)
    plan = make_plan(spec, 6, **kw)  # check_plan runs inside
    fwd = plan.schedule.fwd.numpy().astype(np.int64)
    reads = set(zip(plan.tile_rank.tolist(), plan.tile_kv.tolist()))
    transit = [(d, b) for _, _, d, k, b in fwd.tolist() if k == KIND_KV and (d, b) not in reads]
    assert transit and plan.stats()["kv_relays"] > 0
    clear_plan_cache()
    monkeypatch.setattr(candidates_module, "add_transit", lambda tiles, placement, **_: placement)
    without = make_plan(spec, 6, **kw)
    time = lambda p: p.stats()["sim_time_fwd"] + p.stats()["sim_time_bwd"]  # noqa: E731
    assert time(plan) < 0.99 * time(without)
    clear_plan_cache()



def test_transit_relays_even_out_a_nodes_nic_loads():
    """Receiver side: rank 3 of node {3, 4, 5} pulls 3 blocks over its NIC, rank 5 one, rank 4 none:
    rank 3 hands its latest-needed block to rank 4 and stops there (one more would leave rank 4 above
    it); rank 5's block is read by rank 3, so only rank 4 could take it, and that would not lower the
    node's maximum."""
    from blockattn.planner.relay import transit_relays

    home = np.array([0, 1, 2, 0])
    r, b = np.array([3, 3, 3, 5]), np.array([0, 1, 2, 2])
    first = np.array([2, 3, 2, 2])
    w = 1.0
    kw = dict(ranks_per_node=3, world_size=6, kv_bytes=np.full(4, w))
    load = np.array([0, 0, 0, 3 * w, 0, w])
    out = transit_relays(home, (r, b, first, first), np.zeros((0, 3), np.int64), side="receiver", load=load, **kw)
    assert out.tolist() == [[1, 3, 4]]
    # evened out already: nothing
    assert transit_relays(home, (r, b, first, first), np.zeros((0, 3), np.int64), side="receiver",
                          load=np.array([0, 0, 0, w, w, w]), **kw).size == 0


def _block_zero_read_by_ranks_2_and_3(q, k):
    return (q // 16 == k // 16) | ((k // 16 == 0) & (q // 16 >= 2)) | ((q // 16 == 3) & (k // 16 == 2))


def test_transit_relay_on_the_homes_node():
    """Home side: block 0 (home 0) is read by ranks 2 and 3 of the other node in stage 2 (rank 3 reads
    block 2 in stage 1), so rank 0 sends it twice over its NIC. Rank 1, its node-mate, computes nothing
    with it: it gets block 0 over NVLink in stage 1 and sends rank 2's copy through its own NIC, one
    send each."""
    from blockattn.planner.relay import transit_relays

    spec, tiles, home, rank, stage, groups = _four_ranks_by_hand(
        _block_zero_read_by_ranks_2_and_3, lambda t: np.where(t.q == t.kv, 0, np.where(t.kv == 0, 2, 1)))
    kv_bytes = np.full(4, 1.0)
    relay = transit_relays(home, groups, np.zeros((0, 3), np.int64), ranks_per_node=2, world_size=4, side="home",
                           load=np.array([2.0, 0.0, 0.0, 0.0]), kv_bytes=kv_bytes)
    assert relay.tolist() == [[0, 2, 1]]
    fwd = _checked_transit_plan(spec, tiles, home, rank, stage, relay).schedule.fwd.tolist()
    assert fwd == [[1, 0, 1, KIND_KV, 0], [1, 2, 3, KIND_KV, 2], [2, 0, 3, KIND_KV, 0], [2, 1, 2, KIND_KV, 0]]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_balancing_transit_properties(data):
    """Random receive groups and NIC loads on nodes of 2-4 ranks: every transit row names an eligible
    group and a rank of the giver's node that computes nothing with the block; on the receiver side
    one transit rank per (node, block); and no node's highest NIC load grows."""
    from blockattn.planner.relay import transit_relays
    from blockattn.planner.schedule import receive_groups

    rpn = data.draw(st.integers(2, 4), label="ranks_per_node")
    world = rpn * data.draw(st.integers(2, 3), label="nodes")
    nB = data.draw(st.integers(1, 12), label="blocks")
    home = np.array(data.draw(st.lists(st.integers(0, world - 1), min_size=nB, max_size=nB), label="home"))
    pairs = data.draw(st.lists(st.tuples(st.integers(0, world - 1), st.integers(0, nB - 1), st.integers(1, 3)),
                               min_size=1, max_size=30), label="reads")
    r = np.array([p[0] for p in pairs])
    b = np.array([p[1] for p in pairs])
    s = np.array([p[2] for p in pairs])
    keep = home[b] != r
    if not keep.any():
        return
    groups = receive_groups(r[keep], b[keep], s[keep], nB)
    kv_bytes = np.array(data.draw(st.lists(st.floats(0.5, 2.0), min_size=nB, max_size=nB), label="kv_bytes"))
    load = np.array(data.draw(st.lists(st.floats(0.0, 10.0), min_size=world, max_size=world), label="load"))
    reads = set(zip(groups[0].tolist(), groups[1].tolist()))
    node = lambda x: x // rpn  # noqa: E731
    for side in ("receiver", "home"):
        rows = transit_relays(home, groups, np.zeros((0, 3), np.int64), ranks_per_node=rpn, world_size=world,
                              side=side, load=load, kv_bytes=kv_bytes)
        event(f"{side}: {'some' if rows.size else 'no'} transit rows")
        after = load.copy()
        entered = {}
        for blk, dst, t in rows.tolist():
            assert (dst, blk) in reads and node(dst) != node(home[blk])
            first = groups[2][(groups[0] == dst) & (groups[1] == blk)][0]
            assert first >= 2, "a transit receive needs a stage before the reader's first need"
            giver = dst if side == "receiver" else home[blk]
            assert node(t) == node(giver) and t != giver and (t, blk) not in reads
            after[giver] -= kv_bytes[blk]
            if side == "receiver":  # the transit rank receives the block once, for all its readers
                assert entered.setdefault((node(t), blk), t) == t, "one transit rank per block and node"
            else:  # each forward is a send of its own
                after[t] += kv_bytes[blk]
        for (_, blk), t in entered.items():
            after[t] += kv_bytes[blk]
        for n in range(world // rpn):
            mates = slice(n * rpn, (n + 1) * rpn)
            assert after[mates].max() <= load[mates].max() + 1e-9


def test_one_finisher_finishes_every_relay_table_as_a_fresh_one_would():
    """add_transit finishes one placement under several relay tables with one Finisher, which computes
    the relay-independent parts once: each result equals finish_placement's own, array for array."""
    from blockattn.planner import dcp as dcp_module
    from blockattn.planner.relay import transit_relays
    from blockattn.planner.schedule import as_relay_table, receive_groups
    from blockattn.planner.finish import Finisher, finish_placement

    spec = MaskSpec.documents([6000, 5000, 800])
    tiles = TileSet.from_block_mask(spec.block_mask(128))
    cm = CostModel(topology=Topology(ranks_per_node=2))
    sizes = dict(SIZES, grad_element_size=4)
    base = dcp_module._place(tiles, 6, "hierarchical", cm, 4, sizes, relays=False)[0]
    _, variants = relay_variants(tiles, base, world_size=6, cost_model=cm, max_stages=4, sizes=sizes)
    home, rank, stage = base.block_home, base.tile_rank, base.tile_stage
    remote = home[tiles.kv] != rank
    groups = receive_groups(rank[remote], tiles.kv[remote], stage[remote], tiles.num_blocks)
    transit = transit_relays(home, groups, np.zeros((0, 3), dtype=np.int64), ranks_per_node=2, world_size=6)
    # relays of a variant that keeps the stages (a delaying one would finish other stages)
    relays = [as_relay_table(v.kv_relay) for v in variants if np.array_equal(v.tile_stage, stage)]
    assert relays and relays[0].size and transit.size
    tables = [None, relays[0], transit]
    shared = Finisher(tiles, home, rank, stage, world_size=6, cost_model=cm, sizes=sizes)
    for table in tables + [None]:
        for spread in (False, True):
            got = shared.finish(table, spread_forward=spread, max_stages=4)
            want = finish_placement(tiles, home, rank, stage, world_size=6, cost_model=cm, sizes=sizes,
                                    kv_relay=table, spread_forward=spread, max_stages=4)
            assert got.sim_time == want.sim_time
            for a, b in ((got.tile_stage, want.tile_stage), (got.tile_stage_bwd, want.tile_stage_bwd),
                         (got.schedule.fwd, want.schedule.fwd), (got.schedule.bwd, want.schedule.bwd)):
                assert np.array_equal(np.asarray(a), np.asarray(b))


def test_relay_scorer_starts_from_the_finishs_backward_choice():
    """finish_placement records the relay-free backward staging it chose (``Placement.bwd_choice``); the
    relay scorer, which would choose the same one from the same homes, ranks and stage count, starts
    from it: every variant it weighs is the same, time and arrays, as when it chooses again. A choice
    made for other ranks or another stage count is not used."""
    from blockattn.planner import dcp as dcp_module
    from blockattn.planner.relay import RelayScorer, relay_groups

    spec = MaskSpec.documents([6000, 5000, 800, 2300])
    tiles = TileSet.from_block_mask(spec.block_mask(128))
    cm = CostModel(topology=Topology(ranks_per_node=2))
    sizes = dict(SIZES, grad_element_size=4)
    base = dcp_module._place(tiles, 6, "hierarchical", cm, 4, sizes, relays=False)[0]
    choice = base.bwd_choice
    assert choice is not None and choice.fits(tiles, base.block_home, base.tile_rank, choice.num_stages)
    kw = dict(world_size=6, cost_model=cm, max_stages=4, sizes=sizes)
    with_choice = relay_variants(tiles, base, **kw)
    chosen_again = relay_variants(tiles, dataclasses.replace(base, bwd_choice=None), **kw)
    assert with_choice[0] == chosen_again[0] and len(with_choice[1]) == len(chosen_again[1]) > 0
    for a, b in zip(with_choice[1], chosen_again[1]):
        assert a.sim_time == b.sim_time
        for x, y in ((a.tile_stage, b.tile_stage), (a.tile_stage_bwd, b.tile_stage_bwd), (a.kv_relay, b.kv_relay),
                     (a.schedule.fwd, b.schedule.fwd), (a.schedule.bwd, b.schedule.bwd)):
            assert np.array_equal(np.asarray(x), np.asarray(y))
    # the scorer's own choice is the recorded one
    home, rank = base.block_home, base.tile_rank
    groups = relay_groups(tiles, home, rank, base)
    num_stages = groups[1]
    fresh = RelayScorer.of(tiles, dataclasses.replace(base, bwd_choice=None), home, rank, groups, world_size=6,
                           cost_model=cm, sizes=sizes)
    own_stage_bwd, own_groups = fresh._backward(num_stages)
    assert np.array_equal(own_stage_bwd, choice.stage_bwd)
    for part, recorded in zip(own_groups, choice.groups):
        assert all(np.array_equal(x, y) for x, y in zip(part, recorded))
    # stale: other ranks, another stage count
    moved = rank.copy()
    moved[0] = (moved[0] + 1) % 6
    assert not choice.fits(tiles, home, moved, num_stages) and not choice.fits(tiles, home, rank, num_stages + 1)


def test_a_restaging_takes_the_backward_choice_made_for_its_ranks():
    """finish_placement given another staging's ``bwd_choice`` (same homes and tile ranks) finishes its
    forward stages into the same Placement as when it chooses the backward staging itself: the choice
    does not depend on the forward stages. One made for another stage count is not taken."""
    from blockattn.planner import dcp as dcp_module
    from blockattn.planner.finish import finish_placement
    from blockattn.planner.stages import assign_stages

    spec = MaskSpec.documents([6000, 5000, 800, 2300])
    tiles = TileSet.from_block_mask(spec.block_mask(128))
    cm = CostModel(topology=Topology(ranks_per_node=2))
    sizes = dict(SIZES, grad_element_size=4)
    base = dcp_module._place(tiles, 6, "hierarchical", cm, 4, sizes, relays=False)[0]
    home, rank = base.block_home, base.tile_rank
    flops = cm.tile_flops(tiles.pairs, num_q_heads=sizes["num_q_heads"], head_dim=sizes["head_dim"])
    taken = 0
    for scale, both_ends in ((1.5, False), (1.0, True), (0.7, False)):
        stage = assign_stages(tiles.q, tiles.kv, flops, rank, home, block_size=128, total_len=tiles.total_len,
                              world_size=6, cost_model=cm, max_stages=4, budget_scale=scale, both_ends=both_ends,
                              **sizes)
        kw = dict(world_size=6, cost_model=cm, sizes=sizes, max_stages=4)
        fresh = finish_placement(tiles, home, rank, stage, **kw)
        hinted = finish_placement(tiles, home, rank, stage, bwd_choice=base.bwd_choice, **kw)
        taken += fresh.bwd_choice.num_stages == base.bwd_choice.num_stages
        assert hinted.sim_time == fresh.sim_time
        for a, b in ((hinted.tile_stage, fresh.tile_stage), (hinted.tile_stage_bwd, fresh.tile_stage_bwd),
                     (hinted.schedule.fwd, fresh.schedule.fwd), (hinted.schedule.bwd, fresh.schedule.bwd),
                     (hinted.bwd_choice.stage_bwd, fresh.bwd_choice.stage_bwd)):
            assert np.array_equal(np.asarray(a), np.asarray(b))
    assert taken > 0  # (at least one restaging had the base's stage count, so the choice was taken)


def test_transit_relays_in_passes_until_one_gains_nothing():
    """9 ranks, 3 per node: a first pass of transit relays gains next to nothing, a second one ~9% (the
    first pass's relays free NIC time the second pass's use). dcp's ``_with_transit`` takes passes until
    one gains nothing, and the plan with the relays of both passes is consistent (check_plan, replay)."""
    from blockattn.planner import dcp as dcp_module
    from blockattn.planner.relay import add_transit

    spec = MaskSpec.documents([6817, 8666, 1101, 6605, 2850, 5008])
    tiles = TileSet.from_block_mask(spec.block_mask(128))
    cost_model = CostModel(Topology(ranks_per_node=3))
    sizes = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, element_size=2, grad_element_size=4)
    first = dcp_module._scored(tiles, dcp_module._dcp(tiles, 9, cost_model, 4, sizes, None), 9, cost_model, sizes)
    one = add_transit(tiles, first, world_size=9, cost_model=cost_model, sizes=sizes)
    two = add_transit(tiles, one, world_size=9, cost_model=cost_model, sizes=sizes)
    assert one.sim_time < first.sim_time and two.sim_time < 0.95 * one.sim_time
    passes = dcp_module._with_transit(tiles, first, 9, cost_model, sizes)
    assert passes.sim_time <= two.sim_time
    assert as_relay_table(passes.kv_relay).shape[0] > as_relay_table(one.kv_relay).shape[0]
    plan = build_plan(tiles, passes, strategy="dcp", world_size=9, num_q_heads=32, num_kv_heads=8, head_dim=128,
                      dtype=torch.bfloat16, mask_signature=spec.signature(), cost_model=cost_model)
    check_plan(plan)
    replay(plan)
    stats = plan.stats()
    assert stats["sim_time_fwd"] + stats["sim_time_bwd"] == pytest.approx(passes.sim_time, rel=1e-9)


def _balancing_transit_python(giver, r, b, first, reads, load, kv_bytes, *, ranks_per_node, world_size, one_entry):
    """planner/relay.py ``_balancing_transit`` as the Python loop it was before it was compiled."""
    nB = kv_bytes.size
    load = np.asarray(load, dtype=np.float64).copy()
    out, entry = [], {}  # entry: (node, block) -> the transit rank receiving it
    node = giver // ranks_per_node
    order = np.lexsort((b, -first, giver))  # per giver: latest first need first
    for n in np.unique(node).tolist():
        mates = np.arange(n * ranks_per_node, min((n + 1) * ranks_per_node, world_size))
        mine = order[node[order] == n]
        for g in sorted(mates.tolist(), key=lambda x: (-load[x], x)):
            for i in mine[giver[mine] == g].tolist():
                blk, w = int(b[i]), float(kv_bytes[b[i]])
                t = entry.get((n, blk))
                if t is None:
                    free = mates[(mates != g) & ~reads[mates * nB + blk]]
                    if free.size == 0:
                        continue
                    t = int(free[np.lexsort((free, load[free]))[0]])
                    if load[t] + w > load[g] - w:
                        break  # the giver is no longer above the others
                    load[t] += w
                    if one_entry:
                        entry[(n, blk)] = t
                load[g] -= w
                out.append((blk, int(r[i]), t))
    rows = np.array(out, dtype=np.int64).reshape(-1, 3)
    return rows[np.lexsort((rows[:, 1], rows[:, 0]))]


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), world_size=st.integers(1, 13), ranks_per_node=st.integers(1, 5),
       num_blocks=st.integers(1, 12), num_groups=st.integers(0, 60), one_entry=st.booleans(),
       ties=st.booleans())
def test_balancing_transit_is_its_python_loop(seed, world_size, ranks_per_node, num_blocks, num_groups, one_entry,
                                              ties):
    """planner/relay.py ``_balancing_transit`` (compiled: comm_loops.transit_choices) gives the rows of the
    Python loop it replaced, on random groups, NIC loads (``ties``: whole numbers, many equal) and blocks
    read by random ranks."""
    from blockattn.planner.relay import _balancing_transit

    rng = np.random.default_rng(seed)
    giver = rng.integers(0, world_size, num_groups)
    r = rng.integers(0, world_size, num_groups)
    b = rng.integers(0, num_blocks, num_groups)
    first = rng.integers(2, 6, num_groups)
    reads = rng.random(world_size * num_blocks) < 0.3
    load = (rng.integers(0, 4, world_size) * 1e6) if ties else rng.exponential(5e6, world_size)
    kv_bytes = (rng.integers(1, 3, num_blocks) * 1e6) if ties else rng.exponential(1e6, num_blocks)
    kw = dict(ranks_per_node=ranks_per_node, world_size=world_size, one_entry=one_entry)
    before = load.copy()
    got = _balancing_transit(giver, r, b, first, reads, load, kv_bytes, **kw)
    want = _balancing_transit_python(giver, r, b, first, reads, load, kv_bytes, **kw)
    assert np.array_equal(got, want) and np.array_equal(load, before)
