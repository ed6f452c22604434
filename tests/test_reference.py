"""The float64 reference against SDPA and against a per-row loop; fully masked rows; validation."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from blockattn import MaskSpec
from blockattn.reference import attention


def rand_qkv(T, Hq, Hkv, D, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, Hq, D, generator=g, dtype=dtype)
    k = torch.randn(T, Hkv, D, generator=g, dtype=dtype)
    v = torch.randn(T, Hkv, D, generator=g, dtype=dtype)
    return q, k, v


def per_row_loop(q, k, v, dense, scale):
    """The definition, one (row, head) at a time."""
    T, Hq, D = q.shape
    group = Hq // k.shape[1]
    out = torch.zeros(T, Hq, D, dtype=torch.float64)
    lse = torch.full((Hq, T), float("-inf"), dtype=torch.float64)
    for h in range(Hq):
        for i in range(T):
            keys = torch.nonzero(dense[i]).flatten()
            if keys.numel() == 0:
                continue
            s = (k[keys, h // group] @ q[i, h]) * scale
            m = s.max()
            p = torch.exp(s - m)
            lse[h, i] = m + torch.log(p.sum())
            out[i, h] = (p / p.sum()) @ v[keys, h // group]
    return out, lse


@given(st.integers(1, 24), st.sampled_from([(1, 1), (2, 1), (4, 2)]), st.integers(0, 2**31 - 1))
def test_reference_matches_per_row_definition(T, heads, seed):
    Hq, Hkv = heads
    q, k, v = rand_qkv(T, Hq, Hkv, 8, seed)
    spec = MaskSpec.lambda_mask(T, 2, 3)
    out, lse = attention(q, k, v, spec)
    ref_out, ref_lse = per_row_loop(q, k, v, spec.to_dense(), 1 / math.sqrt(8))
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


def test_reference_matches_sdpa_with_gqa():
    T, Hq, Hkv, D = 33, 6, 2, 16
    q, k, v = rand_qkv(T, Hq, Hkv, D, 0)
    spec = MaskSpec.documents([10, 1, 22])
    out, _ = attention(q, k, v, spec, softmax_scale=0.3)
    kk = k.repeat_interleave(Hq // Hkv, dim=1)
    vv = v.repeat_interleave(Hq // Hkv, dim=1)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1), attn_mask=spec.to_dense(), scale=0.3
    ).transpose(0, 1)
    torch.testing.assert_close(out, sdpa, rtol=1e-10, atol=1e-10)


def test_fully_masked_rows_give_zero_and_minus_inf():
    T = 12
    spec = MaskSpec.from_mask_mod(lambda q, k: (k <= q) & (q % 3 != 0), T)
    q, k, v = rand_qkv(T, 2, 1, 4, 1)
    out, lse = attention(q, k, v, spec)
    masked_rows = torch.arange(T) % 3 == 0
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.all(out[masked_rows] == 0)
    assert torch.all(torch.isneginf(lse[:, masked_rows]))
    assert torch.isfinite(lse[:, ~masked_rows]).all()


def test_same_dtype_eager_mode():
    q, k, v = rand_qkv(20, 2, 2, 8, 3, dtype=torch.bfloat16)
    out, lse = attention(q, k, v, MaskSpec.causal(20), dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref, _ = attention(q, k, v, MaskSpec.causal(20))
    err = (out.double() - ref).abs().max()
    assert 0 < err < 0.1  # bf16 eager is close to, but not exactly, the float64 truth


@pytest.mark.parametrize(
    "shapes, spec_len, message",
    [
        (((8, 2, 4), (8, 2, 4), (8, 2, 4)), 9, "total_len = 9"),
        (((8, 3, 4), (8, 2, 4), (8, 2, 4)), 8, "multiple of key/value heads"),
        (((8, 2, 4), (7, 2, 4), (7, 2, 4)), 8, "k and v must be"),
        (((8, 2), (8, 2, 4), (8, 2, 4)), 8, "shape"),
    ],
)
def test_reference_validates_shapes(shapes, spec_len, message):
    q, k, v = (torch.zeros(s, dtype=torch.float64) for s in shapes)
    with pytest.raises(ValueError, match=message):
        attention(q, k, v, MaskSpec.causal(spec_len))
