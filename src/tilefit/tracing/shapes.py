"""From an aten call to what the cost model needs: its kind, its GEMMs, its FLOPs."""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable
from typing import Any

import torch

from tilefit.compat.fake import flop_formula
from tilefit.compat.moe import EXPERT_LOOP_OPS, grouped_mm_needs_bf16
from tilefit.errors import error_line
from tilefit.tracing.collectives import ENGINE_COPY_NAMESPACE, WAIT_OPS, is_collective
from tilefit.tracing.records import GemmShape
from tilefit.vocab import BALANCED

GEMM_OPS = {"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._scaled_mm",
            "aten._grouped_mm"}
# cuDNN's fused RNN (what a CUDA target runs for nn.LSTM / GRU / RNN: tracing.target_kernels)
CUDNN_RNN_OPS = {"aten._cudnn_rnn", "aten._cudnn_rnn_backward"}
# grouped GEMMs: torch's kernel, and transformers' per-expert loop in its place
# (compat.moe.EXPERT_LOOP_OPS); their FLOPs are the sum of their per-expert GEMMs
EXPERT_LOOP_NAMES = frozenset(op.rsplit(".", 1)[0] for op in EXPERT_LOOP_OPS)
GROUPED_NAMES = EXPERT_LOOP_NAMES | {"aten._grouped_mm"}
# tokens per expert of ``routed`` token-slots over ``experts`` (vocab.ExpertRouting.counts,
# with the model's top-k; tilefit.tracing.moe): what a grouped GEMM's offsets hold on a GPU
ExpertCounts = Callable[[int, int], tuple[int, ...]]
CONV_OPS = {"aten.convolution", "aten._convolution", "aten.convolution_backward",
            "aten.cudnn_convolution", "aten._slow_conv2d_forward", "aten.mkldnn_convolution",
            "aten.convolution_overrideable"}
ATTENTION_OPS = {
    "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_flash_attention_backward",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_efficient_attention_backward",
    "aten._scaled_dot_product_cudnn_attention", "aten._scaled_dot_product_cudnn_attention_backward",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_flash_attention_for_cpu_backward",
}
# Ops that launch no kernel: aliases and bare allocations (their memory is still tracked).
NO_KERNEL = {"aten.detach", "aten.alias", "aten.lift_fresh", "aten._unsafe_view", "aten.empty",
             "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided", "aten.empty_like",
             "aten._local_scalar_dense", "aten.set_", "aten.lift_fresh_copy"}

# bitsandbytes' custom ops (bitsandbytes/_ops.py): its 4-bit GEMM (the weight dequantized,
# then multiplied: tilefit.estimator.cost adds the dequantization's bytes) and its
# memory-bound kernels, which stream their operands once: blockwise (de)quantization, the
# 8-bit vectorwise (de)quantization and the optimizers' fused updates
BNB_GEMM_OPS = {"bitsandbytes.gemm_4bit", "bitsandbytes.gemv_4bit"}
BNB_MEMORY_OPS = ("bitsandbytes.dequantize_", "bitsandbytes.quantize_",
                  "bitsandbytes.int8_vectorwise_", "bitsandbytes.optimizer_update_")

# Op families that are memory-bound by nature (copies, creation, reductions, norms,
# softmax, losses, indexing, pooling, optimizer foreach kernels and their backward ops):
# bytes over bandwidth is their right cost. Pointwise ops are recognised by torch's
# Tag.pointwise. Anything else without a FLOP formula is "unknown" and reported.
_MEMORY_FAMILIES = re.compile(
    r"aten\.(_foreach_|_fused_|_amp_|copy|_to_copy|_copy|clone|contiguous|fill|zero|zeros|ones|"
    r"full|arange|scalar_tensor|cat|stack|split|chunk|unbind|index|gather|scatter|embedding|"
    r"masked|where|sum|mean|amax|amin|max|min|argmax|argmin|var|std|norm|linalg_vector_norm|"
    r"_softmax|_log_softmax|softmax|log_softmax|nll_loss|cross_entropy|mse_loss|l1_loss|"
    r"smooth_l1|huber|binary_cross_entropy|native_layer_norm|native_group_norm|"
    r"_native_batch_norm|native_batch_norm|batch_norm|_batch_norm|cudnn_batch_norm|"
    r"miopen_batch_norm|layer_norm|rms_norm|"
    r"_fused_rms_norm|native_dropout|dropout|bernoulli|rand|normal|uniform|tril|triu|cumsum|"
    r"cumprod|sort|topk|constant_pad|pad|reflection_pad|replication_pad|upsample|max_pool|"
    r"avg_pool|adaptive_|col2im|im2col|repeat|roll|flip|_unsafe_index|new_zeros|new_ones|"
    r"new_full|any|all|logsumexp|prod|isinf|isnan|isfinite|count_nonzero|bincount|histc|one_hot|"
    r"lerp|addcmul|addcdiv|sign|clamp|_local_scalar|item|equal|_assert|linspace|floor_divide|"
    r"[a-z_0-9]*_backward)"
)

TORCH_TO_TILEFIT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
                    torch.float64: "fp32", torch.int8: "int8"}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        TORCH_TO_TILEFIT[getattr(torch, _name)] = "fp8"


def packet_name(func: Any) -> str:
    return str(getattr(func, "overloadpacket", func))


_KIND: dict[Any, str] = {}


def classify(func: Any) -> str:
    """The op's kind for the cost model: view, gemm, conv, attention, memory, collective or
    unknown."""
    kind = _KIND.get(func)
    if kind is None:
        kind = _KIND[func] = _classify(func)
    return kind


def _classify(func: Any) -> str:
    name = packet_name(func)
    if getattr(func, "is_view", False) or name in NO_KERNEL or name in WAIT_OPS:
        return "view"
    if is_collective(name):
        return "collective"
    if name.startswith(ENGINE_COPY_NAMESPACE):  # FSDP2's copy-in / copy-out kernels
        return "memory"
    if name in GEMM_OPS or name in CUDNN_RNN_OPS:
        return "gemm"
    if name in CONV_OPS:
        return "conv"
    if name in ATTENTION_OPS:
        return "attention"
    if torch.Tag.pointwise in getattr(func, "tags", ()) or _MEMORY_FAMILIES.match(name):
        return "memory"
    if name.startswith("tilefit."):  # tilefit's own kernels (models.fused_loss): streaming
        return "memory"
    if name in BNB_GEMM_OPS or name in EXPERT_LOOP_NAMES:
        return "gemm"
    if name.startswith(BNB_MEMORY_OPS):  # bitsandbytes' (de)quantize and optimizer kernels
        return "memory"
    return "unknown"


def tilefit_dtype(dtype: torch.dtype) -> str:
    return TORCH_TO_TILEFIT.get(dtype, "fp32")


def gemm_shapes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any,
                kind: str, expert_counts: ExpertCounts | None = None) -> tuple[GemmShape, ...]:
    name = packet_name(func)
    if name == "aten._grouped_mm":
        return grouped_gemms(args, kwargs, expert_counts)
    if name in EXPERT_LOOP_NAMES:
        return expert_loop_gemms(args, expert_counts)
    if name == "aten.mm" or name == "aten._scaled_mm":
        a, b = args[0], args[1]
        return (GemmShape(1, a.shape[0], b.shape[1], a.shape[1], tilefit_dtype(a.dtype)),)
    if name == "aten.addmm":
        a, b = args[1], args[2]
        return (GemmShape(1, a.shape[0], b.shape[1], a.shape[1], tilefit_dtype(a.dtype)),)
    if name == "aten.bmm":
        a, b = args[0], args[1]
        return (GemmShape(a.shape[0], a.shape[1], b.shape[2], a.shape[2], tilefit_dtype(a.dtype)),)
    if name == "aten.baddbmm":
        a, b = args[1], args[2]
        return (GemmShape(a.shape[0], a.shape[1], b.shape[2], a.shape[2], tilefit_dtype(a.dtype)),)
    if name in BNB_GEMM_OPS:  # A (..., K) times the 4-bit weight of shape shapeB = (N, K)
        a, n = args[0], args[2][0]
        return (GemmShape(1, a.numel() // a.shape[-1], n, a.shape[-1], tilefit_dtype(a.dtype)),)
    if name in CUDNN_RNN_OPS:
        return cudnn_rnn_gemms(args, backward=name == "aten._cudnn_rnn_backward")
    if name == "aten.convolution_backward":
        return _conv_backward_gemms(args)
    if name in CONV_OPS:
        return _conv_forward_gemms(args, out)
    return ()


# gates per step: cudnnRNNMode_t's RNN_RELU, RNN_TANH, LSTM, GRU
_RNN_GATES = {0: 1, 1: 1, 2: 4, 3: 3}


def cudnn_rnn_gemms(args: tuple[Any, ...], *, backward: bool) -> tuple[GemmShape, ...]:
    """The GEMMs of cuDNN's RNN over a sequence of S steps and batch B, per layer and
    direction, with G gates of hidden size H and a recurrent input of size P (the projection,
    else H): one GEMM for every step's input projection (S*B x G*H x I, I the layer's input
    size), then one recurrent GEMM per step (B x G*H x P), in order. The backward runs the
    recurrent GEMM per step the other way (B x P x G*H) and, over the whole sequence, the
    input's gradient (S*B x I x G*H) and the two weights' (G*H x I and G*H x P, the
    contraction S*B long): twice the forward's work. The elementwise gate math is left out
    (it is memory-bound and small beside them)."""
    x, weight = args[0], args[1]
    # forward: (..., mode 6, hidden 7, proj 8, layers 9, batch_first 10, ..., bidir 13,
    # batch_sizes 14); backward: (..., mode 10, hidden 11, proj 12, layers 13,
    # batch_first 14, ..., bidir 17, batch_sizes 18)
    at = 10 if backward else 6
    mode, hidden, proj, layers, batch_first = args[at:at + 5]
    bidir, batch_sizes = args[at + 7], args[at + 8]
    if batch_sizes:
        steps, batch = len(batch_sizes), int(batch_sizes[0])
    else:
        steps, batch = (x.shape[1], x.shape[0]) if batch_first else (x.shape[0], x.shape[1])
    directions, gh = 2 if bidir else 1, _RNN_GATES[int(mode)] * hidden
    rec = proj or hidden
    dt = tilefit_dtype(weight[0].dtype if weight else x.dtype)
    out: list[GemmShape] = []
    for layer in range(layers):
        width = x.shape[-1] if layer == 0 else rec * directions
        for _ in range(directions):
            if not backward:
                out.append(GemmShape(1, steps * batch, gh, width, dt))
                out += [GemmShape(1, batch, gh, rec, dt)] * steps
            else:
                out += [GemmShape(1, batch, rec, gh, dt)] * steps
                out += [GemmShape(1, steps * batch, width, gh, dt),
                        GemmShape(1, gh, width, steps * batch, dt),
                        GemmShape(1, gh, rec, steps * batch, dt)]
    return tuple(out)


def grouped_gemms(args: tuple[Any, ...], kwargs: dict[str, Any],
                  expert_counts: ExpertCounts | None) -> tuple[GemmShape, ...]:
    """``aten._grouped_mm(a, b, offs)``: one GEMM per expert (group), the group's rows from
    the routing (the offsets' values, which a fake tensor lacks). 2D x 3D: the experts'
    forward, rows (S, K) times (E, K, N), M the expert's tokens; 2D x 2D: the weights'
    gradient (K, S) times (S, N) -> (E, K, N), the tokens the contraction; 3D x 2D: N the
    tokens; 3D x 3D: a plain batched GEMM. In bf16 (the grouped kernel) experts of equal
    load are one batched shape; in other dtypes ATen's fallback runs one ``mm`` per group
    (records.grouped_fallback), each its own shape."""
    a, b = args[0], args[1]
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    dt = tilefit_dtype(a.dtype)
    if a.dim() == 3 and b.dim() == 3:
        return (GemmShape(a.shape[0], a.shape[1], b.shape[2], a.shape[2], dt),)
    experts = int(offs.shape[0])
    routed = int(b.shape[0] if a.dim() == 3 else a.shape[-1] if b.dim() == 2 else a.shape[0])
    counts = (expert_counts or BALANCED.counts)(routed, experts)
    loads: dict[int, int] = {}
    for c in counts:
        if c:
            loads[c] = loads.get(c, 0) + 1
    per_group = not grouped_mm_needs_bf16(args)  # ATen's fallback: one kernel per group
    return tuple(_grouped_shape(a, b, c, 1 if per_group else n, dt)
                 for c, n in loads.items() for _ in range(n if per_group else 1))


def _grouped_shape(a: Any, b: Any, rows: int, batch: int, dt: str) -> GemmShape:
    """The GEMM of ``batch`` groups of ``rows`` rows each (grouped_gemms' layouts)."""
    if b.dim() == 3:  # (S, K) x (E, K, N)
        return GemmShape(batch, rows, b.shape[2], a.shape[1], dt)
    if a.dim() == 2:  # (K, S) x (S, N) -> (E, K, N)
        return GemmShape(batch, a.shape[0], b.shape[1], rows, dt)
    return GemmShape(batch, a.shape[1], rows, a.shape[2], dt)


def expert_loop_gemms(args: tuple[Any, ...],
                      expert_counts: ExpertCounts | None) -> tuple[GemmShape, ...]:
    """transformers' per-expert fallback (compat.moe.EXPERT_LOOP_OPS): one ``torch.mm`` per
    expert hit, each its own kernel. Forward ``(input (S, K), weight (E, K, N), offs)``: the
    expert's rows times its (K, N); backward ``(input, weight, offs, grad_output (S, N))``:
    the input's gradient (rows x N) x (N x K) and the weight's (K x rows) x (rows x N)."""
    x, w = args[0], args[1]
    experts, k, n = (int(d) for d in w.shape)
    counts = (expert_counts or BALANCED.counts)(int(x.shape[0]), experts)
    dt = tilefit_dtype(x.dtype)
    if len(args) < 4:
        return tuple(GemmShape(1, c, n, k, dt) for c in counts if c)
    return tuple(g for c in counts if c
                 for g in (GemmShape(1, c, k, n, dt), GemmShape(1, k, n, c, dt)))


def _conv_forward_gemms(args: tuple[Any, ...], out: Any) -> tuple[GemmShape, ...]:
    # Implicit GEMM (cuDNN): M = N * output pixels, N = Cout/groups, K = Cin/groups * kernel.
    x, w = args[0], args[1]
    groups = int(args[8]) if len(args) > 8 else 1
    y = out[0] if isinstance(out, tuple | list) else out
    n = x.shape[0]
    out_pixels = math.prod(y.shape[2:])
    kernel = math.prod(w.shape[2:])
    cout = w.shape[0]
    cin_g = w.shape[1]
    return (GemmShape(groups, n * out_pixels, cout // groups, cin_g * kernel,
                      tilefit_dtype(x.dtype)),)


def _conv_backward_gemms(args: tuple[Any, ...]) -> tuple[GemmShape, ...]:
    grad_out, x, w = args[0], args[1], args[2]
    groups = int(args[9]) if len(args) > 9 else 1
    mask = args[10] if len(args) > 10 else (True, True, True)
    n = x.shape[0]
    in_pixels = math.prod(x.shape[2:])
    out_pixels = math.prod(grad_out.shape[2:])
    kernel = math.prod(w.shape[2:])
    cout, cin_g = w.shape[0], w.shape[1]
    dt = tilefit_dtype(x.dtype)
    gemms: list[GemmShape] = []
    strided = len(args) > 7 and not args[7] and any(int(s) > 1 for s in args[4]) \
        and all(int(d) == 1 for d in args[6])
    if mask[0] and strided:
        gemms.extend(_strided_dgrad_gemms(groups, n * out_pixels, cin_g, cout // groups,
                                          tuple(w.shape[2:]), tuple(args[4]), dt))
    elif mask[0]:  # grad_input: M = N * input pixels, N = Cin/g, K = Cout/g * kernel
        gemms.append(GemmShape(groups, n * in_pixels, cin_g, (cout // groups) * kernel, dt))
    if mask[1]:  # grad_weight: M = Cout/g, N = Cin/g * kernel, K = N * output pixels
        gemms.append(GemmShape(groups, cout // groups, cin_g * kernel, n * out_pixels, dt))
    return tuple(gemms)


def _strided_dgrad_gemms(groups: int, m: int, cin_g: int, cout_g: int,
                         kernel: tuple[int, ...], stride: tuple[int, ...],
                         dt: str) -> tuple[GemmShape, ...]:
    """The input's gradient of a strided convolution as cuDNN and CUTLASS run it (strided
    dgrad): one implicit GEMM per phase of the stride (each input pixel's offset modulo the
    stride), over the output's pixels (M), reading only the filter taps that reach that
    phase (K = Cout/g x taps), so the work is the forward's, not stride^2 times it. Phases of
    equal taps share one batched shape; a phase no tap reaches (a 1x1 filter's) is zeros."""
    per_dim = [[len(range(a, k, s)) for a in range(s)] for k, s in zip(kernel, stride,
                                                                       strict=True)]
    phases: dict[int, int] = {}
    for taps in itertools.product(*per_dim):
        t = math.prod(taps)
        if t:
            phases[t] = phases.get(t, 0) + 1
    return tuple(GemmShape(groups * count, m, cin_g, cout_g * t, dt)
                 for t, count in sorted(phases.items(), reverse=True))


def _groups(args: tuple[Any, ...], index: int) -> int:
    return int(args[index]) if len(args) > index else 1


def grouped_conv_backward_flops(args: tuple[Any, ...]) -> int:
    """A grouped convolution's backward FLOPs: each gradient it computes (the input's, the
    weight's) does the forward's multiply-adds, N x output pixels x Cout x Cin/groups x
    kernel. torch.utils.flop_counter's formula counts the weight's gradient as if
    ungrouped (a depthwise conv's by a factor of its channels), so it is not used here."""
    grad_out, w = args[0], args[2]
    mask = args[10] if len(args) > 10 else (True, True, True)
    macs = grad_out.shape[0] * math.prod(grad_out.shape[2:]) * math.prod(w.shape)
    return 2 * macs * (int(bool(mask[0])) + int(bool(mask[1])))


def attention_flops(info: dict[str, Any]) -> int:
    """FLOPs of scaled-dot-product attention: Q K^T and P V, 2 * b * hq * sq * sk * d each,
    counted in full even when causal (as torch.utils.flop_counter's sdpa formula does); the
    backward does twice the forward's GEMM work (dQ, dK, dV, dP). Written here rather than
    taken from flop_counter because its formula rejects grouped-query attention (hq != hkv)."""
    fwd = 4 * info["b"] * info["hq"] * info["sq"] * info["sk"] * info["d"]
    return fwd if info.get("direction") == "forward" else 2 * fwd


def op_flops(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any,
             attention: dict[str, Any] | None) -> tuple[int, str | None]:
    """(the op's FLOPs, 0 where torch.utils.flop_counter has no formula for it; why its
    formula failed, None where it ran or there is none): OpRecord.flops, .flops_error."""
    if attention is not None and "b" in attention:
        return attention_flops(attention), None
    if packet_name(func) in BNB_GEMM_OPS:
        g = gemm_shapes(func, args, kwargs, out, "gemm")[0]
        return 2 * g.m * g.n * g.k, None
    if packet_name(func) in GROUPED_NAMES:  # the recorder sums its per-expert GEMMs
        return 0, None
    if packet_name(func) == "aten.convolution_backward" and _groups(args, 9) > 1:
        return grouped_conv_backward_flops(args), None
    formula = flop_formula(func)
    if formula is None:
        return 0, None
    try:
        return int(formula(*args, **kwargs, out_val=out)), None
    except (AssertionError, TypeError, ValueError, IndexError) as err:
        return 0, error_line(err)
