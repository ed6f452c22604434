"""The core of planner/stages.py ``assign_stages``, compiled (numba): each rank's items ordered by the
compute they unlock per second of transfer, then cut into stages.

Notation (planner/stages.py): P ranks, n tiles, K items (one remote input a rank receives: a Q or KV
block); ``tile_idx`` / ``item_of``: the (tile, item) entries, a tile's Q item first, then its KV item,
each list in ascending tile order; items sorted by (rank, kind, block), so each rank's items are one run.

Why compiled: the per-rank cuts were a Python loop of searchsorted calls, and the orders around them a
dozen numpy passes, ~0.6 ms of a ~6 ms one-node 128K / 8 plan. Same floats, in the same order (the
credits as bincount sums them, running sums as cumsum), and the same orders (stable sorts), so the
stages are those of the numpy form.
"""

from __future__ import annotations

import numpy as np

from .jit import compiled
from .sort_loops import counting_order, stable_argsort

TABLE_PER_ENTRY = 4  # ``remote_items`` numbers items on a table of every key up to 4 keys per entry


@compiled
def remote_items(q, kv, rank, home):
    """The (tile, item) entries of the tiles' remote inputs and their items: (``tile_idx``, ``item_of``,
    the items' keys ``(rank * 2 + is_kv) * nB + block`` ascending, the number of Q entries, each tile's
    count of remote inputs). Items numbered on a table of every key where it is small against the
    entries (one node: 2 P nB = 16K keys for ~150K entries at 128K / 8), else by two stable counting
    passes (``items_by_counting``; 1M / 64: 1M keys)."""
    n, num_blocks = q.size, home.size
    num_q, num_kv, top = 0, 0, 0
    needs = np.empty(n, dtype=np.int64)
    for i in range(n):
        r = rank[i]
        top = max(top, r)
        need = 0
        if home[q[i]] != r:
            num_q += 1
            need += 1
        if home[kv[i]] != r:
            num_kv += 1
            need += 1
        needs[i] = need
    m = num_q + num_kv
    tile_idx = np.empty(m, dtype=np.int64)
    key = np.empty(m, dtype=np.int64)
    j, k = 0, num_q
    for i in range(n):
        if needs[i] == 0:
            continue
        r = rank[i]
        if home[q[i]] != r:
            tile_idx[j], key[j] = i, 2 * r * num_blocks + q[i]
            j += 1
        if home[kv[i]] != r:
            tile_idx[k], key[k] = i, (2 * r + 1) * num_blocks + kv[i]
            k += 1
    width = 2 * (top + 1) * num_blocks
    if width <= TABLE_PER_ENTRY * m:
        item_of, item_keys = items_by_table(key, width)
    else:
        item_of, item_keys = items_by_counting(key, num_blocks, 2 * (top + 1))
    return tile_idx, item_of, item_keys, num_q, needs


@compiled
def items_by_table(key, width):
    """(each entry's item, the items' keys ascending) of ints ``key`` in [0, ``width``): the distinct keys
    marked on a table and numbered in order."""
    index = np.zeros(width, dtype=np.int64)  # 1 + the key's item, 0 where absent
    for a in range(key.size):
        index[key[a]] = 1
    count = 0
    for w in range(width):
        if index[w]:
            count += 1
            index[w] = count
    item_keys = np.empty(count, dtype=np.int64)
    item_of = np.empty(key.size, dtype=np.int64)
    for a in range(key.size):
        item = index[key[a]] - 1
        item_of[a] = item
        item_keys[item] = key[a]
    return item_of, item_keys


@compiled
def items_by_counting(key, num_blocks, num_groups):
    """``items_by_table`` of keys ``group * num_blocks + block`` (group < ``num_groups``) without a table of
    every key: two stable counting passes, by block then by group, O(entries + nB + groups)."""
    m = key.size
    block = np.empty(m, dtype=np.int64)
    for a in range(m):
        block[a] = key[a] % num_blocks
    by_block = counting_order(block, num_blocks)
    group = np.empty(m, dtype=np.int64)
    for a in range(m):
        group[a] = key[by_block[a]] // num_blocks
    by_group = counting_order(group, num_groups)
    item_of = np.empty(m, dtype=np.int64)
    item_keys = np.empty(m, dtype=np.int64)
    count, previous = 0, -1
    for a in range(m):
        e = by_block[by_group[a]]
        if key[e] != previous:
            item_keys[count] = key[e]
            count += 1
            previous = key[e]
        item_of[e] = count - 1
    return item_of, item_keys[:count].copy()


@compiled
def max_over_items(n, tile_idx, value, num_q_entries, fill):
    """Per tile, the max of ``value`` over its (at most two) entries, ``fill`` for a tile with none."""
    out = np.full(n, fill, dtype=np.int64)
    for j in range(tile_idx.size):
        t = tile_idx[j]
        out[t] = value[j] if j < num_q_entries else max(out[t], value[j])
    return out


@compiled
def _cut_items(lo, hi, budget, scale, max_stages, cum_time, unlocked, cuts):
    """One rank's items ``order[lo:hi]`` cut into stages, written as (begin, end, stage) rows into
    ``cuts``: each group as long as the compute of the previous stage (``budget``: the local compute
    for stage 1) times ``scale`` can hide, the last stage taking the rest. ``unlocked[k]``: the compute
    of the remote tiles complete before position k. Returns (estimated overlapped time, number of rows)."""
    begin, s, count, estimate = lo, 1, 0, 0.0
    while begin < hi:
        if s == max_stages:
            end = hi
        else:
            # largest prefix whose transfer time fits the budget (at least one item)
            end = np.searchsorted(cum_time, cum_time[begin] + budget * scale, side="right") - 1
            end = min(hi, max(end, begin + 1))
        cuts[count, 0], cuts[count, 1], cuts[count, 2] = begin, end, s
        count += 1
        estimate += max(budget, cum_time[end] - cum_time[begin])
        # compute unlocked by this stage's items hides the next stage's transfers
        budget = unlocked[end] - unlocked[begin]
        begin, s = end, s + 1
    return estimate + budget, count


@compiled
def stage_items(n, tile_idx, item_of, num_q_entries, needs, item_rank, item_time, compute_time, rank, remote,
                world_size, max_stages, scales):
    """int64 [n] stage of every tile: per rank, items by decreasing credit per second of transfer (a
    tile's compute credited to its items, half each when it needs two; ties by kind, then block), cut
    by ``_cut_items`` under each budget scale in ``scales``, the rank keeping the cuts of the least
    estimated time; a tile runs in the stage of its last item (0 with none)."""
    K, E = item_rank.size, tile_idx.size
    credit = np.zeros(K)
    for j in range(E):
        t = tile_idx[j]
        credit[item_of[j]] += compute_time[t] / needs[t]
    # items are grouped by rank and, within one, sorted by (kind, block): a stable sort of each rank's
    # run by the ratio gives numpy's lexsort((block, kind, -credit / time, rank))
    starts = np.zeros(world_size + 1, dtype=np.int64)
    for i in range(K):
        starts[item_rank[i] + 1] += 1
    for r in range(world_size):
        starts[r + 1] += starts[r]
    ratio = np.empty(K)
    for i in range(K):
        ratio[i] = -credit[i] / item_time[i]
    order = np.empty(K, dtype=np.int64)
    for r in range(world_size):
        stable_argsort(ratio, starts[r], starts[r + 1], order)
    position = np.empty(K, dtype=np.int64)
    for i in range(K):
        position[order[i]] = i

    # a tile completes when its last item (highest position) has arrived
    entry_value = np.empty(E, dtype=np.int64)
    for j in range(E):
        entry_value[j] = position[item_of[j]]
    done_at = max_over_items(n, tile_idx, entry_value, num_q_entries, -1)
    cum_time = np.zeros(K + 1)
    for i in range(K):
        cum_time[i + 1] = cum_time[i] + item_time[order[i]]
    # The compute of the remote tiles complete before each position, summed in the order of a stable
    # sort of the tiles by the position they complete at (a counting pass, writing only their compute):
    # what the cuts read, at every position.
    local_compute = np.zeros(world_size)
    first = np.zeros(K + 1, dtype=np.int64)  # (counts, then each position's first slot)
    for t in range(n):
        if remote[t]:
            first[done_at[t] + 1] += 1
        else:
            local_compute[rank[t]] += compute_time[t]
    for k in range(K):
        first[k + 1] += first[k]
    compute_by_done = np.empty(first[K])
    slot = first[:K].copy()
    for t in range(n):
        if remote[t]:
            compute_by_done[slot[done_at[t]]] = compute_time[t]
            slot[done_at[t]] += 1
    unlocked = np.zeros(K + 1)
    total = 0.0
    for k in range(K):
        unlocked[k] = total
        for i in range(first[k], first[k + 1]):
            total += compute_by_done[i]
    unlocked[K] = total

    item_stage = np.zeros(K, dtype=np.int64)
    cuts = np.empty((K + 1, 3), dtype=np.int64)
    best_cuts = np.empty((K + 1, 3), dtype=np.int64)
    for r in range(world_size):
        lo, hi = starts[r], starts[r + 1]
        if lo == hi:
            continue
        best, best_count = np.inf, 0
        for scale in scales:  # (the first of equal estimates, as min() keeps it)
            estimate, count = _cut_items(lo, hi, local_compute[r], scale, max_stages, cum_time, unlocked, cuts)
            if estimate < best:
                best, best_count = estimate, count
                for c in range(count):
                    for x in range(3):
                        best_cuts[c, x] = cuts[c, x]
        for c in range(best_count):
            for i in range(best_cuts[c, 0], best_cuts[c, 1]):
                item_stage[order[i]] = best_cuts[c, 2]
    for j in range(E):
        entry_value[j] = item_stage[item_of[j]]
    return max_over_items(n, tile_idx, entry_value, num_q_entries, 0)
