"""Distributed block attention: execute a Plan's stages across ranks, forward and backward.

Notation (docs/design.md): T tokens, B block size, nB blocks, P ranks, S = plan.num_stages, Hq / Hkv / D
heads and head dim. Each rank works on *buffers*: rows ``[0, n_local)`` are its own tokens in
``plan.local_tokens(rank)`` order, followed by the q-blocks (q buffer) and kv-blocks (k/v buffers) it
receives, in CommSchedule row order. Tile lists address these buffers (``row``) while masks use
global token indices (``glob``), so the kernels run unchanged on gathered blocks.

Exchanges. A rank runs S + 1 exchanges per direction; exchange j carries the *inputs* of stage j + 1
(Q/KV forward, DO backward) and the *results* of stage j (OUT forward, DQ/DKV backward, whose
schedule stage is last-compute-stage + 1 = j). It is posted before the compute of stage j, so stage
j + 1's inputs travel while stage j computes, and waited right after that compute. Every payload of
one (exchange, src, dst) travels as one packed message, sections in schedule row order. The
backward runs its own stage of every tile (``plan.tile_stage_bwd``): all forward inputs are resident
by then, so tiles whose partials go to other ranks run first and local tiles last, hiding them.

Relays (planner/relay.py): a KV row's source may be a rank that received the block in an earlier
exchange; it sends from its kv buffer rows. Mirrored, a DKV row's destination may be that relay: the
partial is summed into the relay's dK/dV rows of the block when its exchange completes, and the
relay's own DKV row leaves in a later exchange, packed (at post time) after every child's arrival.

Forward: out/lse accumulate per q-block with the fused ``accumulate=True`` kernel; partial
(out, lse) of q-blocks owned elsewhere go home and fold into the home's running state in place as they
arrive (the backend's ``merge_into``). Backward: the home computes delta = rowsum(dO * O) (minus dLSE
when lse is an output too) and ships dO, lse, delta to the tile ranks; per stage the kernels add dQ
(q-major lists) and dK/dV (kv-major lists) into the rank's fp32 accumulators (``accumulate=True``);
partials of remote blocks go home in the plan's ``grad_comm_dtype`` and are summed there in fp32.
"""
from __future__ import annotations

import hashlib
import math
import weakref
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable
import torch.distributed as dist

from blockattn import comms
from blockattn.attention import _capped, check_softmax_scale
from blockattn.kernels.launch import check_softcap
from blockattn.planner.schedule import KIND_DKV, KIND_DO, KIND_DQ, KIND_KV, KIND_NAMES, KIND_OUT, KIND_Q

__all__ = ["distributed_block_attention", "check_plan_agreement", "rank_program", "build_rank_program", "RankProgram"]

_INPUT_KINDS = {"fwd": (KIND_Q, KIND_KV), "bwd": (KIND_DO,)}
_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}


# ----------------------------------------------------------------------------- the rank program
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


def _token_rows(starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Concatenated ranges [start, start + len) (int64)."""
    starts, lens = starts.to(torch.int64), lens.to(torch.int64)
    total = int(lens.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64)
    offsets = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
    return torch.repeat_interleave(starts, lens) + offsets


def _partial_bits_index(bm, tq: torch.Tensor, tkv: torch.Tensor) -> torch.Tensor | None:
    """Position of each tile in the BlockMask's q-major partial list (the KernelMask.bits index), -1 for
    FULL tiles; None when the mask has intervals (kernels then need no bits)."""
    if bm.row_intervals is not None or bm.part_bits is None:
        return None
    nB = bm.num_blocks
    counts = (bm.part_kv_ptr[1:] - bm.part_kv_ptr[:-1]).to(torch.int64)
    keys = torch.repeat_interleave(torch.arange(nB, dtype=torch.int64), counts) * nB + bm.part_kv_idx.to(torch.int64)
    want = tq.to(torch.int64) * nB + tkv.to(torch.int64)
    if keys.numel() == 0:
        return torch.full_like(want, -1)
    pos = torch.searchsorted(keys, want).clamp(max=keys.numel() - 1)
    return torch.where(keys[pos] == want, pos, torch.full_like(pos, -1))


_PROGRAMS: dict = {}
_FINGERPRINTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def plan_fingerprint(plan) -> str:
    """plan.fingerprint(), computed once per plan object (it hashes every index tensor)."""
    fp = _FINGERPRINTS.get(plan)
    if fp is None:
        fp = _FINGERPRINTS[plan] = plan.fingerprint()
    return fp


def rank_program(plan, rank: int, block_mask, device) -> RankProgram:
    """The cached RankProgram of `rank` for `plan` (built once per plan fingerprint, rank and device)."""
    key = (plan_fingerprint(plan), int(rank), str(device))
    prog = _PROGRAMS.get(key)
    if prog is None:
        prog = build_rank_program(plan, int(rank), block_mask, torch.device(device))
        if len(_PROGRAMS) > 64:
            _PROGRAMS.clear()
        _PROGRAMS[key] = prog
    return prog


def build_rank_program(plan, me: int, bm, device: torch.device) -> RankProgram:
    """Rank `me`'s buffer layout, per-stage tile lists and exchanges for `plan` (bm: its BlockMask)."""
    from blockattn.kernels import TileList

    B, nB, T, S = plan.block_size, plan.num_blocks, plan.total_len, plan.num_stages
    lens = (T - torch.arange(nB, dtype=torch.int64) * B).clamp(max=B)
    local = plan.local_blocks[me].to(torch.int64)
    local_start = torch.cumsum(lens[local], 0) - lens[local]
    n_local = int(lens[local].sum())
    expect_tokens = _token_rows(local * B, lens[local])
    if not torch.equal(plan.local_tokens(me).to(torch.int64).cpu(), expect_tokens):
        raise ValueError(f"plan.local_tokens({me}) does not list the tokens of plan.local_blocks[{me}] in order")

    # Buffer rows of every block on this rank: local first, then received blocks in schedule row order.
    q_row = torch.full((nB,), -1, dtype=torch.int64)
    kv_row = torch.full((nB,), -1, dtype=torch.int64)
    q_row[local] = local_start
    kv_row[local] = local_start
    fwd, bwd = plan.schedule.fwd.to(torch.int64), plan.schedule.bwd.to(torch.int64)
    arrival_q = torch.full((nB,), -1, dtype=torch.int64)
    arrival_kv = torch.full((nB,), -1, dtype=torch.int64)
    arrival_q[local] = 0
    arrival_kv[local] = 0
    q_end = kv_end = n_local
    for stage, _src, _dst, kind, block in fwd[(fwd[:, 2] == me) & (fwd[:, 3] <= KIND_KV)].tolist():
        rows, arrival = (q_row, arrival_q) if kind == KIND_Q else (kv_row, arrival_kv)
        if rows[block] >= 0:
            raise ValueError(f"plan {plan.strategy}: rank {me} receives {KIND_NAMES[kind]} block {block} twice")
        if kind == KIND_Q:
            rows[block], q_end = q_end, q_end + int(lens[block])
        else:
            rows[block], kv_end = kv_end, kv_end + int(lens[block])
        arrival[block] = stage

    # The backward's only inputs: dO (+ lse, delta) of remote q-blocks, in their first backward stage.
    arrival_do = torch.full((nB,), -1, dtype=torch.int64)
    arrival_do[local] = 0
    for stage, _src, _dst, _kind, block in bwd[(bwd[:, 2] == me) & (bwd[:, 3] == KIND_DO)].tolist():
        arrival_do[block] = stage

    # Per-stage tile lists in buffer coordinates: forward stages (q-major) and backward stages
    # (q-major for dQ, kv-major for dK/dV); a tile's backward stage is its own (plan.tile_stage_bwd).
    mine = plan.tile_rank.to(torch.int64) == me
    tq_all, tkv_all = plan.tile_q.to(torch.int64), plan.tile_kv.to(torch.int64)
    full_all = plan.tile_full.to(torch.bool)

    def stage_lists(stage_all: torch.Tensor, s: int, backward: bool) -> _Stage:
        sel = mine & (stage_all == s)
        tq, tkv, tfull = tq_all[sel], tkv_all[sel], full_all[sel]
        if tq.numel() == 0:
            return _Stage(None, None)
        if backward:  # Q and KV were received in the forward and kept; dO must be here by now
            late = (arrival_q[tq] < 0) | (arrival_kv[tkv] < 0) | (arrival_do[tq] < 0) | (arrival_do[tq] > s)
        else:
            late = (arrival_q[tq] < 0) | (arrival_q[tq] > s) | (arrival_kv[tkv] < 0) | (arrival_kv[tkv] > s)
        if bool(late.any()):
            i = int(torch.nonzero(late)[0])
            raise ValueError(
                f"plan {plan.strategy}: rank {me} computes tile ({int(tq[i])}, {int(tkv[i])}) in "
                f"{'backward' if backward else 'forward'} stage {s} but does not hold its inputs by then "
                f"(inconsistent plan; run planner.schedule.check_plan)")
        bits = _partial_bits_index(bm, tq, tkv)
        q_major = TileList.from_tiles(tq, tkv, tfull, block_size=B, work_row_of=q_row, partner_row_of=kv_row,
                                      bits_index=bits, device=device)
        kv_major = TileList.from_tiles(tkv, tq, tfull, block_size=B, work_row_of=kv_row, partner_row_of=q_row,
                                       bits_index=bits, device=device) if backward else None
        return _Stage(q_major, kv_major)

    stages = tuple(stage_lists(plan.tile_stage.to(torch.int64), s, False) for s in range(S))
    stages_bwd = tuple(stage_lists(plan.tile_stage_bwd.to(torch.int64), s, True) for s in range(S))

    exchanges, planned = {}, {}
    for direction, table in (("fwd", fwd), ("bwd", bwd)):
        _check_stages(plan, direction, table)
        # payload bytes of every row by the plan's own rule (planner/schedule.py payload_bytes, as stats())
        nbytes = torch.from_numpy(plan.transfer_bytes(direction))
        exchanges[direction] = tuple(
            _exchange(table, nbytes, direction, j, me, q_row, kv_row, lens, device)
            for j in range(S + 1))
        planned[direction] = int(nbytes[table[:, 1] == me].sum())
    return RankProgram(me, n_local, q_end, kv_end, stages, stages_bwd, exchanges, planned, plan.grad_comm_dtype)


def _check_stages(plan, direction: str, table: torch.Tensor) -> None:
    """Inputs must arrive in stages 1..S-1 and results leave in stages 1..S (the executor's contract)."""
    S = plan.num_stages
    is_input = torch.isin(table[:, 3], torch.tensor(_INPUT_KINDS[direction]))
    last = torch.where(is_input, S - 1, S)
    bad = (table[:, 0] < 1) | (table[:, 0] > last)
    if bool(bad.any()):
        row = table[torch.nonzero(bad)[0, 0]].tolist()
        raise ValueError(f"plan {plan.strategy}: {direction} transfer (stage, src, dst, kind, block)={row} has a stage "
                         f"outside the executor's range (inputs 1..{S - 1}, results 1..{S})")


def _exchange(table, table_nbytes, direction, j, me, q_row, kv_row, lens, device) -> _Exchange:
    """Exchange j of `direction`: inputs of stage j + 1 and results of stage j, as sections per peer
    (``table_nbytes``: the payload bytes of every row of ``table``)."""
    is_input = torch.isin(table[:, 3], torch.tensor(_INPUT_KINDS[direction]))
    in_ex = (is_input & (table[:, 0] == j + 1)) | (~is_input & (table[:, 0] == j))
    mine = in_ex & ((table[:, 1] == me) | (table[:, 2] == me))
    rows, row_nbytes = table[mine], table_nbytes[mine]
    sends, recvs, recv_nbytes, send_nbytes = {}, {}, {}, {}
    for sending in (True, False):
        on_side = rows[:, 1] == me if sending else rows[:, 2] == me
        side, side_nbytes = rows[on_side], row_nbytes[on_side]
        peer_col = 2 if sending else 1
        for peer in torch.unique(side[:, peer_col]).tolist():
            msg = side[side[:, peer_col] == peer]
            sections, nbytes = [], int(side_nbytes[side[:, peer_col] == peer].sum())
            # rows are sorted by (stage, src, dst, kind, block): each (stage, kind) group is contiguous
            group_key = msg[:, 0] * 8 + msg[:, 3]
            for key in torch.unique_consecutive(group_key).tolist():
                blocks = msg[group_key == key][:, 4]
                kind = key % 8
                # q buffer for Q/OUT/DO/DQ, kv buffer for KV/DKV. Local blocks sit at their local rows
                # (q_row[local] == kv_row[local] == local_start), received ones at their gathered rows,
                # so one lookup serves the home, the tile rank and a relay (which forwards received KV
                # and sums its children's DKV partials into its own rows of the block) alike.
                starts = (kv_row if kind in (KIND_KV, KIND_DKV) else q_row)[blocks]
                if bool((starts < 0).any()):
                    raise ValueError(f"{direction} exchange {j}: rank {me} has no buffer row for "
                                     f"{KIND_NAMES[kind]} blocks {blocks[starts < 0].tolist()}")
                tok = _token_rows(starts, lens[blocks])
                sections.append(_Section(kind, blocks, tok.to(device)))
            (sends if sending else recvs)[peer] = sections
            (send_nbytes if sending else recv_nbytes)[peer] = nbytes
    return _Exchange(sends, recvs, recv_nbytes, send_nbytes)


# ----------------------------------------------------------------------------- packing
def _pack(section: _Section, bufs: dict, wire_dtype: torch.dtype, grad_dtype: torch.dtype) -> list[torch.Tensor]:
    """The tensors of one section, in wire order and wire dtypes (activations in ``wire_dtype``, gradient
    partials in ``grad_dtype``; the fp32 accumulators are rounded once, here)."""
    r = section.rows
    k = section.kind
    if k == KIND_Q:
        return [bufs["q"][r]]
    if k == KIND_KV:
        return [bufs["k"][r], bufs["v"][r]]
    if k == KIND_OUT:
        return [bufs["out"][r].to(wire_dtype), bufs["lse"][:, r]]
    if k == KIND_DO:
        return [bufs["dout"][r], bufs["lse_b"][:, r], bufs["delta"][:, r]]
    if k == KIND_DQ:
        return [bufs["dq"][r].to(grad_dtype)]
    return [bufs["dk"][r].to(grad_dtype), bufs["dv"][r].to(grad_dtype)]


def _unpack(section: _Section, buf: torch.Tensor, offset: int, dims: tuple, wire_dtype,
            grad_dtype) -> tuple[list, int]:
    """Views of one received section's tensors; returns (tensors, next offset)."""
    hq, hkv, d = dims
    n = section.rows.numel()
    f32 = torch.float32
    shapes = {
        KIND_Q: [((n, hq, d), wire_dtype)],
        KIND_KV: [((n, hkv, d), wire_dtype)] * 2,
        KIND_OUT: [((n, hq, d), wire_dtype), ((hq, n), f32)],
        KIND_DO: [((n, hq, d), wire_dtype), ((hq, n), f32), ((hq, n), f32)],
        KIND_DQ: [((n, hq, d), grad_dtype)],
        KIND_DKV: [((n, hkv, d), grad_dtype)] * 2,
    }[section.kind]
    out = []
    for shape, dtype in shapes:
        t = comms.from_bytes(buf, offset, shape, dtype)
        offset += t.numel() * t.element_size()
        out.append(t)
    return out, offset


def _run_exchange(ex: _Exchange, bufs: dict, *, group, device, method, tag, wire_dtype, grad_dtype, name):
    """Post one exchange (packing the sends now); returns the StageExchange handle."""
    send = {peer: [t for sec in secs for t in _pack(sec, bufs, wire_dtype, grad_dtype)]
            for peer, secs in ex.sends.items()}
    return comms.StageExchange(send, ex.recv_nbytes, group=group, device=device, method=method, tag=tag,
                               name=name).post()


# ----------------------------------------------------------------------------- forward / backward
class _DistributedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, run):
        prog, be, kmask, scale = run.prog, run.backend, run.kmask, run.scale
        n, hq, d = q.shape
        hkv = k.shape[1]
        dev = q.device
        dims = (hq, hkv, d)
        qb = torch.empty(prog.q_buf_rows, hq, d, dtype=q.dtype, device=dev)
        kb = torch.empty(prog.kv_buf_rows, hkv, d, dtype=k.dtype, device=dev)
        vb = torch.empty(prog.kv_buf_rows, hkv, d, dtype=v.dtype, device=dev)
        qb[:n], kb[:n], vb[:n] = q.detach(), k.detach(), v.detach()
        # The running state lives in q's dtype (the kernels' out contract); lse stays fp32.
        out = torch.zeros(prog.q_buf_rows, hq, d, dtype=q.dtype, device=dev)
        lse = torch.full((hq, prog.q_buf_rows), float("-inf"), dtype=torch.float32, device=dev)
        bufs = {"q": qb, "k": kb, "v": vb, "out": out, "lse": lse}
        S = len(prog.stages)
        for j in range(S + 1):
            handle = _run_exchange(prog.exchanges["fwd"][j], bufs, group=run.group, device=dev, method=run.method,
                                   tag=2 * j, wire_dtype=q.dtype, grad_dtype=prog.grad_dtype,
                                   name=f"fwd exchange {j}/{S}")
            if j < S and prog.stages[j].q_tiles is not None:
                be.attention_fwd(qb, kb, vb, prog.stages[j].q_tiles, kmask, scale, out=out, lse=lse,
                                 accumulate=True, **_capped(run.softcap))
            received = handle.wait()
            for peer, secs in prog.exchanges["fwd"][j].recvs.items():
                offset = 0
                for sec in secs:
                    parts, offset = _unpack(sec, received[peer], offset, dims, q.dtype, prog.grad_dtype)
                    r = sec.rows
                    if sec.kind == KIND_Q:
                        qb[r] = parts[0]
                    elif sec.kind == KIND_KV:
                        kb[r], vb[r] = parts
                    else:  # OUT partial of one of our q-blocks: folded into the running state in place
                        be.merge_into(out, lse, r, parts[0], parts[1])
        out_local = out[:n].clone()
        lse_local = lse[:, :n].contiguous()
        ctx.run = run
        ctx.save_for_backward(qb, kb, vb, out_local, lse_local)
        return out_local, lse_local

    @staticmethod
    # (the kernels' and transfers' backward is not itself differentiable: a double backward raises instead of
    # silently dropping the second-order terms)
    @once_differentiable
    def backward(ctx, dout, dlse):
        run = ctx.run
        prog, be, kmask, scale = run.prog, run.backend, run.kmask, run.scale
        qb, kb, vb, out_local, lse_local = ctx.saved_tensors
        n, hq, d = out_local.shape
        hkv = kb.shape[1]
        dev = qb.device
        dims = (hq, hkv, d)
        dout = torch.zeros_like(out_local) if dout is None else dout.to(out_local.dtype).contiguous()
        delta_local = be.attention_bwd_preprocess(out_local, dout)
        if dlse is not None:
            # d lse / d s_ij = p_ij, so an lse gradient shifts delta: ds = p * (dp - (delta - dlse))
            delta_local = delta_local - torch.nan_to_num(dlse.float(), nan=0.0, posinf=0.0, neginf=0.0)
        dout_b = torch.zeros(prog.q_buf_rows, hq, d, dtype=qb.dtype, device=dev)
        lse_b = torch.full((hq, prog.q_buf_rows), float("-inf"), dtype=torch.float32, device=dev)
        delta_b = torch.zeros(hq, prog.q_buf_rows, dtype=torch.float32, device=dev)
        dout_b[:n], lse_b[:, :n], delta_b[:, :n] = dout, lse_local, delta_local
        dq = torch.zeros(prog.q_buf_rows, hq, d, dtype=torch.float32, device=dev)
        dk = torch.zeros(prog.kv_buf_rows, hkv, d, dtype=torch.float32, device=dev)
        dv = torch.zeros(prog.kv_buf_rows, hkv, d, dtype=torch.float32, device=dev)
        bufs = {"dout": dout_b, "lse_b": lse_b, "delta": delta_b, "dq": dq, "dk": dk, "dv": dv}
        S = len(prog.stages)
        for j in range(S + 1):
            handle = _run_exchange(prog.exchanges["bwd"][j], bufs, group=run.group, device=dev, method=run.method,
                                   tag=2 * j + 1, wire_dtype=qb.dtype, grad_dtype=prog.grad_dtype,
                                   name=f"bwd exchange {j}/{S}")
            if j < S and prog.stages_bwd[j].q_tiles is not None:
                # each stage's gradients are added into the fp32 accumulators by the kernels themselves
                # (not written to fresh full-size buffers, then gathered and index-added)
                st = prog.stages_bwd[j]
                be.attention_bwd_dq(qb, kb, vb, dout_b, lse_b, delta_b, st.q_tiles, kmask, scale, out=dq,
                                    accumulate=True, **_capped(run.softcap))
                be.attention_bwd_dkdv(qb, kb, vb, dout_b, lse_b, delta_b, st.kv_tiles, kmask, scale, out=(dk, dv),
                                      accumulate=True, **_capped(run.softcap))
            received = handle.wait()
            for peer, secs in prog.exchanges["bwd"][j].recvs.items():
                offset = 0
                for sec in secs:
                    parts, offset = _unpack(sec, received[peer], offset, dims, qb.dtype, prog.grad_dtype)
                    r = sec.rows
                    if sec.kind == KIND_DO:
                        dout_b[r], lse_b[:, r], delta_b[:, r] = parts
                    elif sec.kind == KIND_DQ:
                        dq.index_add_(0, r, parts[0].to(torch.float32))
                    else:
                        dk.index_add_(0, r, parts[0].to(torch.float32))
                        dv.index_add_(0, r, parts[1].to(torch.float32))
        return dq[:n].to(qb.dtype), dk[:n].to(kb.dtype), dv[:n].to(vb.dtype), None


@dataclass(frozen=True)
class _Run:
    prog: RankProgram
    backend: object
    kmask: object
    scale: float
    group: object
    method: str
    softcap: float | None = None


# ----------------------------------------------------------------------------- validation
_AGREED: set = set()


def _hash63(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & ((1 << 63) - 1)


_FIELDS = ("plan", "mask", "plan_world", "group_size", "q_rows", "k_rows", "v_rows", "expected_rows",
           "q_heads", "kv_heads", "head_dim", "dtype", "devtype")


def check_plan_agreement(plan, mask_spec, q, k, v, group) -> None:
    """Check on every rank at once that all ranks run the same plan with fitting tensors.

    One fixed-size all_gather of (plan fingerprint, mask signature, world sizes, local row counts, heads,
    head dim, dtype); every rank evaluates the same gathered table and so raises the *same* ValueError,
    instead of some ranks hanging in a transfer their peer never posts. Cached per (fingerprint, group).
    """
    size, me = dist.get_world_size(group), dist.get_rank(group)
    fingerprint = plan_fingerprint(plan)
    key = (fingerprint, id(group), size)
    if key in _AGREED:
        return
    try:
        expected = len(plan.local_tokens(me)) if me < plan.world_size else -1
    except Exception:
        expected = -1
    mine = [_hash63(fingerprint), _hash63(mask_spec.signature()), plan.world_size, size,
            q.shape[0], k.shape[0], v.shape[0], expected, q.shape[1], k.shape[1], q.shape[2],
            _DTYPE_CODES.get(q.dtype, 0) * 16 + _DTYPE_CODES.get(k.dtype, 0) * 4 + _DTYPE_CODES.get(v.dtype, 0),
            0 if q.device.type == "cpu" else 1]
    dev = q.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    table = [torch.zeros(len(mine), dtype=torch.int64, device=dev) for _ in range(size)]
    dist.all_gather(table, torch.tensor(mine, dtype=torch.int64, device=dev), group=group)
    rows = [dict(zip(_FIELDS, r.cpu().tolist())) for r in table]
    problems = []
    if any(r["plan"] != rows[0]["plan"] for r in rows):
        groups = {}
        for i, r in enumerate(rows):
            groups.setdefault(r["plan"], []).append(i)
        problems.append("ranks hold different plans (fingerprints differ; group of ranks per fingerprint: "
                        f"{sorted(groups.values())}); build the plan with identical arguments on every rank")
    if any(r["mask"] != rows[0]["mask"] for r in rows):
        problems.append("ranks pass different mask_specs (signatures differ)")
    for i, r in enumerate(rows):
        if r["plan_world"] != r["group_size"]:
            problems.append(f"rank {i}: plan.world_size = {r['plan_world']} but the process group has "
                            f"{r['group_size']} ranks")
        elif not r["q_rows"] == r["k_rows"] == r["v_rows"] == r["expected_rows"]:
            problems.append(f"rank {i}: q/k/v have {r['q_rows']}/{r['k_rows']}/{r['v_rows']} rows but "
                            f"len(plan.local_tokens({i})) = {r['expected_rows']}; pass x[plan.local_tokens(rank)]")
    for name in ("q_heads", "kv_heads", "head_dim", "dtype", "devtype"):
        if any(r[name] != rows[0][name] for r in rows):
            problems.append(f"ranks disagree on {name}: {[r[name] for r in rows]}")
    if problems:
        raise ValueError(f"distributed_block_attention: ranks disagree before the first run of plan "
                         f"{plan.strategy} (P={plan.world_size}):\n  - " + "\n  - ".join(problems))
    _AGREED.add(key)


def _validate_tensors(q, k, v) -> None:
    """Per-rank tensor checks that need no plan (raised before any communication)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be [local_tokens, heads, head_dim], got shape {tuple(t.shape)}")
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")


def _validate_against_plan(q, k, mask_spec, plan, me: int) -> None:
    """Checks of this rank's inputs against the plan (after the ranks agreed on the plan)."""
    if mask_spec.total_len != plan.total_len:
        raise ValueError(f"mask_spec.total_len = {mask_spec.total_len} but the plan covers {plan.total_len} tokens")
    if mask_spec.signature() != plan.mask_signature:
        raise ValueError("mask_spec is not the mask the plan was made for (signatures differ); "
                         "make the plan from this mask_spec")
    want_q, want_kv = (plan.num_q_heads, plan.head_dim), (plan.num_kv_heads, plan.head_dim)
    if tuple(q.shape[1:]) != want_q or tuple(k.shape[1:]) != want_kv:
        raise ValueError(f"plan expects q [n, {plan.num_q_heads}, {plan.head_dim}] and k/v [n, {plan.num_kv_heads}, "
                         f"{plan.head_dim}], got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if q.dtype != plan.dtype:
        raise TypeError(f"q has dtype {q.dtype} but the plan's byte counts are for {plan.dtype}; "
                        f"make the plan with dtype={q.dtype}")
    n = plan.local_len(me)
    if q.shape[0] != n or k.shape[0] != n:
        raise ValueError(f"rank {me}: q has {q.shape[0]} rows and k {k.shape[0]}, but plan.local_tokens({me}) has {n}; "
                         f"pass this rank's tokens x[plan.local_tokens({me})] (plan.shard(x, {me}))")


def _resolve_backend(backend):
    """The kernel backend (blockattn.backend.get_backend: "triton" by default, which on CPU needs
    TRITON_INTERPRET=1, else raises asking for backend="torch"); never a silent fallback."""
    if backend is None or isinstance(backend, str):
        from blockattn.backend import get_backend

        return get_backend(backend)
    for fn in ("attention_fwd", "merge_partials", "merge_into", "attention_bwd_preprocess", "attention_bwd_dq",
               "attention_bwd_dkdv"):
        if not callable(getattr(backend, fn, None)):
            raise TypeError(f"backend must be 'triton', 'torch' or an object with {fn}(); got {type(backend).__name__}")
    return backend


# ----------------------------------------------------------------------------- public API
def distributed_block_attention(q, k, v, mask_spec, plan, *, softmax_scale=None, return_lse=False, backend=None,
                                group=None, comm_method: str = "p2p", softcap=None):
    """Masked attention of this rank's tokens under a distributed `plan`, differentiable w.r.t. q, k, v.

    q ``[n, Hq, D]``, k/v ``[n, Hkv, D]`` hold this rank's tokens in ``plan.local_tokens(rank)`` order
    (``plan.shard(x)``-style); returns this rank's ``out [n, Hq, D]`` (and ``lse [Hq, n]`` fp32 when
    `return_lse`). Every rank of `group` (default: the world) must call it with the same plan and mask.
    `backend`: "triton", "torch" or a backend object (default per blockattn.backend: Triton on CUDA and
    under TRITON_INTERPRET=1). `comm_method`: "p2p" (batch_isend_irecv) or "a2a" (all_to_all_single).
    `softcap`: logit soft-capping, as block_attention's.
    """
    group = group if group is not None else comms.get_group()
    me = dist.get_rank(group)  # (the group's size is checked against the plan by check_plan_agreement)
    if me < 0:
        raise ValueError(f"global rank {dist.get_rank()} is not a member of the given group; call "
                         "distributed_block_attention only on the group's ranks")
    if comm_method not in comms.COMM_METHODS:
        raise ValueError(f"comm_method must be one of {comms.COMM_METHODS}, got {comm_method!r}")
    check_softmax_scale(softmax_scale)
    check_softcap(softcap)
    for name in ("total_len", "signature", "block_mask"):
        if not hasattr(mask_spec, name):
            raise TypeError(f"mask_spec must be a blockattn.MaskSpec (missing .{name}), got {type(mask_spec).__name__}")
    for name in ("schedule", "local_tokens", "fingerprint"):
        if not hasattr(plan, name):
            raise TypeError(f"plan must be a Plan from blockattn.make_plan (missing .{name}), "
                            f"got {type(plan).__name__}")
    _validate_tensors(q, k, v)
    be = _resolve_backend(backend)
    check_plan_agreement(plan, mask_spec, q, k, v, group)
    _validate_against_plan(q, k, mask_spec, plan, me)
    bm = mask_spec.block_mask(plan.block_size)
    kmask = _kernel_mask(bm, q.device)
    prog = rank_program(plan, me, bm, q.device)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    run = _Run(prog, be, kmask, scale, group, comm_method, softcap)
    out, lse = _DistributedAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), run)
    return (out, lse) if return_lse else out


_KMASKS: dict = {}


def _kernel_mask(bm, device):
    from blockattn.kernels import KernelMask

    key = (id(bm), str(device))
    km = _KMASKS.get(key)
    if km is None or km[0] is not bm:
        km = (bm, KernelMask.from_block_mask(bm, device=device))
        if len(_KMASKS) > 16:
            _KMASKS.clear()
        _KMASKS[key] = km
    return km[1]
