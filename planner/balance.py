"""Cost-aware compute balancing: move tiles off overloaded ranks only where it shortens the slowest rank.

Notation (docs/design.md): P ranks, tiles (qb, kb) with compute time ``c`` (seconds, cost model),
``home[b]`` owns block b; C[r] = compute time of rank r, X[r] = its communication time
(per link: (bytes sent + bytes received) / bandwidth, since inputs travel before the compute and
partials after it; NVLink and NIC in parallel), and the rank's time is estimated as
max(C[r], X[r]) (stages overlap transfers with compute).

Moving a set of tiles from donor r to target t costs, once per block (receive-once rule):
a Q block for each q-block t does not hold yet, a KV block for each kv-block t does not hold yet,
and an OUT partial back for each q-block t does not own. Candidates are prefixes of an ordered
tile list, evaluated all at once with cumulative sums, and the prefix minimizing
max(time(r), time(t)) is taken (never more than brings r to the mean or t to the cap):

* rows to the kv-home (t holds the KV already): whole q-rows, largest first; on one node only a row
  whose piece on t's KV is long enough to cost no more bytes a tile than a rectangle (``priced_rows``);
* rectangles to any rank: tiles ordered by (kv // w, q), so a prefix is a rectangle of a rows by
  w kv-blocks, ``w = sqrt(n * (Q + OUT) / KV)`` minimizing ``a * (Q + OUT) + w * KV`` for n tiles.

Targets are tried same node first, then least loaded; transfers across nodes only win when the
work they carry outweighs the slower link, so placement stays inside nodes where it can.

The rounds of moves (donors, targets, candidate orders) and each move's arithmetic (the cost of every
prefix, the choice of one, the bookkeeping it updates) are compiled, in planner/balance_moves.py.

``slack``: donors shed down to the mean times 1 + slack (default BALANCE_SLACK, 2%; ``CostModel.balance_slack``,
which dcp sets lower for one node's merged blocks, planner/first_pass.py ONE_NODE_MERGED_SLACK).

``start`` (default: every tile on its q-block's home) gives another starting assignment, e.g.
``pushed_rows``: the bookkeeping counts its Q, OUT and KV transfers the same receive-once way.

``relay_aware`` (several nodes) prices KV the way planner/relay.py then moves it: a block crosses
into a node once, into a proxy rotating with the block (a node's NICs share the inbound copies), and
reaches the node's other readers over NVLink. Without it, the rank that first reads a long document's
remote KV on a node carries all of it on its own NIC, and cannot shed work to node-mates that
would each pull the same KV again.

``spread_sends`` (with ``relay_aware``) prices the sending side the same way: a block leaving its
home's node goes out through a node-mate's NIC, rotating with the block and the receiving node, after
an NVLink hop from the home (the home-side transit relays of planner/relay.py ``add_transit``).
Without it, the homes of a long document that many ranks on other nodes read look NIC-bound and
stop shedding its rows, however many idle NICs their node has. A donor still bound by its transfers
then sheds compute where they do not grow (``balance_moves.best_prefix``), since the stages overlap its
transfers with only part of its compute.

``overlap`` weighs that everywhere: a rank's time is estimated as max(C, X) + overlap * min(C, X) (the
stages leave its first inputs and last partials exposed, and rarely split C and X alike), so a donor
whose transfers about equal its compute still sheds compute, and a target is not filled up to where its
transfers catch up with it. dcp re-plans its slowest multi-node plans with it (planner/dcp.py
REPLAN_OVERLAP).

``duplex`` counts a rank's transfers on each link as the busier of its sends and its receives, as the
cost model prices an exchange, instead of their sum. The sum is right for a donor's shed rows (the Q
leaves in an early exchange, the OUT comes back in the last) but not for a home whose KV many ranks
read while it reads others' KV in the same exchanges: on 32 ranks of one node, the homes of a long
document's first blocks sat at max(C, X) = X ~ C with 1.13x the mean compute, where the duplex view
lets them shed it (1.02x). Neither view wins everywhere; dcp re-plans its slow one-node plans with it
too (planner/dcp.py REPLAN_DUPLEX).

``level_nodes`` (several nodes): a node whose mean compute is still over the mean after the rounds
(its excess would cost more NIC time to shed than it saves) then levels its own ranks: the same moves,
with the node's mean and cap and targets on the node only. Without it the donors stop at the global
cap, so a node at 1.07x the mean kept one rank at 1.27x while its node-mates sat at the cap. dcp
weighs it in a pass of its own (planner/passes.py LEVEL_PASS).
"""

from __future__ import annotations

import weakref

import numpy as np

from . import balance_moves as moves
from .balance_moves import BalancerState, MoveRule
from .cost_model import BALANCE_SLACK
from .placement import weighted_bincount
from .schedule import KIND_KV, KIND_OUT, KIND_Q, kv_block_bytes, payload_bytes
from .tiles import TileSet

MAX_TARGETS_PER_DONOR = 12  # targets tried per donor and round (bounds planning time at large P)
MAX_ROUNDS = 3
MAX_FAILED_HOMES = 3  # kv-homes tried in a row without a move before a donor gives up on rows (a later home
# rarely succeeds: 21 of ~3000 such tries over the benchmark cases)
MAX_MOVE_TILES = 4096  # longest prefix evaluated per move (a donor may move again later)

_payloads_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # TileSet -> {sizes: _block_payloads}


class Balancer:
    """Mutable tile -> rank assignment with per-rank compute time and transfer bytes."""

    def __init__(self, tiles: TileSet, home: np.ndarray, compute: np.ndarray, world_size: int, topology, *,
                 num_q_heads: int, num_kv_heads: int, head_dim: int, element_size: int, grad_element_size: int = 4,
                 relay_aware: bool = False, spread_sends: bool = False, start: np.ndarray | None = None,
                 overlap: float = 0.0, duplex: bool = False, level_nodes: bool = False, priced_rows: bool = True,
                 slack: float = BALANCE_SLACK, loads: tuple | None = None):
        P, nB = world_size, tiles.num_blocks
        self.t, self.home, self.c, self.P, self.nB = tiles, home, compute, P, nB
        self.node = np.ascontiguousarray(topology.node_of(np.arange(P)), dtype=np.int64)
        self.bw = np.array([topology.intra_bw, topology.inter_bw])
        self.multi_node = bool(self.node.max() > 0)
        self.relay_aware = relay_aware and self.multi_node
        self.spread_sends = spread_sends and self.relay_aware
        self.overlap = float(overlap)
        self.duplex = bool(duplex)
        self.level_nodes = bool(level_nodes) and self.multi_node
        self.priced_rows = bool(priced_rows) and not self.multi_node
        self.q_bytes, self.kv_bytes, self.out_bytes, self._row_over_column = _block_payloads(
            tiles, (num_q_heads, num_kv_heads, head_dim, element_size, grad_element_size))
        self._mean_tile = compute.mean() if compute.size else 0.0

        home = np.ascontiguousarray(home, dtype=np.int64)
        self.rank = np.array(home[tiles.q] if start is None else start, dtype=np.int64)  # (a copy)
        # (``loads``: the caller's ``_load_and_cap`` of these start ranks, where it has it)
        self.slack = float(slack)
        self.C, self.mean, self.cap = _load_and_cap(self.rank, compute, P, self.slack) if loads is None else loads
        self.send = np.zeros((P, 2))
        self.recv = np.zeros((P, 2))
        self.have_q = np.zeros((P, nB), dtype=bool)
        self.have_kv = np.zeros((P, nB), dtype=bool)
        self.num_nodes = int(self.node.max()) + 1
        self.node_kv = np.zeros((self.num_nodes, nB), dtype=np.int64) - 1  # a rank of the node holding b, or -1
        self.node_size = np.bincount(self.node, minlength=self.num_nodes)
        self.node_start = np.cumsum(self.node_size) - self.node_size  # nodes are runs of consecutive ranks
        self.has_out = np.zeros((P, nB), dtype=bool)
        blocks = np.arange(nB)
        self.have_q[home, blocks] = True
        self.have_kv[home, blocks] = True
        self.node_kv[self.node[home], blocks] = home
        self._state = BalancerState(
            q=np.ascontiguousarray(tiles.q, dtype=np.int64), kv=np.ascontiguousarray(tiles.kv, dtype=np.int64), c=np.ascontiguousarray(compute, dtype=np.float64), home=home, node=self.node,
            node_start=self.node_start, node_size=self.node_size, bw=self.bw, q_bytes=self.q_bytes,
            kv_bytes=self.kv_bytes, out_bytes=self.out_bytes, rank=self.rank, C=self.C, send=self.send,
            recv=self.recv, have_q=self.have_q, have_kv=self.have_kv, has_out=self.has_out, node_kv=self.node_kv)
        self._rule = MoveRule(multi_node=self.multi_node, relay_aware=self.relay_aware,
                              spread_sends=self.spread_sends, duplex=self.duplex, overlap=self.overlap,
                              level_nodes=self.level_nodes, slack=self.slack, max_rounds=MAX_ROUNDS,
                              max_targets=MAX_TARGETS_PER_DONOR, max_failed_homes=MAX_FAILED_HOMES,
                              max_move_tiles=MAX_MOVE_TILES, mean_tile=float(self._mean_tile),
                              row_over_column=float(self._row_over_column), priced_rows=self.priced_rows)
        moves.count_start(self._state, self._rule)

    # ------------------------------------------------------------------ moves (planner/balance_moves.py)
    def comm_time(self, r: int) -> float:
        """Rank r's transfer seconds on its slower link: sends + receives (``duplex``: the busier of them)."""
        return moves.comm_time(self._state, self._rule, r)

    def _move_comm(self, cand: np.ndarray, r: int, t: int) -> tuple[np.ndarray, np.ndarray]:
        """([k], [k]): the comm times of donor r and target t after moving each prefix of ``cand`` (tiles
        on r) to t (``balance_moves.move_comm``)."""
        return moves.move_comm(self._state, self._rule, np.ascontiguousarray(cand, dtype=np.int64), r, t)

    def try_move(self, cand: np.ndarray, r: int, t: int) -> bool:
        """Move the best prefix of ``cand`` (tiles on r, in preference order) to t; True if moved
        (``balance_moves.best_prefix``: the prefix minimizing max(time(r), time(t)), the target kept
        within the cap; with ``spread_sends`` a donor bound by its transfers still sheds compute where
        they do not grow)."""
        return moves.try_move(self._state, self._rule, np.ascontiguousarray(cand, dtype=np.int64), r, t,
                              float(self.mean), float(self.cap))

    def _apply(self, idx: np.ndarray, r: int, t: int) -> None:
        moves.apply_move(self._state, self._rule, np.ascontiguousarray(idx, dtype=np.int64), r, t)

    # ------------------------------------------------------------------ driver
    def run(self) -> np.ndarray:
        """Shed load from overloaded ranks (``balance_moves.run_rounds``); returns the tile ranks."""
        if not _nothing_to_shed(self.C, self.cap, self.c.size):
            moves.run_rounds(self._state, self._rule, float(self.mean), float(self.cap))
        return self.rank


def balanced_ranks(tiles: TileSet, home: np.ndarray, compute: np.ndarray, world_size: int, topology,
                   start: np.ndarray | None = None, slack: float = BALANCE_SLACK, **balancer_args) -> np.ndarray:
    """``Balancer(...).run()``'s tile ranks, without building the Balancer where no rank starts over
    the cap (it would move nothing): its bookkeeping of every rank's bytes was ~10% of a one-node
    128K / 8 plan whose start was already balanced."""
    rank = home[tiles.q] if start is None else start
    loads = _load_and_cap(rank, compute, world_size, slack)
    if _nothing_to_shed(loads[0], loads[2], compute.size):
        return rank.copy()
    return Balancer(tiles, home, compute, world_size, topology, start=rank, slack=slack, loads=loads,
                    **balancer_args).run()


def _block_payloads(tiles: TileSet, sizes: tuple) -> tuple:
    """(Q, KV, OUT bytes of every block as float64 [nB], the largest Q + OUT over the largest KV) for
    ``sizes`` = (num_q_heads, num_kv_heads, head_dim, element_size, grad_element_size), once per TileSet
    and sizes: a plan balances several starts of the same tiles. The arrays are shared by those
    Balancers, which only read them (writable all the same: the compiled moves take one array type)."""
    per_sizes = _payloads_cache.setdefault(tiles, {})
    if sizes not in per_sizes:
        lens = tiles.block_lengths()
        named = dict(zip(("num_q_heads", "num_kv_heads", "head_dim", "element_size", "grad_element_size"), sizes))
        q, kv, out = (payload_bytes(kind, lens, **named).astype(np.float64) for kind in (KIND_Q, KIND_KV, KIND_OUT))
        # a rectangle's q-row moves Q and OUT, its kv-column KV: their ratio sets the rectangle's shape
        row_over_column = float((q.max() + out.max()) / kv.max()) if tiles.num_blocks else 1.0
        per_sizes[sizes] = (q, kv, out, row_over_column)
    return per_sizes[sizes]


def _load_and_cap(rank: np.ndarray, compute: np.ndarray, world_size: int, slack: float) -> tuple:
    """(per-rank compute [P], its mean, the cap donors shed down to: the mean times 1 + ``slack``) of tile
    ranks ``rank``."""
    load = weighted_bincount(rank, compute, world_size)
    mean = load.sum() / world_size
    return load, mean, mean * (1 + slack)


def _nothing_to_shed(load: np.ndarray, cap: float, num_tiles: int) -> bool:
    """Whether ``Balancer.run`` moves no tile: one rank, no tiles, or no rank over the cap."""
    return load.size == 1 or num_tiles == 0 or float(load.max()) <= cap


def pushed_rows(tiles: TileSet, home: np.ndarray, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
                element_size: int, grad_element_size: int = 4, ranks_per_node: int | None = None) -> np.ndarray:
    """Start rank of every tile: its q-home, or its kv-home where the q-row's piece there reads more KV
    bytes (each block's KV shared by the q-home's rows that read it) than the Q block and OUT partial
    that computing it at the kv-home moves.

    ``ranks_per_node`` (several nodes): pieces per kv-*node* instead. A q-row's tiles on another node go
    to that node's rank with the q-home's index inside its node, where the KV they read (shared by the
    rows of the q-home's node: relays bring a block into a node once) outweighs Q and OUT; tiles on the
    q-home's node stay there. Each pushed Q block and OUT partial then crosses into a node once, to one
    rank, and the KV it reads moves over NVLink, where pushed to every kv-home the Q block entered every
    rank through its NIC (causal_blockwise on 32 ranks, 8 per node: 1.28 -> 1.20x the bound)."""
    sizes = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, element_size=element_size,
                 grad_element_size=grad_element_size)
    lens = tiles.block_lengths()
    q_out_bytes = (payload_bytes(KIND_Q, lens, **sizes) + payload_bytes(KIND_OUT, lens, **sizes)).astype(np.float64)
    kv_bytes = kv_block_bytes(lens, **sizes)
    nB, P = tiles.num_blocks, int(home.max()) + 1 if home.size else 1
    group = home if ranks_per_node is None else home // ranks_per_node  # the rank or node of every block
    G = int(group.max()) + 1 if home.size else 1
    q_home, q_group, kv_group = home[tiles.q], group[tiles.q], group[tiles.kv]
    rank = q_home.copy()
    remote = np.flatnonzero(q_group != kv_group)
    if remote.size == 0:
        return rank
    g, k = q_group[remote], tiles.kv[remote]
    readers = np.bincount(g * nB + k, minlength=G * nB)  # rows of group g reading block k
    share = kv_bytes[k] / readers[g * nB + k]
    piece = tiles.q[remote] * G + kv_group[remote]
    push = remote[np.bincount(piece, weights=share, minlength=nB * G)[piece] > q_out_bytes[tiles.q[remote]]]
    if ranks_per_node is None:
        rank[push] = home[tiles.kv[push]]
    else:
        node_ranks = np.minimum(ranks_per_node, P - kv_group[push] * ranks_per_node)  # (a last node may be short)
        rank[push] = kv_group[push] * ranks_per_node + q_home[push] % ranks_per_node % node_ranks
    return rank
