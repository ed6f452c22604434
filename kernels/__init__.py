"""blockattn.kernels: Triton kernels for masked blockwise attention over tile lists.

Public: ``KernelMask``, ``TileList`` (tiles.py) and the seven kernel entry points (launch.py):
``attention_fwd``, ``merge_partials``, ``merge_into``, ``attention_bwd_preprocess``, ``attention_bwd_dq``,
``attention_bwd_dkdv``, ``add_grad_rows``. Kernels see only tensors, tile lists and a kernel mask (docs/design.md).
On CPU the kernels run only when TRITON_INTERPRET=1 was set before this package was imported.
"""
from .launch import (
    KernelConfig,
    add_grad_rows,
    attention_bwd_dkdv,
    attention_bwd_dq,
    attention_bwd_preprocess,
    attention_fwd,
    interpreted,
    kernel_config,
    merge_into,
    merge_partials,
)
from .tiles import KernelMask, TileList

__all__ = [
    "KernelMask", "TileList", "KernelConfig", "kernel_config", "interpreted", "attention_fwd",
    "merge_partials", "merge_into", "attention_bwd_preprocess", "attention_bwd_dq", "attention_bwd_dkdv",
    "add_grad_rows",
]
