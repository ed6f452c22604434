"""The planner's compiled loops against their numpy definitions, on random placements: the (rank,
block) groupings (planner/group_loops.py), the backward class rule and its split
(planner/backward_loops.py), and the per-(rank, stage) and weighted sums (planner/tile_loops.py)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from blockattn.planner.group_loops import group_stages, group_tiles, own_row_movable
from blockattn.planner.stages_bwd import backward_stages


def _placement(seed: int, num_blocks: int, world_size: int, num_tiles: int, num_stages: int):
    rng = np.random.default_rng(seed)
    q = np.sort(rng.integers(0, num_blocks, num_tiles))
    kv = rng.integers(0, num_blocks, num_tiles)
    home = rng.integers(0, world_size, num_blocks)
    # mostly each q-block's home, as the planner places them, some tiles elsewhere
    rank = np.where(rng.random(num_tiles) < 0.6, home[q], rng.integers(0, world_size, num_tiles))
    stage = rng.integers(0, num_stages, num_tiles)
    return q, kv, rank, home, stage


PLACEMENTS = dict(seed=st.integers(0, 2**31 - 1), num_blocks=st.integers(1, 40), world_size=st.integers(1, 9),
                  num_tiles=st.integers(0, 400), num_stages=st.integers(1, 5))


@settings(max_examples=80, deadline=None)
@given(**PLACEMENTS)
def test_receive_groups_match_a_stable_sort_and_segment_reductions(seed, num_blocks, world_size, num_tiles, num_stages):
    q, kv, rank, home, stage = _placement(seed, num_blocks, world_size, num_tiles, num_stages)
    for block in (q, kv):
        tiles = np.flatnonzero(home[block] != rank)
        order, heads, group_rank, group_block = group_tiles(rank, block, tiles)
        key = rank[tiles] * num_blocks + block[tiles]
        expected = tiles[np.argsort(key, kind="stable")]
        assert np.array_equal(order, expected)
        sorted_key = rank[order] * num_blocks + block[order]
        expected_heads = np.flatnonzero(np.r_[True, sorted_key[1:] != sorted_key[:-1]]) if order.size else heads
        assert np.array_equal(heads, expected_heads)
        assert np.array_equal(group_rank * num_blocks + group_block, sorted_key[heads])
        first, last = group_stages(order, heads, stage)
        if order.size:
            assert np.array_equal(first, np.minimum.reduceat(stage[order], heads))
            assert np.array_equal(last, np.maximum.reduceat(stage[order], heads))
        else:
            assert first.size == last.size == 0


def _own_row_movable_numpy(q, kv, stage, rank, home):
    own = home[q] == rank
    idx = np.flatnonzero(home[kv] != rank)
    anchor = np.zeros(q.size, dtype=bool)
    if idx.size:
        span = int(kv.max()) + 1
        key = (rank[idx] * span + kv[idx]) * (int(stage.max()) + 1) + stage[idx]
        by = idx[np.argsort(key, kind="stable")]
        group = rank[by] * span + kv[by]
        anchor[by[np.r_[True, group[1:] != group[:-1]]]] = True
    return own & ~anchor


@settings(max_examples=80, deadline=None)
@given(**PLACEMENTS)
def test_own_row_movable_keeps_each_remote_blocks_earliest_reader(seed, num_blocks, world_size, num_tiles, num_stages):
    q, kv, rank, home, stage = _placement(seed, num_blocks, world_size, num_tiles, num_stages)
    assert np.array_equal(own_row_movable(q, kv, stage, rank, home), _own_row_movable_numpy(q, kv, stage, rank, home))


@settings(max_examples=40, deadline=None)
@given(**PLACEMENTS)
def test_backward_class_rule(seed, num_blocks, world_size, num_tiles, num_stages):
    q, kv, rank, home, _ = _placement(seed, num_blocks, world_size, num_tiles, num_stages)
    last = max(num_stages - 1, 0)
    expected = np.where(home[q] != rank, min(1, last), np.where(home[kv] != rank, 0, min(2, last)))
    got = backward_stages(q, kv, rank, home, num_stages)
    assert got.dtype == np.int64 and np.array_equal(got, expected)
    # (planner/finish.py keeps one class-rule staging for every stage count from 3 on)
    if num_stages >= 3:
        assert np.array_equal(backward_stages(q, kv, rank, home, num_stages + 4), got)


@settings(max_examples=60, deadline=None)
@given(**PLACEMENTS)
def test_per_rank_and_stage_sums_as_bincount_does(seed, num_blocks, world_size, num_tiles, num_stages):
    from blockattn.planner.placement import per_rank_and_stage

    q, _, rank, _, stage = _placement(seed, num_blocks, world_size, num_tiles, num_stages)
    seconds = np.random.default_rng(seed + 1).exponential(1e-6, q.size)
    got = per_rank_and_stage(rank, stage, seconds, world_size, num_stages)
    expected = np.bincount(rank * num_stages + stage, weights=seconds,
                           minlength=world_size * num_stages).reshape(world_size, num_stages)
    assert np.array_equal(got, expected)  # (bit for bit: the same sums in the same order)


def test_per_rank_and_stage_refuses_a_stage_out_of_range():
    import pytest

    from blockattn.planner.placement import per_rank_and_stage

    with pytest.raises(ValueError, match="out of range"):
        per_rank_and_stage(np.array([0, 1]), np.array([0, 3]), np.ones(2), 2, 3)
    with pytest.raises(ValueError, match="out of range"):
        per_rank_and_stage(np.array([0, 2]), np.array([0, 1]), np.ones(2), 2, 3)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), size=st.integers(1, 30), n=st.integers(0, 500))
def test_weighted_bincount_sums_as_numpy_does(seed, size, n):
    from blockattn.planner.placement import weighted_bincount

    rng = np.random.default_rng(seed)
    keys = np.sort(rng.integers(0, size, n)) if seed % 2 else rng.integers(0, size, n)  # (runs, and none)
    weights = rng.exponential(1.0, n) if seed % 3 else rng.integers(0, 1 << 20, n)  # (floats, and ints)
    assert np.array_equal(weighted_bincount(keys, weights, size), np.bincount(keys, weights=weights, minlength=size))


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.integers(1, 700), min_size=1, max_size=6), block=st.sampled_from([16, 64, 128]))
def test_row_pairs_are_each_q_blocks_pairs_read_only_and_kept(lens, block):
    from blockattn.masks import MaskSpec
    from blockattn.planner.tiles import TileSet, coarsen

    tiles = TileSet.from_block_mask(MaskSpec.documents(lens).block_mask(block))
    row = tiles.row_pairs()
    assert np.array_equal(row, np.bincount(tiles.q, weights=tiles.pairs, minlength=tiles.num_blocks))
    assert row.sum() == sum(n * (n + 1) // 2 for n in lens)  # (causal documents: every pair counted once)
    assert not row.flags.writeable and tiles.row_pairs() is row
    # merging the blocks sums the real rows too, and a new TileSet takes them as its memo from there
    fresh = TileSet(total_len=tiles.total_len, block_size=tiles.block_size, num_blocks=tiles.num_blocks,
                    q=tiles.q, kv=tiles.kv, full=tiles.full, pairs=tiles.pairs)
    coarsen(fresh, 2)
    assert "_row_pairs" in fresh.__dict__
    merged_row = fresh.row_pairs()
    assert merged_row.dtype == np.float64 and np.array_equal(merged_row, row) and not merged_row.flags.writeable


def _split_numpy(stage, kv, rank, home, compute, comm_time, world_size, num_stages):
    """The numpy form ``split_backward_stages`` had before it was compiled."""
    P, S, nB = world_size, num_stages, home.size
    per = np.bincount(rank * S + stage, weights=compute, minlength=P * S).reshape(P, S)
    take = np.minimum(comm_time[:, 1] - per[:, 1], per[:, 0] - comm_time[:, 0]) / 2
    idx = np.flatnonzero((stage == 0) & (home[kv] != rank) & (take > 0)[rank])
    if idx.size == 0:
        return stage
    groups, of_tile = np.unique(rank[idx] * nB + (nB - 1 - kv[idx]), return_inverse=True)
    group_rank = groups // nB
    group_c = np.bincount(of_tile, weights=compute[idx], minlength=groups.size)
    cum = np.cumsum(group_c)
    heads = np.r_[True, group_rank[1:] != group_rank[:-1]]
    group_start = np.maximum.accumulate(np.where(heads, np.arange(groups.size), 0))
    chosen = cum - (cum - group_c)[group_start] <= take[group_rank]
    out = stage.copy()
    out[idx[chosen[of_tile]]] = 1
    return out


@settings(max_examples=80, deadline=None)
@given(**PLACEMENTS)
def test_split_backward_stages_is_its_numpy_form(seed, num_blocks, world_size, num_tiles, num_stages):
    from blockattn.planner.stages_bwd import split_backward_stages

    q, kv, rank, home, _ = _placement(seed, num_blocks, world_size, num_tiles, num_stages)
    rng = np.random.default_rng(seed + 2)
    stage = backward_stages(q, kv, rank, home, num_stages)
    compute = rng.exponential(1e-6, q.size)
    # (transfers on the scale of a rank's compute: exchange 1 exposed on some ranks, hidden on others)
    comm_time = rng.exponential(max(compute.sum(), 1e-6) / world_size, (world_size, num_stages + 1))
    got = split_backward_stages(stage, q, kv, rank, home, compute, comm_time, world_size=world_size,
                                num_stages=num_stages)
    want = stage if num_stages < 3 else _split_numpy(stage, kv, rank, home, compute, comm_time, world_size, num_stages)
    assert np.array_equal(got, want)
    assert np.array_equal(stage, backward_stages(q, kv, rank, home, num_stages))  # (the input is not written)


@settings(max_examples=80, deadline=None)
@given(**PLACEMENTS)
def test_remote_items_are_the_distinct_remote_inputs(seed, num_blocks, world_size, num_tiles, num_stages):
    """planner/stage_cuts.py ``remote_items`` against its numpy form: entries (Q entries first, each list
    in tile order), items as the sorted distinct (rank, kind, block) keys, each entry's item."""
    from blockattn.planner.stage_cuts import remote_items

    q, kv, rank, home, _ = _placement(seed, num_blocks, world_size, num_tiles, num_stages)
    tile_idx, item_of, keys, num_q_entries, needs = remote_items(q, kv, rank, home)
    remote_q, remote_kv = home[q] != rank, home[kv] != rank
    want_idx = np.concatenate((np.flatnonzero(remote_q), np.flatnonzero(remote_kv)))
    kind_kv = np.r_[np.zeros(int(remote_q.sum()), dtype=bool), np.ones(int(remote_kv.sum()), dtype=bool)]
    block = np.concatenate((q[remote_q], kv[remote_kv]))
    want_keys, want_of = np.unique((rank[want_idx] * 2 + kind_kv) * num_blocks + block, return_inverse=True)
    assert np.array_equal(tile_idx, want_idx) and num_q_entries == int(remote_q.sum())
    assert np.array_equal(keys, want_keys) and np.array_equal(item_of, want_of.ravel())
    assert np.array_equal(needs, remote_q.astype(np.int64) + remote_kv)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), num_blocks=st.integers(1, 50), num_groups=st.integers(1, 20),
       num_entries=st.integers(0, 300))
def test_items_by_table_and_by_counting_agree(seed, num_blocks, num_groups, num_entries):
    """planner/stage_cuts.py: ``remote_items``' two ways of numbering items (a table of every key, and
    two counting passes where that table would be wide) give np.unique's keys and inverse."""
    from blockattn.planner.stage_cuts import items_by_counting, items_by_table

    key = np.random.default_rng(seed).integers(0, num_groups * num_blocks, num_entries)
    want_keys, want_of = np.unique(key, return_inverse=True)
    for item_of, item_keys in (items_by_table(key, num_groups * num_blocks),
                               items_by_counting(key, num_blocks, num_groups)):
        assert np.array_equal(item_keys, want_keys) and np.array_equal(item_of, want_of.ravel())


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), num_blocks=st.integers(1, 40), num_tiles=st.integers(0, 400),
       documents=st.booleans())
def test_segment_counts_match_their_numpy_forms(seed, num_blocks, num_tiles, documents):
    """planner/tile_loops.py ``boundary_crossings``, ``reads_from_afar`` and ``segment_crossings`` (the
    counts behind planner/fcp.py ``segments``) against the numpy passes they replace, on random
    (q, kv)-sorted tiles with runs of consecutive kv-blocks."""
    from blockattn.planner.tile_loops import boundary_crossings, reads_from_afar, segment_crossings

    rng = np.random.default_rng(seed)
    cells = np.unique(rng.integers(0, num_blocks, (2, num_tiles)), axis=1)  # (q, kv)-sorted, distinct
    q, kv = cells[0].copy(), cells[1].copy()
    full = rng.random(q.size) < 0.5
    nB = num_blocks

    def crossings_numpy(q, kv):
        lo, hi = np.minimum(q, kv), np.maximum(q, kv)
        return np.cumsum(np.bincount(lo + 1, minlength=nB + 2) - np.bincount(hi + 1, minlength=nB + 2))[: nB + 1]

    crossing = boundary_crossings(q, kv, nB)
    assert np.array_equal(crossing, crossings_numpy(q, kv))
    run_start = np.ones(q.size, dtype=bool)
    run_start[1:] = (q[1:] != q[:-1]) | (kv[1:] != kv[:-1] + 1)
    run = np.cumsum(run_start)
    last_run = np.zeros(nB, dtype=np.int64)
    last_run[q] = run
    assert np.array_equal(reads_from_afar(q, kv, nB), np.bincount(kv[run != last_run[q]], minlength=nB))
    shared = rng.random(nB) < 0.3
    started = (kv < q) & ~full if documents else np.zeros(q.size, dtype=bool)
    sel = shared[kv] & ~started
    want = (crossing - np.bincount(kv[started] + 1, minlength=nB + 1)[: nB + 1]
            - crossings_numpy(q[sel], kv[sel]))
    assert np.array_equal(segment_crossings(q, kv, full, crossing, shared, documents), want)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), size=st.sampled_from([0, 1, 7, 8, 9, 15, 16, 17, 127, 128, 129, 300, 1030, 9000]))
def test_numpy_sum_gives_np_sums_floats(seed, size):
    """planner/float_sums.py ``numpy_sum`` and group_loops ``unit_weights`` give the floats of np.sum (pairwise
    summation) bit for bit, on values of very different magnitudes, and a polish unit's weight as the
    numpy expression ``seconds[unit].sum()`` gives it."""
    from blockattn.planner.float_sums import numpy_sum
    from blockattn.planner.group_loops import unit_weights

    rng = np.random.default_rng(seed)
    values = rng.random(size) * 10.0 ** rng.integers(-6, 6, size)
    assert numpy_sum(values) == values.sum()
    lo = size // 3
    assert numpy_sum(values[lo:]) == values[lo:].sum()
    members = rng.permutation(size)
    starts = np.unique(np.r_[0, rng.integers(0, size + 1, 5), size])
    stage = rng.integers(0, 3, size)
    groups = np.arange(starts.size - 1)
    want = [values[members[a:b][stage[members[a:b]] == 1]].sum() for a, b in zip(starts[:-1], starts[1:])]
    assert unit_weights(members, starts, stage, values, groups, 1).tolist() == want


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), num_tiles=st.integers(1, 60), num_groups=st.integers(1, 12),
       num_stages=st.integers(1, 5), kinds=st.integers(1, 3))
def test_shift_groups_matches_the_numpy_update(seed, num_tiles, num_groups, num_stages, kinds):
    """planner/group_loops.py ``shift_groups`` (the polish's move) against the numpy updates it replaced:
    compute per stage (np.add.at's floats), the groups' histogram, first / last stages, the groups
    whose first or last moved, and the values before the move that undo restores."""
    from blockattn.planner.group_loops import shift_groups

    rng = np.random.default_rng(seed)
    stage = rng.integers(0, num_stages, num_tiles)
    table = np.where(rng.random((kinds, num_tiles)) < 0.8, rng.integers(0, num_groups, (kinds, num_tiles)), -1)
    for k in range(kinds):  # (kinds hold distinct group ids, as the polish numbers them)
        table[k][table[k] >= 0] += k * num_groups
    hist = np.zeros((kinds * num_groups, num_stages), dtype=np.int64)
    for k in range(kinds):
        t = np.flatnonzero(table[k] >= 0)
        np.add.at(hist, (table[k][t], stage[t]), 1)

    def ends(h):
        used = h > 0
        return used.argmax(axis=1), num_stages - 1 - used[:, ::-1].argmax(axis=1)

    first, last = ends(hist)
    seconds = rng.random(num_tiles) * 10.0 ** rng.integers(-3, 3, num_tiles)
    compute = rng.random(num_stages)
    tiles = np.unique(rng.integers(0, num_tiles, int(rng.integers(1, num_tiles + 1))))
    old, new = stage[tiles], rng.integers(0, num_stages, tiles.size)

    want_compute = compute.copy()
    np.add.at(want_compute, np.concatenate([old, new]), np.concatenate([-seconds[tiles], seconds[tiles]]))
    g = np.concatenate([table[k][tiles] for k in range(kinds)])
    keep = g >= 0
    g, o, n = g[keep], np.concatenate([old] * kinds)[keep], np.concatenate([new] * kinds)[keep]
    groups = np.unique(g)
    want_hist = hist.copy()
    np.add.at(want_hist, (np.concatenate([g, g]), np.concatenate([o, n])), np.repeat(np.array([-1, 1]), g.size))
    new_first, new_last = ends(want_hist[groups])

    got_hist, got_first, got_last, got_compute = hist.copy(), first.copy(), last.copy(), compute.copy()
    out = shift_groups(tiles, old, new, seconds[tiles], got_compute, table, got_hist, got_first, got_last)
    assert got_compute.tolist() == want_compute.tolist() and np.array_equal(got_hist, want_hist)
    assert np.array_equal(out[0], groups) and np.array_equal(out[1], hist[groups])
    assert np.array_equal(out[2], first[groups]) and np.array_equal(out[3], last[groups])
    assert np.array_equal(got_first[groups], new_first) and np.array_equal(got_last[groups], new_last)
    assert np.array_equal(out[4], groups[new_first != first[groups]])
    assert np.array_equal(out[5], groups[new_last != last[groups]])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), lens=st.lists(st.integers(1, 900), min_size=1, max_size=6),
       shift=st.sampled_from([1, 2, 3, 7]), gather=st.booleans())
def test_inherit_merged_matches_its_numpy_form(seed, lens, shift, gather):
    """planner/tile_loops.py ``inherit_merged`` (runs of a real row's tiles in one merged tile, their
    covering kept as bits; per tile past 64 rows and columns a merged tile) against numpy: every real
    tile's merged rank and stages, and which real rows / columns of each merged tile hold a real tile."""
    from blockattn.masks import MaskSpec
    from blockattn.planner.tile_loops import inherit_merged, merge_tiles
    from blockattn.planner.tiles import TileSet

    tiles = TileSet.from_block_mask(MaskSpec.documents(lens).block_mask(16))
    factor = 1 << shift
    merged_q, _, _, _, of_real, _ = merge_tiles(tiles.q, tiles.kv, tiles.full, tiles.pairs, factor, shift,
                                             tiles.num_blocks)
    m = merged_q.size
    rng = np.random.default_rng(seed)
    rank, stage, stage_bwd = (rng.integers(0, 9, m) for _ in range(3))
    got = inherit_merged(tiles.q, tiles.kv, of_real, shift, m, rank, stage, stage_bwd, gather)
    rows, columns = np.zeros(m * factor, dtype=bool), np.zeros(m * factor, dtype=bool)
    rows[of_real * factor + tiles.q % factor] = True
    columns[of_real * factor + tiles.kv % factor] = True
    assert np.array_equal(got[3], rows) and np.array_equal(got[4], columns)
    if gather:
        for values, out in zip((rank, stage, stage_bwd), got[:3]):
            assert out.dtype == np.int32 and np.array_equal(out, values[of_real])
    else:
        assert all(out.size == 0 for out in got[:3])


@settings(max_examples=80, deadline=None)
@given(stages=st.lists(st.integers(0, 150), min_size=1, max_size=60), int32=st.booleans())
def test_stage_renumbering_compacts_the_used_stages(stages, int32):
    """planner/placement.py ``stage_renumbering`` / ``compact_stages``: used stages >= 1 renumbered 1, 2,
    ... in order (stage 0 kept), ``changed`` exactly where that moves a stage; stages past the compiled
    loop's first table (64) too."""
    from blockattn.planner.placement import compact_stages, stage_renumbering

    stage = np.array(stages, dtype=np.int32 if int32 else np.int64)
    used = np.unique(stage[stage > 0])
    want = np.where(stage > 0, np.searchsorted(used, stage) + 1, 0)
    remap, num_stages, changed = stage_renumbering(stage)
    assert np.array_equal(remap[stage], want) and num_stages == used.size + 1
    assert changed == (not np.array_equal(want, stage))
    assert np.array_equal(compact_stages(stage)[0], want)


def test_stage_renumbering_refuses_a_negative_stage():
    import pytest

    from blockattn.planner.placement import stage_renumbering

    with pytest.raises(ValueError, match="stages must be >= 0, got -5"):
        stage_renumbering(np.array([0, -3, 2, -5, 70]))


@settings(max_examples=80, deadline=None)
@given(**PLACEMENTS, per_node=st.sampled_from([None, 1, 2, 4]))
def test_stage0_remote_kv_groups_are_their_numpy_form(seed, num_blocks, world_size, num_tiles, num_stages, per_node):
    """planner/stages_bwd.py ``_stage0_remote_kv_groups`` (compiled: backward_loops.stage0_kv_groups)
    against a dense unique over ``rank * nB + (nB - 1 - kv)`` and a bincount of the groups' seconds."""
    from blockattn.planner.stages_bwd import _stage0_remote_kv_groups

    q, kv, rank, home, _ = _placement(seed, num_blocks, world_size, num_tiles, num_stages)
    rng = np.random.default_rng(seed + 3)
    stage = backward_stages(q, kv, rank, home, num_stages)
    compute = rng.exponential(1e-6, q.size)
    ranks = rng.random(world_size) < 0.7
    got = _stage0_remote_kv_groups(stage, kv, rank, home, compute, ranks, per_node)
    eligible = (stage == 0) & (home[kv] != rank) & ranks[rank]
    if per_node is not None:
        eligible &= home[kv] // per_node == rank // per_node
    idx = np.flatnonzero(eligible)
    if idx.size == 0:
        assert got is None
        return
    groups, of_tile = np.unique(rank[idx] * num_blocks + (num_blocks - 1 - kv[idx]), return_inverse=True)
    want = (idx, of_tile.ravel(), groups // num_blocks, np.bincount(of_tile.ravel(), weights=compute[idx]))
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


@settings(max_examples=60, deadline=None)
@given(**PLACEMENTS, per_node=st.sampled_from([None, 2]), into_last=st.booleans())
def test_deferral_orders_share_one_group_search(seed, num_blocks, world_size, num_tiles, num_stages, per_node,
                                                into_last):
    """planner/stages_bwd.py ``defer_backward_orders`` (both orders from one search of the groups) and
    ``defer_backward_variants`` give what ``defer_backward_groups`` gives for each order and variant,
    ``stage`` itself where nothing moves."""
    from blockattn.planner.placement import per_rank_and_stage
    from blockattn.planner.stages_bwd import defer_backward_groups, defer_backward_orders, defer_backward_variants

    q, kv, rank, home, _ = _placement(seed, num_blocks, world_size, num_tiles, num_stages + 2)
    rng = np.random.default_rng(seed + 5)
    S = num_stages + 2
    stage = backward_stages(q, kv, rank, home, S)
    compute = rng.exponential(1e-6, q.size)
    load = per_rank_and_stage(rank, stage, compute, world_size, S)
    comm = rng.exponential(2e-6, (world_size, S + 1))
    args = (stage, kv, rank, home, compute, load, comm)
    both = defer_backward_orders(*args, orders=(False, True), into_last=into_last, ranks_per_node=per_node)
    for largest_first, got in zip((False, True), both):
        want = defer_backward_groups(*args, largest_first=largest_first, into_last=into_last, ranks_per_node=per_node)
        assert np.array_equal(got, want) and ((got is stage) == (want is stage))
    # ``defer_backward_variants``: every (largest_first, node_local) variant, the node-local ones by nodes of 2
    variants = ((False, False), (True, False), (False, True), (True, True))
    got = dict(defer_backward_variants(*args, variants, into_last=into_last, ranks_per_node=2))
    assert list(got) == list(variants)
    for (largest_first, node_local), cand in got.items():
        want = defer_backward_groups(*args, largest_first=largest_first, into_last=into_last,
                                     ranks_per_node=2 if node_local else None)
        assert np.array_equal(cand, want) and ((cand is stage) == (want is stage))


@settings(max_examples=80, deadline=None)
@given(keys=st.lists(st.integers(0, 20), max_size=40), key=st.integers(-1, 21), lo=st.integers(0, 40),
       right=st.booleans())
def test_bisect_and_find_sorted_are_numpys_searchsorted(keys, key, lo, right):
    """planner/sort_loops.py ``bisect`` (pour's jump to the next rank) and ``find_sorted`` (the relay loops'
    lookups) against np.searchsorted on sorted keys with repeats."""
    from blockattn.planner.sort_loops import bisect, find_sorted

    keys = np.sort(np.array(keys, dtype=np.int64))
    lo = min(lo, keys.size)
    side = "right" if right else "left"
    assert bisect(keys, key, lo, right) == lo + np.searchsorted(keys[lo:], key, side)
    at = np.searchsorted(keys, key)
    assert find_sorted(keys, key) == (at if at < keys.size and keys[at] == key else -1)


@settings(max_examples=80, deadline=None)
@given(base=st.integers(1, 40), high=st.integers(1, 40), data=st.data())
def test_two_digit_order_is_numpys_stable_argsort(base, high, data):
    """planner/sort_loops.py ``two_digit_order`` (one counting pass over few keys, else by the low digit
    then the high one) is the stable argsort, on dense and sparse key ranges alike."""
    from blockattn.planner.sort_loops import two_digit_order

    keys = np.array(data.draw(st.lists(st.integers(0, base * high - 1), max_size=300)), dtype=np.int64)
    got = two_digit_order(keys, base, base * high)
    assert np.array_equal(got, np.argsort(keys, kind="stable"))
