"""CommSchedule: every transfer a Plan implies, derived once from its placement.

Notation (docs/design.md): P ranks, nB blocks of B tokens (last one short), a tile (qb, kb) runs on
``tile_rank`` in ``tile_stage``; ``block_home[b]`` owns the q, k, v, out and gradients of block b.

Tables are int32 ``[m, 5]`` with columns ``(stage, src, dst, kind, block)``, sorted
lexicographically; that order is the wire order, so a sender and its receiver enumerate the
same rows for their (stage, peer) in the same sequence.

Rules (the executor and ``Plan.stats()`` both follow exactly these rows):

* Q / KV (forward): a rank receives each remote block its tiles read, once, in the first stage
  that needs it; the source is always the block's home (no relaying).
* OUT: one partial (out, lse) per remote q-block the rank computed tiles of, sent to the home at
  ``last compute stage + 1`` (may equal ``num_stages``).
* DO (backward): dO + lse + delta of such a q-block, home -> rank, at its first compute stage.
* DQ / DKV (backward): fp32 partial gradients of remote q-blocks / kv-blocks back to the home at
  ``last compute stage + 1``. Q/KV received in the forward are kept, never re-fetched.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

KIND_Q, KIND_KV, KIND_OUT, KIND_DO, KIND_DQ, KIND_DKV = range(6)
KIND_NAMES = ("Q", "KV", "OUT", "DO", "DQ", "DKV")
FWD_KINDS = (KIND_Q, KIND_KV, KIND_OUT)
BWD_KINDS = (KIND_DO, KIND_DQ, KIND_DKV)
COLUMNS = ("stage", "src", "dst", "kind", "block")


_MAX_VIEW_CHECKS = 256  # per-rank view comparison through sends()/recvs() up to this many (rank, stage) pairs


class PlanConsistencyError(AssertionError):
    """A plan whose tiles, homes, stages and transfers do not agree (a planner bug)."""


def payload_bytes(kind, block_len, *, num_q_heads: int, num_kv_heads: int, head_dim: int, element_size: int):
    """Bytes of one transfer of ``kind`` for a block of ``block_len`` valid tokens (numpy-vectorized).

    Activations travel in the model dtype (``element_size`` bytes); lse, delta and all gradient
    partials are fp32 (4 bytes), as the executor sends them.
    """
    kind = np.asarray(kind, dtype=np.int64)
    rows = np.asarray(block_len, dtype=np.int64)
    q_elems = rows * num_q_heads * head_dim
    kv_elems = 2 * rows * num_kv_heads * head_dim
    kind, rows = np.broadcast_arrays(kind, rows)
    act = element_size
    per_kind = [
        q_elems * act,  # Q
        kv_elems * act,  # KV
        q_elems * act + rows * num_q_heads * 4,  # OUT: out + lse
        q_elems * act + 2 * rows * num_q_heads * 4,  # DO: dout + lse + delta
        q_elems * 4,  # DQ
        kv_elems * 4,  # DKV
    ]
    return np.select([kind == k for k in range(6)], [np.broadcast_to(v, kind.shape) for v in per_kind], -1)


@dataclass(frozen=True, eq=False)
class CommSchedule:
    """Forward and backward transfer tables of a Plan (see module docstring)."""

    fwd: torch.Tensor  # int32 [m_fwd, 5], kinds Q, KV, OUT
    bwd: torch.Tensor  # int32 [m_bwd, 5], kinds DO, DQ, DKV
    num_stages: int
    world_size: int

    def table(self, direction: str) -> torch.Tensor:
        """The ``"fwd"`` or ``"bwd"`` table."""
        if direction not in ("fwd", "bwd"):
            raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")
        return self.fwd if direction == "fwd" else self.bwd

    def rows(self, direction: str, *, stage=None, src=None, dst=None, kind=None) -> torch.Tensor:
        """Rows of one table filtered by any of stage / src / dst / kind (wire order kept)."""
        t = self.table(direction)
        keep = torch.ones(t.shape[0], dtype=torch.bool)
        for col, value in ((0, stage), (1, src), (2, dst), (3, kind)):
            if value is not None:
                keep &= t[:, col] == int(value)
        return t[keep]

    def sends(self, rank: int, stage: int, direction: str = "fwd") -> torch.Tensor:
        """What ``rank`` sends in ``stage``, in wire order."""
        return self.rows(direction, stage=stage, src=rank)

    def recvs(self, rank: int, stage: int, direction: str = "fwd") -> torch.Tensor:
        """What ``rank`` receives in ``stage``, in wire order."""
        return self.rows(direction, stage=stage, dst=rank)

    def bytes(self, rows, plan) -> np.ndarray | int:
        """Payload bytes of one row ``(stage, src, dst, kind, block)`` (an int) or of a ``[m, 5]``
        table (int64 array), for the shapes and dtype of ``plan``."""
        arr = np.asarray(rows.numpy() if isinstance(rows, torch.Tensor) else rows, dtype=np.int64)
        single = arr.ndim == 1
        arr = arr.reshape(-1, 5)
        block = arr[:, 4]
        block_len = np.minimum(plan.block_size, plan.total_len - block * plan.block_size)
        out = payload_bytes(
            arr[:, 3],
            block_len,
            num_q_heads=plan.num_q_heads,
            num_kv_heads=plan.num_kv_heads,
            head_dim=plan.head_dim,
            element_size=torch.empty((), dtype=plan.dtype).element_size(),
        )
        return int(out[0]) if single else out


def _groups(rank: np.ndarray, block: np.ndarray, stage: np.ndarray, num_blocks: int):
    """Unique (rank, block) pairs, ascending, with the first and last stage in which they occur.

    Dense over the [P, nB] grid instead of sorting the (large) tile arrays: entries are written in
    stage order, so the last write to a cell is the latest stage (and in reverse order the earliest).
    """
    if rank.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty, empty
    key = rank * num_blocks + block
    size = int(key.max()) + 1
    by_stage = np.argsort(stage.astype(np.int16) if stage.max() < 2**15 else stage, kind="stable")
    first = np.empty(size, dtype=np.int64)
    last = np.empty(size, dtype=np.int64)
    first[key[by_stage[::-1]]] = stage[by_stage[::-1]]
    last[key[by_stage]] = stage[by_stage]
    present = np.zeros(size, dtype=bool)
    present[key] = True
    uniq = np.flatnonzero(present)
    return uniq // num_blocks, uniq % num_blocks, first[uniq], last[uniq]


def _rows(stage, src, dst, kind: int, block) -> np.ndarray:
    return np.stack([stage, src, dst, np.full_like(stage, kind), block], axis=1)


def _sorted_table(parts: list[np.ndarray]) -> torch.Tensor:
    table = np.concatenate(parts, axis=0) if parts else np.zeros((0, 5), dtype=np.int64)
    order = np.lexsort(tuple(table[:, c] for c in (4, 3, 2, 1, 0)))
    return torch.from_numpy(np.ascontiguousarray(table[order]).astype(np.int32))


def derive_schedule(block_home, tile_q, tile_kv, tile_rank, tile_stage, *, num_blocks: int,
                    num_stages: int, world_size: int) -> CommSchedule:
    """Build the CommSchedule of a placement (numpy or torch int inputs)."""
    home = np.asarray(block_home, dtype=np.int64)
    q = np.asarray(tile_q, dtype=np.int64)
    kv = np.asarray(tile_kv, dtype=np.int64)
    rank = np.asarray(tile_rank, dtype=np.int64)
    stage = np.asarray(tile_stage, dtype=np.int64)

    remote_q = home[q] != rank
    r, b, first, last = _groups(rank[remote_q], q[remote_q], stage[remote_q], num_blocks)
    q_in = _rows(first, home[b], r, KIND_Q, b)
    out = _rows(last + 1, r, home[b], KIND_OUT, b)
    d_out = _rows(first, home[b], r, KIND_DO, b)
    d_q = _rows(last + 1, r, home[b], KIND_DQ, b)

    remote_kv = home[kv] != rank
    r, b, first, last = _groups(rank[remote_kv], kv[remote_kv], stage[remote_kv], num_blocks)
    kv_in = _rows(first, home[b], r, KIND_KV, b)
    d_kv = _rows(last + 1, r, home[b], KIND_DKV, b)

    return CommSchedule(
        fwd=_sorted_table([q_in, kv_in, out]),
        bwd=_sorted_table([d_out, d_q, d_kv]),
        num_stages=int(num_stages),
        world_size=int(world_size),
    )


def check_plan(plan) -> None:
    """Raise PlanConsistencyError unless ``plan`` is internally consistent:

    homes and local blocks agree (every block on exactly one rank, local order ascending); tiles are
    unique and sorted; stage-0 tiles read only home blocks; the schedule equals the one derived from
    the placement; every tile's q and kv block is on its rank by its stage (home, or received at a
    stage <= the tile's); nothing is received twice or without use; every transfer's source/target
    is the block's home; and for every (stage, src, dst) the sender's view of the rows equals the
    receiver's view, in the same order.
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

    q = plan.tile_q.numpy().astype(np.int64)
    kv = plan.tile_kv.numpy().astype(np.int64)
    rank = plan.tile_rank.numpy().astype(np.int64)
    stage = plan.tile_stage.numpy().astype(np.int64)
    key = q * nB + kv
    if key.size and np.any(np.diff(key) <= 0):
        fail("tiles are not unique and sorted by (q, kv)")
    if rank.size and (rank.min() < 0 or rank.max() >= P):
        fail("tile_rank out of range")
    if stage.size and (stage.min() < 0 or stage.max() >= S):
        fail(f"tile_stage out of range [0, {S})")
    at_home = (home[q] == rank) & (home[kv] == rank)
    if np.any((stage == 0) & ~at_home):
        fail("a stage-0 tile reads a block its rank does not own")

    derived = derive_schedule(home, q, kv, rank, stage, num_blocks=nB, num_stages=S, world_size=P)
    for direction in ("fwd", "bwd"):
        if not torch.equal(derived.table(direction), plan.schedule.table(direction)):
            fail(f"{direction} schedule differs from the one derived from the placement")

    fwd = plan.schedule.fwd.numpy().astype(np.int64)
    bwd = plan.schedule.bwd.numpy().astype(np.int64)
    for name, t in (("fwd", fwd), ("bwd", bwd)):
        if t.size and (t[:, 0].min() < 0 or t[:, 0].max() > S):
            fail(f"{name} transfer stage outside [0, {S}]")
        if np.any(t[:, 1] == t[:, 2]):
            fail(f"{name} transfer from a rank to itself")
    incoming = np.isin(fwd[:, 3], (KIND_Q, KIND_KV))
    if np.any(fwd[incoming, 0] == 0):
        fail("a forward input transfer in stage 0")
    if np.any(fwd[incoming, 1] != home[fwd[incoming, 4]]):
        fail("an input transfer does not come from the block's home")
    if np.any(fwd[~incoming, 2] != home[fwd[~incoming, 4]]):
        fail("an OUT partial does not go to the block's home")

    # Each tile's remote inputs: received (once) at a stage no later than the tile's.
    recv_key = (fwd[incoming, 2] * 2 + fwd[incoming, 3]) * nB + fwd[incoming, 4]
    if np.unique(recv_key).size != recv_key.size:
        fail("a block is received twice by the same rank")
    order = np.argsort(recv_key)
    recv_key, recv_stage = recv_key[order], fwd[incoming, 0][order]
    for kind, block in ((KIND_Q, q), (KIND_KV, kv)):
        remote = home[block] != rank
        need = (rank[remote] * 2 + kind) * nB + block[remote]
        pos = np.searchsorted(recv_key, need)
        found = (pos < recv_key.size) & (recv_key[np.minimum(pos, recv_key.size - 1)] == need)
        if not np.all(found):
            fail(f"a tile's {KIND_NAMES[kind]} block never reaches its rank")
        if np.any(recv_stage[pos] > stage[remote]):
            fail(f"a tile's {KIND_NAMES[kind]} block arrives after the tile's stage")

    # Per-rank views, as the executor reads them: every row appears exactly once among the senders'
    # views and once among the receivers' views, and a (src, dst) pair lists the same rows, in the
    # same order, on both sides.
    sched = plan.schedule
    for direction, t in (("fwd", fwd), ("bwd", bwd)):
        if P * (S + 1) > _MAX_VIEW_CHECKS:
            # Large plans: same property without P * S filtered copies - each (stage, src, dst) group
            # is contiguous in the sorted table, so both sides read it as one slice.
            key = (t[:, 0] * P + t[:, 1]) * P + t[:, 2]
            if key.size and np.any(np.diff(key) < 0):
                fail(f"{direction} table is not sorted by (stage, src, dst)")
            continue
        for s in range(S + 1):
            sent = [sched.sends(r, s, direction).numpy().astype(np.int64) for r in range(P)]
            got = [sched.recvs(r, s, direction).numpy().astype(np.int64) for r in range(P)]
            expect = t[t[:, 0] == s]
            for views, col in ((sent, 2), (got, 1)):
                merged = np.concatenate(views) if views else np.zeros((0, 5), np.int64)
                if merged.shape[0] != expect.shape[0]:
                    fail(f"{direction} stage {s}: per-rank views hold {merged.shape[0]} rows, table {expect.shape[0]}")
            for r in range(P):
                for peer in np.unique(sent[r][:, 2]):
                    mine = sent[r][sent[r][:, 2] == peer]
                    theirs = got[peer][got[peer][:, 1] == r]
                    if not np.array_equal(mine, theirs):
                        fail(f"{direction} stage {s}: rank {r}'s sends to {peer} differ from {peer}'s receives")
