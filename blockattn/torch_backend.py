"""Pure-torch blockwise backend: the seven kernel entry points over the same TileList / KernelMask.

A reference for the Triton kernels and an explicit CPU backend (``backend="torch"``). Each work block
gathers its partner blocks' rows and does one dense fp32 softmax over them (no online softmax needed),
so results match the kernels up to fp32 rounding. Notation as in docs/design.md: layout THD,
lse/delta [H, R] fp32 natural log, B block size, T total tokens, ``row`` buffer row, ``glob`` token.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from blockattn.kernels.launch import check_accumulate, check_softcap
from blockattn.kernels.tiles import KernelMask, TileList

__all__ = ["attention_fwd", "merge_partials", "merge_into", "attention_bwd_preprocess", "attention_bwd_dq",
           "attention_bwd_dkdv", "add_grad_rows"]


def _scale(scale, D):
    return 1.0 / math.sqrt(D) if scale is None else float(scale)


def _scores(qf: Tensor, kf: Tensor, scale: float, softcap) -> Tensor:
    """Scores [H, M, N] of fp32 q [H, M, D] and k [H, N, D]: scale * q.k, capped at softcap * tanh(. / softcap)."""
    s = torch.matmul(qf, kf.transpose(1, 2)) * scale
    return s if softcap is None else softcap * torch.tanh(s / softcap)


def _block_rows(row: int, glob: int, B: int, T: int) -> tuple[Tensor, Tensor]:
    """Buffer rows and global indices of a block's valid tokens."""
    n = max(0, min(B, T - glob))
    return torch.arange(row, row + n), torch.arange(glob, glob + n)


class _Lists:
    """Python views of a tile list, so per-work-block loops do not sync on device tensors."""

    def __init__(self, tiles: TileList):
        get = lambda t: t.tolist()  # noqa: E731
        self.work_row, self.work_glob = get(tiles.work_row), get(tiles.work_glob)
        self.full_ptr, self.full_row, self.full_glob = get(tiles.full_ptr), get(tiles.full_row), get(tiles.full_glob)
        self.part_ptr, self.part_row, self.part_glob = get(tiles.part_ptr), get(tiles.part_row), get(tiles.part_glob)
        self.part_bits = get(tiles.part_bits)

    def partners(self, w: int, B: int, T: int):
        """(rows, globs, allowed-builder inputs) of work block w's partners: FULL first, then PARTIAL."""
        segs = []
        for j in range(self.full_ptr[w], self.full_ptr[w + 1]):
            segs.append((self.full_row[j], self.full_glob[j], None))
        for j in range(self.part_ptr[w], self.part_ptr[w + 1]):
            segs.append((self.part_row[j], self.part_glob[j], self.part_bits[j]))
        rows, globs, kinds = [], [], []
        for row, glob, bits in segs:
            r, g = _block_rows(row, glob, B, T)
            rows.append(r)
            globs.append(g)
            kinds.append((bits, g.numel()))
        if not rows:
            return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), []
        return torch.cat(rows), torch.cat(globs), kinds


def _allowed(mask: KernelMask, q_glob: Tensor, k_glob: Tensor, kinds, q_major: bool) -> Tensor:
    """[len(q_glob), len(k_glob)] exact mask; ``kinds`` describes the partner segments (bits index or None)."""
    if q_major:
        seg_axis_len = k_glob.numel()
    else:
        seg_axis_len = q_glob.numel()
    allowed = torch.ones(q_glob.numel(), k_glob.numel(), dtype=torch.bool)
    if mask.intervals is not None:
        iv = mask.intervals.cpu().long()
        lo1, hi1, lo2, hi2 = (iv[i, q_glob][:, None] for i in range(4))
        k = k_glob[None, :]
        interval = ((k >= lo1) & (k < hi1)) | ((k >= lo2) & (k < hi2))
    start = 0
    B = mask.block_size
    for bits, n in kinds:
        sl = slice(start, start + n)
        start += n
        if bits is None:
            continue  # FULL segment
        if bits >= 0:
            tile = mask.bits[bits].cpu().bool()
            if q_major:
                allowed[:, sl] = tile[(q_glob % B)][:, (k_glob[sl] % B)]
            else:
                allowed[sl, :] = tile[(q_glob[sl] % B)][:, (k_glob % B)]
        elif mask.intervals is not None:
            if q_major:
                allowed[:, sl] = interval[:, sl]
            else:
                allowed[sl, :] = interval[sl, :]
        else:
            raise ValueError("a partial tile has bits index -1 but the KernelMask has no intervals")
    assert start == seg_axis_len
    return allowed


def _group(t: Tensor, G: int) -> Tensor:
    """[R, Hkv, D] -> [Hkv*G, R, D] with kv heads repeated for their q heads (fp32)."""
    return t.float().transpose(0, 1).repeat_interleave(G, dim=0)


def attention_fwd(q, k, v, tiles: TileList, mask: KernelMask, scale=None, *, out=None, lse=None,
                  accumulate=False, softcap=None):
    """Torch twin of ``blockattn.kernels.attention_fwd`` (same arguments and results)."""
    Rq, Hq, D = q.shape
    G = Hq // k.shape[1]
    B, T = mask.block_size, mask.total_len
    scale = _scale(scale, D)
    check_softcap(softcap)
    if accumulate and (out is None or lse is None):
        raise ValueError("accumulate=True needs the running state: pass out= and lse=")
    if out is None:
        out = torch.zeros_like(q)
    if lse is None:
        lse = torch.full((Hq, Rq), float("-inf"), dtype=torch.float32, device=q.device)
    lists = _Lists(tiles)
    for w in range(len(lists.work_row)):
        q_rows, q_glob = _block_rows(lists.work_row[w], lists.work_glob[w], B, T)
        if q_rows.numel() == 0:
            continue
        k_rows, k_glob, kinds = lists.partners(w, B, T)
        allowed = _allowed(mask, q_glob, k_glob, kinds, q_major=True).to(q.device)
        qf = q[q_rows].float().transpose(0, 1)                     # [Hq, M, D]
        s = _scores(qf, _group(k[k_rows], G), scale, softcap).masked_fill(~allowed, float("-inf"))
        l_new = torch.logsumexp(s, dim=-1) if k_rows.numel() else torch.full(qf.shape[:2], float("-inf"))
        p = torch.exp(s - torch.where(torch.isinf(l_new), 0.0, l_new)[..., None])
        o_new = torch.matmul(p, _group(v[k_rows], G))              # [Hq, M, D]
        if accumulate:
            l_old = lse[:, q_rows]
            o_old = out[q_rows].float().transpose(0, 1)
            l_tot = torch.logaddexp(l_old, l_new)
            safe = torch.where(torch.isinf(l_tot), 0.0, l_tot)
            w_old = torch.where(torch.isinf(l_old), 0.0, torch.exp(l_old - safe))
            w_new = torch.where(torch.isinf(l_new), 0.0, torch.exp(l_new - safe))
            o_new = w_old[..., None] * torch.nan_to_num(o_old) + w_new[..., None] * o_new
            l_new = l_tot
        out[q_rows] = o_new.transpose(0, 1).to(out.dtype)
        lse[:, q_rows] = l_new
    return out, lse


def merge_partials(outs, lses):
    """Torch twin of ``blockattn.kernels.merge_partials``: N partials [N, R, H, D] / [N, H, R]."""
    if isinstance(outs, (list, tuple)):
        if len(outs) == 0 or len(outs) != len(lses):
            raise ValueError(f"merge_partials needs as many lses as outs (>= 1), got {len(outs)} and {len(lses)}")
        outs, lses = torch.stack(list(outs)), torch.stack(list(lses))
    m = lses.max(dim=0).values
    m_safe = torch.where(torch.isinf(m), 0.0, m)
    weights = torch.exp(lses - m_safe)                              # 0 for empty partials
    total = weights.sum(0)
    o = torch.where(weights.permute(0, 2, 1)[..., None] > 0,
                    weights.permute(0, 2, 1)[..., None] * outs.float(), 0.0).sum(0)
    nonempty = total > 0
    out = torch.where(nonempty.t()[..., None], o / torch.where(nonempty, total, 1.0).t()[..., None], 0.0)
    lse = torch.where(nonempty, m_safe + torch.log(torch.where(nonempty, total, 1.0)), float("-inf"))
    return out.to(outs.dtype), lse.float()


def merge_into(out, lse, rows, part_out, part_lse):
    """Torch twin of ``blockattn.kernels.merge_into``: the running rows gathered, merged, scattered back."""
    rows = rows.long()
    merged_out, merged_lse = merge_partials([out[rows], part_out.to(out.dtype)], [lse[:, rows], part_lse])
    out[rows] = merged_out
    lse[:, rows] = merged_lse
    return out, lse


def attention_bwd_preprocess(out, dout):
    """delta [H, R] fp32 = rowsum(out * dout)."""
    return (out.float() * dout.float()).sum(-1).t().contiguous()


def _p_and_ds(qf, kf, vf, dof, lse_rows, delta_rows, allowed, scale, softcap):
    """P and dS of one (q rows x k rows) group, per head: [H, M, N]; dS of the scaled scores before any cap."""
    s = _scores(qf, kf, scale, softcap)
    lse_safe = torch.where(torch.isinf(lse_rows), float("inf"), lse_rows)
    p = torch.where(allowed, torch.exp(s - lse_safe[..., None]), 0.0)
    dp = torch.matmul(dof, vf.transpose(1, 2))
    ds = p * (dp - delta_rows[..., None])
    return p, ds if softcap is None else ds * (1.0 - (s / softcap) ** 2)


def attention_bwd_dq(q, k, v, dout, lse, delta, tiles: TileList, mask: KernelMask, scale=None, *, out=None,
                     accumulate=False, softcap=None):
    """Torch twin of ``blockattn.kernels.attention_bwd_dq``: fp32 dq [Rq, Hq, D] (``accumulate``: added to
    ``out``'s rows)."""
    check_accumulate(accumulate, out)
    Rq, Hq, D = q.shape
    G = Hq // k.shape[1]
    B, T = mask.block_size, mask.total_len
    scale = _scale(scale, D)
    check_softcap(softcap)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if out is None else out
    lists = _Lists(tiles)
    for w in range(len(lists.work_row)):
        q_rows, q_glob = _block_rows(lists.work_row[w], lists.work_glob[w], B, T)
        k_rows, k_glob, kinds = lists.partners(w, B, T)
        if q_rows.numel() == 0:
            continue
        if k_rows.numel() == 0:
            if not accumulate:
                dq[q_rows] = 0.0
            continue
        allowed = _allowed(mask, q_glob, k_glob, kinds, q_major=True).to(q.device)
        kf = _group(k[k_rows], G)
        _, ds = _p_and_ds(q[q_rows].float().transpose(0, 1), kf, _group(v[k_rows], G),
                          dout[q_rows].float().transpose(0, 1), lse[:, q_rows], delta[:, q_rows], allowed, scale,
                          softcap)
        grad = (torch.matmul(ds, kf) * scale).transpose(0, 1)
        dq[q_rows] = dq[q_rows] + grad if accumulate else grad
    return dq


def attention_bwd_dkdv(q, k, v, dout, lse, delta, tiles_t: TileList, mask: KernelMask, scale=None, *,
                       out=None, accumulate=False, softcap=None):
    """Torch twin of ``blockattn.kernels.attention_bwd_dkdv``: fp32 (dk, dv) [Rk, Hkv, D] (``accumulate``:
    added to ``out``'s rows)."""
    check_accumulate(accumulate, out)
    Rq, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    B, T = mask.block_size, mask.total_len
    scale = _scale(scale, D)
    check_softcap(softcap)
    if out is None:
        out = (torch.zeros(k.shape, dtype=torch.float32, device=q.device),
               torch.zeros(k.shape, dtype=torch.float32, device=q.device))
    dk, dv = out
    lists = _Lists(tiles_t)
    for w in range(len(lists.work_row)):
        k_rows, k_glob = _block_rows(lists.work_row[w], lists.work_glob[w], B, T)
        q_rows, q_glob, kinds = lists.partners(w, B, T)
        if k_rows.numel() == 0:
            continue
        if q_rows.numel() == 0:
            if not accumulate:
                dk[k_rows] = 0.0
                dv[k_rows] = 0.0
            continue
        allowed = _allowed(mask, q_glob, k_glob, kinds, q_major=False).to(q.device)
        qf = q[q_rows].float().transpose(0, 1)
        dof = dout[q_rows].float().transpose(0, 1)
        p, ds = _p_and_ds(qf, _group(k[k_rows], G), _group(v[k_rows], G), dof,
                          lse[:, q_rows], delta[:, q_rows], allowed, scale, softcap)
        dv_h = torch.matmul(p.transpose(1, 2), dof)                 # [Hq, N, D]
        dk_h = torch.matmul(ds.transpose(1, 2), qf) * scale
        dk_w = dk_h.view(Hkv, G, -1, D).sum(1).transpose(0, 1)
        dv_w = dv_h.view(Hkv, G, -1, D).sum(1).transpose(0, 1)
        dk[k_rows] = dk[k_rows] + dk_w if accumulate else dk_w
        dv[k_rows] = dv[k_rows] + dv_w if accumulate else dv_w
    return dk, dv


def add_grad_rows(dst, rows, src):
    """Torch twin of ``blockattn.kernels.add_grad_rows``: ``dst.index_add_`` of ``src`` in fp32."""
    return dst.index_add_(0, rows.long(), src.to(torch.float32))
