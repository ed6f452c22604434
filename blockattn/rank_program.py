"""The rank program: what one rank needs to run a plan - its buffer layout, per-stage tile lists and the
messages of every exchange - built from the plan's arrays.

Notation (docs/design.md): T tokens, B block size, nB blocks, P ranks, S = plan.num_stages. A rank's q and
kv buffers hold its own tokens (rows ``[0, n_local)``, ``plan.local_tokens(rank)`` order) followed by the
blocks it receives in the forward, in schedule row order (Q blocks in the q buffer, KV blocks in the kv
buffer). A schedule row is (stage, src, dst, kind, block); exchange j carries the inputs of stage j + 1
and the results of stage j (blockattn/distributed.py).

Why built in numpy and moved in two copies: a new batch has a new plan, so every training step builds its
rank's program before its first attention layer runs. Built with a torch call per peer, section and
block (and a ``.to(device)`` per tensor) it took 17-80 ms a rank at 128K tokens (8-32 ranks, median over
the ranks), several times the plan's own 4-5 ms; here the rows are grouped with a sort, the tile lists
are built on the host (``TileList.from_tiles``, in numpy) and every index tensor reaches the device in one
copy per dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from blockattn.planner.placement import concatenated_ranges
from blockattn.planner.schedule import KIND_DKV, KIND_DO, KIND_KV, KIND_NAMES, KIND_Q

__all__ = ["RankProgram", "build_rank_program", "INPUT_KINDS"]

INPUT_KINDS = {"fwd": (KIND_Q, KIND_KV), "bwd": (KIND_DO,)}  # a direction's inputs (the rest are results)


@dataclass(frozen=True)
class _Section:
    """All blocks of one kind in one message: their token rows in this rank's buffers."""

    kind: int
    blocks: torch.Tensor  # int64 global block indices, row order
    rows: torch.Tensor  # int64 token rows in this rank's buffer (concatenated over blocks)


@dataclass(frozen=True)
class _Exchange:
    sends: dict  # peer -> list[_Section]  (rows: where to read)
    recvs: dict  # peer -> list[_Section]  (rows: where to write / fold)
    recv_nbytes: dict  # peer -> int
    send_nbytes: dict  # peer -> int


@dataclass(frozen=True)
class _Stage:
    q_tiles: object  # TileList (q-major: forward, dQ) or None when the rank has no tile in this stage
    kv_tiles: object  # TileList (kv-major: dK/dV; backward stages only) or None


@dataclass(frozen=True)
class RankProgram:
    """Everything one rank needs to run a plan: buffer layout, per-stage tile lists, exchanges."""

    rank: int
    n_local: int
    q_buf_rows: int
    kv_buf_rows: int
    stages: tuple  # forward: _Stage per stage (q-major tiles)
    stages_bwd: tuple  # backward: _Stage per backward stage (q-major and kv-major tiles)
    exchanges: dict  # "fwd"/"bwd" -> tuple[_Exchange] of length S + 1
    planned_bytes: dict  # "fwd"/"bwd" -> bytes this rank sends
    grad_dtype: torch.dtype  # dQ / dK / dV partials on the wire (plan.grad_comm_dtype)


def _partial_bits_index(bm, tq: np.ndarray, tkv: np.ndarray) -> np.ndarray | None:
    """Position of each tile in the BlockMask's q-major partial list (the KernelMask.bits index), -1 for
    FULL tiles; None when the mask has intervals (kernels then need no bits)."""
    if bm.row_intervals is not None or bm.part_bits is None:
        return None
    nB = bm.num_blocks
    ptr = bm.part_kv_ptr.numpy().astype(np.int64)
    keys = np.repeat(np.arange(nB, dtype=np.int64), np.diff(ptr)) * nB + bm.part_kv_idx.numpy().astype(np.int64)
    want = tq * nB + tkv
    if keys.size == 0:
        return np.full(want.size, -1, dtype=np.int64)
    pos = np.minimum(np.searchsorted(keys, want), keys.size - 1)
    return np.where(keys[pos] == want, pos, -1)


def _received_rows(table: np.ndarray, me: int, kind: int, local: np.ndarray, local_start: np.ndarray,
                   lens: np.ndarray, what: str):
    """(buffer row of every block [nB] or -1, arrival stage [nB] or -1 (0: local), rows in all) of rank
    ``me``'s ``kind`` buffer: its ``local`` blocks at ``local_start``, then the blocks it receives in
    ``table``, in row order."""
    nB = lens.size
    row, arrival = np.full(nB, -1, dtype=np.int64), np.full(nB, -1, dtype=np.int64)
    row[local], arrival[local] = local_start, 0
    got = table[(table[:, 2] == me) & (table[:, 3] == kind)]
    blocks = got[:, 4]
    values, counts = np.unique(np.concatenate((local, blocks)), return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"{what}: rank {me} receives {KIND_NAMES[kind]} block {int(values[counts > 1][0])} twice")
    first_row = int(lens[local].sum())
    ends = first_row + np.cumsum(lens[blocks])
    row[blocks] = ends - lens[blocks]
    arrival[blocks] = got[:, 0]
    return row, arrival, int(ends[-1]) if blocks.size else first_row


def build_rank_program(plan, me: int, bm, device: torch.device) -> RankProgram:
    """Rank `me`'s buffer layout, per-stage tile lists and exchanges for `plan` (bm: its BlockMask)."""
    B, nB, T, S = plan.block_size, plan.num_blocks, plan.total_len, plan.num_stages
    lens = np.minimum(B, T - np.arange(nB, dtype=np.int64) * B)
    local = plan.local_blocks[me].numpy().astype(np.int64)
    local_start = np.cumsum(lens[local]) - lens[local]
    n_local = int(lens[local].sum())
    expect_tokens = concatenated_ranges(local * B, lens[local])
    if not np.array_equal(plan.local_tokens(me).cpu().numpy().astype(np.int64), expect_tokens):
        raise ValueError(f"plan.local_tokens({me}) does not list the tokens of plan.local_blocks[{me}] in order")

    # Buffer rows of every block on this rank: local first, then received blocks in schedule row order.
    fwd, bwd = (plan.schedule.fwd.numpy().astype(np.int64), plan.schedule.bwd.numpy().astype(np.int64))
    what = f"plan {plan.strategy}"
    q_row, arrival_q, q_end = _received_rows(fwd, me, KIND_Q, local, local_start, lens, what)
    kv_row, arrival_kv, kv_end = _received_rows(fwd, me, KIND_KV, local, local_start, lens, what)
    # The backward's only inputs: dO (+ lse, delta) of remote q-blocks, in their first backward stage.
    do = bwd[(bwd[:, 2] == me) & (bwd[:, 3] == KIND_DO)]
    arrival_do = np.full(nB, -1, dtype=np.int64)
    arrival_do[local] = 0
    arrival_do[do[:, 4]] = do[:, 0]

    # Per-stage tile lists in buffer coordinates: forward stages (q-major) and backward stages
    # (q-major for dQ, kv-major for dK/dV); a tile's backward stage is its own (plan.tile_stage_bwd).
    mine = np.flatnonzero(plan.tile_rank.numpy() == me)
    tq, tkv = plan.tile_q.numpy()[mine].astype(np.int64), plan.tile_kv.numpy()[mine].astype(np.int64)
    tfull = plan.tile_full.numpy()[mine]
    bits = _partial_bits_index(bm, tq, tkv)
    lists = _TileLists(B)

    def stage_lists(stage_of: np.ndarray, s: int, backward: bool) -> _Stage:
        sel = np.flatnonzero(stage_of == s)
        if sel.size == 0:
            return _Stage(None, None)
        q, kv = tq[sel], tkv[sel]
        if backward:  # Q and KV were received in the forward and kept; dO must be here by now
            late = (arrival_q[q] < 0) | (arrival_kv[kv] < 0) | (arrival_do[q] < 0) | (arrival_do[q] > s)
        else:
            late = (arrival_q[q] < 0) | (arrival_q[q] > s) | (arrival_kv[kv] < 0) | (arrival_kv[kv] > s)
        if late.any():
            i = int(np.flatnonzero(late)[0])
            raise ValueError(
                f"plan {plan.strategy}: rank {me} computes tile ({int(q[i])}, {int(kv[i])}) in "
                f"{'backward' if backward else 'forward'} stage {s} but does not hold its inputs by then "
                f"(inconsistent plan; run planner.schedule.check_plan)")
        b = None if bits is None else bits[sel]
        return _Stage(lists.add(q, kv, tfull[sel], b, q_row, kv_row),
                      lists.add(kv, q, tfull[sel], b, kv_row, q_row) if backward else None)

    stage_fwd = plan.tile_stage.numpy()[mine]
    stage_bwd = plan.tile_stage_bwd.numpy()[mine]
    stages = [stage_lists(stage_fwd, s, False) for s in range(S)]
    stages_bwd = [stage_lists(stage_bwd, s, True) for s in range(S)]

    exchanges, planned = {}, {}
    for direction, table in (("fwd", fwd), ("bwd", bwd)):
        _check_stages(plan, direction, table)
        # payload bytes of every row by the plan's own rule (planner/schedule.py payload_bytes, as stats())
        nbytes = plan.transfer_bytes(direction)
        mine_rows = np.flatnonzero((table[:, 1] == me) | (table[:, 2] == me))  # (each exchange reads only these)
        exchanges[direction] = [_exchange(table[mine_rows], nbytes[mine_rows], direction, j, me, q_row, kv_row, lens)
                                for j in range(S + 1)]
        planned[direction] = int(nbytes[table[:, 1] == me].sum())

    # every index tensor to the device in one copy per dtype (a copy per tensor was ~1000 for a rank at 128K)
    to_device = _Mover(device)
    tile_lists = lists.on(to_device)
    stages = tuple(_Stage(tile_lists(st.q_tiles), tile_lists(st.kv_tiles)) for st in stages)
    stages_bwd = tuple(_Stage(tile_lists(st.q_tiles), tile_lists(st.kv_tiles)) for st in stages_bwd)
    sections = [sec for d in exchanges.values() for ex in d for side in (ex.sends, ex.recvs)
                for secs in side.values() for sec in secs]
    moved = iter(to_device.move([sec.rows for sec in sections]))
    rows_of = {id(sec): next(moved) for sec in sections}

    def placed(side: dict) -> dict:
        return {peer: [_Section(sec.kind, torch.from_numpy(sec.blocks), rows_of[id(sec)]) for sec in secs]
                for peer, secs in side.items()}

    exchanges = {d: tuple(_Exchange(placed(ex.sends), placed(ex.recvs), ex.recv_nbytes, ex.send_nbytes) for ex in exs)
                 for d, exs in exchanges.items()}
    return RankProgram(me, n_local, q_end, kv_end, stages, stages_bwd, exchanges, planned, plan.grad_comm_dtype)


def _check_stages(plan, direction: str, table: np.ndarray) -> None:
    """Inputs must arrive in stages 1..S-1 and results leave in stages 1..S (the executor's contract)."""
    S = plan.num_stages
    is_input = np.isin(table[:, 3], INPUT_KINDS[direction])
    last = np.where(is_input, S - 1, S)
    bad = (table[:, 0] < 1) | (table[:, 0] > last)
    if bad.any():
        row = table[np.flatnonzero(bad)[0]].tolist()
        raise ValueError(f"plan {plan.strategy}: {direction} transfer (stage, src, dst, kind, block)={row} has a stage "
                         f"outside the executor's range (inputs 1..{S - 1}, results 1..{S})")


def _exchange(table: np.ndarray, table_nbytes: np.ndarray, direction: str, j: int, me: int, q_row: np.ndarray,
              kv_row: np.ndarray, lens: np.ndarray) -> _Exchange:
    """Exchange j of `direction`: inputs of stage j + 1 and results of stage j, as sections per peer
    (``table``: the schedule rows rank ``me`` sends or receives, in row order; ``table_nbytes``: the payload
    bytes of each); sections hold host arrays here."""
    is_input = np.isin(table[:, 3], INPUT_KINDS[direction])
    in_ex = (is_input & (table[:, 0] == j + 1)) | (~is_input & (table[:, 0] == j))
    sides = []
    for end, peer_col in ((1, 2), (2, 1)):  # (my column, the peer's): sends, then receives
        pick = np.flatnonzero(in_ex & (table[:, end] == me))
        # by peer, keeping row order inside a peer's message: rows are sorted by (stage, src, dst, kind,
        # block), so each (stage, kind) of a message is one run
        pick = pick[np.argsort(table[pick, peer_col], kind="stable")]
        rows, nbytes = table[pick], table_nbytes[pick]
        peer, group = rows[:, peer_col], rows[:, 0] * 8 + rows[:, 3]
        new = np.ones(rows.shape[0], dtype=bool)
        new[1:] = (peer[1:] != peer[:-1]) | (group[1:] != group[:-1])
        starts = np.flatnonzero(new)
        ends = np.append(starts[1:], rows.shape[0])
        messages, message_bytes = {}, {}
        for a, b in zip(starts.tolist(), ends.tolist()):
            p, kind, blocks = int(peer[a]), int(rows[a, 3]), np.ascontiguousarray(rows[a:b, 4])
            # q buffer for Q/OUT/DO/DQ, kv buffer for KV/DKV. Local blocks sit at their local rows
            # (q_row[local] == kv_row[local] == local_start), received ones at their gathered rows,
            # so one lookup serves the home, the tile rank and a relay (which forwards received KV
            # and sums its children's DKV partials into its own rows of the block) alike.
            first = (kv_row if kind in (KIND_KV, KIND_DKV) else q_row)[blocks]
            if (first < 0).any():
                raise ValueError(f"{direction} exchange {j}: rank {me} has no buffer row for "
                                 f"{KIND_NAMES[kind]} blocks {blocks[first < 0].tolist()}")
            messages.setdefault(p, []).append(_Section(kind, blocks, concatenated_ranges(first, lens[blocks])))
            message_bytes[p] = message_bytes.get(p, 0) + int(nbytes[a:b].sum())
        sides.append((messages, message_bytes))
    (sends, send_nbytes), (recvs, recv_nbytes) = sides
    return _Exchange(sends, recvs, recv_nbytes, send_nbytes)


class _TileLists:
    """The rank's tile lists, built on the host (``add``) and moved to the device together (``on``)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.built = []

    def add(self, work, partner, full, bits, work_row_of, partner_row_of):
        """A host TileList of (work block, partner block) tiles in buffer coordinates (kernels/tiles.py)."""
        from blockattn.kernels import TileList

        tiles = TileList.from_tiles(work, partner, full, block_size=self.block_size, work_row_of=work_row_of,
                                    partner_row_of=partner_row_of, bits_index=bits)
        self.built.append(tiles)
        return tiles

    def on(self, mover: "_Mover"):
        """A function from each host TileList (or None) to its copy on the mover's device."""
        from blockattn.kernels import TileList

        if mover.device.type == "cpu":
            return lambda tiles: tiles
        fields = list(TileList.__dataclass_fields__)
        moved = iter(mover.move([getattr(t, f) for t in self.built for f in fields]))
        copies = {id(t): TileList(*(next(moved) for _ in fields)) for t in self.built}
        return lambda tiles: None if tiles is None else copies[id(tiles)]


class _Mover:
    """Moves many small host arrays / tensors to one device in one copy per dtype (views of it come back)."""

    ALIGN = 16  # bytes: every view starts on a 16-byte boundary, as a tensor of its own would

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    def move(self, items: list) -> list:
        tensors = [torch.from_numpy(x) if isinstance(x, np.ndarray) else x for x in items]
        if self.device.type == "cpu":
            return tensors
        out = [None] * len(tensors)
        for dtype in sorted({t.dtype for t in tensors}, key=str):
            which = [i for i, t in enumerate(tensors) if t.dtype == dtype]
            flat, starts = aligned_flat([tensors[i].numpy() for i in which], self.ALIGN)
            flat = torch.from_numpy(flat).to(self.device)
            for i, start in zip(which, starts.tolist()):
                out[i] = flat[start:start + tensors[i].numel()].view(tensors[i].shape)
        return out


def aligned_flat(arrays: list, align: int) -> tuple[np.ndarray, np.ndarray]:
    """(flat, starts): ``arrays`` (one dtype) copied into one flat array, array k at ``starts[k]``, each start
    a multiple of ``align`` bytes. Triton specializes a kernel on whether each pointer is 16-byte aligned:
    views at arbitrary offsets would compile a new variant of each attention kernel for every new pattern
    of aligned and unaligned tile-list pointers, batch after batch."""
    step = max(1, align // arrays[0].itemsize)
    sizes = [a.size for a in arrays]
    starts = np.concatenate(([0], np.cumsum([-(-n // step) * step for n in sizes])))
    flat = np.zeros(int(starts[-1]), dtype=arrays[0].dtype)
    for a, start, n in zip(arrays, starts.tolist(), sizes):
        flat[start:start + n] = a.reshape(-1)
    return flat, starts[:-1]
