"""RNNs on a CUDA target are traced as cuDNN's fused RNN runs them (issue 46, item 3): one
_cudnn_rnn forward and backward with their GEMMs counted (hand counts below), in fp16
under autocast (ATen's cuDNN autocast kernel casts to fp16 whatever the autocast dtype)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tilefit import Recipe, trace
from tilefit.tracing.step import CUDNN_RESERVE_NOTE


def _loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x)[0].float().mean()


def _rnn_ops(build, x, precision="fp32", gpu="a100-80gb"):  # type: ignore[no-untyped-def]
    tr = trace(build, x, gpu=gpu, loss_fn=_loss,
               recipe=Recipe(optimizer="sgd", precision=precision, batch_size=x.shape[0]))
    return tr, [o for o in tr.ops_of_step(1) if "rnn" in o.op]


def test_an_lstm_is_one_cudnn_rnn_with_its_gemms_counted() -> None:
    # 2-layer LSTM(128, 256), batch 8 x 64 steps: 4 gates of 256 -> G*H = 1024
    tr, (fwd, bwd) = _rnn_ops(lambda: nn.LSTM(128, 256, num_layers=2, batch_first=True),
                              torch.randn(8, 64, 128))
    assert (fwd.op, bwd.op) == ("aten._cudnn_rnn.default", "aten._cudnn_rnn_backward.default")
    sb = 8 * 64
    layer0 = 2 * sb * 1024 * 128 + 64 * 2 * 8 * 1024 * 256  # input projection + 64 steps
    layer1 = 2 * sb * 1024 * 256 + 64 * 2 * 8 * 1024 * 256  # its input is the 256 outputs
    assert fwd.flops == layer0 + layer1 == 939_524_096
    assert bwd.flops == 2 * fwd.flops  # data and weight gradients: twice the forward
    assert fwd.kind == bwd.kind == "gemm" and fwd.dtype == "float32"
    assert len(fwd.gemms) == 2 * (1 + 64)  # per layer: the projection, then a GEMM a step
    assert CUDNN_RESERVE_NOTE in tr.warnings


def test_a_bidirectional_gru_counts_both_directions() -> None:
    # GRU(64, 32) one layer, bidirectional, batch 4 x 10 steps: 3 gates -> G*H = 96
    _, (fwd, bwd) = _rnn_ops(lambda: nn.GRU(64, 32, bidirectional=True, batch_first=True),
                             torch.randn(4, 10, 64))
    per_direction = 2 * 40 * 96 * 64 + 10 * 2 * 4 * 96 * 32
    assert fwd.flops == 2 * per_direction and bwd.flops == 2 * fwd.flops


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_under_autocast_cudnn_runs_in_fp16(precision: str) -> None:
    tr, (fwd, bwd) = _rnn_ops(lambda: nn.LSTM(32, 64, batch_first=True),
                              torch.randn(4, 6, 32), precision)
    assert fwd.dtype == bwd.dtype == "float16"
    assert {g.dtype for g in fwd.gemms + bwd.gemms} == {"fp16"}
    # the weights cast into one flat fp16 buffer: 4*64*(32 + 64) + 2*4*64 elements
    (flat,) = [o for o in tr.ops_of_step(1) if o.op == "aten.cat.default"
               and o.phase == "forward"]
    assert flat.output_shapes == ((4 * 64 * (32 + 64) + 2 * 4 * 64,),)


def test_the_cpu_target_runs_the_cpus_kernel() -> None:
    _, ops = _rnn_ops(lambda: nn.LSTM(32, 64, batch_first=True), torch.randn(4, 6, 32),
                      gpu="cpu")
    assert ops and not [o for o in ops if "cudnn" in o.op]
