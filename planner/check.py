"""check_plan: the whole Plan contract asserted, the schedule derived again and compared row for row.

Notation (docs/design.md): P ranks, nB blocks, S stages; schedule rows ``(stage, src, dst, kind, block)``
(planner/schedule.py). ``make_plan`` runs it on every plan by default (``check=True``); the tests run
it on every plan they make.
"""

from __future__ import annotations

import numpy as np
import torch

from .schedule import (BWD_KINDS, FWD_KINDS, KIND_DKV, KIND_DO, KIND_DQ, KIND_KV, KIND_NAMES, KIND_Q,
                       as_relay_table, derive_schedule, int_array)

DENSE_LOOKUP_CELLS = 1 << 22  # check_plan looks receives up in a dense table up to this many cells


class PlanConsistencyError(AssertionError):
    """A plan whose tiles, homes, stages and transfers do not agree (a planner bug)."""


def check_plan(plan) -> None:
    """Raise PlanConsistencyError unless ``plan`` is internally consistent:

    homes and local blocks agree (every block on exactly one rank, local order ascending); tiles are
    unique and sorted; stage-0 tiles read only home blocks; every tile's q and kv block is on its
    rank by its stage (home, or received at a stage <= the tile's); nothing is received twice; Q,
    OUT, DO and DQ go between the block's home and the tile rank; a KV transfer comes from the
    home or from a rank that received the block in a strictly earlier stage (``kv_relay`` lists
    exactly those); DKV partials form chains that end at the home with strictly increasing stages;
    the schedule equals the one derived from the placement and relay table, which is in wire order
    (sorted by stage, src, dst, kind, block), so for every (stage, src, dst) the sender's view of the
    rows is the receiver's, in the same order: both read the same slice of the same table.
    """
    P, nB, S = plan.world_size, plan.num_blocks, plan.num_stages

    def fail(msg: str) -> None:
        raise PlanConsistencyError(f"inconsistent plan ({plan.strategy}, P={P}, nB={nB}): {msg}")

    home = plan.block_home.numpy().astype(np.int64)
    if home.shape != (nB,) or (nB and (home.min() < 0 or home.max() >= P)):
        fail(f"block_home must be [nB]={nB} ranks in [0, {P}), got shape {tuple(home.shape)}")
    if len(plan.local_blocks) != P:
        fail(f"local_blocks has {len(plan.local_blocks)} entries for world size {P}")
    for r, blocks in enumerate(plan.local_blocks):
        expect = np.flatnonzero(home == r)
        if not np.array_equal(blocks.numpy().astype(np.int64), expect):
            fail(f"local_blocks[{r}] disagrees with block_home")

    # The per-tile arrays as they are (int32 in a built plan; keys below are computed in int64): five
    # int64 copies of them were a third of this check's fresh pages, each page a fault on this VM.
    q, kv, rank, stage, stage_bwd = (int_array(t) for t in (plan.tile_q, plan.tile_kv, plan.tile_rank,
                                                              plan.tile_stage, plan.tile_stage_bwd))
    key = q.astype(np.int64)
    key *= nB
    key += kv
    if key.size and np.any(np.diff(key) <= 0):
        fail("tiles are not unique and sorted by (q, kv)")
    if rank.size and (rank.min() < 0 or rank.max() >= P):
        fail("tile_rank out of range")
    if stage.size and (stage.min() < 0 or stage.max() >= S):
        fail(f"tile_stage out of range [0, {S})")
    if stage_bwd.shape != stage.shape or (stage_bwd.size and (stage_bwd.min() < 0 or stage_bwd.max() >= S)):
        fail(f"tile_stage_bwd must be [ntiles] stages in [0, {S})")
    # (each tile's remote inputs, computed once: the checks below and the derived schedule read them)
    remote_q, remote_kv = home[q] != rank, home[kv] != rank
    if np.any((stage == 0) & (remote_q | remote_kv)):
        fail("a stage-0 tile reads a block its rank does not own")

    fwd = plan.schedule.fwd.numpy().astype(np.int64)
    bwd = plan.schedule.bwd.numpy().astype(np.int64)
    for name, t, kinds in (("fwd", fwd, FWD_KINDS), ("bwd", bwd, BWD_KINDS)):
        if t.ndim != 2 or t.shape[1] != 5:
            fail(f"{name} table must be [m, 5] rows (stage, src, dst, kind, block), got shape {tuple(t.shape)}")
        if t.size and (t[:, 0].min() < 0 or t[:, 0].max() > S):
            fail(f"{name} transfer stage outside [0, {S}]")
        if t.size and (t[:, 1:3].min() < 0 or t[:, 1:3].max() >= P or t[:, 4].min() < 0 or t[:, 4].max() >= nB):
            fail(f"{name} transfer rank outside [0, {P}) or block outside [0, {nB})")
        if not np.isin(t[:, 3], kinds).all():
            fail(f"{name} transfer of a kind other than {', '.join(KIND_NAMES[k] for k in kinds)}")
        if np.any(t[:, 1] == t[:, 2]):
            fail(f"{name} transfer from a rank to itself")
    incoming = np.isin(fwd[:, 3], (KIND_Q, KIND_KV))
    early = incoming & (fwd[:, 0] == 0)
    if np.any(early):
        s, src, dst, kind, b = fwd[np.flatnonzero(early)[0]].tolist()
        reads = (rank == dst) & ((kv if kind == KIND_KV else q) == b)
        if kind == KIND_KV and not reads.any():
            fail(f"rank {dst} is a transit source of KV block {b} (it computes no tile of it) but a rank it "
                 f"relays the block to needs it in stage 1: there is no earlier stage to bring it in")
        fail("a forward input transfer in stage 0")
    if np.any((fwd[:, 3] == KIND_Q) & (fwd[:, 1] != home[fwd[:, 4]])):
        fail("a Q transfer does not come from the block's home (only KV may be relayed)")
    if np.any(fwd[~incoming, 2] != home[fwd[~incoming, 4]]):
        fail("an OUT partial does not go to the block's home")

    # Each tile's remote inputs: received (once) at a stage no later than the tile's.
    recv_key = (fwd[incoming, 2] * 2 + fwd[incoming, 3]) * nB + fwd[incoming, 4]
    if np.unique(recv_key).size != recv_key.size:
        fail("a block is received twice by the same rank")
    recv_stage = fwd[incoming, 0]
    # (a dense [P * 2 * nB] table where it is small: a gather per tile instead of a binary search)
    dense = None
    if P * 2 * nB <= max(DENSE_LOOKUP_CELLS, 4 * q.size):
        dense = np.full(P * 2 * nB, -1, dtype=np.int64)
        dense[recv_key] = recv_stage
    else:
        order = np.argsort(recv_key)
        recv_key, recv_stage = recv_key[order], recv_stage[order]

    def received_at(key: np.ndarray) -> np.ndarray:
        """Stage in which each (rank * 2 + kind) * nB + block key is received, -1 if never."""
        if dense is not None:
            return dense[key]
        if recv_key.size == 0:
            return np.full(key.size, -1, dtype=np.int64)
        pos = np.minimum(np.searchsorted(recv_key, key), recv_key.size - 1)
        return np.where(recv_key[pos] == key, recv_stage[pos], -1)

    for kind, block, remote in ((KIND_Q, q, remote_q), (KIND_KV, kv, remote_kv)):
        got = received_at((rank[remote].astype(np.int64) * 2 + kind) * nB + block[remote])
        if np.any(got < 0):
            fail(f"a tile's {KIND_NAMES[kind]} block never reaches its rank")
        if np.any(got > stage[remote]):
            fail(f"a tile's {KIND_NAMES[kind]} block arrives after the tile's stage")

    # Relayed KV: the source holds the block strictly before it forwards it (the exchange of stage s
    # is posted before stage s - 1 computes, so only blocks received by stage s - 1 can go out).
    kv_rows = fwd[fwd[:, 3] == KIND_KV]
    relayed = kv_rows[kv_rows[:, 1] != home[kv_rows[:, 4]]]
    held = received_at((relayed[:, 1] * 2 + KIND_KV) * nB + relayed[:, 4])
    if np.any((held < 0) | (held >= relayed[:, 0])):
        i = int(np.flatnonzero((held < 0) | (held >= relayed[:, 0]))[0])
        fail(f"rank {relayed[i, 1]} relays KV block {relayed[i, 4]} in stage {relayed[i, 0]} but holds it "
             f"{'never' if held[i] < 0 else f'only from stage {held[i]}'}")
    relay = as_relay_table(getattr(plan, "kv_relay", None))
    relay_key = relay[:, 0] * P + relay[:, 1]
    if relay_key.size and (np.any(np.diff(relay_key) <= 0) or np.any(relay[:, 2] == home[relay[:, 0]])):
        fail("kv_relay rows must be unique, sorted by (block, dst) and name a source other than the home")
    if relay.shape[0] != relayed.shape[0]:
        fail(f"kv_relay has {relay.shape[0]} rows but the schedule relays {relayed.shape[0]} KV transfers")

    # Backward: DO from and DQ to the home; DKV partials travel along chains that end at the home,
    # each hop to a rank that forwards the block's partial in a strictly later stage.
    if np.any((bwd[:, 3] == KIND_DO) & (bwd[:, 1] != home[bwd[:, 4]])):
        fail("a DO transfer does not come from the block's home")
    if np.any((bwd[:, 3] == KIND_DQ) & (bwd[:, 2] != home[bwd[:, 4]])):
        fail("a DQ partial does not go to the block's home")
    dkv = bwd[bwd[:, 3] == KIND_DKV]
    send_key = dkv[:, 1] * nB + dkv[:, 4]
    order = np.argsort(send_key)
    send_key, send_stage = send_key[order], dkv[order, 0]
    if send_key.size and np.any(np.diff(send_key) == 0):
        fail("a rank sends its DKV partial of a block twice")
    hop = dkv[dkv[:, 2] != home[dkv[:, 4]]]
    if hop.shape[0]:
        key = hop[:, 2] * nB + hop[:, 4]
        pos = np.minimum(np.searchsorted(send_key, key), send_key.size - 1)
        later = (send_key[pos] == key) & (send_stage[pos] > hop[:, 0])
        if not np.all(later):
            i = int(np.flatnonzero(~later)[0])
            fail(f"rank {hop[i, 1]} sends its DKV partial of block {hop[i, 4]} to rank {hop[i, 2]} in stage "
                 f"{hop[i, 0]}, which does not forward it in a later stage (a chain must end at the home "
                 f"with increasing stages)")

    if np.any((bwd[:, 3] == KIND_DO) & (bwd[:, 0] == 0)):
        fail("a DO transfer in stage 0 (backward inputs travel behind an earlier stage's compute)")
    derived = derive_schedule(home, q, kv, rank, stage, num_blocks=nB, num_stages=S, world_size=P, kv_relay=relay,
                              tile_stage_bwd=stage_bwd, remote=(remote_q, remote_kv))
    for direction in ("fwd", "bwd"):
        if not torch.equal(derived.table(direction), plan.schedule.table(direction)):
            fail(f"{direction} schedule differs from the one derived from the placement")
