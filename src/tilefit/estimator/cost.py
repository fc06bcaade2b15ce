"""The cost model per op kind: a registry from an op's kind to a function of (op, device,
context) -> seconds.

- GEMMs and dense convolutions go through tilefit.gemm (tiles, waves, alignment, roofline);
  depthwise and thin grouped convolutions, and BatchNorm's passes: tilefit.estimator.conv.
- Fused attention kernels: their FLOPs at a fraction of the GEMM rate, or their bytes at the
  bandwidth, whichever is slower.
- Everything else: bytes over the achieved bandwidth, with one kernel launch as the floor.
  The achieved bandwidth depends on the kernel's family (elementwise, reduction,
  normalization, softmax and losses, embedding backward, indexing, copies and casts, foreach
  optimizer kernels): ``op_family`` names it from the aten op, ``KernelEfficiency`` holds
  each family's share of the device's copy bandwidth.
- Views launch nothing and cost nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, get_args

from tilefit.compat.moe import EXPERT_LOOP_OPS
from tilefit.dtypes import parse_dtype
from tilefit.estimator.collectives import collective_time_s
from tilefit.estimator.conv import batch_norm_bytes, direct_conv_time_s, is_direct_conv
from tilefit.estimator.multitensor import kernel_launches
from tilefit.gemm import analyze_gemm
from tilefit.hardware.catalog import catalog_entry
from tilefit.hardware.device import Device
from tilefit.tracing.records import GemmShape, OpRecord

# ---- kernel families of the memory-bound ops -----------------------------------------------
# A family is a cost-model concept: kernels of one family reach a similar share of the
# device's copy bandwidth (docs/references.md, section 15).
KernelFamily = Literal["elementwise", "reduction", "normalization", "batch_norm", "softmax",
                       "embedding_backward", "indexing", "copy", "foreach"]
KERNEL_FAMILIES: tuple[str, ...] = get_args(KernelFamily)

# The family of an aten op by its packet name (the op without its overload). Ops not listed
# are elementwise: torch's pointwise kernels, fills, dropout's RNG, activation backward.
_FAMILY_BY_PACKET: Mapping[str, KernelFamily] = MappingProxyType({
    **dict.fromkeys((
        "aten.sum", "aten.mean", "aten.amax", "aten.amin", "aten.max", "aten.min",
        "aten.argmax", "aten.argmin", "aten.var", "aten.std", "aten.var_mean", "aten.std_mean",
        "aten.norm", "aten.linalg_vector_norm", "aten.any", "aten.all", "aten.prod",
        "aten.logsumexp", "aten.cumsum", "aten.cumprod", "aten.count_nonzero"), "reduction"),
    **dict.fromkeys((
        "aten.native_layer_norm", "aten.native_layer_norm_backward", "aten._fused_rms_norm",
        "aten._fused_rms_norm_backward", "aten.native_group_norm",
        "aten.native_group_norm_backward"), "normalization"),
    # BatchNorm: streaming passes over its input, each pass's bytes counted
    # (tilefit.estimator.conv.batch_norm_bytes)
    **dict.fromkeys((
        "aten.native_batch_norm", "aten.native_batch_norm_backward",
        "aten._native_batch_norm_legit", "aten._native_batch_norm_legit_functional",
        "aten._native_batch_norm_legit_no_training", "aten.cudnn_batch_norm",
        "aten.cudnn_batch_norm_backward", "aten.miopen_batch_norm",
        "aten.miopen_batch_norm_backward", "aten.batch_norm_backward"), "batch_norm"),
    **dict.fromkeys((
        "aten._softmax", "aten._log_softmax", "aten._softmax_backward_data",
        "aten._log_softmax_backward_data", "aten.nll_loss_forward", "aten.nll_loss_backward",
        "aten.nll_loss2d_forward", "aten.nll_loss2d_backward",
        "tilefit.ce_logsumexp", "tilefit.ce_grad_"), "softmax"),
    **dict.fromkeys(("aten.embedding_dense_backward", "aten.embedding_backward",
                     "aten._embedding_bag_backward"), "embedding_backward"),
    **dict.fromkeys((
        "aten.embedding", "aten.index", "aten._unsafe_index", "aten.index_select",
        "aten.index_put", "aten.index_put_", "aten._index_put_impl_", "aten.index_add",
        "aten.index_add_", "aten.gather", "aten.scatter", "aten.scatter_", "aten.scatter_add",
        "aten.scatter_add_", "aten.scatter_reduce", "aten.masked_scatter", "aten.take"),
        "indexing"),
    **dict.fromkeys((
        "aten._to_copy", "aten.copy_", "aten.copy", "aten._copy_from",
        "aten._copy_from_and_resize", "aten.clone", "aten.contiguous", "aten.cat",
        "aten.stack", "aten.constant_pad_nd", "aten.slice_backward", "aten.select_backward",
        "aten.repeat"), "copy"),
})
# Multi-tensor kernels (torch.optim's foreach and fused paths, GradScaler's unscale).
_FAMILY_BY_PREFIX: tuple[tuple[str, KernelFamily], ...] = (
    ("aten._foreach_", "foreach"), ("aten._fused_", "foreach"), ("aten._amp_", "foreach"))


@functools.lru_cache(maxsize=8192)
def op_family(op: str) -> KernelFamily:
    """The kernel family of an aten op ("aten.add.Tensor" or its packet "aten.add")."""
    packet = op.rsplit(".", 1)[0] if op.count(".") >= 2 else op
    family = _FAMILY_BY_PACKET.get(packet)
    if family is not None:
        return family
    for prefix, fam in _FAMILY_BY_PREFIX:
        if packet.startswith(prefix):
            return fam
    return "elementwise"


# Each family's share of the device's achieved copy bandwidth (Device.bandwidth_efficiency
# is a measured copy: docs/references.md, section 6). 1.0 until a measurement says
# otherwise; each value's source: docs/references.md, section 15 (normalization and softmax:
# fitted on PyTorch's own LayerNorm, softmax and cross-entropy kernels, Liger-Kernel's
# benchmarks of them on A100, H100 and RTX 3090; batch_norm: 1.0, its passes counted instead,
# section 37).
FAMILY_EFFICIENCY: Mapping[str, float] = MappingProxyType({
    "elementwise": 1.0, "reduction": 1.0, "normalization": 0.447, "batch_norm": 1.0,
    "softmax": 0.605,
    "embedding_backward": 1.0, "indexing": 1.0, "copy": 1.0, "foreach": 1.0})

# Fused attention efficiency relative to a large GEMM on the same part
# (docs/references.md, section 15): the kernel's published share of the dense peak over the
# GEMM model's A100 main-loop efficiency (the catalog's a100-80gb gemm_efficiency; section
# 28). FlashAttention-2 (Dao, 2023, A100) reaches up to 73% of peak forward and 63% backward;
# the memory-efficient (cutlass/xformers) kernel and FlashAttention-1 reach 30-50%: 45% and
# 40% here.
_EFF_A100 = catalog_entry("a100-80gb").gemm_efficiency
_ATTENTION_OF_PEAK_A100: Mapping[tuple[str, str], float] = {
    ("flash", "forward"): 0.73, ("flash", "backward"): 0.63,
    ("efficient", "forward"): 0.45, ("efficient", "backward"): 0.40}
ATTENTION_EFFICIENCY: Mapping[tuple[str, str], float] = MappingProxyType({
    key: share / _EFF_A100 for key, share in _ATTENTION_OF_PEAK_A100.items()})
# PyTorch's fused attention kernels are FlashAttention-2's generation: written for Ampere's
# mma instructions, they do not use Hopper's wgmma/TMA or Blackwell's tcgen05, so on those
# parts they reach a smaller share of the dense peak (docs/references.md, section 15).
# Hopper: 0.35 / 0.73 of peak (FlashAttention-3 paper). Blackwell: 0.196, fitted on the GPU
# corpus's fit split (FlashAttention-2 on a B200, docs/references.md, section 13;
# benchmarks/bench_gpu_corpus.py): 15% of the B200's dense peak.
ATTENTION_ARCH_FACTOR: Mapping[str, float] = MappingProxyType({
    "Hopper": 0.48, "Blackwell": 0.196})


@dataclass(frozen=True)
class KernelEfficiency:
    """The cost model's kernel efficiencies beyond the Device's own terms: a share of the
    copy bandwidth per memory-bound family, a share of the GEMM rate per fused attention
    kernel and direction, and an architecture factor for the attention kernels."""

    bandwidth: Mapping[str, float] = field(default_factory=lambda: FAMILY_EFFICIENCY,
                                           hash=False)
    attention: Mapping[tuple[str, str], float] = field(
        default_factory=lambda: ATTENTION_EFFICIENCY, hash=False)
    attention_arch: Mapping[str, float] = field(default_factory=lambda: ATTENTION_ARCH_FACTOR,
                                                hash=False)

    def __post_init__(self) -> None:
        missing = set(KERNEL_FAMILIES) - set(self.bandwidth)
        if missing or set(self.bandwidth) - set(KERNEL_FAMILIES):
            raise ValueError(f"bandwidth efficiencies must name each of {KERNEL_FAMILIES}")
        values = [*self.bandwidth.values(), *self.attention.values(),
                  *self.attention_arch.values()]
        if any(not 0 < v <= 1 for v in values):
            raise ValueError(f"kernel efficiencies must be in (0, 1], got {values}")
        for name in ("bandwidth", "attention", "attention_arch"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))

    def family(self, op: str) -> float:
        return self.bandwidth[op_family(op)]

    def attention_share(self, backend: str, direction: str, architecture: str) -> float:
        base = self.attention.get((backend, direction), 0.5)
        return base * self.attention_arch.get(architecture, 1.0)


DEFAULT_EFFICIENCY = KernelEfficiency()


@dataclass(frozen=True)
class CostContext:
    precision: str  # the recipe's precision: fp32 runs GEMMs as tf32 only when asked
    efficiency: KernelEfficiency = DEFAULT_EFFICIENCY


CostFn = Callable[[OpRecord, Device, CostContext], float]
COST_FUNCTIONS: dict[str, CostFn] = {}


def register_cost(kind: str) -> Callable[[CostFn], CostFn]:
    """Register the cost function of an op kind; a kind is registered once."""

    def deco(fn: CostFn) -> CostFn:
        if kind in COST_FUNCTIONS:
            raise ValueError(f"a cost function for op kind {kind!r} is already registered")
        COST_FUNCTIONS[kind] = fn
        return fn

    return deco


def op_time_s(op: OpRecord, device: Device, ctx: CostContext) -> float:
    if op.on_host:
        return 0.0  # the device runs nothing: the host does it (tilefit.estimator.steptime)
    try:
        fn = COST_FUNCTIONS[op.kind]
    except KeyError:
        raise ValueError(f"no cost function for op kind {op.kind!r} ({op.op})") from None
    return fn(op, device, ctx) + fresh_alloc_time_s(op, device)


def fresh_alloc_time_s(op: OpRecord, device: Device) -> float:
    """First-touch page faults of the large buffers the op allocates (CPU only; measured per
    byte by the CPU probe, zero on GPUs, whose caching allocator reuses blocks)."""
    return fresh_bytes_time_s(op.alloc_bytes, device)


def fresh_bytes_time_s(alloc_bytes: tuple[int, ...], device: Device) -> float:
    """First-touch page faults of freshly allocated buffers of these sizes (CPU only)."""
    if device.fresh_alloc_s_per_byte <= 0:
        return 0.0
    fresh = sum(b for b in alloc_bytes if b >= device.fresh_alloc_min_bytes)
    return fresh * device.fresh_alloc_s_per_byte


def gemm_dtype(dtype: str, *, conv: bool, device: Device, ctx: CostContext) -> str:
    """The math a GEMM runs in on ``device``.

    fp32 GEMMs use TF32 Tensor Cores only when the recipe asks (torch.backends.cuda.matmul.
    allow_tf32 defaults to False since PyTorch 1.12); fp32 convolutions use TF32 by default on
    parts that have it (torch.backends.cudnn.allow_tf32 defaults to True).
    """
    if dtype == "fp32" and device.supports("tf32") and (ctx.precision == "tf32" or conv):
        return "tf32"
    if not device.supports(dtype):
        return "fp32"  # e.g. a bf16 GEMM on a CPU profile without a bf16 peak
    return dtype


@functools.lru_cache(maxsize=65536)
def gemm_time_s(shape: GemmShape, dtype: str, device: Device) -> float:
    return analyze_gemm(shape.m, shape.n, shape.k, dtype, device,
                        batch=shape.batch).predicted_time_s


def memory_time_s(nbytes: int, device: Device, launches: int = 1,
                  family_efficiency: float = 1.0) -> float:
    """Bytes at the device's achieved bandwidth (times the kernel family's share of it),
    plus the launches' floor. The families' shares describe CUDA kernels (fitted on GPU
    records); a CPU runs ATen's CPU kernels at the bandwidth its own probe measured."""
    share = 1.0 if device.kind == "cpu" else family_efficiency
    bandwidth = device.bandwidth_bytes_per_s * device.bandwidth_efficiency * share
    return nbytes / bandwidth + launches * device.launch_overhead_s


@register_cost("view")
def _view(op: OpRecord, device: Device, ctx: CostContext) -> float:
    return 0.0


@register_cost("memory")
def _memory(op: OpRecord, device: Device, ctx: CostContext) -> float:
    if op_family(op.op) == "batch_norm" and device.kind != "cpu":
        nbytes, launches = batch_norm_bytes(op)
        return memory_time_s(nbytes, device, launches=launches,
                             family_efficiency=ctx.efficiency.family(op.op))
    return memory_time_s(op.bytes, device, launches=kernel_launches(op, device),
                         family_efficiency=ctx.efficiency.family(op.op))


@register_cost("unknown")
def _unknown(op: OpRecord, device: Device, ctx: CostContext) -> float:
    # no FLOP formula and not a known memory-bound family: costed as memory-bound, and the
    # estimate lists it in a warning
    return _memory(op, device, ctx)


@register_cost("gemm")
def _gemm(op: OpRecord, device: Device, ctx: CostContext) -> float:
    return (sum(gemm_time_s(g, gemm_dtype(g.dtype, conv=False, device=device, ctx=ctx), device)
                for g in op.gemms) or memory_time_s(op.bytes, device)) \
        + dequantize_time_s(op, device) + zero_fill_time_s(op, device)


def zero_fill_time_s(op: OpRecord, device: Device) -> float:
    """transformers' per-expert loop zero-fills its outputs before its GEMMs write them
    (compat.moe.EXPERT_LOOP_OPS): one write of each output."""
    if op.op not in EXPERT_LOOP_OPS:
        return 0.0
    return memory_time_s(sum(op.alloc_bytes), device, launches=len(op.output_shapes))


# bitsandbytes' gemm_4bit dequantizes the 4-bit weight into a buffer of A's dtype, then runs
# F.linear: always on the CPU, and on CUDA as bitsandbytes' own dispatch decides (past M = 1536
# rows, and below that for most shapes its calibrated rule prefers it), else its own kernel
# reads the packed weight inside the GEMM (tilefit.compat.bnb_dispatch;
# docs/references.md, section 33)
BNB_BLOCK = 64  # 4-bit quantization block: one absmax per 64 weights (fp32 once dequantized)


def dequantize_time_s(op: OpRecord, device: Device) -> float:
    """The dequantization kernel before a 4-bit GEMM: it reads the packed weight (half a
    byte each) and its fp32 absmax, and writes the dense weight."""
    if not op.op.startswith("bitsandbytes.gemm_4bit") or not op.gemms:
        return 0.0
    from tilefit.compat.bnb_dispatch import gemm_4bit_dequantizes, gpu_props
    from tilefit.dtypes import torch_dtype

    g = op.gemms[0]
    if not gemm_4bit_dequantizes(g.m, g.n, g.k, torch_dtype(g.dtype), BNB_BLOCK,
                                 gpu_props(device)):
        return 0.0
    weights = g.n * g.k
    dense = weights * parse_dtype(g.dtype).bytes
    return memory_time_s(weights // 2 + 4 * weights // BNB_BLOCK + dense, device)


@register_cost("conv")
def _conv(op: OpRecord, device: Device, ctx: CostContext) -> float:
    if device.kind != "cpu" and is_direct_conv(op):  # depthwise: PyTorch's direct kernels
        return direct_conv_time_s(op, device)
    gemm_s = sum(gemm_time_s(g, gemm_dtype(g.dtype, conv=True, device=device, ctx=ctx), device)
                 for g in op.gemms)
    # the implicit GEMM streams its operands; a conv is never faster than its own traffic
    return max(gemm_s, memory_time_s(op.bytes, device))


@register_cost("collective")
def _collective(op: OpRecord, device: Device, ctx: CostContext) -> float:
    # NCCL's ring formulas over the GPUs' links (tilefit.estimator.collectives)
    c = op.collective
    return 0.0 if c is None else collective_time_s(c.name, c.nbytes, c.group_size, device)


# A causal kernel skips the key blocks above the diagonal: with 128-row blocks it does
# 1/2 + 128/(2 S) of the full work (FlashAttention-2, section 3.1.1, causal masking).
ATTENTION_BLOCK = 128
ATTENTION_LAUNCHES = {"forward": 1, "backward": 3}  # backward: preprocess, main, dq convert


@register_cost("attention")
def _attention(op: OpRecord, device: Device, ctx: CostContext) -> float:
    info = op.attention or {}
    backend = info.get("backend", "flash")
    direction = info.get("direction", "forward")
    dtype = {"bfloat16": "bf16", "float16": "fp16"}.get(info.get("dtype", ""), "fp32")
    if not device.supports(dtype):
        dtype = "fp32"
    work = op.flops
    if info.get("causal") and info.get("sq") == info.get("sk") and info.get("sq"):
        work = work * min(1.0, 0.5 + ATTENTION_BLOCK / (2 * info["sq"]))
    eff = ctx.efficiency.attention_share(
        backend if backend in ("flash", "efficient") else "flash", direction,
        device.architecture)
    math_s = work / (device.peak(dtype) * device.gemm_efficiency * eff)
    mem_s = op.bytes / (device.bandwidth_bytes_per_s * device.bandwidth_efficiency)
    return max(math_s, mem_s) + ATTENTION_LAUNCHES.get(direction, 1) * device.launch_overhead_s
