"""Dense float64 reference attention: the ground truth every kernel and plan is tested against."""

from __future__ import annotations

import math
from typing import Optional

import torch

from blockattn.masks import MaskSpec


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask_spec: MaskSpec,
    softmax_scale: Optional[float] = None,
    *,
    dtype: torch.dtype = torch.float64,
    sinks: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention in ``dtype`` (float64 by default), dense, THD layout.

    q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` (GQA when ``Hq % Hkv == 0``). Returns ``out [T, Hq, D]``
    and ``lse [Hq, T]`` (natural log). Fully masked rows give ``out = 0`` and ``lse = -inf``.
    Pass ``dtype=q.dtype`` to get the same-dtype eager result used to size test tolerances.
    ``sinks [Hq]``: learned sink logits, a key column every row sees with a zero value (GPT-OSS's
    softmax over the scores and the sink, the sink's probability dropped); lse includes it.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"expected q, k, v of shape [T, H, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    T, Hq, D = q.shape
    if k.shape != v.shape or k.shape[0] != T or k.shape[2] != D:
        raise ValueError(f"k and v must be [T={T}, Hkv, D={D}], got k {tuple(k.shape)}, v {tuple(v.shape)}")
    Hkv = k.shape[1]
    if Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
    if mask_spec.total_len != T:
        raise ValueError(f"mask_spec.total_len = {mask_spec.total_len} but q has T = {T} tokens")
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)

    group = Hq // Hkv
    qf = q.to(dtype).transpose(0, 1)  # [Hq, T, D]
    kf = k.to(dtype).transpose(0, 1).repeat_interleave(group, dim=0)
    vf = v.to(dtype).transpose(0, 1).repeat_interleave(group, dim=0)
    allowed = mask_spec.to_dense().to(q.device)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:  # (the sink column joins the normalizer only: its value is zero)
        column = sinks.to(dtype)[:, None, None].expand(Hq, T, 1)
        lse = torch.logsumexp(torch.cat([scores, column], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(scores, dim=-1)  # -inf on fully masked rows
    # exp(-inf - (-inf)) would be NaN; a fully masked row has no probability mass at all.
    safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - safe_lse.unsqueeze(-1))
    out = torch.matmul(probs, vf).transpose(0, 1).contiguous()
    return out.to(dtype), lse.to(torch.float32 if dtype != torch.float64 else dtype)
