"""Kernel-level tests (Triton interpreter on CPU): forward O/LSE and dQ/dK/dV over tile lists against
the float64 reference, with error bounded by the same-dtype torch eager error; outputs poisoned first.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from blockattn import MaskSpec  # noqa: E402
from blockattn import torch_backend  # noqa: E402
from blockattn.kernels import (  # noqa: E402
    KernelMask,
    TileList,
    attention_bwd_dkdv,
    attention_bwd_dq,
    attention_bwd_preprocess,
    attention_fwd,
)
from blockattn.reference import attention as reference  # noqa: E402

ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
FACTOR = 4.0  # kernel error may be this many times the same-dtype eager error (plus ATOL)


def _inputs(T, Hq, Hkv, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda H: torch.randn(T, H, D, generator=g).to(dtype)  # noqa: E731
    return make(Hq), make(Hkv), make(Hkv), make(Hq)


def _ref_with_grads(q, k, v, dout, spec, dtype):
    """(out, lse, dq, dk, dv) of the dense reference computed in ``dtype``."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = reference(*leaves, spec, dtype=dtype)
    out.backward(dout.to(dtype))
    return out.detach(), lse.detach(), *(t.grad for t in leaves)


def assert_close_to_reference(name, got, ref64, eager, dtype):
    finite = torch.isfinite(ref64)
    assert torch.equal(torch.isfinite(got), finite) or not (~finite).any(), f"{name}: inf pattern differs"
    got_f = got.double()[finite]
    err = (got_f - ref64.double()[finite]).abs().max().item() if finite.any() else 0.0
    eager_err = (eager.double()[finite] - ref64.double()[finite]).abs().max().item() if finite.any() else 0.0
    bound = FACTOR * eager_err + ATOL[dtype]
    assert err <= bound, f"{name}: max error {err:.3g} > bound {bound:.3g} (eager error {eager_err:.3g})"


def run_all(spec, q, k, v, dout, block, kmask=None):
    """Forward + backward through the kernels, every output poisoned with NaN beforehand."""
    bm = spec.block_mask(block)
    tiles, tiles_t = TileList.from_block_mask(bm), TileList.from_block_mask(bm, transposed=True)
    kmask = kmask if kmask is not None else KernelMask.from_block_mask(bm)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"))
    out, lse = attention_fwd(q, k, v, tiles, kmask, out=out, lse=lse)
    delta = attention_bwd_preprocess(out, dout)
    dq = attention_bwd_dq(q, k, v, dout, lse, delta, tiles, kmask, out=torch.full(q.shape, float("nan")))
    dk, dv = attention_bwd_dkdv(q, k, v, dout, lse, delta, tiles_t, kmask,
                                out=(torch.full(k.shape, float("nan")), torch.full(k.shape, float("nan"))))
    return out, lse, dq, dk, dv


def check_against_reference(spec, Hq, Hkv, D, dtype, block, kmask=None, seed=0):
    q, k, v, dout = _inputs(spec.total_len, Hq, Hkv, D, dtype, seed)
    got = run_all(spec, q, k, v, dout, block, kmask)
    ref = _ref_with_grads(q, k, v, dout, spec, torch.float64)
    eager = _ref_with_grads(q, k, v, dout, spec, dtype)
    for name, g, r, e in zip(("out", "lse", "dq", "dk", "dv"), got, ref, eager):
        assert not torch.isnan(g).any(), f"{name} has NaN (unwritten rows or a 0/0)"
        assert_close_to_reference(name, g, r, e, dtype)
    return got


MASKS = {
    "causal": lambda: MaskSpec.causal(70),
    "sliding_window": lambda: MaskSpec.sliding_window(100, 13),
    "lambda": lambda: MaskSpec.lambda_mask(90, 5, 20),
    "documents_causal": lambda: MaskSpec.documents([5, 30, 1, 34]),
    "documents_full": lambda: MaskSpec.documents([17, 1, 40], causal=False),
    "shared_question": lambda: MaskSpec.shared_question(20, [7, 1, 30]),
    "causal_blockwise": lambda: MaskSpec.causal_blockwise(96, block=16, k_local=2),
    "mask_mod_bits": lambda: MaskSpec.from_mask_mod(lambda q, k: ((q + k) % 3 == 0) & (k <= q), 45),
    "docs_and_window": lambda: MaskSpec.documents([30, 40]) & MaskSpec.sliding_window(70, 9),
    "composition_or": lambda: (MaskSpec.documents([30, 40]) & MaskSpec.sliding_window(70, 9))
    | MaskSpec.lambda_mask(70, 3, 5),
    "full": lambda: MaskSpec.full(33),
    "single_token": lambda: MaskSpec.causal(1),
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("name", list(MASKS))
def test_every_mask_kind_matches_reference(name):
    spec = MASKS[name]()
    dtype = DTYPES[list(MASKS).index(name) % 3]  # spread the dtypes over the masks
    check_against_reference(spec, Hq=4, Hkv=2, D=16, dtype=dtype, block=16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes_with_gqa_and_ragged_length(dtype):
    check_against_reference(MaskSpec.documents([9, 41, 23]), Hq=6, Hkv=2, D=32, dtype=dtype, block=32, seed=1)


def test_head_dim_64_block_32_bf16():
    check_against_reference(MaskSpec.causal(48), Hq=2, Hkv=1, D=64, dtype=torch.bfloat16, block=32, seed=2)


@pytest.mark.parametrize("D, dtype", [(8, torch.float32), (40, torch.bfloat16), (80, torch.float16),
                                      (96, torch.float32)])
def test_head_dims_that_are_not_powers_of_two(D, dtype):
    """Any D in [1, 256] runs in power-of-two head-dim tiles whose padding loads as 0 and is never stored:
    with Hq > 1 a store past D would land in the next head's columns, and every output starts as NaN.
    Ragged length, GQA, full and partial tiles."""
    spec = MaskSpec.documents([9, 41, 23]) & MaskSpec.sliding_window(73, 20)
    check_against_reference(spec, Hq=4, Hkv=2, D=D, dtype=dtype, block=16, seed=3)


def _empty_rows_mod(q, k):
    return (q % 5 != 0) & (k <= q) & (k >= q - 11)


def test_fully_masked_rows_bits_and_intervals():
    """Rows q % 5 == 0 see no key: O = 0, LSE = -inf, zero grads, no NaN (bitmask and interval paths)."""
    T = 50
    spec = MaskSpec.from_mask_mod(_empty_rows_mod, T)
    out, lse, *_ = check_against_reference(spec, Hq=2, Hkv=2, D=16, dtype=torch.float32, block=16)
    empty = torch.arange(T) % 5 == 0
    assert torch.isneginf(lse[:, empty]).all() and torch.isfinite(lse[:, ~empty]).all()
    assert (out[empty] == 0).all()
    # the same mask as intervals (empty rows are lo == hi), over the same block classification
    q = torch.arange(T)
    iv = torch.stack([(q - 11).clamp(min=0), q + 1, torch.zeros_like(q), torch.zeros_like(q)]).to(torch.int32)
    iv[:, empty] = 0
    bm = spec.block_mask(16)
    kmask = KernelMask(T, 16, intervals=iv)
    check_against_reference(spec, Hq=2, Hkv=2, D=16, dtype=torch.float32, block=16, kmask=kmask)
    assert bm.part_bits is not None


def test_torch_backend_matches_kernels():
    spec = MaskSpec.shared_question(20, [7, 1, 30])
    q, k, v, dout = _inputs(spec.total_len, 4, 2, 16, torch.float32, seed=3)
    bm = spec.block_mask(16)
    tiles, tiles_t, km = TileList.from_block_mask(bm), TileList.from_block_mask(bm, True), KernelMask.from_block_mask(bm)
    got = run_all(spec, q, k, v, dout, 16)
    out, lse = torch_backend.attention_fwd(q, k, v, tiles, km)
    delta = torch_backend.attention_bwd_preprocess(out, dout)
    dq = torch_backend.attention_bwd_dq(q, k, v, dout, lse, delta, tiles, km)
    dk, dv = torch_backend.attention_bwd_dkdv(q, k, v, dout, lse, delta, tiles_t, km)
    for a, b in zip(got, (out, lse, dq, dk, dv)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_buffer_coordinates_permuted_blocks():
    """Kernels read blocks through (row, glob): a buffer holding the blocks in reverse order works."""
    spec = MaskSpec.causal(64)
    B = 16
    q, k, v, _ = _inputs(64, 2, 1, 16, torch.float32, seed=4)
    bm = spec.block_mask(B)
    nB = bm.num_blocks
    perm = torch.arange(nB - 1, -1, -1)                      # buffer slot s holds block perm[s]
    row_of = torch.empty(nB, dtype=torch.long)
    row_of[perm] = torch.arange(nB) * B
    tq, tk, full = bm.tiles()
    tiles = TileList.from_tiles(tq, tk, full, block_size=B, work_blocks=torch.arange(nB),
                                work_row_of=row_of, partner_row_of=row_of)
    gather = torch.cat([torch.arange(b * B, (b + 1) * B) for b in perm.tolist()])
    out_buf, lse_buf = attention_fwd(q[gather], k[gather], v[gather], tiles, KernelMask.from_block_mask(bm))
    out, lse = reference(q.double(), k.double(), v.double(), spec)
    torch.testing.assert_close(out_buf.double(), out[gather], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_buf.double(), lse[:, gather], atol=1e-5, rtol=1e-5)


def test_validation_errors_are_clear():
    spec = MaskSpec.causal(32)
    bm = spec.block_mask(16)
    tiles, km = TileList.from_block_mask(bm), KernelMask.from_block_mask(bm)
    q, k, v, _ = _inputs(32, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="multiple of k/v heads"):
        attention_fwd(q, k[:, :1].expand(32, 3, 16), v[:, :1].expand(32, 3, 16), tiles, km)
    with pytest.raises(TypeError, match="dtype"):
        attention_fwd(q, k.half(), v.half(), tiles, km)
    with pytest.raises(ValueError, match=r"head_dim must be in \[1, 256\], got 272"):
        attention_fwd(*(t.repeat(1, 1, 17) for t in (q, k, v)), tiles, km)
    with pytest.raises(ValueError, match="accumulate"):
        attention_fwd(q, k, v, tiles, km, accumulate=True)
    with pytest.raises(ValueError, match="block size"):
        attention_fwd(q, k, v, TileList.from_block_mask(spec.block_mask(8)), KernelMask.from_block_mask(spec.block_mask(8)))
    with pytest.raises(ValueError, match="n\\+1"):
        TileList.build([0], [0], [0], [], [], [0, 0], [], [])


@pytest.mark.parametrize("spec_fn", [lambda: MaskSpec.documents([23, 1, 50]),
                                     lambda: MaskSpec.from_mask_mod(_empty_rows_mod, 74)], ids=["intervals", "bits"])
def test_sub_tiled_configs_match_whole_block_tiles(spec_fn):
    """GPU configs split a block into BLOCK_M x BLOCK_N sub-tiles; the interpreter checks that path too."""
    from blockattn.kernels import KernelConfig

    spec = spec_fn()
    B = 32
    q, k, v, dout = _inputs(spec.total_len, 4, 2, 16, torch.float32, seed=5)
    bm = spec.block_mask(B)
    tiles, tiles_t, km = TileList.from_block_mask(bm), TileList.from_block_mask(bm, True), KernelMask.from_block_mask(bm)
    whole = run_all(spec, q, k, v, dout, B)
    out, lse = attention_fwd(q, k, v, tiles, km, config=KernelConfig(16, 16, 4, 1))
    delta = attention_bwd_preprocess(out, dout)
    dq = attention_bwd_dq(q, k, v, dout, lse, delta, tiles, km, config=KernelConfig(32, 16, 4, 1))
    dk, dv = attention_bwd_dkdv(q, k, v, dout, lse, delta, tiles_t, km, config=KernelConfig(16, 32, 4, 1))
    dk2, dv2 = attention_bwd_dkdv(q, k, v, dout, lse, delta, tiles_t, km, config=KernelConfig(32, 16, 4, 1))
    for a, b in zip(whole, (out, lse, dq, dk, dv)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, equal_nan=False)
    torch.testing.assert_close(dk2, dk, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dv2, dv, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_backward_accumulate_adds_each_key_groups_gradients_in_place(backend):
    """``accumulate=True`` (a distributed backward's stages): dQ / dK / dV of tiles split into two lists
    (by kv-block, as stages split a rank's tiles) added into one fp32 buffer equal, bit for bit, the
    buffer plus each list's fresh gradients, and add up to the whole mask's; rows outside the lists'
    work blocks keep their values (GQA, a ragged last block, head dim 24 in tiles of 32)."""
    import blockattn.kernels as triton_kernels

    be = torch_backend if backend == "torch" else triton_kernels
    spec = MaskSpec.documents([9, 41, 23]) & MaskSpec.sliding_window(73, 20)
    B, T = 16, 73
    q, k, v, dout = _inputs(T, 4, 2, 24, torch.float32, seed=6)
    bm = spec.block_mask(B)
    km = KernelMask.from_block_mask(bm)
    out, lse = be.attention_fwd(q, k, v, TileList.from_block_mask(bm), km)
    delta = be.attention_bwd_preprocess(out, dout)
    tq, tk, full = bm.tiles()
    whole_dq = be.attention_bwd_dq(q, k, v, dout, lse, delta, TileList.from_block_mask(bm), km)
    whole_dk, whole_dv = be.attention_bwd_dkdv(q, k, v, dout, lse, delta, TileList.from_block_mask(bm, True), km)
    g = torch.Generator().manual_seed(7)
    start_q, start_k, start_v = (torch.randn(t.shape, generator=g) for t in (q, k, v))
    dq, dk, dv = start_q.clone(), start_k.clone(), start_v.clone()
    sum_q, sum_k, sum_v = start_q.clone(), start_k.clone(), start_v.clone()
    for part in (tk % 2 == 0, tk % 2 == 1):
        lists = (TileList.from_tiles(tq[part], tk[part], full[part], block_size=B),
                 TileList.from_tiles(tk[part], tq[part], full[part], block_size=B))
        fresh_q = be.attention_bwd_dq(q, k, v, dout, lse, delta, lists[0], km)
        fresh_k, fresh_v = be.attention_bwd_dkdv(q, k, v, dout, lse, delta, lists[1], km)
        rows_q = torch.cat([torch.arange(b * B, min(T, b * B + B)) for b in torch.unique(tq[part]).tolist()])
        rows_k = torch.cat([torch.arange(b * B, min(T, b * B + B)) for b in torch.unique(tk[part]).tolist()])
        sum_q[rows_q] += fresh_q[rows_q]
        sum_k[rows_k] += fresh_k[rows_k]
        sum_v[rows_k] += fresh_v[rows_k]
        assert be.attention_bwd_dq(q, k, v, dout, lse, delta, lists[0], km, out=dq, accumulate=True) is dq
        be.attention_bwd_dkdv(q, k, v, dout, lse, delta, lists[1], km, out=(dk, dv), accumulate=True)
        for name, got, want in (("dq", dq, sum_q), ("dk", dk, sum_k), ("dv", dv, sum_v)):
            assert torch.equal(got, want), f"{name}: accumulate is not the buffer plus the fresh gradients"
    for name, got, start, whole in (("dq", dq, start_q, whole_dq), ("dk", dk, start_k, whole_dk),
                                    ("dv", dv, start_v, whole_dv)):
        torch.testing.assert_close(got - start, whole, atol=1e-5, rtol=1e-5, msg=name)
    with pytest.raises(ValueError, match="accumulate=True adds to the given gradient buffer"):
        be.attention_bwd_dq(q, k, v, dout, lse, delta, TileList.from_block_mask(bm), km, accumulate=True)
    with pytest.raises(ValueError, match="accumulate=True adds to the given gradient buffer"):
        be.attention_bwd_dkdv(q, k, v, dout, lse, delta, TileList.from_block_mask(bm, True), km, accumulate=True)


@pytest.mark.parametrize("D, src_dtype, rows_dtype", [(16, torch.bfloat16, torch.int64), (40, torch.float16, torch.int32),
                                                      (24, torch.float32, torch.int64)])
def test_add_grad_rows_is_index_add_of_the_fp32_partial(D, src_dtype, rows_dtype):
    """``add_grad_rows`` (a received dQ / dK / dV partial summed into its buffer): the bits of
    ``dst.index_add_(0, rows, src.float())`` at distinct rows in any order; other rows and the head-dim
    padding untouched; the torch twin is that index_add_. Bad arguments raise with the shapes."""
    from blockattn.kernels import add_grad_rows

    g = torch.Generator().manual_seed(D)
    dst = torch.randn(50, 3, D, generator=g)
    rows = torch.randperm(50, generator=g)[:37]
    src = torch.randn(37, 3, D, generator=g).to(src_dtype)
    want = dst.clone().index_add_(0, rows, src.float())
    got = dst.clone()
    assert add_grad_rows(got, rows.to(rows_dtype), src) is got
    assert torch.equal(got, want)
    assert torch.equal(torch_backend.add_grad_rows(dst.clone(), rows, src), want)
    with pytest.raises(ValueError, match="dst must be a contiguous fp32"):
        add_grad_rows(dst.to(torch.bfloat16), rows, src)
    with pytest.raises(ValueError, match=r"src must be a \[n, H=3, D=%d\]" % D):
        add_grad_rows(dst, rows, src[:, :2])
    with pytest.raises(ValueError, match="one buffer row per src row"):
        add_grad_rows(dst, rows[:5], src)
    with pytest.raises(ValueError, match=r"rows must lie in \[0, 50\)"):
        add_grad_rows(dst, rows + 20, src)
