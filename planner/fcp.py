""""fcp" strategy: flexible context parallelism - segments packed onto flexible groups of ranks.

Notation (docs/design.md): nB blocks, P ranks, tile (qb, kb); M = mean per-rank forward FLOPs;
``cap = ceil(nB / P)`` blocks of memory per rank.

1. Segments: the block sequence is cut wherever at most ``SEGMENT_CUT`` tiles cross a boundary -
   packed documents (and groups of short documents sharing blocks) become independent segments,
   each with a token count and a compute weight (FLOPs of the tiles of its q-blocks).
2. Pieces: a segment heavier than one rank's share of compute (or longer than its memory) gets a
   group of k ranks, k = what its compute and length need (any size, not a power of two) - FCP's
   flexible groups. It is cut into 2k chunks and chunk i is paired with chunk 2k-1-i (zigzag
   inside the document) when that evens the pieces out (rows that grow along a causal document),
   so each group member gets equal compute and reads only the KV before its chunks. Other
   segments longer than ``cap / PIECES_PER_RANK`` blocks are cut into pieces of that size.
3. Packing (polynomial, LPT with capacity): pieces by decreasing compute, each to the least loaded
   rank that still has memory room (a piece larger than the room is split and the rest re-queued);
   pieces of an already placed segment prefer that segment's node when it is nearly as idle.
   Every rank ends with at most ``cap`` blocks, so memory stays within one block of balanced.
4. Execution: as ring/zigzag, every tile on its q-block's home (remote KV only, no OUT partials),
   stages from planner/stages.py.

``fcp_home`` is also the optional initial data placement of the dcp strategy (``init="fcp"``).
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from .cost_model import CostModel
from .placement import Placement, compact_stages
from .stages import assign_stages
from .tiles import TileSet

SEGMENT_CUT = 2  # a boundary crossed by at most this many tiles separates two segments
PIECES_PER_RANK = 4  # long segments are cut into pieces of cap / 4 blocks
SEGMENT_AFFINITY = 0.25  # a rank already holding the segment is preferred within 25% of M of the least loaded
NODE_AFFINITY = 0.10  # else a rank on the segment's node is preferred within 10% of M
PAIR_SLACK = 0.1  # zigzag pairs are used when the heaviest is within 10% of the segment's mean piece
SPLIT_SLACK = 0.1  # a segment up to 10% heavier than a rank's share stays on one rank (the balancer trims it)


def segments(tiles: TileSet) -> np.ndarray:
    """int64 [n_seg + 1] block boundaries of the independent segments."""
    crossing = tiles.crossing_counts()
    cuts = np.flatnonzero(crossing[1:-1] <= SEGMENT_CUT) + 1
    return np.r_[0, cuts, tiles.num_blocks].astype(np.int64)


def fcp_home(tiles: TileSet, world_size: int, *, cost_model: CostModel, num_q_heads: int, head_dim: int,
             bin_ranks: np.ndarray | None = None) -> np.ndarray:
    """Bin of every block (see module docstring, steps 1-3). Bins are ranks by default; with
    ``bin_ranks`` (ranks per bin, e.g. per node) bin i gets memory and compute in proportion."""
    nB = tiles.num_blocks
    weight = np.ones(world_size) if bin_ranks is None else np.asarray(bin_ranks, dtype=np.float64)
    P = weight.size
    if P == 1 or nB == 0:
        return np.zeros(nB, dtype=np.int64)
    flops = cost_model.tile_flops(tiles.pairs, num_q_heads=num_q_heads, head_dim=head_dim)
    block_flops = np.bincount(tiles.q, weights=flops, minlength=nB)
    prefix = np.r_[0.0, np.cumsum(block_flops)]
    per_rank = -(-nB // int(weight.sum()))
    cap = (per_rank * weight).astype(np.int64)
    piece = max(1, per_rank // PIECES_PER_RANK)
    node = cost_model.topology.node_of(np.arange(P)) if bin_ranks is None else np.arange(P)
    bounds = segments(tiles)
    mean = prefix[-1] / weight.sum()
    bin_w = float(weight.max())  # a bin's share: bin_w ranks' worth of compute and memory

    # Pieces as (cost, start, end, segment, start2, end2). A segment heavier than a rank's share of
    # compute (or longer than its memory) is spread over k ranks: cut into 2k chunks, chunk i paired
    # with chunk 2k-1-i (zigzag inside the document), so a causal document's k pieces carry equal
    # compute and each needs only the KV before its two chunks. Other long segments are cut into
    # plain pieces that pack flexibly.
    seg_cost = prefix[bounds[1:]] - prefix[bounds[:-1]]
    group = np.maximum(np.ceil(seg_cost / (mean * bin_w) - SPLIT_SLACK), -(-np.diff(bounds) // int(cap.max())))
    cost = prefix.tolist()
    heap = []
    for seg, (a, b, k) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist(), group.astype(np.int64).tolist())):
        if bin_ranks is None and k >= 2 and b - a >= 2 * k:  # node bins: plain pieces keep windows whole
            cuts = np.linspace(a, b, 2 * k + 1).round().astype(np.int64).tolist()
            pairs = [(cuts[i], cuts[i + 1], cuts[2 * k - 1 - i], cuts[2 * k - i]) for i in range(k)]
            pair_cost = [cost[e1] - cost[s1] + cost[e2] - cost[s2] for s1, e1, s2, e2 in pairs]
            # only where pairing evens the pieces out (causal-like rows that grow along the segment)
            if max(pair_cost) <= (1 + PAIR_SLACK) * (cost[b] - cost[a]) / k:
                heap.extend((-c, s1, e1, seg, s2, e2) for c, (s1, e1, s2, e2) in zip(pair_cost, pairs))
                continue
        for s in range(a, b, piece):
            e = min(b, s + piece)
            heap.append((-(cost[e] - cost[s]), s, e, seg, e, e))
    heapq.heapify(heap)

    runs = []  # (start, end, bin) block runs, written into home once at the end
    # Plain Python lists: the loop touches one rank per piece, and for P <= a few hundred a list
    # min beats a numpy call. ratio = load per unit of weight, +inf once a bin is full.
    weights = weight.tolist()
    load = [0.0] * P
    room = cap.tolist()
    ratio = [0.0 if x > 0 else math.inf for x in room]
    ranks = range(P)
    members = {n: [x for x in ranks if node[x] == n] for n in set(node.tolist())}
    node_of = node.tolist()
    seg_node, seg_ranks = {}, {}
    while heap:
        neg_cost, s, e, seg, s2, e2 = heapq.heappop(heap)
        r = min(ranks, key=ratio.__getitem__)
        # Prefer ranks already holding this segment (their KV is local), then its node, when nearly
        # as idle as the least loaded rank: fewer, nearer KV transfers for the same balance.
        for affinity, near in ((SEGMENT_AFFINITY, seg_ranks.get(seg, ())),
                               (NODE_AFFINITY, members.get(seg_node.get(seg, -1), ()))):
            open_near = [x for x in near if room[x] > 0]
            if open_near:
                r_near = min(open_near, key=ratio.__getitem__)
                if ratio[r_near] <= ratio[r] + affinity * mean:
                    r = r_near
                    break
        if e2 > s2 and (e - s) + (e2 - s2) > room[r]:
            # a pair that does not fit: place its two chunks independently
            for a, b in ((s, e), (s2, e2)):
                heapq.heappush(heap, (-(cost[b] - cost[a]), a, b, seg, b, b))
            continue
        take = min(e - s, room[r])
        runs += ((s, s + take, r), (s2, e2, r))
        room[r] -= take + (e2 - s2)
        load[r] += cost[s + take] - cost[s] + cost[e2] - cost[s2]
        ratio[r] = load[r] / weights[r] if room[r] > 0 else math.inf
        seg_node.setdefault(seg, node_of[r])
        seg_ranks.setdefault(seg, []).append(r)
        if s + take < e:
            heapq.heappush(heap, (-(cost[e] - cost[s + take]), s + take, e, seg, e, e))
    start, end, owner = np.array(runs, dtype=np.int64).reshape(-1, 3).T
    order = np.argsort(start, kind="stable")  # the runs partition [0, nB)
    return np.repeat(owner[order], (end - start)[order])


def fcp(tiles: TileSet, world_size: int, *, cost_model: CostModel, num_q_heads: int, num_kv_heads: int,
        head_dim: int, element_size: int, max_stages: int, **_) -> Placement:
    """FCP placement (see module docstring)."""
    home = fcp_home(tiles, world_size, cost_model=cost_model, num_q_heads=num_q_heads, head_dim=head_dim)
    rank = home[tiles.q]
    flops = cost_model.tile_flops(tiles.pairs, num_q_heads=num_q_heads, head_dim=head_dim)
    stage = assign_stages(tiles.q, tiles.kv, flops, rank, home, block_size=tiles.block_size,
                          total_len=tiles.total_len, world_size=world_size, cost_model=cost_model,
                          max_stages=max_stages, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                          head_dim=head_dim, element_size=element_size)
    stage, _ = compact_stages(stage)
    return Placement(block_home=home, tile_rank=rank, tile_stage=stage)
