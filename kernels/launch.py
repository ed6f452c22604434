"""Python entry points of the Triton kernels: validation, tile configuration, grid, launch.

Notation (docs/design.md): layout THD, q [Rq, Hq, D], k/v [Rk, Hkv, D] (R = buffer rows, T = global
tokens), lse/delta [Hq, Rq] fp32; B = KernelMask.block_size; GROUP = Hq // Hkv; any D in [1, 256]
runs in head-dim tiles of ``block_d(D)`` columns. Work blocks are split into BLOCK_M (forward, dQ) or
BLOCK_N (dK/dV) row tiles per program; partner blocks are walked in sub-tiles of the other size.
Programs are launched longest work block first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .backward import (add_grad_rows_kernel, attention_bwd_dkdv_kernel, attention_bwd_dq_kernel,
                       attention_bwd_preprocess_kernel)
from .forward import attention_fwd_kernel
from .merge import merge_into_kernel, merge_partials_kernel
from .tiles import KernelMask, TileList

__all__ = ["KernelConfig", "kernel_config", "block_d", "MAX_HEAD_DIM", "check_positive", "check_softcap",
           "check_accumulate", "interpreted", "attention_fwd", "merge_partials", "merge_into",
           "attention_bwd_preprocess", "attention_bwd_dq", "attention_bwd_dkdv", "add_grad_rows"]

LOG2E = 1.4426950408889634
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def block_d(head_dim: int) -> int:
    """The head-dim tile width: the next power of two >= head_dim, and >= 16 (tl.dot's smallest K).
    A head dim of 80 or 96 runs in 128-wide tiles whose last columns load as zeros (kernels/tile_io.py)."""
    return max(16, 1 << (int(head_dim) - 1).bit_length())


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch options of one kernel (BLOCK_M: q rows, BLOCK_N: kv rows per tile)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def interpreted() -> bool:
    """True when the kernels were defined under TRITON_INTERPRET=1 (they then run on CPU tensors)."""
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(attention_fwd_kernel, InterpretedFunction)


def kernel_config(kind: str, block: int, head_dim: int, device: torch.device, *, softcap: bool = False) -> KernelConfig:
    """Default tiles for ``kind`` in {"fwd", "dq", "dkdv"} at head dim ``head_dim`` (its tile width is
    ``block_d(head_dim)``, with column masks where the head dim does not fill it); ``softcap``: the
    capped-scores variant.

    The interpreter pays per sub-tile in Python, so it takes whole blocks. On GPUs the choice is the
    fastest-looking configuration with zero spills in the sm_90a static report (bench/kernel_report.py,
    bf16, block 128, every mask variant: intervals, bits, both, a ragged last block, the fused
    accumulate; registers in brackets):
    forward 128 x 128, 8 warps, 3 stages (D=128: 250-255 regs); 128 x 64 where the column masks of a
    padded head dim (D=80, 96: 214) or the capped scores (D=128: 218) would spill at 128 x 128; at
    D=256 128 x 32, 2 stages (128 x 64 spilled up to 35 registers on ragged or bitmask tiles; 128 x 32
    leaves 5-7 in the fused accumulate's epilogue alone, which every shape tried spills);
    dQ 128 q rows x 64-key sub-tiles, 8 warps (D=128: 186; 128 x 32, 1 stage at D=256: 254);
    dK/dV 128 key rows x 32-query sub-tiles at D<=64 (217), x 16 at D=128 (236; x 32 spills, and
    64-row kv tiles would load every q tile twice; 2 stages for D=80, 96: 254), 32 x 16 at D=256 (168;
    every HGMMA shape spilled).
    """
    if device.type != "cuda":
        return KernelConfig(block, block, 4, 1)
    # (from here ``head_dim`` is the tile width, ``even_d`` whether the head dim fills it)
    head_dim, even_d = block_d(head_dim), head_dim == block_d(head_dim)
    if kind == "fwd":
        if head_dim <= 64 and not softcap or head_dim == 128 and even_d and not softcap:
            return KernelConfig(min(block, 128), min(block, 128), 8, 3)
        if head_dim <= 128:
            return KernelConfig(min(block, 128), min(block, 64), 8, 3)
        return KernelConfig(min(block, 128), min(block, 32), 8, 2)
    if kind == "dq":
        if head_dim <= 128:
            return KernelConfig(min(block, 128), min(block, 64), 8, 3)
        return KernelConfig(min(block, 128), min(block, 32), 8, 1)
    if kind == "dkdv":
        if head_dim <= 64:
            return KernelConfig(min(block, 32), min(block, 128), 8, 3)
        if head_dim <= 128:
            return KernelConfig(min(block, 16), min(block, 128), 8, 3 if even_d else 2)
        return KernelConfig(min(block, 16), min(block, 32), 8, 2)
    raise ValueError(f"unknown kernel kind {kind!r}; expected 'fwd', 'dq' or 'dkdv'")


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------
def _require_runnable(device: torch.device) -> None:
    if device.type == "cpu" and not interpreted():
        raise RuntimeError(
            "Triton kernels got CPU tensors but were not built for the interpreter: set the environment "
            "variable TRITON_INTERPRET=1 before importing blockattn, or use backend='torch'")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"Triton kernels run on CUDA (or CPU with TRITON_INTERPRET=1), got device {device}")


def _check_head_tensor(name: str, t: Tensor, dtype=None, device=None) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 3:
        raise ValueError(f"{name} must be [rows, heads, head_dim] (THD), got shape {tuple(t.shape)}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but q has {dtype}; cast them to one dtype")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}; move them to one device")
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_qkv(q, k, v):
    q = _check_head_tensor("q", q)
    k = _check_head_tensor("k", k, q.dtype, q.device)
    v = _check_head_tensor("v", v, q.dtype, q.device)
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    Hq, D = q.shape[1], q.shape[2]
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"q heads ({Hq}) must be a multiple of k/v heads ({Hkv}) for GQA")
    if k.shape[2] != D:
        raise ValueError(f"head dims differ: q has {D}, k/v have {k.shape[2]}")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {D}")
    _require_runnable(q.device)
    return q, k, v


def _check_tiles(tiles: TileList, mask: KernelMask, device: torch.device):
    if not isinstance(tiles, TileList):
        raise TypeError(f"tiles must be a TileList, got {type(tiles).__name__}")
    if not isinstance(mask, KernelMask):
        raise TypeError(f"mask must be a KernelMask, got {type(mask).__name__}")
    B = mask.block_size
    if B < 16 or B & (B - 1):
        raise ValueError(f"the kernels need a power-of-two block size >= 16, got {B}")
    if tiles.device != device:
        raise ValueError(f"tile list is on {tiles.device} but the tensors on {device}; use tiles.to({str(device)!r})")
    if tiles.num_partial and mask.intervals is None and mask.bits is None:
        raise ValueError("the tile list has partial tiles but the KernelMask has neither intervals nor bits")
    for name, t in (("intervals", mask.intervals), ("bits", mask.bits)):
        if t is not None and t.device != device:
            raise ValueError(f"KernelMask.{name} is on {t.device} but the tensors on {device}; use mask.to(...)")


def _work_order(tiles: TileList) -> Tensor:
    cached = tiles.__dict__.get("_work_order")
    if cached is None:
        cached = tiles.work_order()
        object.__setattr__(tiles, "_work_order", cached)  # frozen dataclass: cache outside the fields
    return cached


def _mask_args(mask: KernelMask, device):
    dummy = torch.zeros(1, dtype=torch.int32, device=device)
    iv = mask.intervals if mask.intervals is not None else dummy
    bits = mask.bits if mask.bits is not None else dummy.to(torch.uint8)
    return iv, bits, mask.intervals is not None, mask.bits is not None


def _tile_args(tiles: TileList):
    return (_work_order(tiles), tiles.work_row, tiles.work_glob, tiles.full_ptr, tiles.full_row, tiles.full_glob,
            tiles.part_ptr, tiles.part_row, tiles.part_glob, tiles.part_bits)


def _scale(scale, D):
    return 1.0 / math.sqrt(D) if scale is None else float(scale)


def check_positive(name: str, value, meaning: str) -> None:
    """ValueError unless ``value`` is None or a positive finite number; ``meaning`` (what None and the number
    do) goes into the message. A NaN, zero or negative scale or cap runs, with NaN or meaningless results."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be None or a positive finite number ({meaning}), got {value!r}")


def check_softcap(softcap) -> None:
    """ValueError unless ``softcap`` is None (no capping) or a positive finite number (Gemma 2: 50.0)."""
    check_positive("softcap", softcap, "None: no capping; c: scores become c * tanh(score / c), e.g. 50.0")


def _score_args(scale: float, softcap) -> tuple:
    """(qk_scale, cap, SOFTCAP) of the kernels' exp2-domain scores (kernels/mask_tile.py)."""
    check_softcap(softcap)
    if softcap is None:
        return scale * LOG2E, 1.0, False
    return scale / softcap, softcap * LOG2E, True


def _dot_precision(dtype):
    # fp32 inputs follow torch's matmul setting: TF32 tensor cores only where torch allows them
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _check_lse(name, t, H, R, device):
    if t.dtype != torch.float32 or tuple(t.shape) != (H, R) or t.stride(1) != 1:
        raise ValueError(f"{name} must be fp32 [H={H}, R={R}] with unit row stride, got {t.dtype} {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


# --------------------------------------------------------------------------------------------
# entry points
# --------------------------------------------------------------------------------------------
def attention_fwd(q, k, v, tiles: TileList, mask: KernelMask, scale=None, *, out=None, lse=None,
                  accumulate=False, config: KernelConfig | None = None, softcap=None):
    """Masked attention of the work q-blocks of ``tiles``; returns (out [Rq, Hq, D], lse [Hq, Rq] fp32).

    Only rows of work blocks are written; fresh ``out``/``lse`` start as the empty partial (0, -inf).
    ``accumulate=True`` resumes from the given (out, lse) (fused merge of a partial over other keys).
    ``softcap``: scores ``softcap * tanh(scale * q.k / softcap)`` (None: ``scale * q.k``).
    """
    q, k, v = _check_qkv(q, k, v)
    _check_tiles(tiles, mask, q.device)
    Rq, Hq, D = q.shape
    if accumulate and (out is None or lse is None):
        raise ValueError("accumulate=True needs the running state: pass out= and lse=")
    if out is None:
        out = torch.zeros_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1 or out.device != q.device:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device} with unit last stride, "
                         f"got {tuple(out.shape)} {out.dtype}")
    if lse is None:
        lse = torch.full((Hq, Rq), float("-inf"), dtype=torch.float32, device=q.device)
    _check_lse("lse", lse, Hq, Rq, q.device)
    if tiles.num_work == 0:
        return out, lse
    B, T = mask.block_size, mask.total_len
    iv, bits, has_iv, has_bits = _mask_args(mask, q.device)
    qk_scale, cap, capped = _score_args(_scale(scale, D), softcap)
    cfg = config or kernel_config("fwd", B, D, q.device, softcap=capped)
    grid = (tiles.num_work * (B // cfg.block_m) * Hq,)
    attention_fwd_kernel[grid](
        q, k, v, out, lse, *_tile_args(tiles), iv, bits,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        T, Hq, qk_scale, cap,
        GROUP=Hq // k.shape[1], BLOCK=B, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=D, BLOCK_D=block_d(D),
        EVEN_T=(T % B == 0), HAS_INTERVALS=has_iv, HAS_BITS=has_bits, ACCUMULATE=bool(accumulate),
        DOT_PREC=_dot_precision(q.dtype), SOFTCAP=capped, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out, lse


def merge_partials(outs, lses):
    """Merge N partials of the same rows: ``outs`` [N, R, H, D] (or a list of [R, H, D]),
    ``lses`` [N, H, R] fp32 (or a list of [H, R]); returns (out [R, H, D], lse [H, R])."""
    if isinstance(outs, (list, tuple)):
        if len(outs) == 0 or len(outs) != len(lses):
            raise ValueError(f"merge_partials needs as many lses as outs (>= 1), got {len(outs)} and {len(lses)}")
        outs, lses = torch.stack(list(outs)), torch.stack(list(lses))
    if outs.dim() != 4 or lses.dim() != 3:
        raise ValueError(f"outs must be [N, R, H, D] and lses [N, H, R], got {tuple(outs.shape)}, {tuple(lses.shape)}")
    N, R, H, D = outs.shape
    if tuple(lses.shape) != (N, H, R) or lses.dtype != torch.float32:
        raise ValueError(f"lses must be fp32 [N={N}, H={H}, R={R}], got {lses.dtype} {tuple(lses.shape)}")
    if outs.dtype not in SUPPORTED_DTYPES or not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"outs must be fp16/bf16/fp32 with a head dim in [1, {MAX_HEAD_DIM}], got {outs.dtype}, D={D}")
    if lses.device != outs.device:
        raise ValueError(f"outs on {outs.device} and lses on {lses.device}; move them to one device")
    _require_runnable(outs.device)
    outs = outs if outs.stride(-1) == 1 else outs.contiguous()
    lses = lses if lses.stride(-1) == 1 else lses.contiguous()
    out = torch.empty((R, H, D), dtype=outs.dtype, device=outs.device)
    lse = torch.empty((H, R), dtype=torch.float32, device=outs.device)
    if R == 0 or H == 0:
        return out, lse
    block_r = 64 if outs.device.type == "cuda" else 32
    merge_partials_kernel[(triton_cdiv(R, block_r), H)](
        outs, lses, out, lse, N, R,
        outs.stride(0), outs.stride(1), outs.stride(2), lses.stride(0), lses.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        BLOCK_R=block_r, HEAD_DIM=D, BLOCK_D=block_d(D), num_warps=8 if outs.device.type == "cuda" else 4)
    return out, lse


def _check_rows(fn: str, rows, n: int, per: str) -> None:
    """ValueError unless ``rows`` (of ``fn``) is a 1-D int32/int64 tensor of ``n`` buffer rows, one per ``per``."""
    if not isinstance(rows, Tensor) or rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64) \
            or rows.numel() != n:
        raise ValueError(f"{fn}: rows must be a 1-D int32/int64 tensor with one buffer row per {per} ({n}), "
                         f"got {getattr(rows, 'dtype', type(rows).__name__)} {tuple(getattr(rows, 'shape', ()))}")


def _check_rows_range(fn: str, rows: Tensor, R: int) -> None:
    """ValueError unless the (non-empty) ``rows`` lie in [0, R); checked on the host only (on a GPU the
    check would wait for the device)."""
    if rows.device.type == "cpu" and (int(rows.min()) < 0 or int(rows.max()) >= R):
        raise ValueError(f"{fn}: rows must lie in [0, {R}), got {int(rows.min())}..{int(rows.max())}")


def merge_into(out, lse, rows, part_out, part_lse):
    """Fold one partial into a running state in place: for each i, (out[rows[i]], lse[:, rows[i]]) becomes
    the merge of itself with (part_out[i], part_lse[:, i]) - the bits of ``merge_partials`` on the two,
    without gathering the running rows, stacking and scattering them back. ``out`` [R, H, D] and
    ``part_out`` [n, H, D] fp16/bf16/fp32 (unit last stride), ``lse`` [H, R] and ``part_lse`` [H, n]
    fp32, ``rows`` [n] int32/int64 distinct buffer rows in [0, R). Returns (out, lse)."""
    for name, t in (("out", out), ("part_out", part_out)):
        if not isinstance(t, Tensor) or t.dim() != 3 or t.dtype not in SUPPORTED_DTYPES or t.stride(-1) != 1:
            raise ValueError(f"merge_into: {name} must be a [rows, H, D] fp16/bf16/fp32 tensor with unit last stride, "
                             f"got {getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    R, H, D = out.shape
    n = part_out.shape[0]
    if tuple(part_out.shape[1:]) != (H, D):
        raise ValueError(f"merge_into: part_out {tuple(part_out.shape)} must be [n, H={H}, D={D}] like out")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"merge_into: head dim must be in [1, {MAX_HEAD_DIM}], got {D}")
    _check_rows("merge_into", rows, n, "partial row")
    _check_lse("merge_into: lse", lse, H, R, out.device)
    _check_lse("merge_into: part_lse", part_lse, H, n, out.device)
    if part_out.device != out.device or rows.device != out.device:
        raise ValueError(f"merge_into: out on {out.device}, part_out on {part_out.device}, rows on {rows.device}; "
                         "move them to one device")
    if n == 0:
        return out, lse
    _check_rows_range("merge_into", rows, R)
    _require_runnable(out.device)
    rows = rows.contiguous()
    block_r = 64 if out.device.type == "cuda" else 32
    merge_into_kernel[(triton_cdiv(n, block_r), H)](
        out, lse, rows, part_out, part_lse, n,
        out.stride(0), out.stride(1), lse.stride(0), part_out.stride(0), part_out.stride(1), part_lse.stride(0),
        BLOCK_R=block_r, HEAD_DIM=D, BLOCK_D=block_d(D), num_warps=8 if out.device.type == "cuda" else 4)
    return out, lse


def attention_bwd_preprocess(out, dout):
    """delta [H, R] fp32 = rowsum(out * dout) per head."""
    out = _check_head_tensor("out", out)
    dout = _check_head_tensor("dout", dout, None, out.device)
    if dout.shape != out.shape:
        raise ValueError(f"dout {tuple(dout.shape)} must match out {tuple(out.shape)}")
    _require_runnable(out.device)
    R, H, D = out.shape
    delta = torch.empty((H, R), dtype=torch.float32, device=out.device)
    if R == 0:
        return delta
    block_r = 64 if out.device.type == "cuda" else 32
    attention_bwd_preprocess_kernel[(triton_cdiv(R, block_r), H)](
        out, dout, delta, R, out.stride(0), out.stride(1), dout.stride(0), dout.stride(1), delta.stride(0),
        BLOCK_R=block_r, HEAD_DIM=D, BLOCK_D=block_d(D), num_warps=4)
    return delta


def add_grad_rows(dst, rows, src):
    """``dst[rows[i]] += src[i]`` in fp32, in place (a received gradient partial summed into its buffer: the
    same bits as ``dst.index_add_(0, rows, src.float())`` without the fp32 copy of ``src``). ``dst`` [R, H, D]
    fp32 contiguous, ``src`` [n, H, D] fp16/bf16/fp32 (unit last stride), ``rows`` [n] int32/int64
    distinct buffer rows in [0, R). Returns ``dst``."""
    if not isinstance(dst, Tensor) or dst.dim() != 3 or dst.dtype != torch.float32 or not dst.is_contiguous():
        raise ValueError(f"add_grad_rows: dst must be a contiguous fp32 [rows, H, D] tensor, got "
                         f"{getattr(dst, 'dtype', type(dst).__name__)} {tuple(getattr(dst, 'shape', ()))}")
    R, H, D = dst.shape
    if not isinstance(src, Tensor) or src.dim() != 3 or tuple(src.shape[1:]) != (H, D) \
            or src.dtype not in SUPPORTED_DTYPES or src.stride(-1) != 1:
        raise ValueError(f"add_grad_rows: src must be a [n, H={H}, D={D}] fp16/bf16/fp32 tensor with unit last stride, "
                         f"got {getattr(src, 'dtype', type(src).__name__)} {tuple(getattr(src, 'shape', ()))}")
    n = src.shape[0]
    _check_rows("add_grad_rows", rows, n, "src row")
    if src.device != dst.device or rows.device != dst.device:
        raise ValueError(f"add_grad_rows: dst on {dst.device}, src on {src.device}, rows on {rows.device}; "
                         "move them to one device")
    if n == 0:
        return dst
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"add_grad_rows: head dim must be in [1, {MAX_HEAD_DIM}], got {D}")
    _check_rows_range("add_grad_rows", rows, R)
    _require_runnable(dst.device)
    block_r = 64 if dst.device.type == "cuda" else 32
    add_grad_rows_kernel[(triton_cdiv(n, block_r), H)](
        dst, rows.contiguous(), src, n, dst.stride(0), dst.stride(1), src.stride(0), src.stride(1),
        BLOCK_R=block_r, HEAD_DIM=D, BLOCK_D=block_d(D), num_warps=4)
    return dst


def _bwd_common(q, k, v, dout, lse, delta, tiles, mask):
    q, k, v = _check_qkv(q, k, v)
    dout = _check_head_tensor("dout", dout, q.dtype, q.device)
    if dout.shape != q.shape:
        raise ValueError(f"dout {tuple(dout.shape)} must match q {tuple(q.shape)}")
    _check_lse("lse", lse, q.shape[1], q.shape[0], q.device)
    _check_lse("delta", delta, q.shape[1], q.shape[0], q.device)
    _check_tiles(tiles, mask, q.device)
    return q, k, v, dout


def check_accumulate(accumulate, out) -> None:
    """``accumulate=True`` adds to the gradient rows of ``out``, so it needs one."""
    if not isinstance(accumulate, bool):
        raise TypeError(f"accumulate must be a bool, got {type(accumulate).__name__}")
    if accumulate and out is None:
        raise ValueError("accumulate=True adds to the given gradient buffer: pass out=")


def _grad_buffer(name, given, shape, device):
    if given is None:
        return torch.zeros(shape, dtype=torch.float32, device=device)
    if tuple(given.shape) != tuple(shape) or given.dtype != torch.float32 or not given.is_contiguous() \
            or given.device != device:
        raise ValueError(f"{name} must be a contiguous fp32 {tuple(shape)} tensor on {device}, "
                         f"got {given.dtype} {tuple(given.shape)}")
    return given


def attention_bwd_dq(q, k, v, dout, lse, delta, tiles: TileList, mask: KernelMask, scale=None, *,
                     out=None, accumulate=False, config: KernelConfig | None = None, softcap=None):
    """dQ (fp32 [Rq, Hq, D]) over a q-major tile list; only rows of work blocks are written
    (into ``out`` when given, else a fresh zero tensor; ``accumulate=True``: added to ``out``'s rows,
    as a distributed backward sums its stages). ``softcap`` as the forward's."""
    q, k, v, dout = _bwd_common(q, k, v, dout, lse, delta, tiles, mask)
    check_accumulate(accumulate, out)
    Rq, Hq, D = q.shape
    dq = _grad_buffer("out", out, q.shape, q.device)
    if tiles.num_work == 0:
        return dq
    B, T = mask.block_size, mask.total_len
    iv, bits, has_iv, has_bits = _mask_args(mask, q.device)
    scale = _scale(scale, D)
    qk_scale, cap, capped = _score_args(scale, softcap)
    cfg = config or kernel_config("dq", B, D, q.device, softcap=capped)
    attention_bwd_dq_kernel[(tiles.num_work * (B // cfg.block_m) * Hq,)](
        q, k, v, dout, lse, delta, dq, *_tile_args(tiles), iv, bits,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1), lse.stride(0),
        T, Hq, qk_scale, scale, cap,
        GROUP=Hq // k.shape[1], BLOCK=B, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=D, BLOCK_D=block_d(D),
        EVEN_T=(T % B == 0), HAS_INTERVALS=has_iv, HAS_BITS=has_bits, DOT_PREC=_dot_precision(q.dtype),
        SOFTCAP=capped, ACCUMULATE=accumulate, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return dq


def attention_bwd_dkdv(q, k, v, dout, lse, delta, tiles_t: TileList, mask: KernelMask, scale=None, *,
                       out=None, accumulate=False, config: KernelConfig | None = None, softcap=None):
    """(dK, dV) (fp32 [Rk, Hkv, D]) over a kv-major tile list; GQA heads reduced in-program.
    Only rows of work blocks are written (into ``out = (dk, dv)`` when given, else fresh zeros;
    ``accumulate=True``: added to their rows). ``softcap`` as the forward's."""
    q, k, v, dout = _bwd_common(q, k, v, dout, lse, delta, tiles_t, mask)
    check_accumulate(accumulate, out)
    Hq, D = q.shape[1], q.shape[2]
    Hkv = k.shape[1]
    dk = _grad_buffer("out[0]", None if out is None else out[0], k.shape, q.device)
    dv = _grad_buffer("out[1]", None if out is None else out[1], k.shape, q.device)
    if tiles_t.num_work == 0:
        return dk, dv
    B, T = mask.block_size, mask.total_len
    iv, bits, has_iv, has_bits = _mask_args(mask, q.device)
    scale = _scale(scale, D)
    qk_scale, cap, capped = _score_args(scale, softcap)
    cfg = config or kernel_config("dkdv", B, D, q.device, softcap=capped)
    attention_bwd_dkdv_kernel[(tiles_t.num_work * (B // cfg.block_n) * Hkv,)](
        q, k, v, dout, lse, delta, dk, dv, *_tile_args(tiles_t), iv, bits,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        dout.stride(0), dout.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), lse.stride(0),
        T, Hkv, qk_scale, scale, cap,
        GROUP=Hq // Hkv, BLOCK=B, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=D, BLOCK_D=block_d(D),
        EVEN_T=(T % B == 0), HAS_INTERVALS=has_iv, HAS_BITS=has_bits, DOT_PREC=_dot_precision(q.dtype),
        SOFTCAP=capped, ACCUMULATE=accumulate, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return dk, dv


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
