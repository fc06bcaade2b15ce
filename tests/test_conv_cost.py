"""Convolutions and BatchNorm as a GPU runs them (tilefit.estimator.conv): a depthwise
convolution's direct kernels at the copy bandwidth, a dense convolution's implicit GEMM,
BatchNorm's passes. Every expected value is hand arithmetic on the layer's shapes and the
device's datasheet terms."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tilefit.estimator.cost import CostContext, op_family, op_time_s
from tilefit.gemm import analyze_gemm
from tilefit.hardware import get_device
from tilefit.tracing.records import GemmShape, OpRecord

N, C, H, W = 4, 16, 8, 8  # batch, channels, height, width
FP16 = 2  # bytes
X = N * C * H * W  # elements of every activation below


class _Net(nn.Module):
    """A depthwise 3x3 conv (the first layer: its input needs no gradient), BatchNorm and a
    dense 3x3 conv, all size-preserving."""

    def __init__(self) -> None:
        super().__init__()
        self.dw = nn.Conv2d(C, C, 3, padding=1, groups=C, bias=False)
        self.bn = nn.BatchNorm2d(C)
        self.dense = nn.Conv2d(C, C, 3, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(self.bn(self.dw(x))).float().mean()


def _steady_ops(channels_last: bool) -> list[OpRecord]:
    from tilefit import Recipe, trace

    model, x = _Net(), torch.randn(N, C, H, W)
    if channels_last:
        model, x = model.to(memory_format=torch.channels_last), x.to(
            memory_format=torch.channels_last)
    tr = trace(model, x, recipe=Recipe(precision="fp16-mixed", optimizer="sgd"),
               gpu="a100-80gb", loss_fn=lambda m, b: m(b))
    return [o for o in tr.ops if o.step == 1]


@pytest.fixture(scope="module")
def ops() -> dict[str, OpRecord]:
    steady = _steady_ops(channels_last=False)
    by_module: dict[str, OpRecord] = {}
    for o in steady:
        name = o.op.rsplit(".", 1)[0].removeprefix("aten.")
        if name in ("convolution", "convolution_backward", "native_batch_norm",
                    "native_batch_norm_backward"):
            by_module[f"{o.module.rsplit('.', 1)[-1]}:{name}"] = o
    return by_module


def _copy_s(nbytes: float) -> float:
    dev = get_device("a100-80gb")
    return nbytes / (dev.bandwidth_bytes_per_s * dev.bandwidth_efficiency)


def test_a_depthwise_conv_costs_its_bytes_at_the_copy_bandwidth(ops: dict[str, OpRecord]
                                                                 ) -> None:
    dev = get_device("a100-80gb")
    fwd = ops["dw:convolution"]
    # reads x (fp16) and the 16 x 1 x 3 x 3 weight, writes y
    nbytes = FP16 * (X + C * 9 + X)
    flops = 2 * N * H * W * C * 9  # one multiply-add per tap per output
    assert flops / dev.peak("fp32") < _copy_s(nbytes)  # memory-bound, as it runs
    expected = _copy_s(nbytes) + dev.launch_overhead_s
    assert op_time_s(fwd, dev, CostContext("fp16-mixed")) == pytest.approx(expected)


def test_the_depthwise_backward_splits_into_the_gradients_it_computes(
        ops: dict[str, OpRecord]) -> None:
    from tilefit.estimator.conv import direct_kernels

    dev = get_device("a100-80gb")
    bwd = ops["dw:convolution_backward"]
    # the first layer: its input needs no gradient, so one kernel, the weight's: dy and x
    # read, dw written
    assert direct_kernels(bwd) == ((FP16 * (X + X + C * 9), 2 * N * H * W * C * 9),)
    # its FLOPs: the forward's (torch.utils.flop_counter's forward formula, a second method),
    # not flop_counter's backward formula, which counts the weight's gradient ungrouped
    assert bwd.flops == ops["dw:convolution"].flops == 2 * N * H * W * C * 9
    expected = _copy_s(FP16 * (2 * X + C * 9)) + dev.launch_overhead_s
    assert op_time_s(bwd, dev, CostContext("fp16-mixed")) == pytest.approx(expected)
    # a middle layer computes both: the input's gradient (dy and w in, dx out) and the
    # weight's (dy and x in, dw out), and the bias gradient (dy summed) when it has one
    both = OpRecord(bwd.op, "backward", "dw", bwd.input_shapes,
                    ((N, C, H, W), (C, 1, 3, 3), (C,)), "float16", 0, 0, "conv", 1, 0,
                    gemms=(GemmShape(C, N * H * W, 1, 9, "fp16"),
                           GemmShape(C, 1, 9, N * H * W, "fp16")))
    each = FP16 * (X + X + C * 9)
    assert [k[0] for k in direct_kernels(both)] == [each, each, FP16 * (X + C)]
    expected = _copy_s(2 * each + FP16 * (X + C)) + 3 * dev.launch_overhead_s
    assert op_time_s(both, dev, CostContext("fp16-mixed")) == pytest.approx(expected)


def test_a_dense_conv_is_still_its_implicit_gemm(ops: dict[str, OpRecord]) -> None:
    dev = get_device("a100-80gb")
    fwd = ops["dense:convolution"]
    # M = N x output pixels, N = Cout, K = Cin x 3 x 3
    assert fwd.gemms == (GemmShape(1, N * H * W, C, C * 9, "fp16"),)
    gemm = analyze_gemm(N * H * W, C, C * 9, "fp16", dev).predicted_time_s
    floor = _copy_s(FP16 * (X + C * C * 9 + X)) + dev.launch_overhead_s
    assert op_time_s(fwd, dev, CostContext("fp16-mixed")) == pytest.approx(max(gemm, floor))


def test_grouped_convs_run_direct_only_below_eight_channels_per_group() -> None:
    from tilefit.estimator.conv import is_direct_conv

    def conv(cin: int, cout: int, groups: int) -> OpRecord:
        return OpRecord("aten.convolution.default", "forward", "c",
                        ((N, cin, H, W), (cout, cin // groups, 3, 3)), ((N, cout, H, W),),
                        "float16", 0, 0, "conv", 1, 0)

    assert is_direct_conv(conv(64, 64, 64))  # depthwise
    assert is_direct_conv(conv(128, 128, 32))  # ResNeXt 32x4d: 4 channels a group
    assert not is_direct_conv(conv(128, 128, 16))  # RegNet's group width 8 and up
    assert not is_direct_conv(conv(3, 64, 1))  # a dense stem
    # a transposed conv's weight is (Cin, Cout/groups, ...): 64 -> 3 channels is not grouped
    transposed = OpRecord("aten.convolution.default", "forward", "c",
                          ((N, 64, H, W), (64, 3, 3, 3)), ((N, 3, 2 * H, 2 * W),),
                          "float16", 0, 0, "conv", 1, 0)
    assert not is_direct_conv(transposed)


def test_batch_norm_is_its_own_family_with_its_passes_counted(ops: dict[str, OpRecord]
                                                              ) -> None:
    from tilefit.tracing.shapes import classify

    assert classify(torch.ops.aten.native_batch_norm.default) == "memory"
    assert classify(torch.ops.aten.cudnn_batch_norm.default) == "memory"
    dev = get_device("a100-80gb")
    fwd, bwd = ops["bn:native_batch_norm"], ops["bn:native_batch_norm_backward"]
    assert op_family(fwd.op) == op_family(bwd.op) == "batch_norm"
    # training forward: x read twice (statistics, then normalize), y written; the per-channel
    # fp32 vectors are a few hundred bytes (rel 1e-3 of the activations' 8 KiB each)
    assert op_time_s(fwd, dev, CostContext("fp16-mixed")) == pytest.approx(
        _copy_s(3 * FP16 * X) + 2 * dev.launch_overhead_s, rel=1e-3)
    # backward: dy and x read twice (the reductions, then the gradient), dx written
    assert op_time_s(bwd, dev, CostContext("fp16-mixed")) == pytest.approx(
        _copy_s(5 * FP16 * X) + 2 * dev.launch_overhead_s, rel=1e-3)


def test_channels_last_is_costed_without_layout_transposes(ops: dict[str, OpRecord]) -> None:
    """The trace has no memory format: a channels-last step records the same ops, bytes and
    GEMMs as the NCHW one, and neither is charged a layout transpose around its convs."""
    nhwc = _steady_ops(channels_last=True)
    nchw = _steady_ops(channels_last=False)
    assert [(o.op, o.bytes, o.gemms) for o in nhwc] == [(o.op, o.bytes, o.gemms) for o in nchw]
    # the only activation-sized copies are the casts the model itself asks for (the input's
    # autocast to fp16, `.float()` before the loss, and that cast's backward): three
    big = [o for o in nhwc if o.kind != "view" and op_family(o.op) == "copy"
           and math.prod(o.input_shapes[0]) == X]
    assert [o.op for o in big] == ["aten._to_copy.default"] * 3


@pytest.mark.parametrize(("kernel", "dgrad_taps"), [(3, ((4, 1), (2, 2), (1, 1))),
                                                    (1, ((1, 1),))])
def test_a_strided_convs_input_gradient_does_the_forwards_work(
        kernel: int, dgrad_taps: tuple[tuple[int, int], ...]) -> None:
    """Stride 2: the input's gradient is one GEMM per phase of the stride over the output's
    pixels, each with the filter taps that reach it (3x3: 4, 2, 2 and 1 taps; 1x1: one phase
    of one tap), so its multiply-adds are the forward's, not four times them."""
    from tilefit.tracing.shapes import gemm_shapes

    cin, cout, side = 16, 32, 8
    out_side = side // 2

    def meta(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float16, device="meta")

    args = (meta(N, cout, out_side, out_side), meta(N, cin, side, side),
            meta(cout, cin, kernel, kernel), None, [2, 2], [kernel // 2] * 2, [1, 1], False,
            [0, 0], 1, [True, True, False])
    gemms = gemm_shapes(torch.ops.aten.convolution_backward.default, args, {}, None, "conv")
    m = N * out_side * out_side
    assert gemms[:-1] == tuple(GemmShape(batch, m, cin, cout * taps, "fp16")
                               for taps, batch in dgrad_taps)
    forward_macs = m * cout * cin * kernel * kernel
    assert sum(g.batch * g.m * g.n * g.k for g in gemms[:-1]) == forward_macs
    assert gemms[-1] == GemmShape(1, cout, cin * kernel * kernel, m, "fp16")  # the weight's
