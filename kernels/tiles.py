"""Tile lists and kernel masks: the only sparsity description the kernels see.

Notation (docs/design.md): T total tokens, B block size, nB = ceil(T / B) blocks, qb / kb q- and
kv-block indices. A *work block* is the block a program owns (q-block for forward and dQ, kv-block
for dK/dV); its *partners* are the blocks it meets (kv-blocks, resp. q-blocks), split FULL / PARTIAL.
``row`` is the first buffer row of a block (buffers may hold gathered blocks in any order), ``glob``
the global index of its first token (used for masks and for the valid length ``min(B, T - glob)``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = ["KernelMask", "TileList"]


def _as_int32(name: str, value, device=None) -> Tensor:
    """Convert an index sequence to a contiguous int32 tensor, refusing non-integer input."""
    if isinstance(value, Tensor):
        if value.dtype.is_floating_point or value.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got dtype {value.dtype}")
        t = value
    else:
        t = torch.as_tensor(value, dtype=torch.int64)
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    # (int32 fits by construction: no range check, which on a GPU tensor would wait for the device)
    if t.dtype != torch.int32 and t.numel() and (int(t.min()) < -(2**31) or int(t.max()) >= 2**31):
        raise ValueError(f"{name} does not fit int32 (range {int(t.min())}..{int(t.max())})")
    return t.to(device=device if device is not None else t.device, dtype=torch.int32).contiguous()


def _int64_array(value) -> np.ndarray:
    """A flat int64 numpy copy of an index sequence (a tensor, an array or a list)."""
    if isinstance(value, Tensor):
        value = value.detach().cpu().numpy()
    return np.asarray(value).astype(np.int64).reshape(-1)


@dataclass(frozen=True)
class KernelMask:
    """Exact mask of the partial tiles, in global token coordinates.

    ``intervals`` int32 [4, T] (rows lo1, hi1, lo2, hi2: q attends k iff lo1<=k<hi1 or lo2<=k<hi2) or
    ``bits`` uint8 [n_partial_tiles, B, B] (q-major tile order of the BlockMask); at least one of them
    whenever some tile is partial. A tile list entry with ``part_bits >= 0`` uses ``bits``, -1 uses
    ``intervals``.
    """

    total_len: int
    block_size: int
    intervals: Tensor | None = None
    bits: Tensor | None = None

    def __post_init__(self):
        if not isinstance(self.total_len, int) or self.total_len < 1:
            raise ValueError(f"KernelMask.total_len must be a positive int, got {self.total_len!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"KernelMask.block_size must be a positive int, got {self.block_size!r}")
        if self.intervals is not None:
            iv = self.intervals
            if iv.dtype != torch.int32 or tuple(iv.shape) != (4, self.total_len):
                raise ValueError(
                    f"KernelMask.intervals must be int32 [4, T={self.total_len}], got "
                    f"{iv.dtype} {tuple(iv.shape)}; convert with .to(torch.int32)")
            if not iv.is_contiguous():
                object.__setattr__(self, "intervals", iv.contiguous())
        if self.bits is not None:
            b = self.bits
            B = self.block_size
            if b.dim() != 3 or tuple(b.shape[1:]) != (B, B):
                raise ValueError(f"KernelMask.bits must be [n_partial, B={B}, B={B}], got {tuple(b.shape)}")
            if b.dtype == torch.bool:
                b = b.to(torch.uint8)  # Triton loads bytes; bool tensors are passed as int1 pointers
            if b.dtype != torch.uint8:
                raise ValueError(f"KernelMask.bits must be bool or uint8, got {b.dtype}")
            object.__setattr__(self, "bits", b.contiguous())

    @property
    def device(self) -> torch.device | None:
        t = self.intervals if self.intervals is not None else self.bits
        return None if t is None else t.device

    def to(self, device) -> "KernelMask":
        """The same mask with its tensors on ``device``."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return KernelMask(self.total_len, self.block_size, move(self.intervals), move(self.bits))

    @staticmethod
    def from_block_mask(bm, device=None) -> "KernelMask":
        """The kernel mask of a ``BlockMask`` (intervals when the mask has them, else tile bitmasks)."""
        device = torch.device("cpu") if device is None else torch.device(device)
        iv = getattr(bm, "row_intervals", None)
        bits = getattr(bm, "part_bits", None)
        if iv is not None:
            iv = iv.to(device=device, dtype=torch.int32)
            bits = None
        elif bits is not None:
            bits = bits.to(device=device, dtype=torch.uint8)
        return KernelMask(int(bm.total_len), int(bm.block_size), iv, bits)


@dataclass(frozen=True)
class TileList:
    """Work blocks and, per work block, its FULL and PARTIAL partner blocks (CSR, int32)."""

    work_row: Tensor
    work_glob: Tensor
    full_ptr: Tensor
    full_row: Tensor
    full_glob: Tensor
    part_ptr: Tensor
    part_row: Tensor
    part_glob: Tensor
    part_bits: Tensor

    def __post_init__(self):
        names = ("work_row", "work_glob", "full_ptr", "full_row", "full_glob",
                 "part_ptr", "part_row", "part_glob", "part_bits")
        device = self.work_row.device if isinstance(self.work_row, Tensor) else None
        for name in names:
            object.__setattr__(self, name, _as_int32(f"TileList.{name}", getattr(self, name), device))
        n = self.work_row.numel()
        if self.work_glob.numel() != n:
            raise ValueError(f"TileList: work_row has {n} entries but work_glob {self.work_glob.numel()}")
        for kind in ("full", "part"):
            ptr = getattr(self, f"{kind}_ptr")
            if ptr.numel() != n + 1:
                raise ValueError(f"TileList.{kind}_ptr must have n+1={n + 1} entries, got {ptr.numel()}")
            nnz = getattr(self, f"{kind}_row").numel()
            if getattr(self, f"{kind}_glob").numel() != nnz:
                raise ValueError(f"TileList.{kind}_row and {kind}_glob differ in length")
            if ptr.device.type == "cpu":  # device-side lists are validated where they were built
                if int(ptr[0]) != 0 or int(ptr[-1]) != nnz or (n and bool((ptr[1:] < ptr[:-1]).any())):
                    raise ValueError(f"TileList.{kind}_ptr must rise from 0 to {nnz}, got {ptr.tolist()[:8]}...")
        if self.part_bits.numel() != self.part_row.numel():
            raise ValueError(f"TileList.part_bits must have one entry per partial tile "
                             f"({self.part_row.numel()}), got {self.part_bits.numel()}")

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def num_work(self) -> int:
        return self.work_row.numel()

    @property
    def num_full(self) -> int:
        return self.full_row.numel()

    @property
    def num_partial(self) -> int:
        return self.part_row.numel()

    @property
    def device(self) -> torch.device:
        return self.work_row.device

    def to(self, device) -> "TileList":
        """The same list with its tensors on ``device``."""
        return TileList(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))

    def work_order(self) -> Tensor:
        """Work blocks ordered by decreasing tile count (longest first: better tail balance)."""
        counts = (self.full_ptr[1:] - self.full_ptr[:-1]) + (self.part_ptr[1:] - self.part_ptr[:-1])
        return torch.argsort(counts, descending=True, stable=True).to(torch.int32)

    # -- constructors --------------------------------------------------------------------------
    @staticmethod
    def build(work_row, work_glob, full_ptr, full_row, full_glob, part_ptr, part_row, part_glob,
              part_bits=None, device=None) -> "TileList":
        """A tile list from CSR pieces in buffer coordinates (``part_bits`` defaults to all -1)."""
        if part_bits is None:
            part_bits = torch.full((len(part_row),), -1, dtype=torch.int32)
        parts = [work_row, work_glob, full_ptr, full_row, full_glob, part_ptr, part_row, part_glob, part_bits]
        tensors = [_as_int32(f"arg{i}", p) for i, p in enumerate(parts)]
        tl_cpu = TileList(*tensors)
        return tl_cpu if device is None else tl_cpu.to(device)

    @staticmethod
    def from_tiles(work_block, partner_block, is_full, *, block_size: int, work_blocks=None,
                   work_row_of=None, partner_row_of=None, bits_index=None, device=None) -> "TileList":
        """Group (work block, partner block) tiles into a tile list.

        ``work_block``/``partner_block`` are global block indices per tile, ``is_full`` bool per tile,
        ``bits_index`` the KernelMask.bits index of each partial tile (-1 or None: intervals).
        ``work_blocks`` lists every work block to emit (default: the distinct work blocks, ascending) —
        include blocks without tiles to have their rows written as empty (O = 0, LSE = -inf).
        ``work_row_of``/``partner_row_of`` map a global block index to its first buffer row
        (a LongTensor indexed by block, or None for ``row = block * block_size``).
        """
        # (in numpy: its calls cost a fraction of torch's on these small arrays, and every training step
        # builds a rank's tile lists afresh for its new plan, blockattn/rank_program.py)
        wb, pb = _int64_array(work_block), _int64_array(partner_block)
        full = (is_full.detach().cpu().numpy() if isinstance(is_full, Tensor) else np.asarray(is_full)).astype(bool)
        full = full.reshape(-1)
        if not (wb.size == pb.size == full.size):
            raise ValueError(f"from_tiles: work_block ({wb.size}), partner_block ({pb.size}) and "
                             f"is_full ({full.size}) must have one entry per tile")
        bidx = np.full(wb.size, -1, dtype=np.int64) if bits_index is None else _int64_array(bits_index)
        if bidx.size != wb.size:
            raise ValueError(f"from_tiles: bits_index needs one entry per tile, got {bidx.size}")
        works = np.unique(wb) if work_blocks is None else _int64_array(work_blocks)
        if work_blocks is not None and wb.size and not np.isin(wb, works).all():
            raise ValueError("from_tiles: some tiles belong to a work block not listed in work_blocks")
        B = int(block_size)
        size = max(int(works.max()) if works.size else -1, int(wb.max()) if wb.size else -1) + 1
        pos = np.full(size, -1, dtype=np.int64)
        pos[works] = np.arange(works.size)
        slot = pos[wb]
        row_w = works * B if work_row_of is None else _int64_array(work_row_of)[works]
        row_p = pb * B if partner_row_of is None else _int64_array(partner_row_of)[pb]
        stride = int(pb.max()) + 1 if pb.size else 1

        def csr(sel):
            # sort by (work slot, partner block) so partner lists ascend like the BlockMask's
            order = sel[np.argsort(slot[sel] * stride + pb[sel], kind="stable")]
            ptr = np.zeros(works.size + 1, dtype=np.int64)
            np.cumsum(np.bincount(slot[sel], minlength=works.size), out=ptr[1:])
            return ptr, row_p[order], pb[order] * B, bidx[order]

        fptr, frow, fglob, _ = csr(np.flatnonzero(full))
        pptr, prow, pglob, pbits = csr(np.flatnonzero(~full))
        return TileList.build(row_w, works * B, fptr, frow, fglob, pptr, prow, pglob, pbits, device=device)

    @staticmethod
    def from_block_mask(bm, transposed: bool = False, device=None) -> "TileList":
        """Single-device tile list of a BlockMask (``row == glob``); every block is a work block.

        ``transposed=False``: work = q-blocks, partners = kv-blocks (forward, dQ).
        ``transposed=True``: work = kv-blocks, partners = q-blocks (dK/dV).
        """
        B, nB = int(bm.block_size), int(bm.num_blocks)
        glob = torch.arange(nB, dtype=torch.int64) * B
        has_bits = getattr(bm, "row_intervals", None) is None and getattr(bm, "part_bits", None) is not None
        if transposed:
            full_ptr, full_idx = bm.full_q_ptr, bm.full_q_idx
            part_ptr, part_idx = bm.part_q_ptr, bm.part_q_idx
            bits = bm.part_q_tile.to(torch.int64) if has_bits else None
        else:
            full_ptr, full_idx = bm.full_kv_ptr, bm.full_kv_idx
            part_ptr, part_idx = bm.part_kv_ptr, bm.part_kv_idx
            bits = torch.arange(part_idx.numel(), dtype=torch.int64) if has_bits else None
        full_blk = full_idx.to(torch.int64) * B
        part_blk = part_idx.to(torch.int64) * B
        if bits is None:
            bits = torch.full((part_idx.numel(),), -1, dtype=torch.int64)
        return TileList.build(glob, glob, full_ptr, full_blk, full_blk, part_ptr, part_blk, part_blk,
                              bits, device=device)
