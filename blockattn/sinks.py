"""Learned attention sinks: one extra logit per head in every row's softmax (GPT-OSS).

Notation (docs/design.md): out [R, Hq, D] (R rows: the batch's T, or a rank's local rows), lse [Hq, R]
natural log (fp32; fp64 for an fp64 out, as blockattn/merge.py), sinks [Hq] (any float dtype; natural-log units, as the scores ``scale * q.k``).

A sink is a key that every query sees, with logit ``sinks[h]`` and a zero value: it takes probability
mass and adds nothing to the output. Its attention is the partial (O = 0, LSE = sinks[h]), and merging
it with the attention over the real keys is the one -inf-safe merge of blockattn/merge.py:

    lse' = logaddexp(lse, sink),   out' = exp(lse - lse') * out   (the sink's O is 0)

Why here and not in the kernels: merged once the attention is complete (on a distributed plan, after
each home has merged every rank's partials), it leaves the kernels, plans and exchanges as they are,
and it is exact whatever the tiles. A fully masked row (lse = -inf) attends only to the sink: out 0,
lse' = sink. ``sinks[h] = -inf`` is no sink. The backward is written out (``_SinkMerge``) because
autograd through ``logaddexp`` gives NaN where both sides are -inf.

Gradients: q, k, v through block_attention's backward, which takes the lse gradient this merge
produces; the sinks' gradient on a rank covers that rank's rows, like any weight under context
parallelism: reduce it over the context-parallel group with the other weights' gradients.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from blockattn.merge import merge_weights

__all__ = ["check_sinks", "merge_sinks"]


def check_sinks(sinks, q: torch.Tensor) -> None:
    """TypeError / ValueError unless ``sinks`` is a float tensor [Hq] on q's device (q [R, Hq, D])."""
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor [num_q_heads] of logits (or None), got {type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks must be a floating tensor (logits), got dtype {sinks.dtype}")
    if sinks.dim() != 1 or sinks.shape[0] != q.shape[1]:
        raise ValueError(f"sinks must have shape [num_q_heads] = [{q.shape[1]}] (one logit per query head), "
                         f"got {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"sinks are on {sinks.device} but q is on {q.device}; move them to q's device")


def _weights(lse: torch.Tensor, sinks: torch.Tensor) -> tuple:
    """(lse', weight of the real keys exp(lse - lse'), the sink's exp(sink - lse')), all [Hq, R] in lse's
    dtype: blockattn/merge.py's weights of the two partials (0 on a side that is -inf)."""
    merged, (keep, sink_p) = merge_weights(torch.stack([lse, sinks.detach().to(lse.dtype)[:, None].expand_as(lse)]))
    return merged, keep, sink_p


class _SinkMerge(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, lse, sinks):
        # (in fp32, as merge.py, or fp64 for fp64 results)
        acc = torch.float64 if out.dtype == torch.float64 else torch.float32
        merged, keep, sink_p = _weights(lse.to(acc), sinks)
        new_out = (out.to(acc) * keep.transpose(0, 1)[..., None]).to(out.dtype)
        ctx.save_for_backward(out, keep, sink_p)
        ctx.sinks_dtype = sinks.dtype
        ctx.set_materialize_grads(False)
        return new_out, merged

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out, d_lse):
        out, keep, sink_p = ctx.saved_tensors
        # out' = keep * out with keep = exp(lse - lse'), d keep / d lse = keep * sink_p = -d keep / d sink;
        # d lse' / d lse = keep, d lse' / d sink = sink_p
        acc = keep.dtype
        d_keep = torch.zeros_like(keep) if d_out is None else (d_out.to(acc) * out.to(acc)).sum(-1).transpose(0, 1)
        d_in_lse = d_keep * keep * sink_p
        d_sinks = -d_in_lse
        if d_lse is not None:
            d_lse = torch.nan_to_num(d_lse.to(acc), nan=0.0, posinf=0.0, neginf=0.0)
            d_in_lse = d_in_lse + d_lse * keep
            d_sinks = d_sinks + d_lse * sink_p
        d_in_out = None if d_out is None else (d_out.to(acc) * keep.transpose(0, 1)[..., None]).to(out.dtype)
        return d_in_out, d_in_lse, d_sinks.sum(1).to(ctx.sinks_dtype)


def merge_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple:
    """(out', lse') of attention whose softmax also has the sink logits ``sinks`` [Hq], from the attention
    (out [R, Hq, D], lse [Hq, R]) over the real keys; differentiable in all three (module docstring)."""
    return _SinkMerge.apply(out, lse, sinks)
