"""Merge properties (Triton interpreter): partials over a split of the keys merge to attention over all
keys, by the standalone merge kernel and by the forward's accumulate=True; an empty partial is the identity.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from blockattn import MaskSpec  # noqa: E402
from blockattn import torch_backend  # noqa: E402
from blockattn.kernels import KernelMask, TileList, attention_fwd, merge_partials  # noqa: E402
from blockattn.reference import attention as reference  # noqa: E402

B = 16


def _split_tiles(bm, groups):
    """One tile list per key group: the tiles whose kv-block falls in that group (all q-blocks work)."""
    tq, tk, full = bm.tiles()
    lists = []
    for g in range(int(groups.max()) + 1):
        sel = groups[tk.long()] == g
        lists.append(TileList.from_tiles(tq[sel], tk[sel], full[sel], block_size=B,
                                         work_blocks=torch.arange(bm.num_blocks)))
    return lists


@pytest.mark.parametrize("D", [16, 40])  # (40: head-dim tiles of 64 whose padding is neither read nor written)
@settings(max_examples=6, deadline=None)
@given(T=st.integers(1, 70), parts=st.integers(1, 3), seed=st.integers(0, 2**16),
       kind=st.sampled_from(["causal", "docs", "window"]))
def test_split_kv_partials_merge_to_full_attention(D, T, parts, seed, kind):
    spec = {"causal": lambda: MaskSpec.causal(T),
            "docs": lambda: MaskSpec.documents([max(1, T // 3), T - max(1, T // 3)] if T > 1 else [1]),
            "window": lambda: MaskSpec.sliding_window(T, 7)}[kind]()
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(T, H, D, generator=g) for H in (2, 1, 1))
    bm = spec.block_mask(B)
    km = KernelMask.from_block_mask(bm)
    groups = torch.randint(0, parts, (bm.num_blocks,), generator=g)
    partials = [attention_fwd(q, k, v, tl, km) for tl in _split_tiles(bm, groups)]
    ref_out, ref_lse = reference(q.double(), k.double(), v.double(), spec)

    out, lse = merge_partials([p[0] for p in partials], [p[1] for p in partials])
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=1e-5)
    t_out, t_lse = torch_backend.merge_partials([p[0] for p in partials], [p[1] for p in partials])
    torch.testing.assert_close(t_out, out, atol=1e-6, rtol=1e-6)

    # fused merge: fold the remaining key groups into the first partial with accumulate=True
    acc_out, acc_lse = partials[0][0].clone(), partials[0][1].clone()
    for tl in _split_tiles(bm, groups)[1:]:
        acc_out, acc_lse = attention_fwd(q, k, v, tl, km, out=acc_out, lse=acc_lse, accumulate=True)
    torch.testing.assert_close(acc_out.double(), ref_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(acc_lse.double(), ref_lse, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("D", [16, 12])
@settings(max_examples=5, deadline=None)
@given(R=st.integers(1, 40), n=st.integers(1, 4), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_empty_partial_is_identity(D, R, n, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    outs = torch.randn(n, R, 3, D, generator=g).to(dtype)
    lses = torch.randn(n, 3, R, generator=g)
    lses[torch.rand(n, 3, R, generator=g) < 0.3] = float("-inf")   # some rows empty in some partials
    outs = torch.where(torch.isinf(lses).permute(0, 2, 1)[..., None], 0.0, outs.float()).to(dtype)
    base_out, base_lse = merge_partials(outs, lses)
    # an empty partial whose O holds garbage (NaN) must not change anything
    garbage = torch.full((1, R, 3, D), float("nan"), dtype=dtype)
    empty_lse = torch.full((1, 3, R), float("-inf"))
    out, lse = merge_partials(torch.cat([outs, garbage]), torch.cat([lses, empty_lse]))
    torch.testing.assert_close(out, base_out, atol=0, rtol=0)
    torch.testing.assert_close(lse, base_lse, atol=0, rtol=0)
    ref_out, ref_lse = torch_backend.merge_partials(outs, lses)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=1e-2 if dtype == torch.bfloat16 else 1e-6, rtol=1e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    all_empty = torch.isinf(lses).all(0)
    assert torch.isneginf(lse[all_empty]).all() and (out.permute(1, 0, 2)[all_empty] == 0).all()


def test_accumulate_with_no_tiles_keeps_state():
    spec = MaskSpec.causal(40)
    bm = spec.block_mask(B)
    km = KernelMask.from_block_mask(bm)
    q, k, v = (torch.randn(40, H, 16) for H in (2, 2, 2))
    out, lse = attention_fwd(q, k, v, TileList.from_block_mask(bm), km)
    empty = TileList.from_tiles([], [], [], block_size=B, work_blocks=torch.arange(bm.num_blocks))
    out2, lse2 = attention_fwd(q, k, v, empty, km, out=out.clone(), lse=lse.clone(), accumulate=True)
    torch.testing.assert_close(out2, out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse2, lse, atol=1e-6, rtol=1e-6)
    # and a fresh run over no tiles is the empty partial itself
    out3, lse3 = attention_fwd(q, k, v, empty, km, out=torch.full_like(q, float("nan")),
                               lse=torch.full_like(lse, float("nan")))
    assert (out3 == 0).all() and torch.isneginf(lse3).all()


@pytest.mark.parametrize("D", [16, 40])
@settings(max_examples=6, deadline=None)
@given(R=st.integers(1, 50), n=st.integers(0, 50), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), rows_dtype=st.sampled_from([torch.int32, torch.int64]))
def test_merge_into_folds_a_partial_in_place_as_merge_partials_does(D, R, n, seed, dtype, rows_dtype):
    """``merge_into``: partial row i folded into the running state at buffer row rows[i] (distinct rows in
    any order, a subset of the buffer) gives, bit for bit, ``merge_partials`` of the running row and the
    partial; every other row keeps its bits; empty rows on either side (LSE = -inf, O garbage) are
    weightless, and both empty give (0, -inf). The torch backend's twin agrees."""
    from blockattn.kernels import merge_into

    g = torch.Generator().manual_seed(seed)
    H = 3
    n = min(n, R)
    rows = torch.randperm(R, generator=g)[:n]
    out = torch.randn(R, H, D, generator=g).to(dtype)
    lse = torch.randn(H, R, generator=g) * 3
    part_out = torch.randn(n, H, D, generator=g).to(dtype)
    part_lse = torch.randn(H, n, generator=g) * 3
    lse[torch.rand(H, R, generator=g) < 0.25] = float("-inf")
    part_lse[torch.rand(H, n, generator=g) < 0.25] = float("-inf")
    part_out[torch.isinf(part_lse).t()] = float("nan")  # an empty side's O must not leak in
    want_out, want_lse = merge_partials([torch.nan_to_num(out[rows]), torch.nan_to_num(part_out)],
                                        [lse[:, rows], part_lse])
    got_out, got_lse = out.clone(), lse.clone()
    assert merge_into(got_out, got_lse, rows.to(rows_dtype), part_out, part_lse)[0] is got_out
    others = torch.ones(R, dtype=torch.bool)
    others[rows] = False
    assert torch.equal(got_out[rows], want_out) and torch.equal(got_lse[:, rows], want_lse)
    assert torch.equal(got_out[others], out[others]) and torch.equal(got_lse[:, others], lse[:, others])
    both_empty = torch.isinf(lse[:, rows]) & torch.isinf(part_lse)
    assert torch.isneginf(got_lse[:, rows][both_empty]).all()
    assert (got_out[rows].permute(1, 0, 2)[both_empty] == 0).all()
    t_out, t_lse = out.clone(), lse.clone()
    torch_backend.merge_into(t_out, t_lse, rows, torch.nan_to_num(part_out), part_lse)
    torch.testing.assert_close(t_out.float(), got_out.float(), atol=1e-2 if dtype == torch.bfloat16 else 1e-6,
                               rtol=1e-2)
    torch.testing.assert_close(t_lse, got_lse, atol=1e-5, rtol=1e-5)


def test_merge_into_validates_its_arguments():
    from blockattn.kernels import merge_into

    out, lse = torch.zeros(8, 2, 16), torch.zeros(2, 8)
    part, part_lse, rows = torch.zeros(3, 2, 16), torch.zeros(2, 3), torch.tensor([0, 5, 7])
    with pytest.raises(ValueError, match=r"part_out \(3, 2, 8\) must be \[n, H=2, D=16\]"):
        merge_into(out, lse, rows, torch.zeros(3, 2, 8), part_lse)
    with pytest.raises(ValueError, match="rows must be a 1-D int32/int64 tensor with one buffer row per partial row"):
        merge_into(out, lse, rows.float(), part, part_lse)
    with pytest.raises(ValueError, match="rows must be a 1-D int32/int64 tensor"):
        merge_into(out, lse, rows[:2], part, part_lse)
    with pytest.raises(ValueError, match=r"rows must lie in \[0, 8\), got 0..8"):
        merge_into(out, lse, torch.tensor([0, 5, 8]), part, part_lse)
    with pytest.raises(ValueError, match="part_lse must be fp32"):
        merge_into(out, lse, rows, part, part_lse.double())
    with pytest.raises(ValueError, match="out must be a \\[rows, H, D\\] fp16/bf16/fp32 tensor"):
        merge_into(out.double(), lse, rows, part, part_lse)
