"""Learned attention sinks (blockattn/sinks.py): values and gradients of q, k, v and the sinks against the
float64 reference's softmax with a sink column, on both backends; the sink merge is the one merge with
the partial (O = 0, LSE = sink); a -inf sink is no sink; -inf on both sides stays NaN-free; bad sinks."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from blockattn import MaskSpec, block_attention  # noqa: E402
from blockattn.merge import merge_partials  # noqa: E402
from blockattn.reference import attention as reference  # noqa: E402
from blockattn.sinks import merge_sinks  # noqa: E402

FACTOR = 4.0  # as tests/test_kernels.py: error <= FACTOR x the same-dtype eager error + ATOL
ATOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2}
# rows q % 7 == 3 see no key: they attend only to the sink
HOLES = MaskSpec.from_mask_mod(lambda q, k: (k <= q) & (q % 7 != 3), 75)


def _inputs(T, Hq, Hkv, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (Hq, Hkv, Hkv))
    sinks = torch.randn(Hq, generator=g) * 2
    w_out, w_lse = torch.randn(T, Hq, D, generator=g), torch.randn(Hq, T, generator=g)
    return q, k, v, sinks, w_out, w_lse


def _grads(fn, leaves, w_out, w_lse):
    """(out, lse, grads of ``leaves``) of a loss through both outputs."""
    leaves = [t.requires_grad_() for t in leaves]
    out, lse = fn(*leaves)
    loss = (out.double() * w_out.double()).sum() + (lse.double() * w_lse.double()).sum()
    return [out.detach(), lse.detach()] + list(torch.autograd.grad(loss, leaves))


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", [HOLES, MaskSpec.documents([30, 1, 44]) & MaskSpec.sliding_window(75, 9)],
                         ids=["empty_rows", "window_docs"])
def test_values_and_gradients_match_the_reference(backend, dtype, spec):
    T = spec.total_len
    q, k, v, sinks, w_out, w_lse = _inputs(T, 4, 2, 16)
    got = _grads(lambda q, k, v, s: block_attention(q, k, v, spec, sinks=s, return_lse=True, backend=backend,
                                                    block_size=16),
                 [t.to(dtype) for t in (q, k, v)] + [sinks], w_out, w_lse)
    ref = _grads(lambda q, k, v, s: reference(q, k, v, spec, sinks=s),
                 [t.double() for t in (q, k, v, sinks)], w_out, w_lse)
    eager = _grads(lambda q, k, v, s: reference(q, k, v, spec, sinks=s, dtype=dtype),
                   [t.to(dtype) for t in (q, k, v)] + [sinks.to(dtype)], w_out, w_lse)
    assert got[0].dtype == dtype and got[5].dtype == torch.float32  # (the sinks' gradient in their dtype)
    assert torch.isfinite(got[1]).all(), "every row sees its sink: lse is finite"
    for name, g, r, e in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), got, ref, eager):
        err = (g.double() - r).abs().max().item()
        bound = FACTOR * (e.double() - r).abs().max().item() + ATOL[dtype]
        assert err <= bound, f"{name}: error {err:.3g} > bound {bound:.3g}"
    empty = torch.arange(T) % 7 == 3
    if spec is HOLES:  # a row with no key: out 0, lse = its head's sink
        assert (got[0][empty] == 0).all()
        torch.testing.assert_close(got[1][:, empty], sinks[:, None].expand(4, int(empty.sum())).to(torch.float32))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 9), st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_the_sink_is_a_merged_partial_and_minus_infinity_is_none(R, H, seed):
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(R, H, 4, generator=g, dtype=torch.float64)
    lse = torch.randn(H, R, generator=g, dtype=torch.float64)
    lse[torch.rand(H, R, generator=g) < 0.3] = float("-inf")  # rows that saw no key
    out[torch.isinf(lse).transpose(0, 1)] = 0.0
    sinks = torch.randn(H, generator=g, dtype=torch.float64)
    sinks[torch.rand(H, generator=g) < 0.3] = float("-inf")  # heads without a sink
    got_out, got_lse = merge_sinks(out, lse, sinks)
    want_out, want_lse = merge_partials(out, lse, torch.zeros_like(out), sinks[:, None].expand(H, R))
    torch.testing.assert_close(got_out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-12, atol=1e-12)
    none = torch.isinf(sinks)
    assert torch.equal(got_out[:, none], out[:, none])  # -inf: the identity
    # gradients are finite even where both sides are -inf
    leaves = [t.clone().requires_grad_() for t in (out, lse, sinks)]
    o, l = merge_sinks(*leaves)
    ((o * 1.5).sum() + torch.nan_to_num(l, neginf=0.0).sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in leaves)
    assert (leaves[2].grad[none] == 0).all()


def test_bad_sinks_raise():
    q, k, v, sinks, _, _ = _inputs(20, 4, 2, 16)
    spec = MaskSpec.causal(20)
    for bad, err, words in [
        (sinks[:3], ValueError, "shape [num_q_heads] = [4]"),
        (sinks[None], ValueError, "shape [num_q_heads]"),
        (sinks.long(), TypeError, "floating"),
        ([0.0] * 4, TypeError, "torch.Tensor"),
        (sinks.to("meta"), ValueError, "move them to q's device"),
    ]:
        with pytest.raises(err, match=words.replace("[", r"\[").replace("]", r"\]")):
            block_attention(q, k, v, spec, sinks=bad, block_size=16)
