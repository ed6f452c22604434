"""block_attention: differentiable masked attention over a MaskSpec, single device or by a Plan.

Notation (docs/design.md): q [T, Hq, D], k/v [T, Hkv, D] (THD), lse [Hq, T] fp32 natural log, B block
size of the BlockMask the kernels walk. Single device: forward over the q-major tile list, dQ over the
same list, dK/dV over the kv-major (transposed) list. With a Plan of world_size > 1 the call goes to
blockattn.distributed.distributed_block_attention.
"""
from __future__ import annotations

import math
import weakref

import torch
from torch.autograd.function import once_differentiable

from blockattn.backend import Backend, get_backend
from blockattn.kernels.launch import check_positive, check_softcap
from blockattn.kernels.tiles import KernelMask, TileList
from blockattn.sinks import check_sinks, merge_sinks

__all__ = ["block_attention", "default_block_size"]

_SUPPORTED = (torch.float16, torch.bfloat16, torch.float32)
# per BlockMask (weakly held) and device: (q-major tiles, kv-major tiles, kernel mask)
_TILE_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def default_block_size(device: torch.device, mask_spec=None) -> int:
    """128 on CUDA (the kernels' tile); 32 elsewhere, where the interpreter pays per tile row; with
    ``mask_spec``, doubled while the mask has more tiles than make_plan's default allows (planner/api.py
    ``MAX_AUTO_TILES``): one causal document of 1M tokens has 33.6M tiles at 128, whose lists take ~5 s
    of CPU per new mask to build (0.2 s at 512, 2.1M tiles), and the kernels run any power-of-two block
    in BLOCK_M x BLOCK_N sub-tiles, so a larger block costs the GPU nothing there."""
    B = 128 if torch.device(device).type == "cuda" else 32
    if mask_spec is not None:
        from blockattn.planner import api

        while B < mask_spec.total_len and api.more_tiles_than(mask_spec, B, api.MAX_AUTO_TILES):
            B *= 2
    return B


def _device_tiles(bm, device: torch.device):
    per_device = _TILE_CACHE.setdefault(bm, {})
    key = str(device)
    if key not in per_device:
        per_device[key] = (TileList.from_block_mask(bm, device=device),
                           TileList.from_block_mask(bm, transposed=True, device=device),
                           KernelMask.from_block_mask(bm, device))
    return per_device[key]


def _validate(q, k, v, mask_spec):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D [T, heads, head_dim] (THD), got shape {tuple(t.shape)}")
        if t.dtype not in _SUPPORTED:
            raise TypeError(f"{name} has dtype {t.dtype}; use float16, bfloat16 or float32")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type == "meta":
        raise ValueError("q, k, v are meta tensors (shapes without data); block_attention runs on real tensors "
                         "(cuda, or cpu with TRITON_INTERPRET=1 or backend='torch')")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"q, k, v must have the same token count T, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q head_dim {q.shape[2]} differs from k/v head_dim {k.shape[2]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of k/v heads ({k.shape[1]}) (GQA)")
    if not hasattr(mask_spec, "total_len") or not hasattr(mask_spec, "block_mask"):
        raise TypeError(f"mask_spec must be a blockattn.MaskSpec, got {type(mask_spec).__name__}")
    if mask_spec.total_len != q.shape[0]:
        raise ValueError(f"mask_spec.total_len = {mask_spec.total_len} but q has T = {q.shape[0]} tokens")


def check_softmax_scale(softmax_scale) -> None:
    """ValueError unless ``softmax_scale`` is None (1/sqrt(D)) or a positive finite number: a NaN scale
    gives NaN everywhere, and a zero one uniform attention over whatever the mask allows."""
    check_positive("softmax_scale", softmax_scale, "None: 1/sqrt(D)")


def _check_plan_block_size(plan, block_size) -> None:
    """TypeError for a ``plan`` that is not a Plan; ValueError for a ``block_size`` other than the plan's
    (the kernels walk the plan's tiles, so another block size would be ignored)."""
    for name in ("world_size", "block_size", "mask_signature", "fingerprint"):
        if not hasattr(plan, name):
            raise TypeError(f"plan must be a Plan from blockattn.make_plan or None (missing .{name}), "
                            f"got {type(plan).__name__}")
    if block_size is not None and block_size != plan.block_size:
        raise ValueError(f"block_size={block_size!r} but the plan was made with block_size={plan.block_size}; "
                         "leave block_size out (the plan's is used) or make the plan with that block_size")


def _capped(softcap) -> dict:
    """The backends' ``softcap`` keyword where capping is on: a backend object without the keyword still
    runs uncapped attention."""
    return {} if softcap is None else {"softcap": float(softcap)}


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, tiles, tiles_t, kmask, scale, softcap, backend: Backend):
        q, k, v = (t if t.is_contiguous() else t.contiguous() for t in (q, k, v))
        out, lse = backend.attention_fwd(q, k, v, tiles, kmask, scale, **_capped(softcap))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = (tiles, tiles_t, kmask, scale, softcap, backend)
        ctx.set_materialize_grads(False)  # an unused lse gets None, not a zero tensor to subtract
        return out, lse

    @staticmethod
    # (the kernels' backward is not itself differentiable: a double backward raises instead of
    # silently dropping the second-order terms)
    @once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        tiles, tiles_t, kmask, scale, softcap, backend = ctx.meta
        if dout is None:
            dout = torch.zeros_like(out)
        dout = dout.to(q.dtype).contiguous()
        delta = backend.attention_bwd_preprocess(out, dout)
        if dlse is not None:
            # d lse / d s_j = P_j, so a gradient on lse enters dS = P * (dP - delta) as delta - dlse
            delta = delta - torch.nan_to_num(dlse.float(), nan=0.0, posinf=0.0, neginf=0.0)
        dq = backend.attention_bwd_dq(q, k, v, dout, lse, delta, tiles, kmask, scale, **_capped(softcap))
        dk, dv = backend.attention_bwd_dkdv(q, k, v, dout, lse, delta, tiles_t, kmask, scale, **_capped(softcap))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


def block_attention(q, k, v, mask_spec, plan=None, *, softmax_scale=None, return_lse=False, backend=None,
                    group=None, block_size=None, sinks=None, softcap=None):
    """Masked attention ``softmax(scale * q k^T + mask) v`` over a packed batch, differentiable in q, k, v.

    q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` (``Hq % Hkv == 0``), fp16/bf16/fp32, one device; ``mask_spec``
    a MaskSpec with ``total_len == T``. ``plan``: None or a world-size-1 plan runs on this device;
    a plan with ``world_size > 1`` runs distributed (q, k, v then hold this rank's tokens).
    ``backend``: "triton" (default) or "torch". ``block_size``: tile size of the BlockMask the kernels
    walk (default: the plan's, else 128 on CUDA and 32 on CPU, larger for masks with millions of tiles). Returns ``out`` (and ``lse [Hq, T]``
    fp32 when ``return_lse``); fully masked rows give out 0 and lse -inf. ``sinks``: None or a float
    tensor [Hq] of learned sink logits (GPT-OSS), one more key per head with a zero value in every row's
    softmax (blockattn/sinks.py); lse then includes it, and a fully masked row gives out 0, lse = sink.
    ``softcap``: None or a positive number c: scores ``c * tanh(scale * q.k / c)`` (Gemma 2's logit
    soft-capping, c = 50), inside the kernels' forward and backward.
    """
    check_softmax_scale(softmax_scale)
    check_softcap(softcap)
    if sinks is not None:
        if isinstance(q, torch.Tensor) and q.dim() == 3:  # (else the checks below say what is wrong with q)
            check_sinks(sinks, q)
        out, lse = block_attention(q, k, v, mask_spec, plan, softmax_scale=softmax_scale, return_lse=True,
                                   backend=backend, group=group, block_size=block_size, softcap=softcap)
        out, lse = merge_sinks(out, lse, sinks)
        return (out, lse) if return_lse else out
    if plan is not None:
        _check_plan_block_size(plan, block_size)
        if int(plan.world_size) > 1:
            from blockattn.distributed import distributed_block_attention

            return distributed_block_attention(q, k, v, mask_spec, plan, softmax_scale=softmax_scale,
                                               return_lse=return_lse, backend=backend, group=group,
                                               softcap=softcap)
    _validate(q, k, v, mask_spec)
    if plan is not None:  # (a one-rank plan is held to the same inputs as a distributed one)
        from blockattn.distributed import _validate_against_plan

        _validate_against_plan(q, k, mask_spec, plan, 0)
        block_size = plan.block_size
    elif block_size is None:
        block_size = default_block_size(q.device, mask_spec)
    be = get_backend(backend)
    D = q.shape[2]
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    # (block_mask checks block_size: an int >= 1, numpy's too)
    tiles, tiles_t, kmask = _device_tiles(mask_spec.block_mask(block_size), q.device)
    out, lse = _BlockAttention.apply(q, k, v, tiles, tiles_t, kmask, scale, softcap, be)
    return (out, lse) if return_lse else out
