"""The kernels a CUDA target runs where the CPU's differ, registered in the dispatcher for a
traced step, so that every call gets them whatever Python function makes it.

- ``scaled_dot_product_attention``: the backend PyTorch picks on the target
  (tracing.attention's router: flash, memory-efficient or math), run as the CPU stand-in with
  the same memory behaviour.
- ``dropout``: ATen's fused kernel, ``native_dropout``, which CUDA takes for a training input
  with 0 < p < 1 (is_fused_kernel_acceptable in ATen's Dropout.cpp); it returns the output
  and a bool mask that its backward keeps. The CPU decomposes it into bernoulli_, div_ and
  mul, keeping a mask in the input's dtype.

- ``lstm``, ``gru``, ``rnn_tanh``, ``rnn_relu``: cuDNN's fused RNN, ``_cudnn_rnn``, which
  CUDA runs for them where the CPU runs oneDNN's layer (or a loop of cells); its backward,
  ``_cudnn_rnn_backward``, gets a meta kernel for the trace (torch ships the forward's only).
  cuDNN's reserve space (what the forward keeps for the backward) is not published:
  torch's meta kernel gives it no bytes, and the trace keeps that (a note says so; the GPU
  validation's rnn section measures it).

These are CompositeImplicitAutograd ops: the kernels sit at the AutogradCPU key (above
autograd, as the composite itself runs) and run the composite, or the target's op, from
there (docs/references.md, section 46).
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


# cuDNN's RNN modes (cudnnRNNMode_t, as aten._cudnn_rnn takes them)
CUDNN_MODES = {"rnn_relu": 0, "rnn_tanh": 1, "lstm": 2, "gru": 3}


_CUDNN_RNN = dispatch.op_overload("_cudnn_rnn")


def _cudnn_rnn(mode: str) -> Callable[..., Any]:
    """``lstm.input`` (and the GRU's and RNNs') as CUDA runs it: one ``_cudnn_rnn``."""
    def kernel(x: torch.Tensor, hx: Any, params: list[torch.Tensor], has_biases: bool,
               num_layers: int, dropout: float, train: bool, bidirectional: bool,
               batch_first: bool) -> tuple[torch.Tensor, ...]:
        states = list(hx) if isinstance(hx, (list, tuple)) else [hx]
        h0, c0 = states[0], (states[1] if len(states) > 1 else None)
        directions = 2 if bidirectional else 1
        hidden = c0.shape[-1] if c0 is not None else h0.shape[-1]
        proj = h0.shape[-1] if c0 is not None and h0.shape[-1] != hidden else 0
        # the flat weight buffer nn's RNNs keep on a GPU holds the parameters themselves:
        # an empty stand-in (the autocast kernel makes the fp16 one it casts into)
        out = _CUDNN_RNN(
            x, list(params), len(params) // (num_layers * directions), x.new_empty(0), h0,
            c0, CUDNN_MODES[mode], hidden, proj, num_layers, batch_first, dropout, train,
            bidirectional, [], None)
        return (out[0], out[1], out[2]) if c0 is not None else (out[0], out[1])
    return kernel


def _cudnn_rnn_backward_meta(x: torch.Tensor, weight: list[torch.Tensor], *args: Any
                             ) -> tuple[Any, ...]:
    """The gradients' shapes: the input's, the initial states', each weight's."""
    hx, cx = args[1], args[2]
    return (x.new_empty(x.shape), hx.new_empty(hx.shape),
            None if cx is None else cx.new_empty(cx.shape),
            [w.new_empty(w.shape) for w in weight])


def register_target_kernels(regs: dispatch.Registrations, router: AttentionRouter) -> None:
    """The CUDA target's attention, dropout and RNN kernels, for the registrations'
    lifetime."""
    regs.impl("scaled_dot_product_attention", _sdpa(router), KEY)
    regs.impl("dropout", _dropout, KEY)
    for mode in CUDNN_MODES:
        regs.impl(f"{mode}.input", _cudnn_rnn(mode), KEY)
    regs.impl("_cudnn_rnn_backward", _cudnn_rnn_backward_meta, "Meta")
