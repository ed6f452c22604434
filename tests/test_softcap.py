"""Logit soft-capping (Gemma 2): scores ``c * tanh(scale * q.k / c)`` in the kernels' forward and backward
and in the torch backend, against the float64 reference (errors bounded by the same-dtype eager error);
the fused accumulate path; a huge cap is no cap; bad caps raise."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from blockattn import MaskSpec, block_attention  # noqa: E402
from blockattn.attention import _device_tiles  # noqa: E402
from blockattn.backend import get_backend  # noqa: E402
from blockattn.kernels.mask_tile import tanh  # noqa: E402
from blockattn.reference import attention as reference  # noqa: E402

FACTOR = 4.0  # as tests/test_kernels.py: error <= FACTOR x the same-dtype eager error + ATOL
ATOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2}
CAP = 2.0  # small against the scores below (|scale * q.k| up to ~10): most scores sit on the tanh's bend


def _inputs(T, Hq, Hkv, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(T, h, D, generator=g) * s for h, s in ((Hq, 2.0), (Hkv, 2.0), (Hkv, 1.0)))
    return q, k, v, torch.randn(T, Hq, D, generator=g), torch.randn(Hq, T, generator=g)


def _grads(fn, leaves, w_out, w_lse):
    leaves = [t.requires_grad_() for t in leaves]
    out, lse = fn(*leaves)
    loss = (out.double() * w_out.double()).sum() + (torch.nan_to_num(lse.double(), neginf=0.0) * w_lse.double()).sum()
    return [out.detach(), lse.detach()] + list(torch.autograd.grad(loss, leaves))


def _check(got, ref, eager, dtype):
    for name, g, r, e in zip(("out", "lse", "dq", "dk", "dv"), got, ref, eager):
        finite = torch.isfinite(r)
        assert torch.equal(torch.isfinite(g), finite), f"{name}: -inf pattern differs from the reference"
        err = (g.double() - r)[finite].abs().max().item()
        bound = FACTOR * (e.double() - r)[finite].abs().max().item() + ATOL[dtype]
        assert err <= bound, f"{name}: error {err:.3g} > bound {bound:.3g}"


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec, D", [
    # rows q % 7 == 3 see no key (bitmask tiles): out 0, lse -inf, as without a cap
    (MaskSpec.from_mask_mod(lambda q, k: (k <= q) & (q % 7 != 3), 75), 16),
    (MaskSpec.documents([30, 1, 44]) & MaskSpec.sliding_window(75, 9), 24),  # intervals; head dim 24 in 32
], ids=["bits_empty_rows", "intervals_d24"])
def test_capped_values_and_gradients_match_the_reference(backend, dtype, spec, D):
    T = spec.total_len
    q, k, v, w_out, w_lse = _inputs(T, 4, 2, D)
    got = _grads(lambda q, k, v: block_attention(q, k, v, spec, softcap=CAP, return_lse=True, backend=backend,
                                                 block_size=16),
                 [t.to(dtype) for t in (q, k, v)], w_out, w_lse)
    ref = _grads(lambda q, k, v: reference(q, k, v, spec, softcap=CAP), [t.double() for t in (q, k, v)], w_out, w_lse)
    eager = _grads(lambda q, k, v: reference(q, k, v, spec, softcap=CAP, dtype=dtype), [t.to(dtype) for t in (q, k, v)],
                   w_out, w_lse)
    _check(got, ref, eager, dtype)
    # the cap changes the result: these inputs are far from the uncapped attention
    plain, _ = reference(*(t.double() for t in (q, k, v)), spec)
    assert (plain - ref[0]).abs().max() > 0.1


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_the_fused_accumulate_folds_capped_partials(backend):
    """Two key halves run in turn with accumulate=True (the distributed forward's fused merge) equal one
    capped attention over all keys."""
    T = 64
    spec = MaskSpec.causal(T)
    q, k, v, _, _ = _inputs(T, 4, 2, 16)
    be = get_backend(backend)
    halves = [spec & MaskSpec.from_mask_mod(lambda qi, ki, h=h: (ki // 16) % 2 == h, T) for h in (0, 1)]
    out = lse = None
    for part in halves:
        tiles, _, kmask = _device_tiles(part.block_mask(16), q.device)
        out, lse = be.attention_fwd(q, k, v, tiles, kmask, None, out=out, lse=lse, accumulate=out is not None,
                                    softcap=CAP)
    ref_out, ref_lse = reference(q.double(), k.double(), v.double(), spec, softcap=CAP)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=1e-5)


def test_a_cap_far_above_the_scores_is_no_cap():
    spec = MaskSpec.lambda_mask(60, 4, 20)
    q, k, v, _, _ = _inputs(60, 2, 2, 16)
    capped = block_attention(q, k, v, spec, softcap=1e6, block_size=16)
    plain = block_attention(q, k, v, spec, block_size=16)
    torch.testing.assert_close(capped, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad", [0.0, -50.0, float("nan"), float("inf"), "50", True])
def test_bad_caps_raise(bad):
    q, k, v, _, _ = _inputs(20, 2, 2, 16)
    with pytest.raises(ValueError, match="softcap must be None or a positive finite number"):
        block_attention(q, k, v, MaskSpec.causal(20), softcap=bad, block_size=16)


@triton.jit
def _apply_tanh(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, tanh(tl.load(X + offs)))


def test_the_kernels_tanh_is_accurate_to_a_few_ulp_everywhere():
    x = torch.cat([torch.linspace(-12, 12, 4000), torch.logspace(-30, 1, 95), -torch.logspace(-30, 1, 95),
                   torch.tensor([0.0, 0.1, -0.1, 1e30, -1e30, 88.0])]).float()
    pad = 4096 * 2 - x.numel()
    x = torch.cat([x, torch.zeros(pad)])
    y = torch.empty_like(x)
    _apply_tanh[(1,)](x, y, N=x.numel())
    exact = torch.tanh(x.double())
    ulps = (y.double() - exact).abs() / (exact.abs() * 2.0 ** -23).clamp_min(2.0 ** -149)
    assert ulps.max().item() <= 2.0, f"tanh off by {ulps.max().item():.2f} ulp at x = {x[ulps.argmax()].item()}"
