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
partials of remote blocks go home in the plan's ``grad_comm_dtype`` and are summed there in fp32 as they
arrive (``add_grad_rows``: converted and added in one pass).
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
from blockattn.planner.schedule import KIND_DKV, KIND_DO, KIND_DQ, KIND_KV, KIND_OUT, KIND_Q
from blockattn.rank_program import RankProgram, _Exchange, _Section, build_rank_program

__all__ = ["distributed_block_attention", "check_plan_agreement", "rank_program", "build_rank_program", "RankProgram"]

_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}


# ----------------------------------------------------------------------------- the rank program
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
                        be.add_grad_rows(dq, r, parts[0])
                    else:
                        be.add_grad_rows(dk, r, parts[0])
                        be.add_grad_rows(dv, r, parts[1])
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
               "attention_bwd_dkdv", "add_grad_rows"):
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
