"""Initial data placements: the homes of token blocks that dcp's candidates start from.

Notation (docs/design.md): T tokens, nB blocks of B tokens, P ranks, tile (qb, kb); ``home[b]`` is the
rank holding block b. Every function here returns an int64 ``home`` [nB] with memory (blocks per rank)
balanced within a few percent; planner/candidates.py names them (``_initial_home``) for dcp's candidates and the
Balancer (planner/balance.py) then places the tiles on them.

* "contiguous" (``contiguous_cut_home``): P equal-token contiguous runs of blocks, each cut nudged by
  at most ``CUT_SLACK`` of a run to the boundary crossed by the fewest tiles, so documents stay whole
  where a cheap cut exists and long documents are split over neighbouring ranks (same node).
* "hierarchical" / "hierarchical-fcp" / "hierarchical-fcp-wide" (several nodes, ``hierarchical_home``):
  FCP packing of documents onto nodes (compute and memory in proportion to each node's ranks; a
  document that fits a node stays whole, a heavier one is cut into as many contiguous parts as pay for
  the KV its cuts send over the inter-node links), then contiguous runs / FCP packing onto the ranks
  inside each node; "-wide" prices a cut's KV as spread over the node's NICs.
* "dealt" (``dealt_home``, batches with hot rows, ``hot_rows``): the hot rows dealt round-robin over
  the ranks and nodes, the rest contiguous.
* Variants of given homes that keep every rank's block count and every block's node (``deal_blocks``):
  a node's blocks that other nodes read dealt over its ranks (``spread_read_blocks``), or its heavy
  document pieces (``deal_heavy_pieces``), so their transfers leave through every rank's links.
"""

from __future__ import annotations

import numpy as np

from .cost_model import CostModel
from .placement import balanced_bounds, runs_to_home
from .tiles import TileSet

CUT_SLACK = 0.03  # a run boundary may move by up to 3% of a run to find a cheaper cut
# A q-row with more than HOT_ROW times the mean row's pairs, read from more than HOT_SPAN of the blocks, is
# "hot" (causal_blockwise's last block reads the whole sequence): batches with hot rows also get the
# "dealt" candidate (``dealt_home``), and on several nodes "dealt-nodes" too (the same homes, rows pushed
# per node: ``pushed_rows(ranks_per_node=...)``; each won some world sizes of causal_blockwise). On the
# benchmark's document masks it never won, hence the span.
HOT_ROW = 3.0
HOT_SPAN = 0.25
DEAL_PIECE_FROM = 1.0  # a piece's rows on a node above this many ranks' shares of compute are dealt


def contiguous_cut_home(tiles: TileSet, world_size: int) -> np.ndarray:
    """Home of each block: P equal-token contiguous runs, each cut moved (within CUT_SLACK) to the
    boundary with the fewest crossing tiles (ties: the nearest to the balanced cut)."""
    nB = tiles.num_blocks
    bounds = balanced_bounds(nB, world_size)
    slack = int(CUT_SLACK * nB / world_size)
    if slack > 0 and tiles.num_tiles:
        crossing = tiles.crossing_counts()
        inner = bounds[1:-1]
        offsets = np.arange(-slack, slack + 1)
        cand = np.clip(inner[:, None] + offsets[None, :], 0, nB)
        # cost: crossing tiles first, distance from the balanced cut second
        score = crossing[cand] * (2 * slack + 1) + np.abs(offsets)[None, :]
        best = cand[np.arange(inner.size), np.argmin(score, axis=1)]
        bounds = np.r_[0, np.maximum.accumulate(best), nB]
    return runs_to_home(bounds, np.arange(world_size), nB)


def hot_rows(tiles: TileSet) -> np.ndarray:
    """int64 block indices of the hot q-rows: more than HOT_ROW times the mean row's unmasked pairs, over
    more than HOT_SPAN of all kv-blocks (global rows; a long document's last rows read only the KV of
    the ranks next to it in a contiguous placement, and are better balanced as a document)."""
    nB = tiles.num_blocks
    if nB == 0:
        return np.zeros(0, dtype=np.int64)
    row = tiles.row_pairs()
    span = np.bincount(tiles.q, minlength=nB)
    return np.flatnonzero((row > HOT_ROW * row.mean()) & (span > HOT_SPAN * nB))


def dealt_home(tiles: TileSet, world_size: int, *, topology) -> np.ndarray:
    """Home of each block: the hot rows (``hot_rows``) dealt round-robin over the ranks, consecutive
    ones to different nodes, the other blocks in equal-token contiguous runs over the room left.
    Each rank then pushes its hot rows' pieces to the kv-homes (``pushed_rows``), so the Q blocks and
    OUT partials of the hot rows leave through every rank's links instead of one rank's."""
    nB = tiles.num_blocks
    hot = hot_rows(tiles)
    ranks = np.arange(world_size)
    dealing_order = np.lexsort((topology.node_of(ranks), ranks % topology.ranks_per_node))  # r0 of each node, r1, ...
    home = np.empty(nB, dtype=np.int64)
    home[hot] = dealing_order[np.arange(hot.size) % world_size]
    room = np.diff(balanced_bounds(nB, world_size)) - np.bincount(home[hot], minlength=world_size)
    cool = np.ones(nB, dtype=bool)
    cool[hot] = False
    num_cool = int(cool.sum())
    bounds = np.minimum(np.r_[0, np.cumsum(np.maximum(room, 0))], num_cool)
    bounds[-1] = num_cool
    home[cool] = runs_to_home(bounds, ranks, num_cool)
    return home


def spread_read_blocks(tiles: TileSet, home: np.ndarray, topology) -> np.ndarray:
    """``home`` with, inside each node, the blocks whose KV other nodes read dealt round-robin over the
    node's ranks (as evenly as each rank's block count allows) and the other blocks in contiguous
    runs over the room left; every rank keeps its number of blocks, every block its node. Their
    inter-node sends then leave through every NIC of the node rather than one home's."""
    node = home // topology.ranks_per_node
    read = np.zeros(tiles.num_blocks, dtype=bool)
    read[tiles.kv[node[tiles.q] != node[tiles.kv]]] = True
    return deal_blocks(home, read, topology, keep_rest=False)


def deal_heavy_pieces(tiles: TileSet, home: np.ndarray, world_size: int, topology) -> np.ndarray:
    """``home`` with, inside each node, the blocks of every piece of a segment (planner/fcp.py ``segments``,
    documents cut at the blocks they start in) whose rows there hold more than DEAL_PIECE_FROM ranks'
    shares of compute dealt round-robin over the node's ranks (``deal_blocks``): every rank of the node
    then computes rows of the piece and reads its KV from the others over NVLink, where in contiguous runs
    one home holds most of its rows and carries every transfer that shedding them takes."""
    from .fcp import segments

    bounds = segments(tiles, documents=True)
    segment = runs_to_home(bounds, np.arange(bounds.size - 1), tiles.num_blocks)  # each block's segment
    piece = segment * world_size + home // topology.ranks_per_node  # (segment, node)
    row = tiles.row_pairs()
    heavy = np.bincount(piece, weights=row) > DEAL_PIECE_FROM * row.sum() / world_size
    return deal_blocks(home, heavy[piece], topology)


def deal_blocks(home: np.ndarray, dealt: np.ndarray, topology, *, keep_rest: bool = True) -> np.ndarray:
    """``home`` with, inside each node, the blocks marked in ``dealt`` (bool [nB]) dealt round-robin over
    the node's ranks (as evenly as each rank's block count allows); the other blocks stay on their
    homes as far as the room left allows (``keep_rest``; the overflow fills the others' room in block
    order) or fill the room left in contiguous runs. Every rank keeps its number of blocks, every
    block its node."""
    rpn = topology.ranks_per_node
    node = home // rpn
    out = home.copy()
    for n in np.unique(node).tolist():
        blocks = np.flatnonzero(node == n)  # ascending
        count = np.bincount(home[blocks] - n * rpn, minlength=rpn)
        mine = blocks[dealt[blocks]]
        if mine.size == 0:
            continue
        # as even as the counts allow: up to level - 1 each, one more for the lowest ranks that can
        level = 0
        while int(np.minimum(count, level).sum()) < mine.size:
            level += 1
        take = np.minimum(count, level - 1)
        take[np.flatnonzero(count >= level)[: mine.size - int(take.sum())]] += 1
        # deal in rounds: round j gives one block to every rank with take > j, lowest rank first
        rounds = np.concatenate([np.flatnonzero(take > j) for j in range(int(take.max()))])
        out[mine] = n * rpn + rounds
        rest = blocks[~dealt[blocks]]
        room = count - take
        if not keep_rest:
            out[rest] = n * rpn + np.repeat(np.arange(rpn), room)
            continue
        own = home[rest] - n * rpn
        order = np.argsort(own, kind="stable")  # each rank's rest blocks, ascending
        first_of_rank = np.searchsorted(own[order], np.arange(rpn))
        position = np.empty(rest.size, dtype=np.int64)
        position[order] = np.arange(rest.size) - first_of_rank[own[order]]
        stays = position < room[own]
        left = room - np.bincount(own[stays], minlength=rpn)  # (out already holds the others' homes)
        out[rest[~stays]] = n * rpn + np.repeat(np.arange(rpn), left)
    return out


def hierarchical_home(tiles: TileSet, world_size: int, *, cost_model: CostModel, num_q_heads: int,
                      head_dim: int, inner: str = "contiguous", kv_bytes: np.ndarray | None = None,
                      cut_links: int = 1) -> np.ndarray:
    """Across nodes, FCP packing (whole segments, contiguous parts of heavy ones, LPT by compute with
    memory capacity) so that every node gets its share of compute and memory and inter-node links
    carry only the KV of documents split across nodes; inside a node, ``inner`` = "contiguous"
    (equal-token runs) or "fcp" (planner/fcp.py on the node's own blocks), rebalanced over NVLink by
    the tile placement. ``kv_bytes`` [nB] (each block's KV payload) makes the node packing weigh a
    split's inter-node KV against the compute it evens out, priced over ``cut_links`` NICs (fcp_home).
    One node: ``contiguous_cut_home``."""
    rpn = cost_model.topology.ranks_per_node
    if world_size <= rpn:
        return contiguous_cut_home(tiles, world_size)
    from .fcp import fcp_home

    # Documents not aligned to blocks: with the tile-count segments a long-tail batch is one segment,
    # spread over every node in small pieces. Cut at the blocks documents start in, a document stays
    # on as few nodes as its compute needs (1M tokens / 64 ranks: 2.50 -> 2.18x the bound). The
    # "hierarchical-fcp" candidate keeps the tile-count segments: with them it won more cases.
    node_ranks = np.bincount(np.arange(world_size) // rpn)
    node = fcp_home(tiles, world_size, cost_model=cost_model, num_q_heads=num_q_heads, head_dim=head_dim,
                    bin_ranks=node_ranks, kv_bytes=kv_bytes if inner == "fcp" else None,
                    contiguous_parts=inner == "fcp", documents=inner == "contiguous", cut_links=cut_links,
                    memory_slack=cost_model.home_memory_slack)
    home = np.empty(tiles.num_blocks, dtype=np.int64)
    local = np.full(tiles.num_blocks, -1, dtype=np.int64)
    if inner == "fcp":
        inside = node[tiles.q] == node[tiles.kv]  # a node's own sub-batch (tiles across nodes stay as placed)
    for n, ranks in enumerate(node_ranks.tolist()):
        blocks = np.flatnonzero(node == n)
        if inner == "fcp":
            local[blocks] = np.arange(blocks.size)
            sel = inside & (node[tiles.q] == n)
            sub = TileSet(total_len=blocks.size * tiles.block_size, block_size=tiles.block_size,
                          num_blocks=blocks.size, q=local[tiles.q[sel]], kv=local[tiles.kv[sel]],
                          full=tiles.full[sel], pairs=tiles.pairs[sel])
            home[blocks] = n * rpn + fcp_home(sub, ranks, cost_model=cost_model, num_q_heads=num_q_heads, head_dim=head_dim)
        else:
            home[blocks] = n * rpn + runs_to_home(balanced_bounds(blocks.size, ranks), np.arange(ranks), blocks.size)
    return home
