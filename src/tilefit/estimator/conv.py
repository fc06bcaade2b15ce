"""Convolutions and BatchNorm as a GPU runs them (docs/references.md, section 37).

- A dense convolution is an implicit GEMM (cuDNN): tilefit.estimator.cost costs its GEMMs.
- A depthwise or thin grouped convolution, whose per-group GEMM has fewer than
  ``TENSOR_CORE_MIN_CHANNELS`` input or output channels, cannot fill a Tensor Core
  instruction: PyTorch runs a depthwise convolution in its own direct kernels
  (aten/src/ATen/native/cuda/DepthwiseConv2d.cu: one forward kernel; backward, one kernel for
  the input's gradient and one for the weight's), which stream their operands and accumulate
  in fp32 on the CUDA cores. Each kernel costs its bytes at the copy bandwidth or its FLOPs at
  the fp32 peak, whichever is slower, plus a launch.
- BatchNorm in training makes two passes over its input (the statistics, then the
  normalization; backward: the reductions of dy and dy * x, then the input's gradient), so
  the trace's bytes (each tensor once) gain a second read of what those passes re-read.

Pure arithmetic on the trace's records; only a GPU runs the direct kernels (a CPU target
keeps the implicit GEMM of its BLAS model).
"""

from __future__ import annotations

import math

from tilefit.dtypes import parse_dtype
from tilefit.errors import TilefitError
from tilefit.hardware.device import Device
from tilefit.tracing.records import OpRecord

# NVIDIA's Tensor Core requirement for convolutions: input and output channels (per group)
# multiples of 8 in fp16/bf16 (docs/references.md, section 37). Fewer than 8 per group cannot
# fill one MMA operand: such a convolution runs as a direct (CUDA-core) kernel.
TENSOR_CORE_MIN_CHANNELS = 8

# BatchNorm ops in training mode: the forward's statistics pass re-reads the input; the
# backward's reduction pass re-reads dy and the input (PyTorch's Normalization.cuh kernels:
# batch_norm_collect_statistics then batch_norm_transform_input; batch_norm_backward_reduce
# then batch_norm_backward_elemt). Two kernels each.
BN_TRAIN_FORWARD = ("aten.native_batch_norm", "aten._native_batch_norm_legit",
                    "aten._native_batch_norm_legit_functional", "aten.cudnn_batch_norm",
                    "aten.miopen_batch_norm")
BN_BACKWARD = ("aten.native_batch_norm_backward", "aten.cudnn_batch_norm_backward",
               "aten.miopen_batch_norm_backward", "aten.batch_norm_backward")
BN_KERNELS = 2


def _packet(op: str) -> str:
    return op.rsplit(".", 1)[0] if op.count(".") >= 2 else op


def _elem_bytes(dtype: str) -> int:
    """The element size of a trace's dtype name ("float16", "fp16"); 4 if tilefit has no
    entry for it."""
    try:
        return parse_dtype(dtype).bytes
    except TilefitError:
        return 4


def conv_groups(op: OpRecord) -> tuple[int, int, int]:
    """(groups, input channels per group, output channels per group) of a convolution op
    (forward: input, weight, ...; convolution_backward: grad_out, input, weight, ...)."""
    backward = _packet(op.op) == "aten.convolution_backward"
    x, w = (op.input_shapes[1], op.input_shapes[2]) if backward else op.input_shapes[:2]
    cin_g = w[1]
    groups = max(1, x[1] // cin_g)
    return groups, cin_g, w[0] // groups


def is_direct_conv(op: OpRecord) -> bool:
    """A grouped convolution too thin per group for Tensor Cores (depthwise: one channel
    per group), which runs as a direct kernel, not an implicit GEMM."""
    backward = _packet(op.op) == "aten.convolution_backward"
    if len(op.input_shapes) < (3 if backward else 2) or len(op.input_shapes[1]) < 3:
        return False
    groups, cin_g, cout_g = conv_groups(op)
    x_channels = op.input_shapes[1 if backward else 0][1]
    if x_channels != groups * cin_g or cout_g * groups != op.input_shapes[2 if backward else 1][0]:
        return False  # not a grouped convolution's shapes (a transposed one's weight)
    return groups > 1 and min(cin_g, cout_g) < TENSOR_CORE_MIN_CHANNELS


def direct_kernels(op: OpRecord) -> tuple[tuple[int, int], ...]:
    """(bytes, FLOPs) of each kernel a direct convolution launches. Forward: one kernel, the
    trace's bytes. convolution_backward: one kernel per gradient it computes, each reading
    dy and the other operand and writing its gradient (input: dy and w in, dx out; weight:
    dy and x in, dw out), plus the bias gradient's reduction of dy where it has one. FLOPs:
    each kernel does the forward's multiply-adds (N x output pixels x Cout x Cin/groups x
    kernel; 2 FLOPs each), which the forward's per-group GEMM holds."""
    if _packet(op.op) != "aten.convolution_backward":
        return ((op.bytes, sum(2 * g.batch * g.m * g.n * g.k for g in op.gemms)),)
    elem = _elem_bytes(op.gemms[0].dtype if op.gemms else op.dtype)
    dy_shape = op.input_shapes[0]
    dy, x, w = (math.prod(s) for s in op.input_shapes[:3])
    flops = 2 * dy_shape[0] * math.prod(dy_shape[2:]) * w
    x_shape, w_shape = op.input_shapes[1], op.input_shapes[2]
    grads = int(x_shape in op.output_shapes) + int(w_shape in op.output_shapes)
    kernels = [(elem * (dy + x + w), flops)] * grads
    cout = op.input_shapes[2][0]
    if any(s == (cout,) for s in op.output_shapes):  # the bias gradient: dy summed
        kernels.append((elem * (dy + cout), dy))
    return tuple(kernels)


def direct_conv_time_s(op: OpRecord, device: Device) -> float:
    """The direct kernels' time: each at max(bytes over the achieved copy bandwidth, FLOPs
    at the fp32 CUDA-core peak), plus its launch."""
    bandwidth = device.bandwidth_bytes_per_s * device.bandwidth_efficiency
    cuda_core = device.peak("fp32")
    return sum(max(nbytes / bandwidth, flops / cuda_core) + device.launch_overhead_s
               for nbytes, flops in direct_kernels(op))


def batch_norm_bytes(op: OpRecord) -> tuple[int, int]:
    """(bytes, kernels) of a BatchNorm op as its training kernels run it: the trace's bytes
    (each tensor once) plus the input re-read by the forward's second pass, or dy and the
    input re-read by the backward's; other BatchNorm ops (inference) as traced, one kernel."""
    packet = _packet(op.op)
    if not op.input_shapes:
        return op.bytes, 1
    elem = _elem_bytes(op.dtype)
    if packet in BN_TRAIN_FORWARD:
        return op.bytes + elem * math.prod(op.input_shapes[0]), BN_KERNELS
    if packet in BN_BACKWARD and len(op.input_shapes) > 1:
        return op.bytes + elem * 2 * math.prod(op.input_shapes[1]), BN_KERNELS
    return op.bytes, 1
