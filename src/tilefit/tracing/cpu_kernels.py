"""The kernels a CPU target runs whose fake versions differ from the real ones: meta kernels
registered once for the process and switched on for a traced step by ``cpu_target_kernels``
(the CUDA target's are tracing.target_kernels).

- ``mkldnn_rnn_layer``: oneDNN's LSTM layer, one call per layer and direction, which ATen runs
  on the CPU for ``nn.LSTM`` in fp32 and bf16 (``aten/src/ATen/native/mkldnn/RNN.cpp``;
  ``nn.GRU`` and ``nn.RNN`` run a loop of cells instead, and an LSTM with ``proj_size`` too).
  With grad mode on it returns, beside the output and final states, a uint8 workspace of the
  size oneDNN's LSTM primitive asks for (``lstm_forward_training``), which autograd keeps for
  the layer's backward; torch's meta kernel returns it empty, so the trace missed several MB
  a layer. ``lstm_workspace_bytes`` is oneDNN's own layout, exact against the real op
  (docs/references.md, section 48).
- ``mkldnn_rnn_layer_backward``: returns the bias's gradient twice, the second a clone
  (``diff_b2_``); torch's meta kernel returns the first tensor again, one storage short.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tilefit.compat import dispatch
from tilefit.compat.fake import uncached
from tilefit.gemm import round_up

_LAYER = "mkldnn_rnn_layer"
_LAYER_BACKWARD = "mkldnn_rnn_layer_backward"
# the bias's gates by ideep's rnn_kind (RNN_RELU 0, RNN_TANH 1, LSTM 2, GRU 3: its GRU bias
# keeps the reset gate's two halves apart)
BIAS_GATES = {2: 4, 3: 4}
PAGE_BYTES = 4096  # each workspace region starts on a page (rnn_utils.cpp, set_offsets)
CACHE_LINE_BYTES = 64  # a GEMM operand's leading dimension is a whole number of lines
ALIASING_PERIOD = 256  # ... and not a multiple of 256 elements (4K aliasing)
LSTM_GATES = 4
ACCUMULATOR_BYTES = 4  # gemm_acc_t: fp32 for fp32, bf16 and fp16 cells alike
# oneDNN 3.9 dropped two unused copies of the hidden states (commit d3fb569, "cpu: rnn: remove
# unnecessary memory allocations"); torch 2.13 ships 3.12
STATES_ITER_DROPPED = (3, 9)


def good_leading_dim(dim: int, element_bytes: int) -> int:
    """oneDNN's ``get_good_ld``: ``dim`` elements rounded up to a cache line, one line more
    where that is a multiple of 256 elements."""
    per_line = CACHE_LINE_BYTES // element_bytes
    ld = round_up(dim, per_line)
    return ld + per_line if ld % ALIASING_PERIOD == 0 else ld


def lstm_workspace_bytes(seq_len: int, batch: int, input_size: int, hidden_size: int, *,
                         state_bytes: int, cell_bytes: int,
                         onednn: tuple[int, int] = (3, 12)) -> int:
    """The workspace of one oneDNN LSTM layer and direction in training (``set_offsets``
    and ``set_workspace_sizes`` in oneDNN's src/cpu/rnn/rnn_utils.{cpp,hpp}): its regions,
    each starting on a 4 KiB page, for 1 layer, 1 direction and ``seq_len`` steps of
    ``batch`` rows (``state_bytes``: the input's element size, which the gates, hidden and
    layer states take; ``cell_bytes``: the cell state's; the gradients' accumulate in fp32).
    """
    steps, states = seq_len * batch, 2 * (seq_len + 1) * batch  # states: layers 0-1, t 0..T
    widest = max(input_size, hidden_size)
    layer_states = states * good_leading_dim(widest, state_bytes) * state_bytes
    diff_states = states * good_leading_dim(widest, ACCUMULATOR_BYTES) * ACCUMULATOR_BYTES
    regions = [
        steps * good_leading_dim(LSTM_GATES * hidden_size, state_bytes) * state_bytes,  # gates
        steps * good_leading_dim(hidden_size, state_bytes) * state_bytes,  # ht
        layer_states,
        *([layer_states] * 2 if onednn < STATES_ITER_DROPPED else []),  # iter, registered twice
        states * hidden_size * cell_bytes,  # cell states
        diff_states,  # gradients of the layer states
        diff_states,  # ... and of the iteration states
        states * hidden_size * ACCUMULATOR_BYTES,  # ... and of the cell states
    ]
    return sum(round_up(r, PAGE_BYTES) for r in regions)


@functools.cache
def onednn_version() -> tuple[int, int]:
    """The oneDNN torch was built with, from ``torch.__config__.show()`` ("MKL-DNN
    v3.12.0"); (3, 12) where it does not say."""
    found = re.search(r"MKL-DNN v(\d+)\.(\d+)", torch.__config__.show())
    return (int(found.group(1)), int(found.group(2))) if found else (3, 12)


def _mkldnn_rnn_layer_meta(x: torch.Tensor, w0: torch.Tensor, w1: torch.Tensor,
                           w2: torch.Tensor, w3: torch.Tensor, hx: torch.Tensor,
                           cx: torch.Tensor, *args: Any) -> tuple[torch.Tensor, ...]:
    """What the CPU kernel returns: the output (``x`` is time-major here whatever
    batch_first says: ATen's lstm transposes it first), the final states, and a workspace
    only with grad mode on (the kernel tests GradMode, not its ``train`` flag)."""
    seq_len, batch, input_size = x.shape
    hidden = int(args[3])  # after reverse, batch_sizes, mode
    nbytes = lstm_workspace_bytes(seq_len, batch, input_size, hidden,
                                  state_bytes=x.element_size(), cell_bytes=cx.element_size(),
                                  onednn=onednn_version()) if torch.is_grad_enabled() else 0
    return (x.new_empty((seq_len, batch, hidden)), hx.new_empty(hx.shape),
            cx.new_empty(cx.shape), x.new_empty((nbytes,), dtype=torch.uint8))


def _mkldnn_rnn_layer_backward_meta(x: torch.Tensor, w0: torch.Tensor, w1: torch.Tensor,
                                    w2: torch.Tensor, w3: torch.Tensor, hx: torch.Tensor,
                                    cx: torch.Tensor, *args: Any) -> tuple[torch.Tensor, ...]:
    """The gradients as the CPU kernel returns them, in fp32: the input's, the weights', the
    bias's twice (the second a clone, where torch's meta kernel returns the first again) and
    the initial states'."""
    mode, hidden = int(args[7]), int(args[8])  # after output, hy, cy, 3 grads, reverse
    bias = BIAS_GATES.get(mode, 1) * hidden
    fp32 = torch.float32
    return (x.new_empty(x.shape, dtype=fp32), w0.new_empty(w0.shape, dtype=fp32),
            w1.new_empty(w1.shape, dtype=fp32), w2.new_empty((bias,), dtype=fp32),
            w2.new_empty((bias,), dtype=fp32), hx.new_empty(hx.shape, dtype=fp32),
            cx.new_empty(cx.shape, dtype=fp32))


_inside: list[int] = [0]  # cpu_target_kernels blocks entered and not left


def _switched(ours: Callable[..., Any], op: Any) -> Callable[..., Any]:
    """``ours`` inside a cpu_target_kernels block, torch's own meta kernel outside it."""
    torchs = dispatch.python_meta_kernel(op)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if _inside[0] or torchs is None:
            return ours(*args, **kwargs)
        return torchs(*args, **kwargs)
    return kernel


@functools.cache
def _installed() -> tuple[Any, Any] | None:
    """The two ops, their meta kernels registered once for the process (a kernel registered
    for a block would not hold for fake tensors: compat.dispatch.kept_registration)."""
    forward, backward = dispatch.op_overload(_LAYER), dispatch.op_overload(_LAYER_BACKWARD)
    if forward is None or backward is None:  # a torch without oneDNN's RNN
        return None
    dispatch.kept_registration(_LAYER, _switched(_mkldnn_rnn_layer_meta, forward), "Meta")
    dispatch.kept_registration(_LAYER_BACKWARD, _switched(
        _mkldnn_rnn_layer_backward_meta, backward), "Meta")
    return forward, backward


@contextlib.contextmanager
def cpu_target_kernels() -> Iterator[None]:
    """oneDNN's LSTM layer with its workspace, for the block (out of the fake-tensor cache's
    way: its key does not hold grad mode, on which the workspace depends, and its entries
    from outside the block hold torch's empty workspace)."""
    ops = _installed()
    if ops is None:
        yield
        return
    with uncached(ops[0]), uncached(ops[1]):
        _inside[0] += 1
        try:
            yield
        finally:
            _inside[0] -= 1
