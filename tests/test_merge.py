"""The torch -inf-safe merge: merging partials of a split KV equals attention over all KV."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from blockattn import MaskSpec
from blockattn.merge import merge_many, merge_partials
from blockattn.reference import attention


def split_masks(spec, n_parts, seed):
    """Partition the keys of ``spec`` into n random disjoint key sets (some possibly empty)."""
    T = spec.total_len
    owner = torch.randint(0, n_parts, (T,), generator=torch.Generator().manual_seed(seed))
    return [spec & MaskSpec.from_mask_mod(lambda q, k, p=p: owner[k] == p, T) for p in range(n_parts)]


@given(st.integers(1, 30), st.integers(1, 4), st.integers(0, 2**31 - 1), st.sampled_from(["causal", "docs", "window"]))
def test_merging_split_kv_equals_attention_over_all_kv(T, n_parts, seed, kind):
    spec = {
        "causal": MaskSpec.causal(T),
        "docs": MaskSpec.documents([max(1, T // 3), T - max(1, T // 3)] if T > 1 else [1]),
        "window": MaskSpec.sliding_window(T, 4),
    }[kind]
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(T, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    parts = [attention(q, k, v, m) for m in split_masks(spec, n_parts, seed)]
    out, lse = merge_many([p[0] for p in parts], [p[1] for p in parts])
    ref_out, ref_lse = attention(q, k, v, spec)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
    # Pairwise folding in any order gives the same result (what a streaming merge relies on).
    acc_out, acc_lse = parts[-1]
    for o, l in reversed(parts[:-1]):
        acc_out, acc_lse = merge_partials(o, l, acc_out, acc_lse)
    torch.testing.assert_close(acc_out, ref_out, rtol=1e-12, atol=1e-12)


@given(st.integers(1, 20), st.integers(0, 2**31 - 1))
def test_empty_partial_is_the_identity(T, seed):
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(T, 3, 4, generator=g, dtype=torch.float32)
    lse = torch.randn(3, T, generator=g)
    lse[0, 0] = float("-inf")  # a row that is itself empty stays empty
    out[0, 0] = 0
    empty_out = torch.zeros_like(out)
    empty_lse = torch.full_like(lse, float("-inf"))
    for merged in (merge_partials(out, lse, empty_out, empty_lse), merge_partials(empty_out, empty_lse, out, lse)):
        assert torch.equal(merged[0], out)
        assert torch.equal(merged[1], lse)


def test_all_empty_partials_give_zero_and_minus_inf_without_nan():
    out = torch.zeros(5, 2, 4, dtype=torch.bfloat16)
    lse = torch.full((2, 5), float("-inf"))
    m_out, m_lse = merge_many([out, out, out], [lse, lse, lse])
    assert m_out.dtype == torch.bfloat16 and torch.all(m_out == 0)
    assert torch.all(torch.isneginf(m_lse))


def test_merge_validates_layout():
    with pytest.raises(ValueError, match=r"lse \[H, R\]"):
        merge_partials(torch.zeros(4, 2, 3), torch.zeros(4, 2), torch.zeros(4, 2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="same positive number"):
        merge_many([], [])
