"""A real training step on the live device, measured, beside the estimate's prediction.

Time: the median of several steady steps after warm-up (CUDA: events and a synchronize).
Peak memory: CUDA: torch.cuda.max_memory_allocated over the first two steps (and
max_memory_reserved, the cache emptied after building); CPU: PyTorch's MemTracker over the
first two steps (live tensor bytes, what the estimate predicts).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from tilefit.dtypes import torch_dtype
from tilefit.errors import TilefitError
from tilefit.loop import NO_HOOKS, Hooks, autocast_for, training_step
from tilefit.models import Workload
from tilefit.recipe import Recipe

# Repeated steps whose spread (max - min over the median) exceeds this are reported as
# noisy: a policy, checked against benchmarks/bench_step_cpu.py on a quiet machine and with
# --load (its output prints every row's spread). A steady competitor does not spread the
# steps (one busy process made every step 1.6-2x slower with spreads of 3-14%,
# benchmarks/results_step_cpu.txt), so a load average above the core count (our own threads
# included) also marks the machine busy.
NOISY_SPREAD = 0.10
BUSY_LOAD_MARGIN = 0.5


@dataclass(frozen=True)
class StepMeasurement:
    device: str
    step_time_s: float  # median of the timed steps
    step_times_s: tuple[float, ...]
    peak_memory_bytes: int
    # CUDA: torch.cuda.max_memory_reserved over the same two steps (the caching allocator's
    # segments); None on the CPU, whose allocator is not the caching one
    peak_reserved_bytes: int | None = None
    threads: int = 0  # torch.get_num_threads() while measuring
    load_average: float = 0.0  # the machine's 1-minute load average after measuring
    cores: int = 0

    @property
    def spread(self) -> float:
        """(slowest - fastest) / median of the timed steps."""
        times = self.step_times_s
        return (max(times) - min(times)) / self.step_time_s if len(times) > 1 else 0.0

    @property
    def busy(self) -> bool:
        """More runnable threads than cores: something else competes for the CPU."""
        return self.cores > 0 and self.load_average > self.cores + BUSY_LOAD_MARGIN

    @property
    def noisy(self) -> bool:
        """The repeats disagree more than a quiet machine's would, or the machine is busy:
        do not trust the figure."""
        return self.spread > NOISY_SPREAD or self.busy

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "spread": self.spread, "busy": self.busy,
                "noisy": self.noisy}


def measure_step(workload: Workload, recipe: Recipe, kind: str = "cpu", *,
                 steps: int = 5, warmup: int = 2) -> StepMeasurement:
    """Build the workload for real on ``kind`` ("cpu" or "cuda"), train ``warmup + steps``
    steps on a synthetic batch, and measure."""
    import torch

    from tilefit.bench.qlora import quant_state_tensors

    _check_recipe(recipe, kind)
    model, batch, opt = _build(workload, recipe, kind)
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = recipe.spec.allow_tf32

    loss_fn = workload.loss_for(recipe.fused_ce)
    # the recipe's step, as the estimate traces it (tilefit.loop), with torch.amp's
    # GradScaler where the precision scales the loss
    scaler = torch.amp.GradScaler(kind) if recipe.spec.grad_scaler else None
    params = [p for p in model.parameters() if p.requires_grad]

    def step(phase: Callable[[str], None] = NO_HOOKS.phase) -> None:
        training_step(lambda: loss_fn(model, batch), opt, params, recipe, scaler=scaler,
                      hooks=Hooks(phase=phase, forward=lambda: autocast_for(kind, recipe.spec)))

    try:
        if kind == "cuda":
            # what building the model left cached (from_pretrained's and the casts'
            # temporaries) is released first, so the reserved peak is the step's
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            step()
            step()
            _sync(kind)
            peak = int(torch.cuda.max_memory_allocated())
            reserved: int | None = int(torch.cuda.max_memory_reserved())
        else:
            reserved = None
            # bitsandbytes' quantization state: MemTracker sees tensors only as parameters,
            # buffers, gradients, optimizer state or what it is handed
            peak = memtracker_peak_bytes(model, opt, (batch, quant_state_tensors(model)), step)
        times = _timed_steps(step, kind, steps=steps, warmup=warmup)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_tf32
    return StepMeasurement(device=kind, step_time_s=statistics.median(times),
                           step_times_s=tuple(times), peak_memory_bytes=peak,
                           peak_reserved_bytes=reserved,
                           threads=torch.get_num_threads(), load_average=os.getloadavg()[0],
                           cores=os.cpu_count() or 0)


def as_cuda_counts(estimate: Any) -> tuple[int, int | None]:
    """The estimate's peak and reserved peak as torch.cuda's counters see them: on a GPU
    both include cuBLAS's workspace, which the caching allocator holds (max_memory_allocated
    counts it; it is one more segment of max_memory_reserved); reserved None without a
    reserved model (the CPU)."""
    from tilefit.estimator import cublas_workspace_bytes

    workspace = cublas_workspace_bytes(estimate.device)
    reserved = estimate.reserved
    return (estimate.peak_memory_bytes + workspace,
            None if reserved is None else reserved.peak_reserved_bytes + workspace)


def comparison(estimate: Any, measured: StepMeasurement) -> dict[str, Any]:
    """A measured step beside its estimate: time, peak and reserved peak, measured,
    predicted (as_cuda_counts) and the signed error (predicted / measured - 1; None where
    either side has no reserved figure)."""
    peak, reserved = as_cuda_counts(estimate)
    real_reserved = measured.peak_reserved_bytes
    return {
        "measured_step_time_s": measured.step_time_s,
        "predicted_step_time_s": estimate.step_time_s,
        "step_time_error": estimate.step_time_s / measured.step_time_s - 1,
        "measured_peak_memory_bytes": measured.peak_memory_bytes,
        "predicted_peak_memory_bytes": peak,
        "peak_memory_error": peak / measured.peak_memory_bytes - 1,
        "measured_peak_reserved_bytes": real_reserved,
        "predicted_peak_reserved_bytes": reserved,
        "peak_reserved_error": None if reserved is None or not real_reserved
        else reserved / real_reserved - 1,
    }


def _check_recipe(recipe: Recipe, kind: str) -> None:
    """An error unless bench step can run ``recipe`` on ``kind``."""
    import torch

    if kind == "cuda" and not torch.cuda.is_available():
        raise TilefitError("--device cuda needs a CUDA GPU, and this machine has none",
                           expected="a machine with an NVIDIA GPU", given="no CUDA device",
                           fix="use --device cpu")


def _build(workload: Workload, recipe: Recipe, kind: str) -> tuple[Any, Any, Any]:
    """The model (seeded, in the recipe's weights, attention, adapters, quantization and
    checkpointing, in train mode), its batch and its optimizer, for real on ``kind``."""
    from tilefit.tracing.optimizers import make_optimizer

    model = _real_model(workload, recipe, kind)
    if recipe.grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    batch = workload.make_batch(recipe.batch_size, device=kind)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(recipe.optimizer, params, foreach=kind == "cuda")
    return model, batch, opt


def _real_model(workload: Workload, recipe: Recipe, kind: str) -> Any:
    """The model as the tracer builds it (tracing.workload_traces), for real: plain; with peft's
    LoRA on a base in the recipe's 16-bit dtype (tilefit.models.lora); or QLoRA, loaded
    quantized by from_pretrained (tilefit.bench.qlora). A pure 16-bit recipe casts every
    floating parameter, as the tracer does."""
    import tempfile
    from pathlib import Path

    import torch

    from tilefit.models.cast import cast_floating
    from tilefit.tracing.workload_traces import check_lora

    if recipe.lora is not None:
        check_lora(workload)
    torch.manual_seed(0)
    if recipe.quantize is not None:
        from tilefit.bench.qlora import qlora_of_workload
        from tilefit.compat.bitsandbytes import require_bitsandbytes

        require_bitsandbytes(f"Recipe(quantize={recipe.quantize!r})")

        with tempfile.TemporaryDirectory(prefix="tilefit-bench-") as where:
            model = qlora_of_workload(workload, recipe, Path(where), kind)
    else:
        with torch.device(kind):
            model = workload.build(recipe.attention)
        if recipe.lora is not None:
            from tilefit.models.lora import get_peft_model, lora_base_dtype

            model = get_peft_model(model, workload.task, recipe.lora)
            cast_floating(model, lora_base_dtype(recipe), frozen_only=True)
    if recipe.spec.param_dtype != "fp32":
        cast_floating(model, torch_dtype(recipe.spec.param_dtype))
    return model


def _sync(kind: str) -> None:
    if kind == "cuda":
        import torch

        torch.cuda.synchronize()


def _timed_steps(step: Callable[[], None], kind: str, *, steps: int,
                 warmup: int) -> list[float]:
    """The rest of the warm-up (the peak's two steps count towards it), then ``steps`` timed
    steps, each between two synchronizations."""
    for _ in range(max(0, warmup - 2)):
        step()
    times = []
    for _ in range(steps):
        _sync(kind)
        t0 = time.perf_counter()
        step()
        _sync(kind)
        times.append(time.perf_counter() - t0)
    return times


def memtracker_peak_bytes(model: Any, opt: Any, batch: Any,
                          step: Callable[[Callable[[str], None]], Any], steps: int = 2) -> int:
    """Peak live tensor bytes of ``steps`` calls of ``step(phase)`` on real CPU tensors, by
    PyTorch's MemTracker (its own accounting, independent of tilefit's tracer). ``phase``
    is tilefit.loop's phase hook: MemTracker follows one forward per module between its
    resets, so it is reset as each micro-batch's forward begins."""
    import torch

    from tilefit.compat.distributed import new_mem_tracker

    tracker = new_mem_tracker()
    tracker.track_external(model, opt, batch)

    def phase(name: str) -> None:
        if name == "forward":
            tracker.reset_mod_stats()

    with tracker:
        for _ in range(steps):
            step(phase)
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def real_step_peak_bytes(model: Any, opt: Any, batch: Any, loss_fn: Any, *,
                         set_to_none: bool = True, steps: int = 2) -> int:
    """Peak live tensor bytes of ``steps`` plain training steps of ``model`` on real CPU
    tensors (tilefit.loop's step of plain PyTorch's loop: ``loss_fn(model, batch)``,
    backward, the optimizer step, zero_grad with ``set_to_none``), by PyTorch's MemTracker:
    the second method tilefit's predicted CPU peaks are checked against."""
    recipe = Recipe(precision="fp32", zero_grad_to_none=set_to_none)
    params = [p for group in opt.param_groups for p in group["params"]]
    return memtracker_peak_bytes(model, opt, batch, lambda phase: training_step(
        lambda: loss_fn(model, batch), opt, params, recipe, hooks=Hooks(phase=phase)), steps)
