"""The Estimate: predicted time and memory of one training step on one device."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from tilefit.estimator.collectives import ENGINE_COPY_PREFIX
from tilefit.estimator.cost import CostContext, gemm_dtype
from tilefit.hardware.device import Device
from tilefit.html_repr import HtmlRepr
from tilefit.tracing.records import GemmShape, OpRecord
from tilefit.units import fmt_bytes, fmt_time
from tilefit.vocab import OPTIMIZER_PHASES

if TYPE_CHECKING:
    from tilefit.estimator.collectives import ParallelSummary
    from tilefit.estimator.reserved import ReservedMemory


@dataclass(frozen=True)
class OpCost:
    """One traced op of the steady-state step with its predicted time."""

    record: OpRecord
    time_s: float
    repeats: int  # how many times it runs per optimizer step (accumulation)

    def to_dict(self) -> dict[str, Any]:
        r = self.record
        return {
            "op": r.op, "phase": r.phase, "module": r.module,
            "input_shapes": [list(s) for s in r.input_shapes],
            "output_shapes": [list(s) for s in r.output_shapes],
            "dtype": r.dtype, "flops": r.flops, "bytes": r.bytes, "kind": r.kind,
            "time_s": self.time_s, "repeats": self.repeats,
            "gemms": [asdict(g) for g in r.gemms],
            **({"collective": asdict(r.collective)} if r.collective is not None else {}),
        }


# What the ops outside every module are, by phase: the loss (a Hugging Face model computes
# it in its own forward, outside its submodules) and the training loop's own steps.
OUTSIDE_MODULES: dict[str, str] = {
    "forward": "(loss, top level: forward)", "backward": "(loss, top level: backward)",
    "recompute": "(top level: recompute)", "loss_check": "(loop: loss read on the host)",
    "clip_grad": "(loop: gradient clipping)", "optimizer": "(loop: optimizer step)",
    "zero_grad": "(loop: zero_grad)", "scaler": "(loop: GradScaler)"}
COMPILED_GRAPH = "(compiled graph)"
ENGINE = "(data-parallel engine)"  # FSDP2's copies outside its modules' hooks
# the rest of the step time, beyond the modules' device time
HOST_WAIT = "(GPU waiting for the host)"
EXPOSED_COMMUNICATION = "(communication not hidden by compute)"


def module_key(record: OpRecord) -> str:
    """The row of Estimate.modules an op's time goes to: its module, or what it is."""
    if record.phase in OPTIMIZER_PHASES or record.phase == "loss_check":
        return OUTSIDE_MODULES[record.phase]
    if record.module:
        return record.module
    if record.compiled:
        return COMPILED_GRAPH
    if record.op.startswith(ENGINE_COPY_PREFIX):
        return ENGINE
    return OUTSIDE_MODULES.get(record.phase, f"({record.phase})")


def fold_layer_indices(module: str) -> str:
    """A module path with its layer indices folded: h.0.mlp -> h.*.mlp."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", module)


@dataclass(frozen=True)
class ModuleSummary:
    """One row of the step's time: a module path (its forward and backward, the layers'
    indices kept), what the ops outside every module are (OUTSIDE_MODULES,
    COMPILED_GRAPH, ENGINE), or the rest of the step (HOST_WAIT, EXPOSED_COMMUNICATION).
    The rows' times add up to the step time."""

    module: str
    time_s: float  # per optimizer step, accumulation included
    flops: int
    bytes: int
    ops: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Estimate(HtmlRepr):
    device: Device
    precision: str
    optimizer: str
    peak_memory_bytes: int  # highest live tensor bytes over the first and a steady step
    memory_breakdown: dict[str, int]  # live bytes by category at the peak
    overhead_bytes: int  # CUDA context and library workspaces, apart from tensors
    step_time_s: float  # one optimizer step, all micro-batches included (host and device)
    flops: int  # model FLOPs of one optimizer step (checkpoint recompute excluded)
    hardware_flops: int  # FLOPs executed, recompute included
    samples_per_step: int
    tokens_per_step: int | None
    samples_per_s: float
    tokens_per_s: float | None
    mfu: float  # model FLOP/s over the dense peak of the training dtype
    mfu_dtype: str
    # device time of each phase (ops x repeats), compute only: the collectives of a multi-GPU
    # step run on their own stream (Estimate.parallel.communication_by_phase_s)
    time_by_phase_s: dict[str, float]
    ops: tuple[OpCost, ...]
    modules: tuple[ModuleSummary, ...]
    warnings: tuple[str, ...] = field(default=())
    param_count: int = 0
    trainable_param_count: int = 0  # those the optimizer steps (LoRA: the adapters alone)
    accumulation_steps: int = 1
    host_time_s: float = 0.0  # the host's issue time (eager PyTorch; GPU targets)
    device_time_s: float = 0.0  # the device's busy time
    host_bound_fraction: float = 0.0  # share of the step the GPU waits for the host
    # several GPUs: the engine, communication, throughput of the job, scaling (None: one)
    parallel: ParallelSummary | None = None
    # how the host issues the step: None eager, else the trace's vocab.CompileMode
    compile_mode: str | None = None
    # what the CUDA caching allocator holds over the step and whether it runs out of memory
    # (tilefit.estimator.reserved); None on the CPU and for modelled (ZeRO) estimates
    reserved: ReservedMemory | None = None

    def __repr__(self) -> str:
        """One line (print() of a result; its detail is in the fields)."""
        return (f"Estimate(gpu={self.device.name!r}, recipe='{self.precision}, "
                f"{self.optimizer}', step_time={fmt_time(self.step_time_s)}, "
                f"peak={fmt_bytes(self.peak_memory_bytes)}, fits={self.fits})")

    @property
    def total_memory_bytes(self) -> int:
        return self.peak_memory_bytes + self.overhead_bytes

    @property
    def fits(self) -> bool:
        """Whether the step runs without an out-of-memory error: on a GPU, as the caching
        allocator replays it (its cache released and the allocation retried first); and
        the tensors with the context and workspace within the device's memory."""
        within = self.total_memory_bytes <= self.device.memory_bytes
        return within and (self.reserved is None or self.reserved.fits)

    @property
    def peak_reserved_bytes(self) -> int | None:
        """torch.cuda.max_memory_reserved as predicted; None where it is not modelled."""
        return None if self.reserved is None else self.reserved.peak_reserved_bytes

    def gemms(self) -> Iterator[tuple[OpCost, GemmShape, str]]:
        """Every GEMM of the steady step's GEMM and convolution ops: (its op, its shape, the
        dtype it runs in on this device)."""
        ctx = CostContext(precision=self.precision)
        for c in self.ops:
            if c.record.kind in ("gemm", "conv"):
                for g in c.record.gemms:
                    yield c, g, gemm_dtype(g.dtype, conv=c.record.kind == "conv",
                                           device=self.device, ctx=ctx)

    def modules_by_pattern(self) -> tuple[ModuleSummary, ...]:
        """Module times with layer indices folded (h.0.mlp, h.1.mlp -> h.*.mlp)."""
        acc: dict[str, list[float]] = {}
        for m in self.modules:
            key = fold_layer_indices(m.module)
            a = acc.setdefault(key, [0.0, 0, 0, 0])
            a[0] += m.time_s
            a[1] += m.flops
            a[2] += m.bytes
            a[3] += m.ops
        out = [ModuleSummary(k, v[0], int(v[1]), int(v[2]), int(v[3])) for k, v in acc.items()]
        return tuple(sorted(out, key=lambda s: -s.time_s))

    def to_dict(self, *, include_ops: bool = True) -> dict[str, Any]:
        return {
            "gpu": self.device.name,
            "device": self.device.to_dict(),
            "precision": self.precision,
            "optimizer": self.optimizer,
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory_breakdown": dict(self.memory_breakdown),
            "overhead_bytes": self.overhead_bytes,
            "total_memory_bytes": self.total_memory_bytes,
            "device_memory_bytes": self.device.memory_bytes,
            "fits": self.fits,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "reserved": None if self.reserved is None else self.reserved.to_dict(),
            "step_time_s": self.step_time_s,
            "compile_mode": self.compile_mode,
            "host_time_s": self.host_time_s,
            "device_time_s": self.device_time_s,
            "host_bound_fraction": self.host_bound_fraction,
            "flops": self.flops,
            "hardware_flops": self.hardware_flops,
            "samples_per_step": self.samples_per_step,
            "tokens_per_step": self.tokens_per_step,
            "samples_per_s": self.samples_per_s,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "mfu_dtype": self.mfu_dtype,
            "time_by_phase_s": dict(self.time_by_phase_s),
            "param_count": self.param_count,
            "trainable_param_count": self.trainable_param_count,
            "accumulation_steps": self.accumulation_steps,
            "modules": [m.to_dict() for m in self.modules],
            "warnings": list(self.warnings),
            **({"parallel": self.parallel.to_dict()} if self.parallel is not None else {}),
            **({"ops": [o.to_dict() for o in self.ops]} if include_ops else {}),
        }
