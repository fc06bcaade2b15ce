"""The kernels a CUDA target runs where the CPU's differ, registered in the dispatcher for a
traced step, so that every call gets them whatever Python function makes it.

- ``scaled_dot_product_attention``: the backend PyTorch picks on the target
  (tracing.attention's router: flash, memory-efficient or math), run as the CPU stand-in with
  the same memory behaviour.
- ``dropout``: ATen's fused kernel, ``native_dropout``, which CUDA takes for a training input
  with 0 < p < 1 (is_fused_kernel_acceptable in ATen's Dropout.cpp); it returns the output
  and a bool mask that its backward keeps. The CPU decomposes it into bernoulli_, div_ and
  mul, keeping a mask in the input's dtype.

Both are CompositeImplicitAutograd ops: the kernels sit at the AutogradCPU key (above
autograd, as the composite itself runs) and run the composite, or the fused op, from there
(docs/references.md, section 46).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tilefit.compat import dispatch
from tilefit.tracing.attention import AttentionRouter

KEY = "AutogradCPU"
_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_DROPOUT = torch.ops.aten.dropout.default


def _sdpa(router: AttentionRouter) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        return router(_SDPA.decompose, args, kwargs)
    return kernel


def _dropout(x: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    if not train or p == 0 or x.numel() == 0:
        return x  # ATen returns the input itself: no kernel runs
    if p < 1:
        return torch.ops.aten.native_dropout.default(x, p, train)[0]  # type: ignore[no-any-return]
    return _DROPOUT.decompose(x, p, train)  # type: ignore[no-any-return]


def register_target_kernels(regs: dispatch.Registrations, router: AttentionRouter) -> None:
    """The CUDA target's attention and dropout kernels, for the registrations' lifetime."""
    regs.impl("scaled_dot_product_attention", _sdpa(router), KEY)
    regs.impl("dropout", _dropout, KEY)
