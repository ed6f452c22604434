"""FCP's packing of pieces onto bins (planner/fcp.py step 3), compiled (numba).

Notation (planner/fcp.py): P bins (ranks, or nodes with ``bin_ranks``), nB blocks; a piece is a run of
blocks [s, e) of one segment, with a second run [s2, e2) when it is a zigzag pair (else s2 = e2 = e);
``cost`` [nB + 1] the prefix sums of the blocks' compute, so a run's compute is cost[e] - cost[s].

Why compiled: the packing is a loop over the pieces with two heaps, ~100-300 pieces on a 128K-token
batch, ~0.4 ms of Python per start, which dcp plans up to three of on one node. The loop below is the
Python one's, step for step (the same heap orders, ties and float sums), so the homes are the same.
"""

from __future__ import annotations

import heapq

import numpy as np

from .jit import compiled



@compiled
def pack_pieces(neg_cost, start, end, segment, start2, end2, cost, weights, room, node, num_segments,
                num_blocks, mean, segment_affinity, node_affinity, neighbor_affinity):
    """int64 [nB] bin of every block. Pieces (``neg_cost``: minus their compute) by decreasing compute,
    each to the least loaded bin per unit of weight that still has room (ties: the lowest bin); a bin
    already holding the piece's segment is preferred within ``segment_affinity * mean`` of it, else
    (``neighbor_affinity`` > 0) a bin holding a block next to one of the piece's runs within
    ``neighbor_affinity * mean``, else a bin on the node of the segment's first piece within
    ``node_affinity * mean``. A pair that does not fit the bin is placed as its two runs; a run longer
    than the bin's room is split, the rest queued again. ``room`` [P]: blocks each bin may still take
    (written to)."""
    P = weights.size
    heap = [(neg_cost[i], start[i], end[i], segment[i], start2[i], end2[i]) for i in range(neg_cost.size)]
    heapq.heapify(heap)
    load = np.zeros(P)
    ratio = np.empty(P)  # load per unit of weight, +inf once a bin is full
    for r in range(P):
        ratio[r] = 0.0 if room[r] > 0 else np.inf
    idle = [(ratio[r], r) for r in range(P)]  # (ratio, bin) min-heap, stale entries skipped lazily
    heapq.heapify(idle)
    home = np.full(num_blocks, -1, dtype=np.int64)  # (-1: not placed yet)
    # the bins holding each segment, in the order they took its pieces: a linked list per segment
    seg_head = np.full(num_segments, -1)
    seg_tail = np.full(num_segments, -1)
    seg_node = np.full(num_segments, -1)
    link_bin = np.empty(0, dtype=np.int64)
    link_next = np.empty(0, dtype=np.int64)
    num_links = 0
    while len(heap) > 0:
        _, s, e, seg, s2, e2 = heapq.heappop(heap)
        while idle[0][0] != ratio[idle[0][1]]:
            heapq.heappop(idle)
        r = idle[0][1]  # least loaded (ties: lowest bin)
        # bins holding the segment, then bins holding a neighbouring block, then bins on the segment's
        # node: the first open one of least ratio, where nearly as idle as the least loaded bin
        for pass_ in range(3):
            if pass_ != 1 and seg_head[seg] < 0:  # (a segment's first piece has no bins or node to prefer yet)
                continue
            if pass_ == 1 and neighbor_affinity <= 0:
                continue
            best = -1
            if pass_ == 0:
                link = seg_head[seg]
                while link >= 0:
                    x = link_bin[link]
                    if room[x] > 0 and (best < 0 or ratio[x] < ratio[best]):
                        best = x
                    link = link_next[link]
                affinity = segment_affinity
            elif pass_ == 1:
                # segments meet where a document starts inside the block before the boundary and goes on
                # after it: with the two sides on different bins that block's KV crosses, and its
                # gradient comes back
                for b in (s - 1, e, s2 - 1 if e2 > s2 else -1, e2 if e2 > s2 else -1):
                    if 0 <= b < num_blocks and home[b] >= 0:
                        x = home[b]
                        if room[x] > 0 and (best < 0 or ratio[x] < ratio[best]):
                            best = x
                affinity = neighbor_affinity
            else:
                for x in range(P):
                    if node[x] == seg_node[seg] and room[x] > 0 and (best < 0 or ratio[x] < ratio[best]):
                        best = x
                affinity = node_affinity
            if best >= 0 and ratio[best] <= ratio[r] + affinity * mean:
                r = best
                break
        if e2 > s2 and (e - s) + (e2 - s2) > room[r]:
            # a pair that does not fit: place its two runs independently
            heapq.heappush(heap, (-(cost[e] - cost[s]), s, e, seg, e, e))
            heapq.heappush(heap, (-(cost[e2] - cost[s2]), s2, e2, seg, e2, e2))
            continue
        take = min(e - s, room[r])
        home[s:s + take] = r
        home[s2:e2] = r
        room[r] -= take + (e2 - s2)
        load[r] += cost[s + take] - cost[s] + cost[e2] - cost[s2]
        ratio[r] = load[r] / weights[r] if room[r] > 0 else np.inf
        if r == idle[0][1]:  # (the usual case) its entry is the top: replace it rather than leave it stale
            heapq.heapreplace(idle, (ratio[r], r))
        else:
            heapq.heappush(idle, (ratio[r], r))
        if num_links == link_bin.size:  # (grow the links)
            link_bin = np.concatenate((link_bin, np.empty(max(16, link_bin.size), dtype=np.int64)))
            link_next = np.concatenate((link_next, np.empty(max(16, link_next.size), dtype=np.int64)))
        link_bin[num_links], link_next[num_links] = r, -1
        if seg_head[seg] < 0:
            seg_head[seg] = num_links
            seg_node[seg] = node[r]
        else:
            link_next[seg_tail[seg]] = num_links
        seg_tail[seg] = num_links
        num_links += 1
        if s + take < e:
            heapq.heappush(heap, (-(cost[e] - cost[s + take]), s + take, e, seg, e, e))
    return home


@compiled
def cut_pieces(bounds, group, cost, node_bins, piece, heaviest, pair_slack, skip):
    """The pieces of the segments (planner/fcp.py step 2) as arrays (minus compute, s, e, segment, s2,
    e2), but of the segments flagged in ``skip`` (cut by the caller). A segment of group k >= 2 with at
    least 2k blocks is cut into 2k chunks at ``np.linspace(a, b, 2k + 1).round()`` (the same floats),
    chunk i paired with chunk 2k-1-i, where the heaviest pair is within 1 + ``pair_slack`` of the
    segment's mean piece (bins are ranks, not ``node_bins``); any other into runs of ``piece`` blocks (a
    segment of group <= 1 on node bins: whole), each cut short where its compute would pass
    ``heaviest``."""
    n_seg = bounds.size - 1
    cap = bounds[-1] + 1  # pieces partition the blocks, each at least one block long
    neg = np.empty(cap)
    out = np.empty((5, cap), dtype=np.int64)  # s, e, segment, s2, e2
    m = 0
    for seg in range(n_seg):
        if skip[seg]:
            continue
        a, b, k = bounds[seg], bounds[seg + 1], group[seg]
        if not node_bins and k >= 2 and b - a >= 2 * k:
            num = 2 * k + 1
            step = (float(b) - float(a)) / (num - 1)
            cuts = np.empty(num, dtype=np.int64)
            for i in range(num):
                cuts[i] = b if i == num - 1 else np.int64(np.rint(i * step + a))
            heaviest_pair = -np.inf
            for i in range(k):
                s1, e1, s2, e2 = cuts[i], cuts[i + 1], cuts[2 * k - 1 - i], cuts[2 * k - i]
                heaviest_pair = max(heaviest_pair, cost[e1] - cost[s1] + cost[e2] - cost[s2])
            # only where pairing evens the pieces out (causal-like rows that grow along the segment)
            if heaviest_pair <= (1 + pair_slack) * (cost[b] - cost[a]) / k:
                for i in range(k):
                    s1, e1, s2, e2 = cuts[i], cuts[i + 1], cuts[2 * k - 1 - i], cuts[2 * k - i]
                    neg[m] = -(cost[e1] - cost[s1] + cost[e2] - cost[s2])
                    out[0, m], out[1, m], out[2, m], out[3, m], out[4, m] = s1, e1, seg, s2, e2
                    m += 1
                continue
        # node bins: a segment that fits one node stays whole (a split across nodes costs a slow link)
        step_blocks = b - a if node_bins and k <= 1 else piece
        s = a
        while s < b:
            e = min(b, s + step_blocks)
            if cost[e] - cost[s] > heaviest and e - s > 1:
                # rows too heavy for one piece (a long document's last rows, where pairing could not
                # even them out): cut where the piece reaches its share
                e = min(e - 1, max(s + 1, np.searchsorted(cost, cost[s] + heaviest, side="right") - 1))
            neg[m] = -(cost[e] - cost[s])
            out[0, m], out[1, m], out[2, m], out[3, m], out[4, m] = s, e, seg, e, e
            m += 1
            s = e
    return neg[:m].copy(), out[0, :m].copy(), out[1, :m].copy(), out[2, :m].copy(), out[3, :m].copy(), out[4, :m].copy()
