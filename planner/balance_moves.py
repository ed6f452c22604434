"""The Balancer's rounds of moves and each move's arithmetic (planner/balance.py), compiled with numba.

Notation (docs/design.md, planner/balance.py): P ranks, nB blocks, tiles (qb, kb) with compute time
``c``; ``home[b]`` owns block b. Per rank r and link l (0 NVLink, 1 NIC): ``send[r, l]`` / ``recv[r, l]``
bytes; per rank and block: ``have_q`` / ``have_kv`` (the block is held), ``has_out`` (an OUT partial of
that q-block goes home from it); per node and block: ``node_kv`` (a rank of the node holding the KV
block, or -1). ``state`` bundles them with the constants (see ``BalancerState``).

Why compiled: a move evaluates up to MAX_MOVE_TILES prefixes of a candidate list and then updates the
bookkeeping, ~40 numpy calls on small arrays (~100 us a move, ~25 moves a long-tail plan at 128K / 8),
where one loop over the candidates takes a few microseconds; the rounds around the moves (donors,
targets, candidate orders) were as many numpy calls again per donor. The code is explicit loops: numba's
own argsort, cumsum, searchsorted and array assignments take seconds each to compile. The results are the same as the numpy
forms they replace, to the bit: byte counts are whole numbers (float sums exact in any order), and the
compute sums keep numpy's order (planner/float_sums.py ``numpy_sum``: numpy's pairwise summation;
``np.cumsum``'s running sum), so the plans do not change.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .float_sums import numpy_sum
from .jit import compiled
from .sort_loops import counting_order, stable_order



class BalancerState(NamedTuple):
    """The Balancer's arrays as the compiled moves read and update them (the last eight in place)."""

    q: np.ndarray  # int64 [n] q-block of every tile
    kv: np.ndarray  # int64 [n] kv-block of every tile
    c: np.ndarray  # float64 [n] compute seconds of every tile
    home: np.ndarray  # int64 [nB]
    node: np.ndarray  # int64 [P] node of every rank
    node_start: np.ndarray  # int64 [nodes] first rank of every node
    node_size: np.ndarray  # int64 [nodes]
    bw: np.ndarray  # float64 [2] NVLink, NIC bandwidth
    q_bytes: np.ndarray  # float64 [nB]
    kv_bytes: np.ndarray  # float64 [nB]
    out_bytes: np.ndarray  # float64 [nB]
    rank: np.ndarray  # int64 [n] (updated)
    C: np.ndarray  # float64 [P] compute per rank (updated)
    send: np.ndarray  # float64 [P, 2] (updated)
    recv: np.ndarray  # float64 [P, 2] (updated)
    have_q: np.ndarray  # bool [P, nB] (updated)
    have_kv: np.ndarray  # bool [P, nB] (updated)
    has_out: np.ndarray  # bool [P, nB] (updated)
    node_kv: np.ndarray  # int64 [nodes, nB] (updated)


class MoveRule(NamedTuple):
    """The Balancer's settings and limits (planner/balance.py)."""

    multi_node: bool
    relay_aware: bool
    spread_sends: bool
    duplex: bool
    overlap: float
    level_nodes: bool
    slack: float  # donors shed down to the mean times 1 + slack (the cap)
    max_rounds: int
    max_targets: int  # targets tried per donor and round
    max_failed_homes: int  # kv-homes tried in a row without a move before a donor gives up on rows
    max_move_tiles: int  # longest prefix evaluated per move
    mean_tile: float  # a tile's mean compute (sizes the rectangles)
    row_over_column: float  # (Q + OUT) / KV bytes of a block: the rectangles' shape
    priced_rows: bool  # rows to kv-homes only in pieces no dearer a tile than a rectangle (one node)


@compiled(error_model="numpy")
def comm_time(state, rule, r):
    """Rank r's transfer seconds on its slower link: sends + receives (``duplex``: the busier)."""
    best = 0.0
    for link in range(2):
        if rule.duplex:
            moved = max(state.send[r, link], state.recv[r, link])
        else:
            moved = state.send[r, link] + state.recv[r, link]
        best = max(best, moved / state.bw[link])
    return best


@compiled(error_model="numpy")
def _estimate(rule, compute, comm):
    """max(C, X) + overlap x min(C, X): a rank's time as the Balancer weighs it."""
    if rule.overlap == 0.0:
        return max(compute, comm)
    return max(compute, comm) + rule.overlap * min(compute, comm)


@compiled(error_model="numpy")
def move_comm(state, rule, cand, r, t):
    """([k], [k]) comm times of donor r and target t after moving each prefix of ``cand`` (tiles on r) to
    t (a prefix adds Q into t and OUT back from t per new q-block, on the q-home's
    link and the donor's own where it is that home; KV into t per new kv-block, with ``duplex`` also a
    send of the donor's where it is that block's home)."""
    k = cand.size
    nB = state.home.size
    seen_q = np.zeros(nB, dtype=np.bool_)
    seen_kv = np.zeros(nB, dtype=np.bool_)
    node_t = state.node[t]
    # running bytes per (rank r / t, direction send / recv, link): moved so far
    r_send = np.zeros(2)
    r_recv = np.zeros(2)
    t_send = np.zeros(2)
    t_recv = np.zeros(2)
    comm_r = np.empty(k)
    comm_t = np.empty(k)
    for i in range(k):
        tile = cand[i]
        qb, kb = state.q[tile], state.kv[tile]
        hq, hkv = state.home[qb], state.home[kb]
        q_in = out_back = kv_in = 0.0
        if not seen_q[qb]:
            seen_q[qb] = True
            if not state.have_q[t, qb]:
                q_in = state.q_bytes[qb]
            if hq != t and not state.has_out[t, qb]:
                out_back = state.out_bytes[qb]
        if not seen_kv[kb]:
            seen_kv[kb] = True
            if not state.have_kv[t, kb]:
                kv_in = state.kv_bytes[kb]
        lq = lkv = 0
        if rule.multi_node:
            lq = 1 if state.node[hq] != node_t else 0
            lkv = 1 if state.node[hkv] != node_t else 0
            if rule.relay_aware and state.node_kv[node_t, kb] >= 0:
                lkv = 0  # held on t's node: relayed over NVLink
        if rule.duplex:
            if hq == r:
                r_send[lq] += q_in
                r_recv[lq] += out_back
            if hkv == r:
                r_send[lkv] += kv_in
            t_send[lq] += out_back
            t_recv[lq] += q_in
            t_recv[lkv] += kv_in
        else:  # sends and receives summed: one running total per link
            if hq == r:
                r_send[lq] += q_in + out_back
            t_send[lq] += q_in + out_back
            t_send[lkv] += kv_in
        cr = ct = 0.0
        for link in range(2 if rule.multi_node else 1):
            bw = state.bw[link]
            if rule.duplex:
                cr = max(cr, max(state.send[r, link] + r_send[link], state.recv[r, link] + r_recv[link]) / bw)
                ct = max(ct, max(state.send[t, link] + t_send[link], state.recv[t, link] + t_recv[link]) / bw)
            else:
                cr = max(cr, (state.send[r, link] + state.recv[r, link] + r_send[link]) / bw)
                ct = max(ct, (state.send[t, link] + state.recv[t, link] + t_send[link]) / bw)
        comm_r[i] = cr
        comm_t[i] = ct
    return comm_r, comm_t


@compiled(error_model="numpy")
def best_prefix(state, rule, cand, r, t, mean, cap):
    """The number of leading tiles of ``cand`` (tiles on r, in preference order) that Balancer.try_move
    moves to t, 0 for none: the prefix minimizing max(time(r), time(t)), up to the tile that brings r to
    the mean or t to the cap, never turning t into a new straggler (its time stays within the cap)."""
    C = state.C
    amount = min(C[r] - mean, cap - C[t])
    if cand.size == 0 or amount <= 0:
        return 0
    # the prefix up to the tile that crosses the amount (the objective decides), running sums as cumsum's
    # (explicit loops: numba's cumsum and searchsorted cost a second of compile here)
    limit_tiles = min(cand.size, rule.max_move_tiles)
    cum_c = np.empty(limit_tiles)
    k_max, total = 0, 0.0
    while k_max < limit_tiles:
        total += state.c[cand[k_max]]
        cum_c[k_max] = total
        k_max += 1
        if total > amount:
            break
    comm_r, comm_t = move_comm(state, rule, cand[:k_max], r, t)
    comm_r_now, comm_t_now = comm_time(state, rule, r), comm_time(state, rule, t)
    limit = max(cap, C[t], comm_t_now)
    before = max(_estimate(rule, C[r], comm_r_now), _estimate(rule, C[t], comm_t_now))
    obj = np.empty(k_max)
    best = 0
    for i in range(k_max):
        load_t = C[t] + cum_c[i]
        estimate_t = _estimate(rule, load_t, comm_t[i])
        time_t = estimate_t if rule.overlap == 0.0 else max(load_t, comm_t[i])
        obj[i] = np.inf if time_t > limit else max(_estimate(rule, C[r] - cum_c[i], comm_r[i]), estimate_t)
        if obj[i] < obj[best]:
            best = i
    if obj[best] < before * (1 - 1e-6):
        return best + 1
    if not rule.spread_sends:
        return 0
    # A donor bound by its transfers still sheds compute where its transfers do not grow, the pair's
    # max(C, X) does not grow and the target stays within the cap (``obj`` is inf past it): the stages
    # overlap its transfers with only part of its compute.
    best, spread_best = -1, np.inf
    for i in range(k_max):
        if comm_r[i] <= comm_r_now * (1 + 1e-9) and obj[i] <= before * (1 + 1e-9):
            spread = max(C[r] - cum_c[i], C[t] + cum_c[i])
            if spread < spread_best:
                best, spread_best = i, spread
    return best + 1 if best >= 0 and spread_best < C[r] * (1 - 1e-6) else 0


@compiled(error_model="numpy")
def add_kv(state, rule, d, kb):
    """Count the KV transfer that gives rank d block kb (not held yet). With ``relay_aware`` the block
    crosses into d's node once, into a proxy rotating with the block (with ``spread_sends`` leaving
    its home's node through a node-mate rotating with the block and the node), and reaches the node's
    other readers over NVLink."""
    state.have_kv[d, kb] = True
    src = state.home[kb]
    link = 1 if state.node[src] != state.node[d] else 0
    nbytes = state.kv_bytes[kb]
    if rule.relay_aware and link == 1:
        nd = state.node[d]
        if state.node_kv[nd, kb] < 0:  # first copy into the node: over a NIC, to the proxy
            proxy = state.node_start[nd] + kb % state.node_size[nd]
            sender = src
            if rule.spread_sends:
                home_node = state.node[src]
                mate = state.node_start[home_node] + (kb + nd) % state.node_size[home_node]
                if mate != sender:
                    state.send[sender, 0] += nbytes
                    state.recv[mate, 0] += nbytes
                sender = mate
            state.send[sender, 1] += nbytes
            state.recv[proxy, 1] += nbytes
            state.node_kv[nd, kb] = proxy
        src, link = state.node_kv[nd, kb], 0
        if src == d:  # the proxy itself: its NIC receive is counted
            return
    state.send[src, link] += nbytes
    state.recv[d, link] += nbytes


@compiled(error_model="numpy")
def add_q_out(state, t, qb):
    """Count the Q block qb into rank t and its OUT partial back home, where not counted yet."""
    hq = state.home[qb]
    link = 1 if state.node[hq] != state.node[t] else 0
    if not state.have_q[t, qb]:
        state.send[hq, link] += state.q_bytes[qb]
        state.recv[t, link] += state.q_bytes[qb]
        state.have_q[t, qb] = True
    if hq != t and not state.has_out[t, qb]:
        state.send[t, link] += state.out_bytes[qb]
        state.recv[hq, link] += state.out_bytes[qb]
        state.has_out[t, qb] = True


@compiled(error_model="numpy")
def apply_move(state, rule, tiles, r, t):
    """Move ``tiles`` from r to t: compute, ranks and the transfers they add (Balancer._apply)."""
    moved = numpy_sum(state.c[tiles])
    state.C[r] -= moved
    state.C[t] += moved
    for i in range(tiles.size):
        tile = tiles[i]
        state.rank[tile] = t
        add_q_out(state, t, state.q[tile])
        kb = state.kv[tile]
        if not state.have_kv[t, kb]:
            add_kv(state, rule, t, kb)


@compiled(error_model="numpy")
def try_move(state, rule, cand, r, t, mean, cap):
    """Balancer.try_move: move ``best_prefix`` of ``cand`` to t; True if any tile moved."""
    k = best_prefix(state, rule, cand, r, t, mean, cap)
    if k == 0:
        return False
    apply_move(state, rule, cand[:k], r, t)
    return True


@compiled(error_model="numpy")
def count_start(state, rule):
    """The transfers of the starting assignment ``state.rank``, counted into the empty bookkeeping
    (every block held by its home only): each tile's remote KV once per rank, and each tile placed off
    its q-block's home its Q in and OUT back once per rank."""
    for tile in range(state.q.size):
        d, qb, kb = state.rank[tile], state.q[tile], state.kv[tile]
        if not state.have_kv[d, kb]:
            add_kv(state, rule, d, kb)
        if state.home[qb] != d:
            add_q_out(state, d, qb)


# ---------------------------------------------------------------------- the rounds (Balancer.run)
@compiled(error_model="numpy")
def _target_order(state, rule, ranks, r):
    """The first ``max_targets`` of ``ranks``: same node as r first, then least loaded (ties: as listed)."""
    load = np.empty(ranks.size)
    for i in range(ranks.size):
        load[i] = state.C[ranks[i]]
    by_load = stable_order(load)
    out = np.empty(ranks.size, dtype=np.int64)
    n = 0
    for remote in range(2):
        for i in range(ranks.size):
            x = ranks[by_load[i]]
            if (1 if state.node[x] != state.node[r] else 0) == remote:
                out[n] = x
                n += 1
    return out[: min(n, rule.max_targets)]


@compiled(error_model="numpy")
def _on_rank(state, tiles, r):
    """The tiles of ``tiles`` still on rank r, in order."""
    out = np.empty(tiles.size, dtype=np.int64)
    n = 0
    for tile in tiles:
        if state.rank[tile] == r:
            out[n] = tile
            n += 1
    return out[:n]


@compiled(error_model="numpy")
def _ranks_under(state, mean, only_node, exclude):
    """Ranks whose compute is under ``mean`` (but ``exclude``; on node ``only_node`` if >= 0), ascending."""
    out = np.empty(state.C.size, dtype=np.int64)
    n = 0
    for x in range(state.C.size):
        if x != exclude and state.C[x] < mean and (only_node < 0 or state.node[x] == only_node):
            out[n] = x
            n += 1
    return out[:n]


@compiled(error_model="numpy")
def _shed_rows(state, rule, r, mine, mean, cap, only_node):
    """Rows of r's tiles ``mine`` to kv-homes under the mean (only Q + OUT move), largest rows first; with
    ``priced_rows`` only a row's piece long enough to cost no more bytes a tile than a rectangle would."""
    nB, P = state.home.size, state.C.size
    row_c = np.zeros(nB)
    row_of = np.full(nB, -1)  # the rows of ``mine``, numbered in ascending q (``mine`` is in (q, kv) order)
    rows = np.empty(mine.size, dtype=np.int64)
    num_rows = 0
    reads = np.zeros(P, dtype=np.bool_)  # ranks homing a kv-block the rows read
    for tile in mine:  # (in order: bincount's sums)
        qb = state.q[tile]
        row_c[qb] += state.c[tile]
        if row_of[qb] < 0:
            row_of[qb] = num_rows
            rows[num_rows] = qb
            num_rows += 1
        reads[state.home[state.kv[tile]]] = True
    # rows by decreasing compute, ties: lower q (a stable sort over ascending q)
    neg_c = np.empty(num_rows)
    for i in range(num_rows):
        neg_c[i] = -row_c[rows[i]]
    by_c = stable_order(neg_c)
    row_rank = np.empty(num_rows, dtype=np.int64)
    for i in range(num_rows):
        row_rank[by_c[i]] = i
    # the tiles by their row's rank (stable: a row keeps its tiles in kv order)
    keys = np.empty(mine.size, dtype=np.int64)
    for i in range(mine.size):
        keys[i] = row_rank[row_of[state.q[mine[i]]]]
    order = counting_order(keys, num_rows)
    homes = np.empty(P, dtype=np.int64)
    num_homes = 0
    for x in range(P):
        if reads[x] and x != r and state.C[x] < mean and (only_node < 0 or state.node[x] == only_node):
            homes[num_homes] = x
            num_homes += 1
    failed = 0
    rows_to = np.empty(mine.size, dtype=np.int64)
    piece = np.zeros(num_rows, dtype=np.int64)
    # ``priced_rows`` (one node): a row's piece of k tiles reading t's KV costs Q + OUT, R / k KV blocks'
    # bytes a tile (R = row_over_column), where a rectangle of the n tiles the donor must shed costs about
    # 2 sqrt(n R), 2 sqrt(R / n) a tile: only pieces at least as cheap (k >= sqrt(n R) / 2) go as rows, the
    # rest to the rectangles. Long-tail causal plans on 8 ranks had shed many rows' first 1-2 tiles to the
    # home of their document's first blocks, ~2 MB of Q + OUT each (docs/planner_log.md, session 40). On
    # several nodes the search's later passes went either way with it.
    min_piece = 0.0
    if rule.priced_rows:
        shed = max(1.0, (state.C[r] - mean) / max(rule.mean_tile, 1e-300))
        min_piece = np.sqrt(shed * rule.row_over_column) / 2
    for t in _target_order(state, rule, homes[:num_homes], r):
        if state.C[r] <= cap or failed >= rule.max_failed_homes:
            return
        n = 0
        for i in range(mine.size):
            tile = mine[order[i]]
            if state.home[state.kv[tile]] == t and state.rank[tile] == r:
                rows_to[n] = tile
                n += 1
        if min_piece > 1:
            piece[:] = 0
            for i in range(n):
                piece[row_of[state.q[rows_to[i]]]] += 1
            kept = 0
            for i in range(n):
                row = row_of[state.q[rows_to[i]]]
                if piece[row] >= min_piece:
                    rows_to[kept] = rows_to[i]
                    kept += 1
            n = kept
        failed = 0 if try_move(state, rule, rows_to[:n], r, t, mean, cap) else failed + 1


@compiled(error_model="numpy")
def _shed_rectangles(state, rule, r, mine, mean, cap, only_node):
    """Rectangles of r's tiles ``mine`` to the least loaded ranks, same node first. A failed move means
    more loaded targets of the same class (same node / other node) would fail too - except on one node,
    where a target may fail for its own transfers (e.g. it homes blocks many ranks read): a more loaded
    one with less transfer time than every failed one is still tried."""
    targets = _target_order(state, rule, _ranks_under(state, mean, only_node, -1), r)
    if targets.size == 0 or mine.size == 0:
        return
    n = max(1.0, (state.C[r] - mean) / targets.size / rule.mean_tile)
    width = int(max(1.0, np.rint(np.sqrt(n * rule.row_over_column))))  # (rint: Python's round, half to even)
    # tiles by (kv // width, q, kv): ``mine`` is in (q, kv) order, so a stable sort by kv // width does it
    keys = np.empty(mine.size, dtype=np.int64)
    for i in range(mine.size):
        keys[i] = state.kv[mine[i]] // width
    order = counting_order(keys, state.home.size // width + 1)
    rect = np.empty(mine.size, dtype=np.int64)
    for i in range(mine.size):
        rect[i] = mine[order[i]]
    failed = np.full(2, np.inf)  # per class (same node, other node): the least transfer time of a failed target
    for t in targets:
        if state.C[r] <= cap:
            return
        remote = 1 if state.node[t] != state.node[r] else 0
        if state.C[t] >= cap:
            continue
        if failed[remote] < np.inf and (rule.multi_node or comm_time(state, rule, t) >= failed[remote]):
            continue
        rect = _on_rank(state, rect, r)
        if not try_move(state, rule, rect, r, t, mean, cap):
            failed[remote] = min(failed[remote], comm_time(state, rule, t))


@compiled(inline="always", error_model="numpy")  # (a function of its own: ~1 s more of the first compile)
def _shed(state, rule, r, initial, mean, cap, only_node):
    """One donor's turn: rows, then rectangles, of its ``initial`` tiles it still holds."""
    mine = _on_rank(state, initial, r)
    _shed_rows(state, rule, r, mine, mean, cap, only_node)
    _shed_rectangles(state, rule, r, _on_rank(state, mine, r), mean, cap, only_node)


@compiled(error_model="numpy")
def _by_decreasing_load(state, ranks):
    """``ranks`` by decreasing compute (ties: as listed)."""
    neg = np.empty(ranks.size)
    for i in range(ranks.size):
        neg[i] = -state.C[ranks[i]]
    order = stable_order(neg)
    out = np.empty(ranks.size, dtype=np.int64)
    for i in range(ranks.size):
        out[i] = ranks[order[i]]
    return out


@compiled(error_model="numpy")
def run_rounds(state, rule, mean, cap):
    """Balancer.run's rounds: the donors over the cap, most loaded first, shed to targets under the mean,
    for up to ``max_rounds`` rounds while some donor makes progress; then, with ``level_nodes``, each node
    whose mean is still over the mean levels its own ranks to its own mean (shedding more of its work
    would cost more NIC time than it saves). A donor's candidates are its initial tiles (targets are
    filled to about the cap, so the tiles a rank received are never worth passing on again)."""
    P = state.C.size
    by_rank = counting_order(state.rank, P)
    bounds = np.zeros(P + 1, dtype=np.int64)
    for tile in range(state.rank.size):
        bounds[state.rank[tile] + 1] += 1
    for x in range(P):
        bounds[x + 1] += bounds[x]
    all_nodes = np.int64(-1)  # (one type for the node filter: -1 or a node)
    stuck = np.zeros(P, dtype=np.bool_)  # donors that found no move in a round stay put
    for _ in range(rule.max_rounds):
        progress = False
        for r in _by_decreasing_load(state, np.arange(P)):
            if state.C[r] <= cap:
                break
            if stuck[r] or _ranks_under(state, mean, all_nodes, -1).size == 0:
                continue
            load_before = state.C[r]
            _shed(state, rule, r, by_rank[bounds[r]:bounds[r + 1]], mean, cap, all_nodes)
            stuck[r] = state.C[r] >= load_before
            progress |= not stuck[r]
        if not progress:
            break
    if not rule.level_nodes:
        return
    for n in range(state.node_start.size):
        ranks = np.arange(state.node_start[n], state.node_start[n] + state.node_size[n])
        node_c = np.empty(ranks.size)
        for i in range(ranks.size):
            node_c[i] = state.C[ranks[i]]
        node_mean = numpy_sum(node_c) / ranks.size
        if node_mean <= mean:
            continue
        node_cap = node_mean * (1 + rule.slack)
        for r in _by_decreasing_load(state, ranks):
            if state.C[r] <= node_cap:
                break
            _shed(state, rule, r, by_rank[bounds[r]:bounds[r + 1]], node_mean, node_cap, np.int64(n))
