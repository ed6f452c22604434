""""fcp" strategy: flexible context parallelism - segments packed onto flexible groups of ranks.

Notation (docs/design.md): nB blocks, P ranks, tile (qb, kb); M = mean per-rank forward FLOPs;
``cap = ceil(nB / P)`` blocks of memory per rank.

1. Segments: the block sequence is cut wherever at most ``SEGMENT_CUT`` tiles cross a boundary -
   packed documents (and groups of short documents sharing blocks) become independent segments,
   each with a token count and a compute weight (FLOPs of the tiles of its q-blocks). With
   ``documents`` a document that starts inside a block is cut from what precedes it too.
2. Pieces: a segment heavier than one rank's share of compute (or longer than its memory) gets a
   group of k ranks, k = what its compute and length need (any size, not a power of two) - FCP's
   flexible groups. It is cut into 2k chunks and chunk i is paired with chunk 2k-1-i (zigzag
   inside the document) when that evens the pieces out (rows that grow along a causal document),
   so each group member gets equal compute and reads only the KV before its chunks. Other
   segments longer than ``cap / PIECES_PER_RANK`` blocks are cut into pieces of that size (in the
   fcp strategy also of at most 3/4 of a rank's share of compute, ``strategy_home``).
   With node bins (``bin_ranks``, the dcp "hierarchical" placements) a segment that fits a node
   stays whole, and a heavier one is cut into k contiguous compute-balanced parts, k chosen by the
   cost model between what memory needs and what compute asks: the estimated time
   max(compute per rank, KV read across the busiest cut / inter-node bandwidth), so a document a
   little heavier than a node stays on one node when splitting it would move more KV over the slow
   link than the compute it saves (``kv_read_across``).
3. Packing (polynomial, LPT with capacity): pieces by decreasing compute, each to the least loaded
   rank that still has memory room (a piece larger than the room is split and the rest re-queued);
   pieces of an already placed segment prefer that segment's node when it is nearly as idle. On one
   node (``neighbor_affinity``) a piece also prefers a rank holding a block next to it when that rank
   is within ``NEIGHBOR_AFFINITY`` of the least loaded: segments meet where a document starts inside
   a block and goes on after it, and two neighbours on different ranks cost that block's KV (and its
   gradient back). With ~150 short documents per 128K tokens most of the fcp homes' bytes were such
   boundaries (a Wikipedia batch on 8 ranks: ~120 of 159 MB).
   Every rank ends with at most ``cap`` blocks, so memory stays within one block of balanced (with
   ``memory_slack``, within that fraction of the mean: dcp's re-plan of its slow plans).
4. Execution: as ring/zigzag, every tile on its q-block's home (remote KV only, no OUT partials),
   stages from planner/stages.py.

``fcp_home`` is also the optional initial data placement of the dcp strategy (``init="fcp"``).
"""

from __future__ import annotations

import math
import weakref

import numpy as np

from .cost_model import CostModel
from .fcp_pack import cut_pieces, pack_pieces
from .placement import Placement, compact_stages, prefix_sums, weighted_bincount
from .schedule import kv_block_bytes
from .stages import assign_stages
from .tile_loops import reads_from_afar, segment_crossings
from .tiles import TileSet

SEGMENT_CUT = 2  # a boundary crossed by at most this many tiles separates two segments
PIECES_PER_RANK = 4  # long segments are cut into pieces of cap / 4 blocks
PIECE_SHARE = 0.75  # the fcp strategy's pieces: at most this many ranks' shares of compute (``strategy_home``)
SEGMENT_AFFINITY = 0.25  # a rank already holding the segment is preferred within 25% of M of the least loaded
NODE_AFFINITY = 0.10  # else a rank on the segment's node is preferred within 10% of M
# one node: else a rank holding a neighbouring block within 2% of M (near-ties: 0.05-0.3 moved 1-11% more bytes
# than 0.02 on the bench's 8-rank plans of seeds 0 and 777, and fcp's plans were slower)
NEIGHBOR_AFFINITY = 0.02
PAIR_SLACK = 0.1  # zigzag pairs are used when the heaviest is within 10% of the segment's mean piece
SPLIT_SLACK = 0.1  # a segment up to 10% heavier than a rank's share stays on one rank (the balancer trims it)
SHARED_COLUMN = 0.5  # a kv-block read by more than half of the q-blocks is shared by the batch (``segments``)
_segments_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # TileSet -> {documents: bounds}


def segments(tiles: TileSet, documents: bool = False) -> np.ndarray:
    """int64 [n_seg + 1] block boundaries of the independent segments.

    Tiles reading a *shared* kv-block (``shared_columns``: a shared question, causal_blockwise's first
    block) do not join segments: every rank reads such a block wherever the rows are placed (the
    relays bring it into each node once), so with them a shared-question batch was one segment, cut
    across nodes by compute alone (16 ranks / 4 per node: 1.51 -> 1.33x the bound). The question's
    own rows and the first answer, which reads it in one run with itself, are cut off it too (another
    batch on 32 ranks / 8 per node: 1.33x the bound kept with it, 1.18x cut off).
    ``documents``: also cut after a block that a document merely starts in. Its later rows all read
    that block (partial tiles: only the document's few tokens there), so the tile count sees a long
    run of crossings and, with no document boundary on a block boundary, one segment for the whole
    batch; these partial tiles into the block just before a boundary are not counted there."""
    per_tiles = _segments_cache.setdefault(tiles, {})  # (dcp's candidates and its segment test share them)
    if documents not in per_tiles:
        bounds = _segments(tiles, documents)
        bounds.setflags(write=False)
        per_tiles[documents] = bounds
    return per_tiles[documents]


def _segments(tiles: TileSet, documents: bool) -> np.ndarray:
    nB = tiles.num_blocks
    shared = np.zeros(nB, dtype=bool)
    shared[shared_columns(tiles)] = True
    # (one compiled pass: planner/tile_loops.py)
    crossing = segment_crossings(tiles.q, tiles.kv, tiles.full, tiles.crossing_counts(), shared, documents)
    cuts = np.flatnonzero(crossing[1:-1] <= SEGMENT_CUT) + 1
    return np.concatenate(([0], cuts, [nB])).astype(np.int64)


def shared_columns(tiles: TileSet) -> np.ndarray:
    """int64 kv-blocks that more than SHARED_COLUMN of all q-blocks read *from afar*, i.e. in a run of
    kv-blocks other than their row's last run: a shared question read by the answers, causal_blockwise's
    first block. A long causal document's first block, read by its rows in one run up to the diagonal,
    is not one."""
    nB = tiles.num_blocks
    if nB < 4 or tiles.num_tiles == 0:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(reads_from_afar(tiles.q, tiles.kv, nB) > SHARED_COLUMN * nB)


def kv_read_across(tiles: TileSet, kv_bytes: np.ndarray) -> np.ndarray:
    """float64 [nB + 1]: for boundary j, the KV bytes on one side of it read by q-blocks on the other
    (what a cut there sends, each block once); ``kv_bytes`` [nB] is each block's KV payload."""
    nB = tiles.num_blocks
    hi = np.arange(nB)
    lo = np.arange(nB)
    np.maximum.at(hi, tiles.kv, tiles.q)  # latest q-block reading each kv-block
    np.minimum.at(lo, tiles.kv, tiles.q)  # earliest one (masks that look ahead)
    # block b is read across every boundary j with lo[b] < j <= hi[b]
    diff = np.bincount(lo + 1, weights=kv_bytes, minlength=nB + 2) - np.bincount(hi + 1, weights=kv_bytes,
                                                                                minlength=nB + 2)
    return np.cumsum(diff)[: nB + 1]


def neighbor_affinity_for(world_size: int, cost_model: CostModel) -> float:
    """``fcp_home``'s ``neighbor_affinity`` for ``world_size`` ranks: NEIGHBOR_AFFINITY where they share
    one node, else 0 (measured either way on several nodes, where a neighbour may sit across a NIC)."""
    return NEIGHBOR_AFFINITY if world_size <= cost_model.topology.ranks_per_node else 0.0


def fcp_home(tiles: TileSet, world_size: int, *, cost_model: CostModel, num_q_heads: int, head_dim: int,
             bin_ranks: np.ndarray | None = None, kv_bytes: np.ndarray | None = None,
             contiguous_parts: bool = False, documents: bool = False, cut_links: int = 1,
             piece_share: float = math.inf, neighbor_affinity: float = 0.0,
             block_flops: np.ndarray | None = None, memory_slack: float = 0.0) -> np.ndarray:
    """Bin of every block (see module docstring, steps 1-3). Bins are ranks by default; with
    ``bin_ranks`` (ranks per bin, e.g. per node) bin i gets memory and compute in proportion, and
    with ``kv_bytes`` (each block's KV payload) a segment heavier than a bin's compute share is
    spread over only as many bins as pays for the KV its cuts send over the inter-node links, in
    contiguous parts; ``contiguous_parts`` cuts segments longer than a bin's memory that way too
    (else into plain pieces, which pack more flexibly: better for causal_blockwise, worse for
    shared_question batches over the benchmark cases, so the dcp candidates use both). ``documents``:
    segments cut after the blocks documents start in (``segments``). ``cut_links``: the inter-node links
    a cut's KV is priced as spread over (1: one NIC; a node's NICs where relays and transit relays
    spread it, planner/relay.py). ``piece_share``: plain pieces are also cut where they reach this many
    bins' shares of compute (the fcp strategy's ``strategy_home``; zigzag pairs and node parts are not).
    ``neighbor_affinity``: a piece prefers a bin holding a neighbouring block within this many M of the
    least loaded (step 3; ``neighbor_affinity_for`` for the fcp homes of ranks). ``block_flops`` [nB]:
    each block's compute, where it is more than its tiles here (a node's blocks whose rows also read
    other nodes' KV, ``node_first_home``). ``memory_slack``: a bin may hold up to ``floor(nB * (1 +
    memory_slack))`` blocks per rank of its weight, not just its share (dcp's starts pass
    ``cost_model.home_memory_slack``, which its re-plan sets to make_plan's ``memory_slack``): a bin holding
    a heavy segment then takes fewer of the light blocks that fill it (planner/dcp.py MEMORY_REPLAN_FROM)."""
    nB = tiles.num_blocks
    weight = np.ones(world_size) if bin_ranks is None else np.asarray(bin_ranks, dtype=np.float64)
    P = weight.size
    if P == 1 or nB == 0:
        return np.zeros(nB, dtype=np.int64)
    if block_flops is None:
        block_flops = weighted_bincount(tiles.q, cost_model.tile_flops(tiles.pairs, num_q_heads=num_q_heads,
                                                                       head_dim=head_dim), nB)
    prefix = prefix_sums(block_flops)
    per_rank = -(-nB // int(weight.sum()))
    cap = (per_rank * weight).astype(np.int64)
    if memory_slack > 0:
        cap = np.maximum(cap, np.floor(nB * (1 + memory_slack) / weight.sum()) * weight).astype(np.int64)
    piece = max(1, per_rank // PIECES_PER_RANK)
    node = cost_model.topology.node_of(np.arange(P)) if bin_ranks is None else np.arange(P)
    bounds = segments(tiles, documents)
    mean = prefix[-1] / weight.sum()
    bin_w = float(weight.max())  # a bin's share: bin_w ranks' worth of compute and memory

    # Pieces as (cost, start, end, segment, start2, end2). A segment heavier than a rank's share of
    # compute (or longer than its memory) is spread over k ranks: cut into 2k chunks, chunk i paired
    # with chunk 2k-1-i (zigzag inside the document), so a causal document's k pieces carry equal
    # compute and each needs only the KV before its two chunks. Other long segments are cut into
    # plain pieces that pack flexibly.
    seg_cost = prefix[bounds[1:]] - prefix[bounds[:-1]]
    k_mem = -(-np.diff(bounds) // int(cap.max()))
    group = np.maximum(np.ceil(seg_cost / (mean * bin_w) - SPLIT_SLACK), k_mem).astype(np.int64)
    node_cuts = {}  # segment -> contiguous cuts of a heavy segment spread over node bins
    if bin_ranks is not None and kv_bytes is not None:
        across = kv_read_across(tiles, kv_bytes)
        for seg in np.flatnonzero((group > k_mem) | ((group >= 2) & contiguous_parts)).tolist():
            group[seg], node_cuts[seg] = _node_group(prefix, across, bounds[seg], bounds[seg + 1], int(k_mem[seg]),
                                                     int(group[seg]), mean, bin_w, cost_model, cut_links)
    heaviest = piece_share * mean * bin_w  # (inf by default: plain pieces cut by size alone)
    skip = np.zeros(bounds.size - 1, dtype=bool)
    skip[list(node_cuts)] = True
    pieces = list(cut_pieces(bounds, group, prefix, bin_ranks is not None, piece, float(heaviest), PAIR_SLACK, skip))
    if node_cuts:  # contiguous parts: each node reads only the KV before its part
        cut_at = [(seg, s, e) for seg, cuts in node_cuts.items() for s, e in zip(cuts[:-1], cuts[1:])]
        seg_, s_, e_ = (np.array(x, dtype=np.int64) for x in zip(*cut_at))
        extra = (-(prefix[e_] - prefix[s_]), s_, e_, seg_, e_, e_)
        pieces = [np.concatenate((mine, more)) for mine, more in zip(pieces, extra)]
    return pack_pieces(*pieces, prefix, weight, cap.astype(np.int64), np.asarray(node, dtype=np.int64),
                       bounds.size - 1, nB, float(mean), SEGMENT_AFFINITY, NODE_AFFINITY, float(neighbor_affinity))


def _node_group(prefix: np.ndarray, across: np.ndarray, a: int, b: int, k_min: int, k_max: int, mean: float,
                bin_w: float, cost_model: CostModel, cut_links: int = 1) -> tuple[int, list]:
    """(k, cuts): the number of node bins for segment [a, b) and its k compute-balanced contiguous
    parts. k minimizes the estimated time max(compute per rank, KV received over ``cut_links`` NICs at
    the busiest cut); a segment a little heavier than a node stays on one node when splitting it
    would send more KV than the compute it saves."""
    best = None
    for k in range(max(1, k_min), k_max + 1):
        targets = prefix[a] + (prefix[b] - prefix[a]) * np.arange(1, k) / k
        inner = np.clip(np.searchsorted(prefix, targets), a + 1, b - 1) if b - a > 1 else np.zeros(0, np.int64)
        cuts = [a] + sorted(set(inner.tolist())) + [b]
        compute = max(mean, (prefix[b] - prefix[a]) / (k * bin_w)) / cost_model.fwd_rate
        busiest_cut = float(across[cuts[1:-1]].max()) if len(cuts) > 2 else 0.0
        transfer = busiest_cut / (cut_links * cost_model.topology.inter_bw)
        t = max(compute, transfer)
        if best is None or t < best[0]:
            best = (t, len(cuts) - 1, cuts)
    return best[1], best[2]


def strategy_home(tiles: TileSet, world_size: int, *, cost_model: CostModel, num_q_heads: int,
                  head_dim: int, kv_bytes: np.ndarray | None = None, grad_ratio: float = 2.0) -> np.ndarray:
    """The fcp strategy's homes: ``fcp_home`` with segments cut at document starts and no plain piece
    heavier than PIECE_SHARE of a rank's compute where a block allows. A long document's last rows,
    in too few blocks for zigzag pairs to even out, were cut by size alone: the bench's causal_blockwise
    batch on 32 ranks of one NVLink domain planned at 2.49x the bound, now 1.39x (over the bench's 252
    fcp plans of two draws 45 faster, 5 slower, all on several nodes, where fcp's plans are NIC-bound;
    geomean 1.55 -> 1.46x; docs/planner_log.md). dcp's "fcp" / "fcp-docs" starts keep plain pieces
    (``fcp_home``'s default): the balancer evens such pieces out, and with the bound dcp's plans moved
    either way; dcp's last check weighs this plan.
    On several nodes, with ``kv_bytes`` [nB] (each block's KV payload; ``grad_ratio``: its dK/dV
    partial's bytes over it), these homes or ``node_first_home``'s, whichever ``owner_time_estimate``
    finds faster (either wins by up to ~2x on some batches: docs/planner_log.md, session 44)."""
    # (the tiles' and blocks' compute once, for both placements and the estimate)
    flops = cost_model.tile_flops(tiles.pairs, num_q_heads=num_q_heads, head_dim=head_dim)
    block_flops = weighted_bincount(tiles.q, flops, tiles.num_blocks)
    home = fcp_home(tiles, world_size, cost_model=cost_model, num_q_heads=num_q_heads, head_dim=head_dim,
                    documents=True, piece_share=PIECE_SHARE, block_flops=block_flops,
                    neighbor_affinity=neighbor_affinity_for(world_size, cost_model))
    if kv_bytes is None or world_size <= cost_model.topology.ranks_per_node:
        return home
    nodes_first = node_first_home(tiles, world_size, cost_model=cost_model, num_q_heads=num_q_heads,
                                  head_dim=head_dim, kv_bytes=kv_bytes, block_flops=block_flops)
    moved = kv_bytes * (1.0 + grad_ratio)  # KV there, its dK/dV partial back
    estimate = [owner_time_estimate(tiles, h, flops, moved, world_size, cost_model) for h in (home, nodes_first)]
    return nodes_first if estimate[1] < estimate[0] else home


def node_first_home(tiles: TileSet, world_size: int, *, cost_model: CostModel, num_q_heads: int, head_dim: int,
                    kv_bytes: np.ndarray, block_flops: np.ndarray) -> np.ndarray:
    """FCP's packing one level at a time: segments (documents cut where they start) onto nodes, a
    segment heavier than a node split into as many contiguous parts as pay for the KV the cuts send
    over the NICs (``fcp_home`` with node bins and ``kv_bytes``); then each node's blocks onto its ranks
    by the compute of their whole rows (reads of other nodes' KV included), as the fcp strategy packs
    ranks. Documents stay inside a node where they fit, so only the split ones cross the NICs.
    ``block_flops`` [nB]: the compute of each block's whole row."""
    rpn = cost_model.topology.ranks_per_node
    node_ranks = np.bincount(np.arange(world_size) // rpn)
    node = fcp_home(tiles, world_size, cost_model=cost_model, num_q_heads=num_q_heads, head_dim=head_dim,
                    bin_ranks=node_ranks, kv_bytes=kv_bytes, documents=True, block_flops=block_flops)
    home = np.empty(tiles.num_blocks, dtype=np.int64)
    # each node's own sub-batch (the tiles it holds both blocks of), in (q, kv) order: the inside tiles
    # grouped by node with a stable sort on a small key (one pass, not a mask per node)
    q_node = node[tiles.q]
    inside = np.flatnonzero(q_node == node[tiles.kv])
    inside = inside[np.argsort(q_node[inside].astype(np.int16), kind="stable")]
    count = np.bincount(q_node[inside], minlength=node_ranks.size)
    ends = np.cumsum(count)
    starts = ends - count
    local = np.empty(tiles.num_blocks, dtype=np.int64)
    for n, ranks in enumerate(node_ranks.tolist()):
        blocks = np.flatnonzero(node == n)
        if blocks.size == 0:
            continue
        local[blocks] = np.arange(blocks.size)
        sel = inside[starts[n]:ends[n]]
        sub = TileSet(total_len=blocks.size * tiles.block_size, block_size=tiles.block_size, num_blocks=blocks.size,
                      q=local[tiles.q[sel]], kv=local[tiles.kv[sel]], full=tiles.full[sel], pairs=tiles.pairs[sel])
        home[blocks] = n * rpn + fcp_home(sub, ranks, cost_model=cost_model, num_q_heads=num_q_heads,
                                          head_dim=head_dim, documents=True, piece_share=PIECE_SHARE,
                                          block_flops=block_flops[blocks], neighbor_affinity=NEIGHBOR_AFFINITY)
    return home


def owner_time_estimate(tiles: TileSet, home: np.ndarray, flops: np.ndarray, moved: np.ndarray, world_size: int,
                        cost_model: CostModel) -> float:
    """A quick estimate of the fcp plan's time on ``home`` (every tile on its q-block's home): the busiest
    rank's forward + backward compute, or its NIC's traffic (``moved`` [nB]: a block's bytes there and
    back, once per reading rank on another node), whichever is longer. It ranks two candidate homes as
    their staged plans do in all but a few of the bench's cases (docs/planner_log.md, session 44)."""
    rank = home[tiles.q]
    compute = np.bincount(rank, weights=flops, minlength=world_size) * (1.0 + cost_model.bwd_flops_factor)
    rpn = cost_model.topology.ranks_per_node
    far = np.flatnonzero(rank // rpn != home[tiles.kv] // rpn)
    read = np.zeros(tiles.num_blocks * world_size, dtype=bool)  # (block, reader) once each
    read[tiles.kv[far] * world_size + rank[far]] = True
    block, reader = np.divmod(np.flatnonzero(read), world_size)
    nic = np.maximum(np.bincount(reader, weights=moved[block], minlength=world_size),
                     np.bincount(home[block], weights=moved[block], minlength=world_size))
    return float(np.max(np.maximum(compute / cost_model.fwd_rate, nic / cost_model.topology.inter_bw)))


def fcp(tiles: TileSet, world_size: int, *, cost_model: CostModel, num_q_heads: int, num_kv_heads: int,
        head_dim: int, element_size: int, max_stages: int, home: np.ndarray | None = None,
        grad_element_size: int = 4, **_) -> Placement:
    """FCP placement (see module docstring), segments cut at the blocks documents start in: FCP assigns
    *sequences* to groups. Cut by tile counts alone, packed documents that start inside blocks chain
    into long segments, cut into plain pieces whose heaviest ones are heavier than a rank's share (1M
    tokens / 64 ranks of Wikipedia documents: compute imbalance 2.77, with document starts 1.13).
    ``home``: those homes (``strategy_home``), where the caller has them already."""
    if home is None:
        kv_bytes = kv_block_bytes(tiles.block_lengths(), num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                  head_dim=head_dim, element_size=element_size)
        home = strategy_home(tiles, world_size, cost_model=cost_model, num_q_heads=num_q_heads, head_dim=head_dim,
                             kv_bytes=kv_bytes, grad_ratio=grad_element_size / element_size)
    rank = home[tiles.q]
    flops = cost_model.tile_flops(tiles.pairs, num_q_heads=num_q_heads, head_dim=head_dim)
    stage = assign_stages(tiles.q, tiles.kv, flops, rank, home, block_size=tiles.block_size,
                          total_len=tiles.total_len, world_size=world_size, cost_model=cost_model,
                          max_stages=max_stages, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                          head_dim=head_dim, element_size=element_size)
    stage, _ = compact_stages(stage)
    return Placement(block_home=home, tile_rank=rank, tile_stage=stage)
