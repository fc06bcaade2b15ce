"""What plan() returns, frozen: the plan, the full trace that confirmed its choice, and the
fewest GPUs that fit when nothing fits one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tilefit.hardware import Device
from tilefit.html_repr import HtmlRepr
from tilefit.planner.rows import PlanRow
from tilefit.units import fmt_time

if TYPE_CHECKING:
    from tilefit.planner.host import HostBudget


@dataclass(frozen=True)
class Confirmation:
    """The chosen plan traced in full, against the affine sweep's prediction."""

    affine_peak_bytes: int
    traced_peak_bytes: int
    affine_step_time_s: float
    traced_step_time_s: float
    # the caching allocator's reserved peak, where modelled (None: CPU offload, the CPU)
    affine_reserved_bytes: int | None = None
    traced_reserved_bytes: int | None = None
    # the full trace's cudaMalloc retries after a release of the allocator's cache: over its
    # two steps, and in the steady state after (ReservedMemory)
    alloc_retries: int = 0
    steady_alloc_retries: int = 0

    @property
    def peak_error(self) -> float:
        return self.affine_peak_bytes / self.traced_peak_bytes - 1

    @property
    def reserved_error(self) -> float | None:
        if not self.affine_reserved_bytes or not self.traced_reserved_bytes:
            return None
        return self.affine_reserved_bytes / self.traced_reserved_bytes - 1

    @property
    def time_error(self) -> float:
        return self.affine_step_time_s / self.traced_step_time_s - 1

    def to_dict(self) -> dict[str, Any]:
        return {"affine_peak_bytes": self.affine_peak_bytes,
                "traced_peak_bytes": self.traced_peak_bytes,
                "affine_step_time_s": self.affine_step_time_s,
                "traced_step_time_s": self.traced_step_time_s,
                "peak_error": self.peak_error, "time_error": self.time_error,
                "affine_reserved_bytes": self.affine_reserved_bytes,
                "traced_reserved_bytes": self.traced_reserved_bytes,
                "reserved_error": self.reserved_error,
                "alloc_retries": self.alloc_retries,
                "steady_alloc_retries": self.steady_alloc_retries}


@dataclass(frozen=True)
class MultiGpuPlan:
    """The fewest GPUs that fit when nothing fits one (``Plan.multi_gpu``): the chosen
    engine's plan, confirmed by a full trace; or ``gpus`` None and a note saying why none."""

    gpus: int | None
    note: str = ""  # why no GPU count fits (gpus None)
    formula_gpus: int | None = None  # the ZeRO-3 formula's fewest, where the search started
    best: PlanRow | None = None  # the chosen plan per GPU, with its confirming trace's figures
    confirmation: Confirmation | None = None
    plans: tuple[PlanRow, ...] = ()  # that GPU count's best plans, by throughput
    configs: dict[str, Any] = field(default_factory=dict)  # what launches (planner.launch)
    method: str = ""  # how the figures were made, in words (traced, or DeepSpeed modelled)

    def to_dict(self) -> dict[str, Any]:
        best = self.best
        if self.gpus is None or best is None:
            return {"gpus": None, "note": self.note}
        return {"gpus": self.gpus, "engine": best.strategy, "micro_batch": best.micro_batch,
                "accumulation_steps": best.accumulation_steps,
                "predicted_per_gpu_memory_bytes": best.predicted_peak_memory_bytes,
                "fits": best.fits, "step_time_s": best.predicted_step_time_s,
                "samples_per_s_all_gpus": best.samples_per_s,
                "confirmation": None if self.confirmation is None
                else self.confirmation.to_dict(),
                "formula_gpus": self.formula_gpus,
                "recipe": {"precision": best.precision, "optimizer": best.optimizer,
                           "grad_checkpointing": best.grad_checkpointing,
                           "attention": best.attention},
                "plans": [r.to_dict() for r in self.plans], "configs": self.configs,
                "model": self.method}


@dataclass(frozen=True)
class Plan(HtmlRepr):
    model: str
    device: Device
    global_batch: int
    seq_len: int | None
    objective: str
    memory_fraction: float
    budget_bytes: int  # device memory x fraction - CUDA context and workspaces
    overhead_bytes: int
    rows: tuple[PlanRow, ...]  # ranked; affine predictions
    best: PlanRow | None  # the chosen plan, with the figures of its confirming trace
    reason: str
    confirmation: Confirmation | None
    configs: dict[str, Any]
    multi_gpu: MultiGpuPlan | None  # when nothing fits one GPU with the optimizer on it
    notes: tuple[str, ...] = field(default=())
    traces: int = 0
    wall_time_s: float = 0.0
    world_size: int = 1  # GPUs the plan is for (rows per GPU; --gpus)
    # the CPU memory per node the rows' were judged against (None: unknown, not checked)
    host_budget: HostBudget | None = None

    def __repr__(self) -> str:
        """One line (print() of a result; its detail is in the fields)."""
        best = "none fits" if self.best is None else (
            f"batch {self.best.recipe.batch_size} x {self.best.recipe.accumulation_steps}, "
            f"{self.best.recipe.precision}, {fmt_time(self.best.predicted_step_time_s)}")
        return (f"Plan(model={self.model!r}, gpu={self.device.name!r}, global_batch="
                f"{self.global_batch}, rows={len(self.rows)}, best='{best}')")

    def to_dict(self) -> dict[str, Any]:
        best = None
        if self.best is not None:
            best = self.best.to_dict()
            if self.confirmation is not None:
                best["confirmation"] = self.confirmation.to_dict()
        return {
            "model": self.model, "gpu": self.device.name, "global_batch": self.global_batch,
            "seq_len": self.seq_len, "objective": self.objective,
            "memory_fraction": self.memory_fraction, "budget_bytes": self.budget_bytes,
            "overhead_bytes": self.overhead_bytes,
            "plans": [r.to_dict() for r in self.rows], "best": best, "reason": self.reason,
            "configs": self.configs,
            "multi_gpu": None if self.multi_gpu is None else self.multi_gpu.to_dict(),
            "notes": list(self.notes),
            "traces": self.traces, "wall_time_s": self.wall_time_s,
            "world_size": self.world_size,
            "host_budget": None if self.host_budget is None else self.host_budget.to_dict(),
        }
