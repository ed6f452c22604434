"""The one -inf-safe merge of partial attention results, in torch.

Partials over disjoint key sets of the same rows combine as
``lse = logaddexp(lse_a, lse_b)``, ``out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b``,
with weight 0 for a partial whose lse is -inf (it saw no key). ``kernels/merge.py`` is the Triton
twin of this file; tests hold the two to the same results.

Layout: ``out [R, H, D]`` (any float dtype), ``lse [H, R]`` fp32/fp64 natural log.
"""

from __future__ import annotations

from typing import Sequence

import torch


def _check_pair(out: torch.Tensor, lse: torch.Tensor, name: str) -> None:
    if out.dim() != 3 or lse.dim() != 2 or lse.shape != (out.shape[1], out.shape[0]):
        raise ValueError(f"{name}: expected out [R, H, D] and lse [H, R], got out {tuple(out.shape)}, lse {tuple(lse.shape)}")


def merge_weights(lse_stack: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(merged lse [H, R], each partial's weight exp(lse_i - lse) [N, H, R]) of partials with lses
    ``lse_stack`` [N, H, R]: weight 0 for an empty partial, and lse -inf only where every partial is empty."""
    lse = torch.logsumexp(lse_stack, dim=0)  # -inf where every partial is empty
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return lse, torch.exp(lse_stack - safe)  # exp(-inf) = 0 for empty partials


def merge_many(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge N partial (out, lse) results of the same rows; returns (out in outs[0].dtype, lse fp32)."""
    if len(outs) == 0 or len(outs) != len(lses):
        raise ValueError(f"need the same positive number of outs and lses, got {len(outs)} and {len(lses)}")
    for i, (o, l) in enumerate(zip(outs, lses)):
        _check_pair(o, l, f"partial {i}")
        if o.shape != outs[0].shape:
            raise ValueError(f"partial {i} has out shape {tuple(o.shape)}, partial 0 has {tuple(outs[0].shape)}")
    acc_dtype = torch.float64 if outs[0].dtype == torch.float64 else torch.float32
    lse, weights = merge_weights(torch.stack([l.to(acc_dtype) for l in lses]))
    out = torch.zeros(outs[0].shape, dtype=acc_dtype, device=outs[0].device)
    for w, o in zip(weights, outs):
        out += w.transpose(0, 1).unsqueeze(-1) * o.to(acc_dtype)
    return out.to(outs[0].dtype), lse.to(lses[0].dtype if lses[0].dtype == torch.float64 else torch.float32)


def merge_partials(out_a, lse_a, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial results of the same rows (see module docstring)."""
    return merge_many([out_a, out_b], [lse_a, lse_b])
