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



@compiled
def remote_items(q, kv, rank, home):
    """The (tile, item) entries of the tiles' remote inputs and their items: (``tile_idx``, ``item_of``,
    the items' keys ``(rank * 2 + is_kv) * nB + block`` ascending, the number of Q entries, each tile's
    count of remote inputs). Items found by two stable counting passes over the entries (by block, then
    by rank and kind): O(entries + nB + P), where a table of every key would be 2 P nB wide."""
    n, num_blocks = q.size, home.size
    num_q, num_kv, top = 0, 0, 0
    needs = np.zeros(n, dtype=np.int64)
    for i in range(n):
        top = max(top, rank[i])
        if home[q[i]] != rank[i]:
            num_q += 1
            needs[i] += 1
        if home[kv[i]] != rank[i]:
            num_kv += 1
            needs[i] += 1
    m = num_q + num_kv
    tile_idx = np.empty(m, dtype=np.int64)
    block = np.empty(m, dtype=np.int64)
    group = np.empty(m, dtype=np.int64)  # rank * 2 + is_kv
    j, k = 0, num_q
    for i in range(n):
        if home[q[i]] != rank[i]:
            tile_idx[j], block[j], group[j] = i, q[i], rank[i] * 2
            j += 1
        if home[kv[i]] != rank[i]:
            tile_idx[k], block[k], group[k] = i, kv[i], rank[i] * 2 + 1
            k += 1
    by_block = counting_order(block, num_blocks)
    keys = np.empty(m, dtype=np.int64)
    for a in range(m):
        keys[a] = group[by_block[a]]
    by_group = counting_order(keys, 2 * (top + 1))
    item_of = np.empty(m, dtype=np.int64)
    item_keys = np.empty(m, dtype=np.int64)
    count, previous = 0, -1
    for a in range(m):
        e = by_block[by_group[a]]
        key = group[e] * num_blocks + block[e]
        if key != previous:
            item_keys[count] = key
            count += 1
            previous = key
        item_of[e] = count - 1
    return tile_idx, item_of, item_keys[:count].copy(), num_q, needs


@compiled
def max_over_items(n, tile_idx, value, num_q_entries, fill):
    """Per tile, the max of ``value`` over its (at most two) entries, ``fill`` for a tile with none."""
    out = np.full(n, fill, dtype=np.int64)
    for j in range(tile_idx.size):
        t = tile_idx[j]
        out[t] = value[j] if j < num_q_entries else max(out[t], value[j])
    return out


@compiled
def _cut_items(lo, hi, budget, scale, max_stages, cum_time, done_sorted, cum_done, cuts):
    """One rank's items ``order[lo:hi]`` cut into stages, written as (begin, end, stage) rows into
    ``cuts``: each group as long as the compute of the previous stage (``budget``: the local compute
    for stage 1) times ``scale`` can hide, the last stage taking the rest. Returns (estimated overlapped
    time, number of rows)."""
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
        a = np.searchsorted(done_sorted, begin)
        b = np.searchsorted(done_sorted, end)
        budget = cum_done[b] - cum_done[a]
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
    local_compute = np.zeros(world_size)
    num_remote = 0
    for t in range(n):
        if remote[t]:
            num_remote += 1
        else:
            local_compute[rank[t]] += compute_time[t]
    remote_tiles = np.empty(num_remote, dtype=np.int64)
    done_remote = np.empty(num_remote, dtype=np.int64)
    m = 0
    for t in range(n):
        if remote[t]:
            remote_tiles[m], done_remote[m] = t, done_at[t]
            m += 1
    # remote tiles by the position they complete at (stable, as numpy's stable argsort)
    by_done = remote_tiles[counting_order(done_remote, K)]
    done_sorted = np.empty(num_remote, dtype=np.int64)
    cum_done = np.zeros(num_remote + 1)
    for i in range(num_remote):
        done_sorted[i] = done_at[by_done[i]]
        cum_done[i + 1] = cum_done[i] + compute_time[by_done[i]]

    item_stage = np.zeros(K, dtype=np.int64)
    cuts = np.empty((K + 1, 3), dtype=np.int64)
    best_cuts = np.empty((K + 1, 3), dtype=np.int64)
    for r in range(world_size):
        lo, hi = starts[r], starts[r + 1]
        if lo == hi:
            continue
        best, best_count = np.inf, 0
        for scale in scales:  # (the first of equal estimates, as min() keeps it)
            estimate, count = _cut_items(lo, hi, local_compute[r], scale, max_stages, cum_time, done_sorted,
                                         cum_done, cuts)
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
