"""Compiled loops over schedule rows (numba): a placement's transfer times per rank and exchange, its
rows (relay-free, and the KV side and dK/dV reduce trees of relayed ones), the polish's rank times, and
the transit relays' choice of ranks by NIC load.

Notation (docs/design.md): P ranks, S stages, schedule rows (stage, src, dst, kind, block); exchange j
carries the inputs of stage j + 1 and the results of stage j (planner/cost_model.py).

Why: finishing a placement (planner/finish.py) prices its forward and backward transfers about six
times (each backward staging it weighs, each stage count), and each pricing in numpy was a dozen
passes over the rows (bytes per row, exchange, node test, four bincounts, the link times): ~50 us of
call overhead a time on a merged one-node plan. One loop gives the same floats: bytes are summed per
(rank, exchange, link) in row order, as ``np.bincount`` sums them. The relayed rows and reduce trees
replace binary searches and sorts in numpy that the relay scorer and the backward polish ran ~1,000s
of times a multi-node plan (tests/test_comm_times.py keeps the numpy forms and checks both agree).
"""

from __future__ import annotations

import numpy as np

from .float_sums import numpy_sum
from .jit import compiled
from .sort_loops import find_sorted, stable_order


@compiled
def link_seconds(intra_busiest, inter_busiest, intra_rows, inter_rows, intra_bw, inter_bw, intra_lat, inter_lat):
    """One rank's transfer time in one exchange (planner/cost_model.py ``link_time``): the slower link for
    the busier side's bytes, plus one latency, the inter-node one if a row there crosses nodes."""
    lat = inter_lat if inter_rows else (intra_lat if intra_rows else 0.0)
    return max(intra_busiest / intra_bw, inter_busiest / inter_bw) + lat


@compiled
def exchange_times(table, block_len, kind_bytes, is_input, ranks_per_node, intra_bw, inter_bw, intra_lat,
                   inter_lat, world_size, num_stages):
    """float64 [P, S + 1]: planner/cost_model.py ``stage_comm_time`` of int64 rows ``table`` [m, 5] with
    the payload of every row (``kind_bytes[kind] * block_len[block]``, schedule.py ``row_bytes``);
    ``is_input[kind]``: 1 for the kinds that travel before their stage (Q, KV, dO)."""
    P, S1 = world_size, num_stages + 1
    size = P * S1
    sent = np.zeros(2 * size)  # (rank, exchange) bytes: NVLink in the low half, NIC in the high half
    received = np.zeros(2 * size)
    used = np.zeros(2 * size, dtype=np.bool_)
    for i in range(table.shape[0]):
        src, dst, kind = table[i, 1], table[i, 2], table[i, 3]
        exchange = table[i, 0] - is_input[kind]
        link = size if src // ranks_per_node != dst // ranks_per_node else 0
        nbytes = float(kind_bytes[kind] * block_len[table[i, 4]])
        at_src, at_dst = link + src * S1 + exchange, link + dst * S1 + exchange
        sent[at_src] += nbytes
        received[at_dst] += nbytes
        used[at_src] = True
        used[at_dst] = True
    out = np.empty((P, S1))
    for r in range(P):
        for j in range(S1):
            at = r * S1 + j
            out[r, j] = link_seconds(max(sent[at], received[at]), max(sent[size + at], received[size + at]),
                                     used[at], used[size + at], intra_bw, inter_bw, intra_lat, inter_lat)
    return out


@compiled
def relay_free_rows(home, q_rank, q_block, q_first, q_last, qb_rank, qb_block, qb_first, qb_last, kv_rank, kv_block,
                    kv_first, kv_last_bwd):
    """planner/schedule.py ``schedule_rows`` without relays: (forward rows, backward rows), int64 [m, 5]
    (stage, src, dst, kind, block) - Q in, KV in, OUT back; dO in, dQ back, dK/dV back - from the q and
    kv receive groups (rank, block, first, last) of the forward and (``qb_*``, ``kv_last_bwd``) the
    backward stages. Every input comes from its block's home and every partial returns there."""
    nq, nqb, nkv = q_rank.size, qb_rank.size, kv_rank.size
    fwd = np.empty((2 * nq + nkv, 5), dtype=np.int64)
    bwd = np.empty((2 * nqb + nkv, 5), dtype=np.int64)
    for i in range(nq):
        b, r = q_block[i], q_rank[i]
        fwd[i, 0], fwd[i, 1], fwd[i, 2], fwd[i, 3], fwd[i, 4] = q_first[i], home[b], r, 0, b  # KIND_Q
        j = nq + nkv + i
        fwd[j, 0], fwd[j, 1], fwd[j, 2], fwd[j, 3], fwd[j, 4] = q_last[i] + 1, r, home[b], 2, b  # KIND_OUT
    for i in range(nkv):
        b, r, j = kv_block[i], kv_rank[i], nq + i
        fwd[j, 0], fwd[j, 1], fwd[j, 2], fwd[j, 3], fwd[j, 4] = kv_first[i], home[b], r, 1, b  # KIND_KV
        j = 2 * nqb + i
        bwd[j, 0], bwd[j, 1], bwd[j, 2], bwd[j, 3], bwd[j, 4] = kv_last_bwd[i] + 1, r, home[b], 5, b  # KIND_DKV
    for i in range(nqb):
        b, r = qb_block[i], qb_rank[i]
        bwd[i, 0], bwd[i, 1], bwd[i, 2], bwd[i, 3], bwd[i, 4] = qb_first[i], home[b], r, 3, b  # KIND_DO
        j = nqb + i
        bwd[j, 0], bwd[j, 1], bwd[j, 2], bwd[j, 3], bwd[j, 4] = qb_last[i] + 1, r, home[b], 4, b  # KIND_DQ
    return fwd, bwd


@compiled
def dkv_routes(home, r, b, last, src, num_blocks, num_stages):
    """planner/schedule.py ``dkv_routes`` (whose docstring states the rule) in two passes over the
    groups, with no temporaries per pass: (DKV destination, stage, transit rows [m, 5]) of the (rank r,
    kv-block b) receive groups, ascending by r * nB + b. The polish of the backward routes the groups of a
    few blocks ~2,500 times a 32-rank plan, where numpy's dozen calls were ~50 us a time."""
    n = r.size
    dst = np.empty(n, dtype=np.int64)
    stage = np.empty(n, dtype=np.int64)
    key = np.empty(n, dtype=np.int64)
    for i in range(n):
        dst[i], stage[i], key[i] = home[b[i]], last[i] + 1, r[i] * num_blocks + b[i]
    # children of proxies (a rank with tiles of the block): reduce into the proxy where it can still forward
    # the sum and got the block from the home or a transit rank; the proxy then sends after its last child
    through = np.zeros(n, dtype=np.bool_)
    count = 0
    for i in range(n):
        if src[i] == home[b[i]]:
            continue
        parent = find_sorted(key, src[i] * num_blocks + b[i])
        if parent < 0:
            through[i] = True  # (a child of a transit rank: routed below, once every proxy's stage is known)
            count += 1
        elif last[i] + 2 <= num_stages and (src[parent] == home[b[i]]
                                            or find_sorted(key, src[parent] * num_blocks + b[i]) < 0):
            dst[i] = src[i]
            stage[parent] = max(stage[parent], last[i] + 2)
    # children of transit ranks: through the transit rank where it can forward one stage later; one
    # transit row per (transit rank, block), leaving after its last child's partial
    transit_key = np.empty(count, dtype=np.int64)
    transit_stage = np.empty(count, dtype=np.int64)
    m = 0
    for i in range(n):
        if through[i] and stage[i] + 1 <= num_stages:
            dst[i] = src[i]
            transit_key[m], transit_stage[m] = src[i] * num_blocks + b[i], stage[i] + 1
            m += 1
    order = stable_order(transit_key[:m])
    rows = np.empty((m, 5), dtype=np.int64)
    k = 0
    for j in range(m):
        t = order[j]
        if k > 0 and rows[k - 1, 1] * num_blocks + rows[k - 1, 4] == transit_key[t]:
            rows[k - 1, 0] = max(rows[k - 1, 0], transit_stage[t])
            continue
        block = transit_key[t] % num_blocks
        rows[k, 0], rows[k, 1], rows[k, 2], rows[k, 3], rows[k, 4] = (transit_stage[t], transit_key[t] // num_blocks,
                                                                      home[block], 5, block)  # KIND_DKV
        k += 1
    return dst, stage, rows[:k].copy()


@compiled
def rank_times(ranks, load, rows_at, compute, intra_bw, inter_bw, intra_lat, inter_lat):
    """The polish's per-rank time (planner/polish.py ``StageSearch._times``): for each of ``ranks``, every
    exchange's transfer time (``link_seconds``) from its loads (``load`` [link, send / receive, rank,
    exchange]; ``rows_at`` [link, rank, exchange]) overlapped with the compute of its stage (``compute``
    [ranks, S]), summed in stage order, then the last exchange: ``CostModel.overlapped_time`` of
    ``CostModel.link_time``, the same floats."""
    S = compute.shape[1]
    out = np.empty(ranks.size)
    overlapped = np.empty(S)
    for k in range(ranks.size):
        r = ranks[k]
        for j in range(S + 1):
            comm = link_seconds(max(load[0, 0, r, j], load[0, 1, r, j]), max(load[1, 0, r, j], load[1, 1, r, j]),
                                rows_at[0, r, j] > 0, rows_at[1, r, j] > 0, intra_bw, inter_bw, intra_lat, inter_lat)
            if j < S:
                overlapped[j] = max(compute[r, j], comm)
            else:  # (summed as numpy sums a row: pairwise from 8 stages on)
                out[k] = numpy_sum(overlapped) + comm
    return out


@compiled
def relayed_kv_rows(home, r, b, first, relay, num_blocks):
    """The KV side of a relayed schedule (planner/schedule.py ``schedule_rows``): (each (rank r, kv-block b)
    receive group's source - the home, or the relay row (block, dst, src) naming it, the last such row
    where several do -, the forward KV rows [m, 5]: each group's from its source in its first stage,
    then one row into every *transit* source (a relay source with no receive group of the block, not
    its home, with a receiver that has one), from the home one stage before the earliest of its
    receivers needs the block, in ascending (source, block)). Groups ascend by r * nB + b, so relay rows
    find theirs by binary search."""
    n, m = r.size, relay.shape[0]
    key = np.empty(n, dtype=np.int64)
    src = np.empty(n, dtype=np.int64)
    for i in range(n):
        key[i], src[i] = r[i] * num_blocks + b[i], home[b[i]]
    transit_key = np.empty(m, dtype=np.int64)
    transit_need = np.empty(m, dtype=np.int64)
    count = 0
    for j in range(m):
        block, dst, source = relay[j, 0], relay[j, 1], relay[j, 2]
        receiver = find_sorted(key, dst * num_blocks + block)
        if receiver < 0:
            continue  # (a row naming no group: left to check_plan)
        src[receiver] = source
        if source != home[block] and find_sorted(key, source * num_blocks + block) < 0:
            transit_key[count], transit_need[count] = source * num_blocks + block, first[receiver]
            count += 1
    # per transit (source, block): the earliest need; ties keep the first row, as a stable sort does
    order = stable_order(transit_key[:count])
    rows = np.empty((n + count, 5), dtype=np.int64)
    for i in range(n):
        rows[i, 0], rows[i, 1], rows[i, 2], rows[i, 3], rows[i, 4] = first[i], src[i], r[i], 1, b[i]  # KIND_KV
    k = n
    for j in range(count):
        t = order[j]
        if k > n and rows[k - 1, 2] * num_blocks + rows[k - 1, 4] == transit_key[t]:
            rows[k - 1, 0] = min(rows[k - 1, 0], transit_need[t] - 1)
            continue
        block = transit_key[t] % num_blocks
        rows[k, 0], rows[k, 1], rows[k, 2], rows[k, 3], rows[k, 4] = (transit_need[t] - 1, home[block],
                                                                      transit_key[t] // num_blocks, 1, block)
        k += 1
    return src, rows[:k].copy()


@compiled
def transit_choices(giver, r, b, order, reads, load, kv_bytes, ranks_per_node, world_size, one_entry):
    """planner/relay.py ``_balancing_transit``'s choices, unsorted: int64 [m, 3] (block, r, t) rows for
    the eligible groups (r, b) in ``order`` (per giver: latest first need first). Per node in ascending
    order, its ranks by decreasing ``load`` (ties by rank) give their groups to the least-loaded rank of
    the node that reads no tile of the block (ties by rank), while that leaves the taker's load below
    the giver's; ``one_entry``: a block already entering the node through a transit rank reuses it.
    ``load`` is not modified. The same comparisons of the same floats as the Python loop it replaces
    (tests/test_relay.py keeps it and checks both agree), without a numpy call per group."""
    nB, n_items = kv_bytes.size, order.size
    load = load.copy()
    num_nodes = (world_size + ranks_per_node - 1) // ranks_per_node
    entry = np.full(num_nodes * nB, -1, dtype=np.int64)  # (node, block) -> its transit rank, or -1
    out = np.empty((n_items, 3), dtype=np.int64)
    node_of = np.empty(n_items, dtype=np.int64)
    present = np.zeros(num_nodes, dtype=np.bool_)
    for k in range(n_items):
        node_of[k] = giver[order[k]] // ranks_per_node
        present[node_of[k]] = True
    mates = np.empty(ranks_per_node, dtype=np.int64)
    m = 0
    for n in range(num_nodes):
        if not present[n]:
            continue
        lo, hi = n * ranks_per_node, min((n + 1) * ranks_per_node, world_size)
        for j in range(hi - lo):  # (insertion sort of the node's few ranks, by load as the node starts)
            x, k = lo + j, j
            while k > 0 and load[mates[k - 1]] < load[x]:
                mates[k] = mates[k - 1]
                k -= 1
            mates[k] = x
        by_load = mates[:hi - lo].copy()
        for g in by_load:
            for k in range(n_items):
                i = order[k]
                if node_of[k] != n or giver[i] != g:
                    continue
                blk, w = b[i], kv_bytes[b[i]]
                t = entry[n * nB + blk]  # (-1: none yet)
                if t < 0:
                    for x in range(lo, hi):  # the least-loaded rank of the node not reading blk
                        if x != g and not reads[x * nB + blk] and (t < 0 or load[x] < load[t]):
                            t = x
                    if t < 0:
                        continue
                    if load[t] + w > load[g] - w:
                        break  # the giver is no longer above the others
                    load[t] += w
                    if one_entry:
                        entry[n * nB + blk] = t
                load[g] -= w
                out[m, 0], out[m, 1], out[m, 2] = blk, r[i], t
                m += 1
    return out[:m].copy()
