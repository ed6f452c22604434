"""Kernel backends: the seven entry points the executors call, chosen by name, never silently.

``"triton"`` (default): blockattn.kernels — compiled on CUDA; on CPU only when TRITON_INTERPRET=1 was
set before import (the interpreter). ``"torch"``: blockattn.torch_backend, the same functions in
plain torch over the same TileList / KernelMask (reference and CPU backend).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["Backend", "get_backend", "BACKENDS"]

BACKENDS = ("triton", "torch")


@dataclass(frozen=True)
class Backend:
    """A named set of the seven kernel entry points (signatures as in docs/design.md)."""

    name: str
    attention_fwd: Callable
    merge_partials: Callable
    merge_into: Callable
    attention_bwd_preprocess: Callable
    attention_bwd_dq: Callable
    attention_bwd_dkdv: Callable
    add_grad_rows: Callable


def get_backend(name: str | Backend | None = None) -> Backend:
    """The backend called ``name`` ("triton" when None); raises if it cannot run here."""
    if isinstance(name, Backend):
        return name
    name = "triton" if name is None else name
    if name == "triton":
        from blockattn import kernels as mod

        if not torch.cuda.is_available() and not mod.interpreted():
            raise RuntimeError(
                "backend='triton' needs a CUDA GPU, or on CPU the Triton interpreter: set the environment "
                "variable TRITON_INTERPRET=1 before importing blockattn (kernels are built at import), "
                "or pass backend='torch' for the pure-torch CPU backend")
    elif name == "torch":
        from blockattn import torch_backend as mod
    else:
        raise ValueError(f"unknown backend {name!r}; choose one of {BACKENDS}")
    return Backend(name, mod.attention_fwd, mod.merge_partials, mod.merge_into, mod.attention_bwd_preprocess,
                   mod.attention_bwd_dq, mod.attention_bwd_dkdv, mod.add_grad_rows)
