"""Compiled loops over schedule rows (numba): a placement's transfer times per rank and exchange.

Notation (docs/design.md): P ranks, S stages, schedule rows (stage, src, dst, kind, block); exchange j
carries the inputs of stage j + 1 and the results of stage j (planner/cost_model.py).

Why: finishing a placement (planner/finish.py) prices its forward and backward transfers about six
times (each backward staging it weighs, each stage count), and each pricing in numpy was a dozen
passes over the rows (bytes per row, exchange, node test, four bincounts, the link times): ~50 us of
call overhead a time on a merged one-node plan. One loop gives the same floats: bytes are summed per
(rank, exchange, link) in row order, as ``np.bincount`` sums them.
"""

from __future__ import annotations

import numpy as np

from .jit import compiled


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
            lat = inter_lat if used[size + at] else (intra_lat if used[at] else 0.0)
            out[r, j] = max(max(sent[at], received[at]) / intra_bw,
                            max(sent[size + at], received[size + at]) / inter_bw) + lat
    return out
