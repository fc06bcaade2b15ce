"""A real training step on the live device, measured, beside the estimate's prediction.

Time: the median of several steady steps after warm-up (CUDA: events and a synchronize).
Peak memory: CUDA: torch.cuda.max_memory_allocated over the first two steps (and
max_memory_reserved, the cache emptied after building); CPU: PyTorch's MemTracker over the
first two steps (live tensor bytes, what the estimate predicts).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from tilefit.dtypes import torch_dtype
from tilefit.errors import TilefitError
from tilefit.models import Workload
from tilefit.recipe import Recipe
from tilefit.vocab import PRECISIONS, mixed_precision, parse_precision

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


def _autocast(kind: str, precision: str) -> Any:
    import torch

    low = parse_precision(precision).autocast_dtype
    if low is None:
        return contextlib.nullcontext()
    return torch.autocast(kind, dtype=torch_dtype(low))


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

    def step() -> None:  # the recipe's loop, as the tracer's (tilefit.tracing.loop)
        with _autocast(kind, recipe.precision):
            loss = loss_fn(model, batch)
        loss.backward()
        # the HF Trainer's read of the loss on the host, then its running total (the tracer's
        # loss_check phase: tilefit.tracing.loop._check_loss)
        if recipe.loss_sync and not (torch.isnan(loss) or torch.isinf(loss)):
            loss.detach().add(0.0)
        del loss
        if recipe.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(
                [p for p in model.parameters() if p.grad is not None], recipe.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=recipe.zero_grad_to_none)

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
    if recipe.accumulation_steps != 1:
        raise TilefitError("bench step measures one micro-batch per optimizer step",
                           expected="Recipe(accumulation_steps=1)",
                           given=str(recipe.accumulation_steps),
                           fix="pass Recipe(accumulation_steps=1)")
    if recipe.spec.grad_scaler:
        raise TilefitError("bench step does not run a grad scaler yet",
                           expected="a precision without loss scaling: " + ", ".join(
                               p.name for p in PRECISIONS if not p.grad_scaler),
                           given=recipe.precision,
                           fix=f"use Recipe(precision={mixed_precision('bf16').name!r})")


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
    """The model as the tracer builds it (tracing.workloads), for real: plain; with peft's
    LoRA on a base in the recipe's 16-bit dtype (tilefit.models.lora); or QLoRA, loaded
    quantized by from_pretrained (tilefit.bench.qlora). A pure 16-bit recipe casts every
    floating parameter, as the tracer does."""
    import tempfile
    from pathlib import Path

    import torch

    from tilefit.models.cast import cast_floating
    from tilefit.tracing.workloads import check_lora

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


def memtracker_peak_bytes(model: Any, opt: Any, batch: Any, step: Any, steps: int = 2) -> int:
    """Peak live tensor bytes of ``steps`` calls of ``step()`` on real CPU tensors, by PyTorch's
    MemTracker (its own accounting, independent of tilefit's tracer)."""
    import torch

    from tilefit.compat.distributed import new_mem_tracker

    tracker = new_mem_tracker()
    tracker.track_external(model, opt, batch)
    with tracker:
        for _ in range(steps):
            step()
            tracker.reset_mod_stats()
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def real_step_peak_bytes(model: Any, opt: Any, batch: Any, loss_fn: Any, *,
                         set_to_none: bool = True, steps: int = 2) -> int:
    """Peak live tensor bytes of ``steps`` plain training steps of ``model`` on real CPU
    tensors (``loss_fn(model, batch)``, backward, the optimizer step, zero_grad with
    ``set_to_none``), by PyTorch's MemTracker: the second method tilefit's predicted CPU
    peaks are checked against."""

    def step() -> None:
        loss = loss_fn(model, batch)
        loss.backward()
        del loss
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)

    return memtracker_peak_bytes(model, opt, batch, step, steps)
