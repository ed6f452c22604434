"""Compiled passes over every real tile (numba), where numpy takes several passes and temporaries.

Notation (docs/design.md): tiles (qb, kb) sorted by (q, kv), nB blocks of B tokens, P ranks; blocks
merged ``factor`` at a time (planner/tiles.py ``coarsen``; dcp merges ``factor = 2 ** shift``), real
block b in merged block b >> shift, at position b & (factor - 1) inside it; ``home[b]`` owns block b.

Why: a large one-node batch (128K tokens of long documents, 100-200K tiles at block 128) is planned on
merged blocks, and then every real tile is visited to merge it, to map the merged plan's receive groups
back to real blocks and to count bytes; in numpy those passes took ~3 of its ~10 ms (about a dozen
passes over the tiles, each writing a temporary as large). One loop each does the same work in one or
two passes. The results are the same arrays (integer sums), so the plans do not change. Also here:
``compact_stages``' renumbering, the spreads' grouping by rank and pour (planner/spread_loops.py), and the
per-(rank, stage) and weighted sums over tiles that finishing a placement takes a dozen times
(``stage_loads``, ``key_sums``), same floats as their numpy forms, and the counts behind the fcp
segments (``boundary_crossings``, ``reads_from_afar``, ``segment_crossings``). Where a loop would store
into a table once per tile, it keeps what it marks as the bits of a word where it can (the stages
used, a merged tile's covered rows and columns): a store per tile cost ~10x a vectorized reduction.
"""

from __future__ import annotations

import numpy as np

from .jit import compiled
from .sort_loops import bisect, counting_order


@compiled
def _merged(block, factor, shift):
    """The merged block of real ``block``: a shift where ``factor`` is a power of two (``shift`` >= 0)."""
    return block >> shift if shift >= 0 else block // factor


@compiled
def _real_row_end(q, kv, start):
    """(end, contiguous) of the real row whose first tile is ``start``: one past its last tile, and whether
    its columns are one run kv[start], kv[start] + 1, ... (a document's row is; a sink's or a shared
    question's may not be). q is sorted, so the end is found in strides of 16 tiles, then tile by tile."""
    n, row = q.size, q[start]
    end = start + 1
    while end + 16 <= n and q[end + 15] == row:
        end += 16
    while end < n and q[end] == row:
        end += 1
    return end, kv[end - 1] - kv[start] == end - 1 - start


@compiled
def merge_tiles(q, kv, full, pairs, factor, shift, num_blocks):
    """The tiles of blocks merged ``factor`` at a time, from (q, kv)-sorted real tiles: (merged q, merged
    kv, each merged tile's real-tile pairs summed, its count of full real tiles, each real tile's merged
    tile, each real q-block's pairs summed as float64 [num_blocks]: ``TileSet.row_pairs`` of the real
    tiles, summed on the way), merged tiles sorted by (q, kv). A merged row's columns are marked on a
    presence table over its span only (sized like the mask's band, not nB ** 2), a real row's columns by
    their range where they are one run (a store per merged column instead of a test per tile: 0.69 -> 0.39 ms on 164K tiles
    merged 4x). ``shift``: log2(factor) where it is a power of two, else -1."""
    n = q.size
    num_merged_blocks = (num_blocks + factor - 1) // factor
    merged_q = np.empty(n, dtype=np.int64)
    merged_kv = np.empty(n, dtype=np.int64)
    # (sized for the worst case, zeroed per merged tile as it is found: zeroing n cells took ~10%)
    merged_pairs = np.empty(n, dtype=np.int64)
    merged_full = np.empty(n, dtype=np.int64)
    of_real = np.empty(n, dtype=np.int64)
    seen_in_row = np.full(num_merged_blocks, -1, dtype=np.int64)  # the merged row that last held the column
    index = np.empty(num_merged_blocks, dtype=np.int64)  # the column's merged tile in that row
    m = 0
    begin = 0
    while begin < n:
        row = _merged(q[begin], factor, shift)
        end, lo, hi = begin, num_merged_blocks, -1
        while end < n and _merged(q[end], factor, shift) == row:
            start = end
            end, contiguous = _real_row_end(q, kv, start)
            first, last = _merged(kv[start], factor, shift), _merged(kv[end - 1], factor, shift)
            if contiguous:
                for col in range(first, last + 1):
                    seen_in_row[col] = row
            else:
                for i in range(start, end):
                    seen_in_row[_merged(kv[i], factor, shift)] = row
            lo, hi = min(lo, first), max(hi, last)
        for col in range(lo, hi + 1):
            if seen_in_row[col] == row:
                merged_q[m], merged_kv[m], index[col] = row, col, m
                merged_pairs[m], merged_full[m] = 0, 0
                m += 1
        for i in range(begin, end):
            of_real[i] = index[_merged(kv[i], factor, shift)]
        begin = end
    # consecutive real tiles mostly share a merged tile: sum them in registers (a sum into the same
    # array cell as the tile before waits for that store, ~3x slower), in a pass of its own (~2x faster
    # than within the one above)
    # (and each real row's pairs, summed alike)
    row_pairs = np.zeros(num_blocks, dtype=np.float64)
    tile, run_pairs, run_full = -1, 0, 0
    row, run_row = -1, 0
    for i in range(n):
        if of_real[i] != tile:
            if tile >= 0:
                merged_pairs[tile] += run_pairs
                merged_full[tile] += run_full
            tile, run_pairs, run_full = of_real[i], 0, 0
        if q[i] != row:
            if row >= 0:
                row_pairs[row] = run_row
            row, run_row = q[i], 0
        run_pairs += pairs[i]
        run_full += full[i]
        run_row += pairs[i]
    if tile >= 0:
        merged_pairs[tile] += run_pairs
        merged_full[tile] += run_full
        row_pairs[row] = run_row
    # (copies: the merged TileSet is cached with its batch, and holds m of the n entries)
    return (merged_q[:m].copy(), merged_kv[:m].copy(), merged_pairs[:m].copy(), merged_full[:m].copy(), of_real,
            row_pairs)


@compiled
def covered_rows_and_columns(q, kv, of_real, shift, num_merged_tiles):
    """bool [merged tiles * factor] twice: which of each merged tile's ``factor`` real rows (q), and
    which of its real columns (kv), hold a real tile (row-major: merged tile t, position j at
    t * factor + j)."""
    empty = np.zeros(0, dtype=np.int64)
    return inherit_merged(q, kv, of_real, shift, num_merged_tiles, empty, empty, empty, False)[3:]


@compiled
def inherit_merged(q, kv, of_real, shift, num_merged_tiles, rank, stage, stage_bwd, gather):
    """(rank, stage, backward stage) of every real tile, its merged tile's (``gather``; else empty), and
    ``covered_rows_and_columns``, in one pass over the real tiles (the gathers and the covering each
    read every real tile's merged tile). The gathered columns are int32, as the Plan holds them: a
    one-node plan on merged blocks is final once inherited (half the bytes written, no conversion).
    A real row's consecutive tiles mostly share a merged tile: per such run its values are read once
    and the positions it covers kept as the bits of a word, stored once (~30% faster than a table
    store per tile), where a merged tile has at most 64 rows and columns."""
    n, factor = q.size, 1 << shift
    size = n if gather else 0
    out_rank = np.empty(size, dtype=np.int32)
    out_stage = np.empty(size, dtype=np.int32)
    out_bwd = np.empty(size, dtype=np.int32)
    rows = np.zeros(num_merged_tiles * factor, dtype=np.bool_)
    columns = np.zeros(num_merged_tiles * factor, dtype=np.bool_)
    low = factor - 1
    if factor > 64:
        for i in range(n):
            t = of_real[i]
            if gather:
                out_rank[i], out_stage[i], out_bwd[i] = rank[t], stage[t], stage_bwd[t]
            at = t << shift
            rows[at | (q[i] & low)] = True
            columns[at | (kv[i] & low)] = True
        return out_rank, out_stage, out_bwd, rows, columns
    row_bits = np.zeros(num_merged_tiles, dtype=np.uint64)
    column_bits = np.zeros(num_merged_tiles, dtype=np.uint64)
    t, row, bits, r, s, sb = -1, -1, np.uint64(0), 0, 0, 0
    for i in range(n):
        if of_real[i] != t or q[i] != row:  # (a new run: the last one's covering stored)
            if t >= 0:
                column_bits[t] |= bits
                row_bits[t] |= np.uint64(1) << np.uint64(row & low)
            t, row, bits = of_real[i], q[i], np.uint64(0)
            if gather:
                r, s, sb = rank[t], stage[t], stage_bwd[t]
        if gather:
            out_rank[i], out_stage[i], out_bwd[i] = r, s, sb
        bits |= np.uint64(1) << np.uint64(kv[i] & low)
    if t >= 0:
        column_bits[t] |= bits
        row_bits[t] |= np.uint64(1) << np.uint64(row & low)
    for m in range(num_merged_tiles):
        for j in range(factor):
            rows[m * factor + j] = (row_bits[m] >> np.uint64(j)) & np.uint64(1) != 0
            columns[m * factor + j] = (column_bits[m] >> np.uint64(j)) & np.uint64(1) != 0
    return out_rank, out_stage, out_bwd, rows, columns


@compiled
def remote_tokens(blocks, home, rank, block_len, world_size):
    """The tokens of the distinct (rank, block) pairs of the tiles whose block (``blocks``: each tile's
    q- or kv-block) is homed away from the tile's rank: what the receive-once rule moves."""
    num_blocks = home.size
    held = np.zeros(world_size * num_blocks, dtype=np.bool_)
    tokens = 0
    for i in range(blocks.size):
        b, r = blocks[i], rank[i]
        if home[b] != r and not held[r * num_blocks + b]:
            held[r * num_blocks + b] = True
            tokens += block_len[b]
    return tokens


@compiled
def stage_renumbering(stage):
    """(remap, number of stages, whether remap changes any stage, smallest stage) of non-empty stages:
    ``remap[s]`` renumbers the used stages >= 1 as 1, 2, ... (stage 0 kept), in one pass over the
    tiles; where the smallest is negative, nothing else is meaningful (the caller raises)."""
    # one pass: the bounds and, for stages below 64 (all but a few plans), the stages used as bits of a
    # word - a reduction the compiler vectorizes (~10x faster than marking a table per tile)
    top, low, bits = stage[0], stage[0], np.uint64(0)
    for i in range(stage.size):
        s = stage[i]
        top, low = max(top, s), min(low, s)
        bits |= np.uint64(1) << np.uint64(s & 63)
    if low < 0:
        return np.zeros(0, dtype=np.int64), 0, False, low
    used = np.zeros(top + 1, dtype=np.bool_)
    if top < 64:
        for s in range(top + 1):
            used[s] = (bits >> np.uint64(s)) & np.uint64(1) != 0
    else:
        for s in stage:
            used[s] = True
    remap = np.empty(used.size, dtype=np.int64)
    count = 0
    for s in range(used.size):
        if s > 0 and used[s]:
            count += 1
        remap[s] = count
    return remap, count + 1, count != used.size - 1, low


@compiled
def renumbered(stage, remap):
    """``remap[stage]``, a new array."""
    out = np.empty(stage.size, dtype=np.int64)
    for i in range(stage.size):
        out[i] = remap[stage[i]]
    return out


@compiled
def group_by_rank(tiles, rank, seconds, world_size):
    """(tiles grouped by ascending rank, stably; their ranks; each one's end position in its rank's list,
    in seconds): planner/stages.py ``LocalWork``. The ends are the running sum over all the grouped
    tiles less the sum before the rank's first, as ``_grouped_cumsum`` computes them (same floats)."""
    order = tiles[counting_order(rank[tiles], world_size)]
    ranks = rank[order]
    return order, ranks, grouped_running_sums(ranks, seconds[order])


@compiled
def grouped_running_sums(keys, values):
    """Per position, ``values`` summed over the positions up to it with the same key, the keys in runs:
    the running sum over all positions less the sum before the run's first (planner/stages.py
    ``_grouped_cumsum``'s floats)."""
    out = np.empty(values.size)
    cum, before = 0.0, 0.0
    for i in range(values.size):
        value = values[i]
        cum += value
        if i == 0 or keys[i] != keys[i - 1]:
            before = cum - value
        out[i] = cum - before
    return out


@compiled
def pour(stage, order, ranks, end, total, gaps, movable, fill):
    """The spreads' pour (planner/spread_loops.py): per rank, its local tiles (``order``, with ``ranks``
    and ``end``) fill the gaps ``gaps[r, i]`` of stages ``fill[i]`` in turn, up to ``movable[r]`` seconds
    in all; a tile goes to the first gap whose cumulative room reaches its end position. (stages,
    whether a tile moved): ``stage`` itself where none moves. (The rows of cumulative room are searched
    laid end to end, each shifted past the previous one, with the same floats as the numpy form.)"""
    P, F = gaps.shape
    movable = np.maximum(movable, 0.0)
    if order.size == 0 or F == 0 or not (gaps != 0).any() or not (movable != 0).any():
        return stage, False
    upto = np.empty((P, F))  # work placed up to gap i, non-decreasing along i
    for r in range(P):
        room = 0.0
        for i in range(F):
            room += gaps[r, i]
            upto[r, i] = min(room, movable[r])
    shift = 2.0 * max(total.max(), upto.max()) + 1.0
    flat = np.empty(P * F)
    for r in range(P):
        for i in range(F):
            flat[r * F + i] = upto[r, i] + shift * r
    out, moved = stage, False
    # a tile's gap is searchsorted(flat, end + shift * r, "left") - r * F; within a rank the ends grow,
    # and so does that position: one pointer per rank walks the rank's row instead of a search per tile.
    # Once it is past the rank's last gap, the rank's later tiles stay: the walk jumps to the next rank
    # (most of a rank's local tiles, where its gaps are small: ~1/3 of a 1M / 64 plan's pours)
    n, j = order.size, 0
    while j < n:
        r, i = ranks[j], 0
        while j < n and ranks[j] == r:
            target = end[j] + shift * r
            while i < F and flat[r * F + i] < target:
                i += 1
            if i == F:
                j = bisect(ranks, r, j + 1, True)  # (the next rank's first tile)
                break
            if not moved:
                out, moved = stage.copy(), True
            out[order[j]] = fill[i]
            j += 1
    return out, moved


@compiled
def real_groups(covered, order, heads, stage, stage_bwd, group_rank, group_block, factor):
    """planner/schedule.py ``derive_schedule_merged``: the real (rank, block) receive groups of merged
    groups (``order``: merged tiles by group, ``heads``: each group's first position), with each real
    group's first and last forward and backward stage over the merged tiles that cover its block
    (``covered``: ``covered_rows_and_columns``' rows or columns). Groups in the merged groups' order,
    each one's real blocks ascending; (rank, block, first, last, first bwd, last bwd)."""
    num_groups, n = heads.size, order.size
    out_rank = np.empty(num_groups * factor, dtype=np.int64)
    out_block = np.empty(num_groups * factor, dtype=np.int64)
    out_stages = np.empty((4, num_groups * factor), dtype=np.int64)
    lo = np.empty((2, factor), dtype=np.int64)
    hi = np.empty((2, factor), dtype=np.int64)
    present = np.empty(factor, dtype=np.bool_)
    m = 0
    for g in range(num_groups):
        end = heads[g + 1] if g + 1 < num_groups else n
        lo[:] = np.iinfo(np.int64).max
        hi[:] = -1
        present[:] = False
        for p in range(heads[g], end):
            t = order[p]
            fwd, bwd = stage[t], stage_bwd[t]
            for j in range(factor):
                if covered[t * factor + j]:
                    present[j] = True
                    lo[0, j], hi[0, j] = min(lo[0, j], fwd), max(hi[0, j], fwd)
                    lo[1, j], hi[1, j] = min(lo[1, j], bwd), max(hi[1, j], bwd)
        for j in range(factor):
            if present[j]:
                out_rank[m], out_block[m] = group_rank[g], group_block[g] * factor + j
                out_stages[0, m], out_stages[1, m] = lo[0, j], hi[0, j]
                out_stages[2, m], out_stages[3, m] = lo[1, j], hi[1, j]
                m += 1
    return (out_rank[:m].copy(), out_block[:m].copy(), out_stages[0, :m].copy(), out_stages[1, :m].copy(),
            out_stages[2, :m].copy(), out_stages[3, :m].copy())


@compiled
def _cell_sums(major, minor, width, weights, size):
    """float64 [size]: ``weights`` summed per cell ``major * width + minor`` (``minor`` None: the cell is
    ``major``), in input order: the floats of a weighted ``np.bincount`` over the cells. Consecutive
    elements mostly share a cell, so its sum is carried in a register while they do (the same additions
    in the same order; adding into the cell the element before stored waits for that store, ~3x
    slower). A cell or minor index out of range raises ValueError."""
    out = np.zeros(size)
    cell, total = -1, 0.0
    for i in range(major.size):
        at = major[i] if minor is None else major[i] * width + minor[i]
        if at < 0 or at >= size or (minor is not None and (minor[i] < 0 or minor[i] >= width)):
            raise ValueError("a tile's rank, stage or key is out of range")
        if at != cell:
            if cell >= 0:
                out[cell] = total
            cell, total = at, out[at]
        total += weights[i]
    if cell >= 0:
        out[cell] = total
    return out


@compiled
def stage_loads(rank, stage, seconds, world_size, width):
    """float64 [P, width]: ``seconds`` summed per (rank, stage) of the tiles, in tile order (the floats of
    ``np.bincount(rank * width + stage, weights=seconds)``, without its key and temporaries)."""
    return _cell_sums(rank, stage, width, seconds, world_size * width).reshape(world_size, width)


@compiled
def key_sums(keys, weights, size):
    """float64 [size]: ``weights`` summed per key in [0, size), in input order (the floats of
    ``np.bincount(keys, weights=weights, minlength=size)``, which on a merged plan's ~10K tiles costs ~4x
    this loop)."""
    return _cell_sums(keys, None, 1, weights, size)


@compiled
def boundary_crossings(q, kv, num_blocks):
    """int64 [nB + 1]: for boundary j (between blocks j-1 and j), the tiles (q, kv) whose q and kv lie on
    opposite sides: +1 at the lower block's boundary after it, -1 after the higher, summed up."""
    diff = np.zeros(num_blocks + 1, dtype=np.int64)
    for i in range(q.size):
        lo, hi = min(q[i], kv[i]), max(q[i], kv[i])
        diff[lo + 1] += 1
        diff[hi + 1] -= 1
    running = 0
    for j in range(num_blocks + 1):
        running += diff[j]
        diff[j] = running
    return diff


@compiled
def segment_crossings(q, kv, full, crossing, shared, documents):
    """planner/fcp.py ``segments``' counts: ``crossing`` (every tile's) less the tiles that do not join
    segments: with ``documents`` a partial tile into an earlier block (the block its document starts in)
    at the boundary after that block, else a tile reading a ``shared`` kv-block at every boundary it
    crosses."""
    size = crossing.size  # nB + 1
    point = np.zeros(size, dtype=np.int64)
    diff = np.zeros(size + 1, dtype=np.int64)
    for i in range(q.size):
        if documents and kv[i] < q[i] and not full[i]:
            point[kv[i] + 1] += 1
        elif shared[kv[i]]:
            diff[min(q[i], kv[i]) + 1] += 1
            diff[max(q[i], kv[i]) + 1] -= 1
    out = np.empty(size, dtype=np.int64)
    running = 0
    for j in range(size):
        running += diff[j]
        out[j] = crossing[j] - point[j] - running
    return out


@compiled
def reads_from_afar(q, kv, num_blocks):
    """int64 [nB]: per kv-block, the (q, kv)-sorted tiles reading it in a run of consecutive kv-blocks
    other than their row's last run (planner/fcp.py ``shared_columns``)."""
    counts = np.zeros(num_blocks, dtype=np.int64)
    n, begin = q.size, 0
    while begin < n:
        end = begin + 1
        while end < n and q[end] == q[begin]:
            end += 1
        last_run = end - 1
        while last_run > begin and kv[last_run] == kv[last_run - 1] + 1:
            last_run -= 1
        for i in range(begin, last_run):
            counts[kv[i]] += 1
        begin = end
    return counts
