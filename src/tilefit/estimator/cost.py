"""The cost model per op kind: a registry from an op's kind to a function of (op, device,
context) -> seconds.

- GEMMs and convolutions go through tilefit.gemm (tiles, waves, alignment, roofline).
- Fused attention kernels: their FLOPs at a fraction of the GEMM rate, or their bytes at the
  bandwidth, whichever is slower.
- Everything else: bytes over the achieved bandwidth, with one kernel launch as the floor.
- Views launch nothing and cost nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from tilefit.gemm import analyze_gemm
from tilefit.hardware.device import Device
from tilefit.tracing.records import GemmShape, OpRecord


@dataclass(frozen=True)
class CostContext:
    precision: str  # the recipe's precision: fp32 runs GEMMs as tf32 only when asked


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
    try:
        fn = COST_FUNCTIONS[op.kind]
    except KeyError:
        raise ValueError(f"no cost function for op kind {op.kind!r} ({op.op})") from None
    return fn(op, device, ctx) + fresh_alloc_time_s(op, device)


def fresh_alloc_time_s(op: OpRecord, device: Device) -> float:
    """First-touch page faults of the large buffers the op allocates (CPU only; measured per
    byte by the CPU probe, zero on GPUs, whose caching allocator reuses blocks)."""
    if device.fresh_alloc_s_per_byte <= 0:
        return 0.0
    fresh = sum(b for b in op.alloc_bytes if b >= device.fresh_alloc_min_bytes)
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


def memory_time_s(nbytes: int, device: Device, launches: int = 1) -> float:
    return nbytes / (device.bandwidth_bytes_per_s * device.bandwidth_efficiency) + \
        launches * device.launch_overhead_s


@register_cost("view")
def _view(op: OpRecord, device: Device, ctx: CostContext) -> float:
    return 0.0


@register_cost("memory")
def _memory(op: OpRecord, device: Device, ctx: CostContext) -> float:
    return memory_time_s(op.bytes, device)


@register_cost("unknown")
def _unknown(op: OpRecord, device: Device, ctx: CostContext) -> float:
    # no FLOP formula and not a known memory-bound family: costed as memory-bound, and the
    # estimate lists it in a warning
    return memory_time_s(op.bytes, device)


@register_cost("gemm")
def _gemm(op: OpRecord, device: Device, ctx: CostContext) -> float:
    return sum(gemm_time_s(g, gemm_dtype(g.dtype, conv=False, device=device, ctx=ctx), device)
               for g in op.gemms) or memory_time_s(op.bytes, device)


@register_cost("conv")
def _conv(op: OpRecord, device: Device, ctx: CostContext) -> float:
    gemm_s = sum(gemm_time_s(g, gemm_dtype(g.dtype, conv=True, device=device, ctx=ctx), device)
                 for g in op.gemms)
    # the implicit GEMM streams its operands; a conv is never faster than its own traffic
    return max(gemm_s, memory_time_s(op.bytes, device))


# Fused attention efficiency relative to a large GEMM on the same part. FlashAttention-2
# (Dao, 2023, A100) reaches up to 73% of peak forward and 63% backward, where cuBLAS GEMMs
# reach ~87%: 0.84 and 0.72. The memory-efficient (cutlass/xformers) kernel and
# FlashAttention-1 reach 30-50%: 0.52 and 0.46 here.
ATTENTION_EFFICIENCY = {("flash", "forward"): 0.84, ("flash", "backward"): 0.72,
                        ("efficient", "forward"): 0.52, ("efficient", "backward"): 0.46}
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
    eff = ATTENTION_EFFICIENCY.get((backend if backend in ("flash", "efficient") else "flash",
                                    direction), 0.5)
    math_s = work / (device.peak(dtype) * device.gemm_efficiency * eff)
    mem_s = op.bytes / (device.bandwidth_bytes_per_s * device.bandwidth_efficiency)
    return max(math_s, mem_s) + ATTENTION_LAUNCHES.get(direction, 1) * device.launch_overhead_s
