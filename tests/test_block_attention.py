"""block_attention (autograd over the kernels): values and gradients vs the float64 reference, both
backends, input validation, backend selection and the distributed delegation."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from blockattn import MaskSpec, make_plan  # noqa: E402
from blockattn.attention import block_attention  # noqa: E402
from blockattn.backend import get_backend  # noqa: E402
from blockattn.reference import attention as reference  # noqa: E402


def _leaves(T, Hq, Hkv, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, H, D, generator=g).to(dtype).requires_grad_() for H in (Hq, Hkv, Hkv)]


def _loss(out, lse, w_out, w_lse):
    # a loss through both outputs: checks the lse gradient path (delta - dlse) too
    return (out.float() * w_out).sum() + (torch.nan_to_num(lse, neginf=0.0) * w_lse).sum()


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("spec_fn", [
    lambda: MaskSpec.lambda_mask(75, 4, 17),
    lambda: MaskSpec.from_mask_mod(lambda q, k: (q // 7) == (k // 5), 45),
], ids=["lambda", "mask_mod"])
def test_values_and_grads_match_reference(backend, spec_fn):
    spec = spec_fn()
    T = spec.total_len
    q, k, v = _leaves(T, 4, 2, 16)
    g = torch.Generator().manual_seed(1)
    w_out, w_lse = torch.randn(T, 4, 16, generator=g), torch.randn(4, T, generator=g)
    out, lse = block_attention(q, k, v, spec, return_lse=True, backend=backend, block_size=16)
    _loss(out, lse, w_out, w_lse).backward()
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    r_out, r_lse = reference(*ref_leaves, spec)
    _loss(r_out, r_lse, w_out.double(), w_lse.double()).backward()
    torch.testing.assert_close(out.double(), r_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), r_lse, atol=2e-5, rtol=1e-5)
    for got, ref in zip((q.grad, k.grad, v.grad), ref_leaves):
        torch.testing.assert_close(got.double(), ref.grad, atol=5e-5, rtol=1e-4)


def test_non_contiguous_inputs_and_default_scale():
    spec = MaskSpec.documents([20, 1, 27])
    base = torch.randn(48, 16, 4)  # [T, D, H] -> transpose gives non-contiguous [T, H, D]
    q = base.transpose(1, 2)
    k = base[:, :, :2].transpose(1, 2)
    v = (base[:, :, 2:] * 0.5).transpose(1, 2)
    assert not q.is_contiguous()
    out = block_attention(q, k, v, spec, block_size=16, softmax_scale=0.3)
    ref, _ = reference(q.double(), k.double(), v.double(), spec, softmax_scale=0.3)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)


def test_bf16_uses_default_block_size():
    spec = MaskSpec.causal(40)
    q, k, v = (t.detach() for t in _leaves(40, 2, 2, 32, torch.bfloat16))
    out = block_attention(q, k, v, spec)
    ref, _ = reference(q.double(), k.double(), v.double(), spec)
    eager, _ = reference(q, k, v, spec, dtype=torch.bfloat16)
    err = (out.double() - ref).abs().max().item()
    assert out.dtype == torch.bfloat16 and err <= 4 * (eager.double() - ref).abs().max().item() + 1e-2


def test_the_default_block_size_grows_for_masks_with_millions_of_tiles():
    from blockattn.attention import default_block_size
    from blockattn.planner.api import MAX_AUTO_TILES

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert default_block_size(cuda) == 128 and default_block_size(cpu) == 32
    long_doc = MaskSpec.causal(1 << 20)  # 33.6M tiles at 128
    assert default_block_size(cuda, long_doc) == default_block_size(cpu, long_doc) == 512
    assert long_doc.num_tiles(512) <= MAX_AUTO_TILES < long_doc.num_tiles(256)
    docs = MaskSpec.documents([2000] * 500)  # 1M tokens of short documents: few tiles
    assert default_block_size(cuda, docs) == 128 and default_block_size(cpu, docs) == 32


@pytest.mark.parametrize("bad, exc, match", [
    (lambda q, k, v: (q[:, :, :8], k, v), ValueError, "head_dim"),
    (lambda q, k, v: (q, k[:, :1].repeat(1, 3, 1), v[:, :1].repeat(1, 3, 1)), ValueError, "multiple"),
    (lambda q, k, v: (q[:10], k[:10], v[:10]), ValueError, "total_len"),
    (lambda q, k, v: (q, k[:-1], v), ValueError, "same token count"),
    (lambda q, k, v: (q.double(), k.double(), v.double()), TypeError, "dtype"),
    (lambda q, k, v: (q, k.half(), v.half()), TypeError, "share a dtype"),
    (lambda q, k, v: (q[0], k, v), ValueError, "3-D"),
])
def test_bad_inputs_raise_clear_errors(bad, exc, match):
    spec = MaskSpec.causal(32)
    q, k, v = (t.detach() for t in _leaves(32, 4, 2, 16))
    with pytest.raises(exc, match=match):
        block_attention(*bad(q, k, v), spec, block_size=16)


def test_unknown_backend_and_bad_mask():
    q, k, v = (t.detach() for t in _leaves(16, 2, 2, 16))
    with pytest.raises(ValueError, match="unknown backend"):
        block_attention(q, k, v, MaskSpec.causal(16), backend="cuda-magic")
    with pytest.raises(TypeError, match="MaskSpec"):
        block_attention(q, k, v, torch.ones(16, 16, dtype=torch.bool))


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the compiled Triton backend is valid")
def test_triton_backend_without_interpreter_is_an_error_not_a_fallback():
    code = ("import torch\n"
            "from blockattn.backend import get_backend\n"
            "assert not torch.cuda.is_available()\n"
            "try:\n    get_backend('triton')\nexcept RuntimeError as e:\n    print('ERR', e)\n"
            "print(get_backend('torch').name)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "ERR" in res.stdout and "TRITON_INTERPRET=1" in res.stdout and "backend='torch'" in res.stdout
    assert res.stdout.strip().endswith("torch")


def test_world_size_one_plan_runs_locally_and_larger_plans_delegate(monkeypatch):
    spec = MaskSpec.causal(32)
    q, k, v = (t.detach() for t in _leaves(32, 2, 1, 16))
    heads = dict(num_q_heads=2, num_kv_heads=1, head_dim=16, dtype=q.dtype, block_size=16)
    local = block_attention(q, k, v, spec, make_plan(spec, 1, **heads))
    torch.testing.assert_close(local, block_attention(q, k, v, spec, block_size=16))
    calls = {}
    fake = types.ModuleType("blockattn.distributed")

    def distributed_block_attention(q_, k_, v_, spec_, plan_, **kw):
        calls.update(kw, plan=plan_)
        return "delegated"

    fake.distributed_block_attention = distributed_block_attention
    monkeypatch.setitem(sys.modules, "blockattn.distributed", fake)
    plan = make_plan(spec, 2, **heads)
    assert block_attention(q, k, v, spec, plan, return_lse=True, backend="torch") == "delegated"
    assert calls["plan"] is plan and calls["return_lse"] and calls["backend"] == "torch"
    assert get_backend("torch").name == "torch"


def test_bad_plan_block_size_and_softmax_scale_are_refused_on_one_device_as_distributed():
    spec = MaskSpec.documents([20, 12])
    q, k, v = (t.detach() for t in _leaves(32, 2, 1, 16))
    plan = make_plan(spec, 1, num_q_heads=2, num_kv_heads=1, head_dim=16, dtype=q.dtype, block_size=16)
    # a one-rank plan of another mask: the distributed path's check, not the plan silently ignored
    with pytest.raises(ValueError, match="not the mask the plan was made for"):
        block_attention(q, k, v, MaskSpec.causal(32), plan)
    with pytest.raises(ValueError, match="plan expects q"):
        block_attention(torch.randn(32, 4, 16), k, v, spec, plan)
    with pytest.raises(ValueError, match="block_size=8 but the plan was made with block_size=16"):
        block_attention(q, k, v, spec, plan, block_size=8)
    torch.testing.assert_close(block_attention(q, k, v, spec, plan, block_size=16, backend="torch"),
                               block_attention(q, k, v, spec, block_size=16, backend="torch"))
    with pytest.raises(TypeError, match="plan must be a Plan"):
        block_attention(q, k, v, spec, "plan")
    with pytest.raises(ValueError, match="meta tensors"):
        block_attention(*(t.to("meta") for t in (q, k, v)), spec, block_size=16)
    with pytest.raises(TypeError, match="block_size must be an int"):
        block_attention(q, k, v, spec, block_size=2.5)
    torch.testing.assert_close(block_attention(q, k, v, spec, block_size=np.int64(16), backend="torch"),
                               block_attention(q, k, v, spec, block_size=16, backend="torch"))  # (numpy's ints too)
    for scale in (float("nan"), 0.0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="softmax_scale must be None or a positive finite number"):
            block_attention(q, k, v, spec, block_size=16, softmax_scale=scale, backend="torch")


def test_double_backward_raises_instead_of_dropping_second_order_terms():
    """A gradient penalty through block_attention: the kernels' backward is not differentiable, so the
    second backward must fail loudly (once_differentiable), not treat dQ as a constant."""
    spec = MaskSpec.documents([20, 12])
    q, k, v = _leaves(32, 2, 1, 16)
    w = torch.randn(32, 2, 16, requires_grad=True)
    (dq,) = torch.autograd.grad((block_attention(q, k, v, spec, block_size=16, backend="torch") * w).sum(), q,
                                create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        (dq ** 2).sum().backward()
