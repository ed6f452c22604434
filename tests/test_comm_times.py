"""The compiled pricing of schedule rows (planner/comm_loops.py, ``CostModel.table_comm_time``) against
the numpy cost model it replaces in the planner (``stage_comm_time`` of ``row_bytes``): the same
floats, bit for bit, on random tables and on a real plan's schedule."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from blockattn.masks import MaskSpec
from blockattn.planner import CostModel, Topology, make_plan
from blockattn.planner.schedule import KIND_DO, KIND_KV, KIND_Q, row_bytes

HEADS = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)


def _numpy_times(cost_model, table, block_len, world_size, num_stages, sizes):
    return cost_model.stage_comm_time(table, row_bytes(table, block_len, **sizes), world_size, num_stages)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), world_size=st.integers(1, 13), ranks_per_node=st.integers(1, 8),
       num_stages=st.integers(1, 5), rows=st.integers(0, 300), grad=st.sampled_from([2, 4]))
def test_compiled_comm_times_equal_the_numpy_cost_model(seed, world_size, ranks_per_node, num_stages, rows, grad):
    rng = np.random.default_rng(seed)
    num_blocks = int(rng.integers(1, 40))
    block_len = np.full(num_blocks, 128, dtype=np.int64)
    block_len[-1] = int(rng.integers(1, 129))  # (a short last block)
    kind = rng.integers(0, 6, rows)
    is_input = np.isin(kind, (KIND_Q, KIND_KV, KIND_DO))
    # inputs arrive in the exchange before their stage (stage >= 1), results leave after theirs
    stage = np.where(is_input, rng.integers(1, num_stages + 1, rows), rng.integers(0, num_stages, rows))
    table = np.stack([stage, rng.integers(0, world_size, rows), rng.integers(0, world_size, rows), kind,
                      rng.integers(0, num_blocks, rows)], axis=1).astype(np.int64)
    cost_model = CostModel(topology=Topology(ranks_per_node=ranks_per_node, inter_bw=float(rng.uniform(10e9, 100e9)),
                                             inter_lat=float(rng.uniform(0, 3e-5))))
    sizes = dict(HEADS, element_size=2, grad_element_size=grad)
    compiled = cost_model.table_comm_time(table, block_len, world_size, num_stages, **sizes)
    expected = _numpy_times(cost_model, table, block_len, world_size, num_stages, sizes)
    assert compiled.shape == (world_size, num_stages + 1)
    assert np.array_equal(compiled, expected), np.abs(compiled - expected).max()


def test_a_plans_transfer_times_are_priced_the_same_both_ways():
    """A two-node plan of documents (inter- and intra-node rows, several stages, both directions)."""
    lens = [3000, 700, 1, 5200, 2100, 999]
    plan = make_plan(MaskSpec.documents(lens) & MaskSpec.causal(sum(lens)), 6, block_size=64,
                     topology=Topology(ranks_per_node=4), **HEADS)
    cost_model = plan.cost_model
    block_len = np.minimum(plan.block_size, plan.total_len - np.arange(plan.num_blocks) * plan.block_size)
    sizes = dict(HEADS, element_size=plan.dtype.itemsize, grad_element_size=plan.grad_comm_dtype.itemsize)
    for direction in ("fwd", "bwd"):
        table = plan.schedule.table(direction).numpy().astype(np.int64)
        assert table.shape[0] > 0
        compiled = cost_model.table_comm_time(table, block_len, plan.world_size, plan.num_stages, **sizes)
        expected = _numpy_times(cost_model, table, block_len, plan.world_size, plan.num_stages, sizes)
        assert np.array_equal(compiled, expected)
        assert (compiled > 0).any()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), world_size=st.integers(1, 9), num_blocks=st.integers(1, 30),
       num_stages=st.integers(1, 5))
def test_relay_free_rows_are_the_rows_of_the_receive_groups(seed, world_size, num_blocks, num_stages):
    """planner/comm_loops.py ``relay_free_rows`` (``schedule_rows`` without relays) against the rows
    written out by hand: Q / KV in at a group's first stage from the home, OUT / dQ / dK/dV back after
    its last, dO in at its first backward stage."""
    from blockattn.planner.schedule import KIND_DKV, KIND_DQ, KIND_OUT, schedule_rows

    rng = np.random.default_rng(seed)
    home = rng.integers(0, world_size, num_blocks)

    def groups(n):
        r, b = rng.integers(0, world_size, n), rng.integers(0, num_blocks, n)
        first = rng.integers(1, num_stages + 1, n)
        return r, b, first, np.maximum(first, rng.integers(0, num_stages, n))

    q, kv = groups(int(rng.integers(0, 20))), groups(int(rng.integers(0, 20)))
    q_bwd = (q[0], q[1], *groups(q[0].size)[2:])
    kv_bwd = (kv[0], kv[1], *groups(kv[0].size)[2:])
    fwd, bwd = schedule_rows(home, q, kv, num_blocks=num_blocks, num_stages=num_stages, bwd_groups=(q_bwd, kv_bwd))

    def rows(stage, src, dst, kind, block):
        return np.stack([stage, src, dst, np.full_like(stage, kind), block], axis=1).reshape(-1, 5)

    want_fwd = np.concatenate([rows(q[2], home[q[1]], q[0], KIND_Q, q[1]),
                               rows(kv[2], home[kv[1]], kv[0], KIND_KV, kv[1]),
                               rows(q[3] + 1, q[0], home[q[1]], KIND_OUT, q[1])])
    want_bwd = np.concatenate([rows(q_bwd[2], home[q[1]], q[0], KIND_DO, q[1]),
                               rows(q_bwd[3] + 1, q[0], home[q[1]], KIND_DQ, q[1]),
                               rows(kv_bwd[3] + 1, kv[0], home[kv[1]], KIND_DKV, kv[1])])
    assert np.array_equal(fwd, want_fwd) and np.array_equal(bwd, want_bwd)


def _dkv_routes_numpy(home, r, b, last, src, num_blocks, num_stages):
    """planner/schedule.py ``dkv_routes`` as numpy passes (the form the compiled loop replaced)."""
    def lookup(sorted_keys, keys):
        pos = np.minimum(np.searchsorted(sorted_keys, keys), sorted_keys.size - 1)
        return pos, sorted_keys[pos] == keys

    dkv_dst, dkv_stage = home[b].copy(), last + 1
    none = np.zeros((0, 5), dtype=np.int64)
    child = np.flatnonzero(src != home[b])
    if child.size == 0:
        return dkv_dst, dkv_stage, none
    group_key = r * num_blocks + b
    ppos, is_proxy = lookup(group_key, src[child] * num_blocks + b[child])
    ok = is_proxy & (last[child] + 2 <= num_stages)
    parent_src = src[ppos[ok]]
    ok[ok] = (parent_src == home[b[child[ok]]]) | ~lookup(group_key, parent_src * num_blocks + b[child[ok]])[1]
    dkv_dst[child[ok]] = src[child[ok]]
    np.maximum.at(dkv_stage, ppos[ok], last[child[ok]] + 2)
    through = child[~is_proxy]
    through = through[dkv_stage[through] + 1 <= num_stages]
    if through.size == 0:
        return dkv_dst, dkv_stage, none
    dkv_dst[through] = src[through]
    transit, of_child = np.unique(src[through] * num_blocks + b[through], return_inverse=True)
    stage = np.zeros(transit.size, dtype=np.int64)
    np.maximum.at(stage, of_child, dkv_stage[through] + 1)
    block = transit % num_blocks
    rows = np.stack([stage, transit // num_blocks, home[block], np.full(block.size, 5), block], axis=1)
    return dkv_dst, dkv_stage, rows


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), world_size=st.integers(1, 9), num_blocks=st.integers(1, 12),
       num_stages=st.integers(1, 5), relayed=st.floats(0.0, 1.0))
def test_dkv_routes_equal_their_numpy_passes(seed, world_size, num_blocks, num_stages, relayed):
    """The compiled ``dkv_routes`` (planner/comm_loops.py) against the numpy passes it replaced: every
    group's DKV destination and stage, and the transit rows, on random receive groups whose KV came from
    the home, a proxy with tiles of the block, or a transit rank without."""
    from blockattn.planner.schedule import dkv_routes

    rng = np.random.default_rng(seed)
    home = rng.integers(0, world_size, num_blocks)
    cells = np.unique(rng.integers(0, world_size * num_blocks, int(rng.integers(0, 3 * world_size * num_blocks + 1))))
    r, b = cells // num_blocks, cells % num_blocks  # (ascending r * nB + b, as receive groups are)
    last = rng.integers(0, num_stages, r.size)
    src = np.where(rng.random(r.size) < relayed, rng.integers(0, world_size, r.size), home[b])
    got = dkv_routes(home, r, b, last, src, num_blocks, num_stages)
    want = _dkv_routes_numpy(home, r, b, last, src, num_blocks, num_stages)
    for g, w in zip(got, want):
        assert np.array_equal(g, w)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), world_size=st.integers(1, 12), num_stages=st.integers(1, 11))
def test_polish_rank_times_equal_the_cost_model(seed, world_size, num_stages):
    """planner/comm_loops.py ``rank_times`` (the polish's per-rank time) against ``CostModel.overlapped_time``
    of ``CostModel.link_time`` on the same loads: the same floats, also from 8 stages on (where numpy
    sums a row pairwise)."""
    from blockattn.planner.comm_loops import rank_times

    rng = np.random.default_rng(seed)
    cm = CostModel(topology=Topology(ranks_per_node=4))
    topo = cm.topology
    S, P = num_stages, world_size
    load = rng.integers(0, 1 << 26, (2, 2, P, S + 1)) * (rng.random((2, 2, P, S + 1)) < 0.6)
    rows_at = rng.integers(0, 3, (2, P, S + 1))
    compute = rng.random((P, S)) * 1e-3
    ranks = rng.permutation(P)[: int(rng.integers(1, P + 1))]
    want = cm.overlapped_time(compute[ranks], cm.link_time(load[:, :, ranks].max(axis=1), rows_at[:, ranks] > 0))
    got = rank_times(ranks, load, rows_at, compute, float(topo.intra_bw), float(topo.inter_bw),
                     float(topo.intra_lat), float(topo.inter_lat))
    assert got.tolist() == want.tolist()


def _relayed_kv_rows_numpy(home, r, b, first, relay, num_blocks):
    """The KV side of a relayed schedule as the numpy passes that ``relayed_kv_rows`` replaced: each
    group's source by binary search of the relay rows' (dst, block), and the transit rows by a stable
    sort of the transit sources' keys."""
    group_key = r * num_blocks + b
    src = home[b].copy()
    own = np.stack([first, src, r, np.full(r.size, 1), b], axis=1)
    if relay.shape[0] == 0 or r.size == 0:
        return src, own

    def lookup(keys):
        pos = np.minimum(np.searchsorted(group_key, keys), group_key.size - 1)
        return pos, group_key[pos] == keys

    pos, hit = lookup(relay[:, 1] * num_blocks + relay[:, 0])
    src[pos[hit]] = relay[hit, 2]
    own[:, 1] = src
    src_key = relay[:, 2] * num_blocks + relay[:, 0]
    transit = ~lookup(src_key)[1] & (relay[:, 2] != home[relay[:, 0]]) & hit
    rows, need, key = relay[transit], first[pos[transit]], src_key[transit]
    order = np.lexsort((need, key))
    key, need, rows = key[order], need[order], rows[order]
    head = np.r_[True, key[1:] != key[:-1]] if key.size else np.zeros(0, dtype=bool)
    rows, need = rows[head], need[head]
    into = np.stack([need - 1, home[rows[:, 0]], rows[:, 2], np.full(need.size, 1), rows[:, 0]], axis=1)
    return src, np.concatenate([own, into.reshape(-1, 5)])


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), world_size=st.integers(1, 9), num_blocks=st.integers(1, 10),
       num_stages=st.integers(1, 5), num_relays=st.integers(0, 14))
def test_relayed_kv_rows_equal_their_numpy_passes(seed, world_size, num_blocks, num_stages, num_relays):
    """planner/comm_loops.py ``relayed_kv_rows`` against the numpy passes it replaced, on random receive
    groups and relay tables (rows naming no group, proxies, transit sources, repeated (source, block))."""
    from blockattn.planner.comm_loops import relayed_kv_rows

    rng = np.random.default_rng(seed)
    home = rng.integers(0, world_size, num_blocks)
    cells = np.unique(rng.integers(0, world_size * num_blocks, int(rng.integers(0, 3 * world_size * num_blocks + 1))))
    r, b = cells // num_blocks, cells % num_blocks
    first = rng.integers(1, num_stages + 1, r.size)
    relay = np.stack([rng.integers(0, num_blocks, num_relays), rng.integers(0, world_size, num_relays),
                      rng.integers(0, world_size, num_relays)], axis=1).astype(np.int64)
    relay = relay[np.lexsort((relay[:, 1], relay[:, 0]))]
    got = relayed_kv_rows(home, r, b, first, relay, num_blocks)
    want = _relayed_kv_rows_numpy(home, r, b, first, relay, num_blocks)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), world_size=st.integers(1, 9), num_blocks=st.integers(1, 10),
       num_stages=st.integers(1, 5), num_relays=st.integers(1, 14))
def test_a_relayed_kv_side_given_gives_the_same_rows(seed, world_size, num_blocks, num_stages, num_relays):
    """``schedule_rows`` with the KV side derived once (``relayed_kv_side``, as a Finisher keeps it per
    relay table) gives the rows it derives itself, for two backward stagings of the same groups."""
    from blockattn.planner.schedule import relayed_kv_side, schedule_rows

    rng = np.random.default_rng(seed)
    home = rng.integers(0, world_size, num_blocks)

    def groups(cells):
        r, b = cells // num_blocks, cells % num_blocks
        first = rng.integers(1, num_stages + 1, r.size)
        return r, b, first, np.maximum(first, rng.integers(0, num_stages, r.size))

    def cells():
        size = world_size * num_blocks
        return np.unique(rng.integers(0, size, int(rng.integers(0, 2 * size + 1))))

    q, kv = groups(cells()), groups(cells())
    relay = np.stack([rng.integers(0, num_blocks, num_relays), rng.integers(0, world_size, num_relays),
                      rng.integers(0, world_size, num_relays)], axis=1).astype(np.int64)
    relay = relay[np.lexsort((relay[:, 1], relay[:, 0]))]
    side = relayed_kv_side(home, kv, relay, num_blocks)
    assert not any(part.flags.writeable for part in side)
    for _ in range(2):
        bwd = tuple((g[0], g[1], *groups(g[0] * num_blocks + g[1])[2:]) for g in (q, kv))
        args = dict(num_blocks=num_blocks, num_stages=num_stages, kv_relay=relay, bwd_groups=bwd)
        got, want = schedule_rows(home, q, kv, kv_side=side, **args), schedule_rows(home, q, kv, **args)
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
