""""hypergraph" strategy: DCP's placement problem handed to a general hypergraph partitioner
(Mt-KaHyPar), as DCP does, to measure dcp's own fast placement against it.

Notation (docs/design.md): nB blocks, P ranks, tile (qb, kb); lambda(e) = number of ranks a net e
touches. With the connectivity metric sum_e w(e) * (lambda(e) - 1), a net per data block whose pins
are the block's home and every tile that reads it counts exactly the zero-redundant schedule's
bytes: the block goes once to each other rank that reads it (planner/schedule.py).

Memory and FLOPs must both be balanced, and Mt-KaHyPar (MIT, on PyPI) balances one vertex weight,
so the model is solved in two phases:

1. Data: vertices = blocks (weight = tokens, balanced within ``MEMORY_EPS``); a net per kv-block b =
   {b} + the q-blocks that read it, weight = the KV and dK/dV bytes of b. With every tile computed
   at its q-block's home, lambda - 1 is the number of ranks b is sent to.
2. Compute: the blocks are fixed at those homes (weight 1, negligible); vertices = tiles (weight =
   unmasked pairs, balanced within ``COMPUTE_EPS``); per block a Q net = {b} + the tiles of row b
   (Q, OUT, dO and dQ bytes) and a KV net = {b} + the tiles of column b (KV and dK/dV bytes). The
   objective is then the plan's total bytes. On several nodes both phases partition over the nodes
   first (the objective is then the inter-node bytes), then each node's vertices over its ranks.

The tiles are then staged and completed like every strategy's (planner/stages.py, planner/finish.py), with dcp's KV
relays on several nodes, so only the placement differs from dcp's candidates (whose kept plan then
also has its backward deferred, planner/candidates.py ``with_deferred_backward``).

Planning takes seconds (0.7-38 s per 128K-token batch on 8 ranks, on a 2-core CPU: one thread and
the DETERMINISTIC preset, so that every rank computes the same plan; dcp: 7-91 ms).
``pip install 'blockattn[hypergraph]'`` brings Mt-KaHyPar.
"""

from __future__ import annotations

import threading

import numpy as np

from .cost_model import CostModel
from .finish import finish_placement
from .placement import Placement
from .relay import add_relays
from .schedule import KIND_DKV, KIND_DO, KIND_DQ, KIND_KV, KIND_OUT, KIND_Q, payload_bytes
from .stages import assign_stages
from .tiles import TileSet

MEMORY_EPS = 0.03  # tokens per rank within 3% of the mean (dcp's placements: within one block)
COMPUTE_EPS = 0.01  # FLOPs per rank within 1% of the mean (dcp reaches 1-2% on one node)
SEED = 0
_WEIGHT_LIMIT = 1 << 28  # Mt-KaHyPar's vertex and net weights are 32-bit: totals are scaled below this
_partitioner = None
_lock = threading.Lock()  # one partition at a time per process: the library and its seed are global


def _mtkahypar():
    """The Mt-KaHyPar module, initialized once per process (one thread: deterministic and cheap)."""
    global _partitioner
    try:
        import mtkahypar
    except ImportError as err:
        raise ImportError("strategy='hypergraph' needs the Mt-KaHyPar partitioner: "
                          "pip install 'blockattn[hypergraph]' (or pip install mtkahypar)") from err
    if _partitioner is None:
        _partitioner = mtkahypar.initialize(1, False)
    return mtkahypar, _partitioner


def _scaled(weights: np.ndarray, minimum: int) -> list:
    """Non-negative weights as Python ints with their total under _WEIGHT_LIMIT (ratios kept)."""
    weights = np.asarray(weights, dtype=np.float64)
    total = float(weights.sum())
    scale = min(1.0, _WEIGHT_LIMIT / total) if total > 0 else 1.0
    return np.maximum(np.rint(weights * scale), minimum).astype(np.int64).tolist()


def _nets(members: np.ndarray, of_net: np.ndarray, num_nets: int, head: np.ndarray) -> list:
    """Net i = [head[i]] + members[of_net == i] (vertex ids), for every i."""
    order = np.argsort(of_net, kind="stable")
    bounds = np.searchsorted(of_net[order], np.arange(num_nets + 1))
    grouped = members[order].tolist()
    heads = head.tolist()
    return [[heads[i]] + grouped[bounds[i]:bounds[i + 1]] for i in range(num_nets)]


def _partition(nets: list, net_weights: list, vertex_weights: list, parts: np.ndarray, epsilon: float,
               fixed: list | None = None) -> np.ndarray:
    """Part of every vertex: Mt-KaHyPar, connectivity objective, ``len(parts)`` parts whose weights
    follow ``parts`` (ranks per part) within ``epsilon``; ``fixed``: part per vertex or -1."""
    k = len(parts)
    if k == 1:
        return np.zeros(len(vertex_weights), dtype=np.int64)
    mtkahypar, init = _mtkahypar()
    context = init.context_from_preset(mtkahypar.PresetType.DETERMINISTIC)
    context.set_partitioning_parameters(k, epsilon, mtkahypar.Objective.KM1)
    context.logging = False
    if len(set(parts.tolist())) > 1:  # a short last node: its part gets its share only
        total = sum(vertex_weights)
        context.set_individual_target_block_weights(
            [int((1 + epsilon) * total * r / parts.sum()) + 1 for r in parts.tolist()])
    with _lock:
        mtkahypar.set_seed(SEED)
        graph = init.create_hypergraph(context, len(vertex_weights), len(nets), nets, vertex_weights, net_weights)
        if fixed is not None:
            graph.add_fixed_vertices(fixed, k)
        part = np.asarray(graph.partition(context).get_partition(), dtype=np.int64)
    if fixed is not None:
        pinned = np.asarray(fixed)
        if not np.array_equal(part[pinned >= 0], pinned[pinned >= 0]):
            raise RuntimeError("Mt-KaHyPar moved fixed vertices; the hypergraph strategy cannot use this version")
    return part


def _partition_ranks(nets: list, net_weights: list, vertex_weights: list, world_size: int, epsilon: float,
                     topology, fixed: np.ndarray | None = None) -> np.ndarray:
    """Rank of every vertex. On several nodes hierarchically, as the bytes that matter are the
    inter-node ones: the vertices are first partitioned over the nodes (the objective then counts
    the bytes crossing between nodes), then each node's vertices over its ranks, with the nets cut
    down to that node's pins (a block from another node enters the node once, then spreads)."""
    ranks = np.arange(world_size)
    node_ranks = np.bincount(topology.node_of(ranks))
    if node_ranks.size == 1:
        return _partition(nets, net_weights, vertex_weights, np.ones(world_size, dtype=np.int64), epsilon,
                          None if fixed is None else fixed.tolist())
    rpn = topology.ranks_per_node
    fixed_node = None if fixed is None else np.where(fixed >= 0, fixed // rpn, -1)
    node = _partition(nets, net_weights, vertex_weights, node_ranks, epsilon,
                      None if fixed is None else fixed_node.tolist())
    rank = np.empty(len(vertex_weights), dtype=np.int64)
    weights = np.asarray(vertex_weights)
    for n, size in enumerate(node_ranks.tolist()):
        members = np.flatnonzero(node == n)
        local = np.full(node.size, -1, dtype=np.int64)
        local[members] = np.arange(members.size)
        sub_nets, sub_weights = [], []
        for net, w in zip(nets, net_weights):
            pins = [int(local[v]) for v in net if local[v] >= 0]
            if len(pins) > 1:
                sub_nets.append(pins)
                sub_weights.append(w)
        sub_fixed = None if fixed is None else np.where(fixed[members] >= 0, fixed[members] - n * rpn, -1).tolist()
        rank[members] = n * rpn + _partition(sub_nets, sub_weights, weights[members].tolist(),
                                             np.ones(size, dtype=np.int64), epsilon, sub_fixed)
    return rank


def _round_trip_bytes(block_len: np.ndarray, sizes: dict) -> tuple[np.ndarray, np.ndarray]:
    """Per block, the bytes a rank other than its home costs by reading it: as a q-block (Q in, OUT
    back, dO in, dQ back) and as a kv-block (KV in, dK/dV back)."""
    q_trip = sum(payload_bytes(kind, block_len, **sizes) for kind in (KIND_Q, KIND_OUT, KIND_DO, KIND_DQ))
    return q_trip, payload_bytes(KIND_KV, block_len, **sizes) + payload_bytes(KIND_DKV, block_len, **sizes)


def hypergraph_home(tiles: TileSet, world_size: int, *, sizes: dict, topology) -> np.ndarray:
    """Phase 1: the home of every block (see module docstring)."""
    nB = tiles.num_blocks
    block_len = tiles.block_lengths()
    reads = np.unique(tiles.kv * nB + tiles.q)  # (kv-block, q-block) pairs, each once
    kv_of, q_of = reads // nB, reads % nB
    off_diagonal = kv_of != q_of
    kv_bytes = _round_trip_bytes(block_len, sizes)[1]
    nets = _nets(q_of[off_diagonal], kv_of[off_diagonal], nB, np.arange(nB))
    return _partition_ranks(nets, _scaled(kv_bytes, 1), _scaled(block_len, 1), world_size, MEMORY_EPS, topology)


def hypergraph_ranks(tiles: TileSet, home: np.ndarray, world_size: int, *, sizes: dict, topology) -> np.ndarray:
    """Phase 2: the rank of every tile, blocks fixed at ``home`` (see module docstring)."""
    nB, n = tiles.num_blocks, tiles.num_tiles
    q_bytes, kv_bytes = _round_trip_bytes(tiles.block_lengths(), sizes)
    tile_vertex = nB + np.arange(n)  # vertices 0..nB-1 are the blocks
    nets = (_nets(tile_vertex, tiles.q, nB, np.arange(nB)) + _nets(tile_vertex, tiles.kv, nB, np.arange(nB)))
    weights = _scaled(np.concatenate([q_bytes, kv_bytes]), 1)
    # the fixed blocks weigh 1, not 0: Mt-KaHyPar 1.7 moves fixed vertices of weight 0
    vertex_weights = [1] * nB + _scaled(tiles.pairs, 1)
    fixed = np.concatenate([home, np.full(n, -1, dtype=np.int64)])
    return _partition_ranks(nets, weights, vertex_weights, world_size, COMPUTE_EPS, topology, fixed=fixed)[nB:]


def hypergraph(tiles: TileSet, world_size: int, *, cost_model: CostModel, num_q_heads: int, num_kv_heads: int,
               head_dim: int, element_size: int, max_stages: int, grad_element_size: int = 4, **_) -> Placement:
    """The "hypergraph" placement (see module docstring), staged and completed."""
    sizes = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, element_size=element_size,
                 grad_element_size=grad_element_size)
    topology = cost_model.topology
    if world_size == 1 or tiles.num_tiles == 0:
        home = np.zeros(tiles.num_blocks, dtype=np.int64)
        rank = np.zeros(tiles.num_tiles, dtype=np.int64)
    else:
        home = hypergraph_home(tiles, world_size, sizes=sizes, topology=topology)
        rank = hypergraph_ranks(tiles, home, world_size, sizes=sizes, topology=topology)
    flops = cost_model.tile_flops(tiles.pairs, num_q_heads=num_q_heads, head_dim=head_dim)
    stage = assign_stages(tiles.q, tiles.kv, flops, rank, home, block_size=tiles.block_size,
                          total_len=tiles.total_len, world_size=world_size, cost_model=cost_model,
                          max_stages=max_stages, **sizes)
    placement = finish_placement(tiles, home, rank, stage, world_size=world_size, cost_model=cost_model,
                                 sizes=sizes, max_stages=max_stages)
    if world_size > topology.ranks_per_node:
        placement = add_relays(tiles, placement, world_size=world_size, cost_model=cost_model,
                               max_stages=max_stages, sizes=sizes)
    return placement
