"""Tracing a recipe at the sweep's points and turning the fitted model into plan rows."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from tilefit.batches import is_friendly
from tilefit.errors import TilefitError
from tilefit.estimator import Estimate, estimate_trace
from tilefit.estimator.offload import (
    OffloadLink,
    offload_host_bytes,
    offload_peak_bytes,
    offload_step_time_s,
)
from tilefit.hardware import Device
from tilefit.models import Workload
from tilefit.models.fused_loss import fused_ce_affine_tokens
from tilefit.planner.affine import SweepModel
from tilefit.planner.rows import PlanRow
from tilefit.planner.sample import STATE_CATEGORIES, Sample, sample_of
from tilefit.planner.space import OPTIMIZER_LABELS
from tilefit.recipe import Lora, Parallelism, Recipe
from tilefit.tracing import Trace
from tilefit.tracing.distributed import Parallel
from tilefit.tracing.workload_traces import prefetch, trace_workload
from tilefit.vocab import parse_precision, same_update

if TYPE_CHECKING:
    from collections.abc import Sequence


# Models deeper than this are traced at LEVER_LAYERS layers and extrapolated (affine in the
# layer count): a 32-layer 7B model traces in ~16 s on this 2-core machine, 1-2 layers in ~1 s.
LAYER_LEVER_MIN_LAYERS = 4
LEVER_LAYERS = (1, 2)
# Accumulation used for the sweep's traces: with >= 2 micro-batches the gradients of the
# previous micro-batch are live during the next forward, the steady peak of any accumulation
# >= 2 and an upper bound for accumulation 1.
SWEEP_ACCUMULATION = 2


@dataclass(frozen=True)
class Depth:
    """How the model's depth is swept: the config field, the full count and the traced ones,
    counted in repeats of ``period`` layers (1: alike layers; a repeating pattern of layer
    kinds, Gemma 2's sliding and full attention or Qwen3.5's three linear-attention layers to
    one full, is traced at 1 and 2 repeats: tilefit.models.layer_pattern)."""

    field: str | None
    full: int
    traced: tuple[int, ...]
    period: int = 1

    @property
    def lever(self) -> bool:
        return self.field is not None and len(self.traced) > 1

    @property
    def layers(self) -> int:
        """The model's layer count (``full`` repeats of ``period`` layers)."""
        return self.full * self.period

    def in_full(self) -> Depth:
        """The same model traced at its full depth only."""
        return Depth(None, self.full, (self.full,), self.period)

    def workload_at(self, workload: Workload, repeats: int) -> Workload:
        """``workload`` cut to ``repeats`` of its ``period`` layers."""
        if self.field is None or repeats == self.full:
            return workload
        from tilefit.models.layer_pattern import depth_changes

        assert workload.config is not None
        return workload.with_config(**depth_changes(workload.config, self.field, self.period,
                                                    repeats))

    def layers_text(self, units: tuple[int, ...], sep: str = ", ") -> str:
        """Repeat counts as layer counts, "4, 8"."""
        return sep.join(str(u * self.period) for u in units)


def depth_of(workload: Workload, *, use_lever: bool | None = None) -> Depth:
    if workload.config is None:
        return Depth(None, 1, (1,))
    from tilefit.models import hf
    from tilefit.models.layer_pattern import repeated_period

    key = hf.canonical_field(workload.config, "num_hidden_layers")
    if key not in workload.config:
        return Depth(None, 1, (1,))
    full = int(workload.config[key])
    lever = full > LAYER_LEVER_MIN_LAYERS if use_lever is None else use_lever
    period = repeated_period(workload.config, key) if lever else None
    # layers that differ without repeating a pattern (DeepSeek's dense first layers) are
    # traced at full depth, as is a pattern repeated too few times to extrapolate
    if period is None or full // period <= max(LEVER_LAYERS):
        return Depth(None, full, (full,))
    return Depth("num_hidden_layers", full // period, LEVER_LAYERS, period)


def mfu_dtype_for(precision: str, device: Device) -> str:
    """The dtype whose dense peak MFU is measured against (as the estimator does)."""
    dt = parse_precision(precision).compute_dtype
    return dt if device.supports(dt) else "fp32"


def half_parameter_bytes(parameters_bytes: float, precision: str) -> float:
    """The parameters' bytes in 16 bits: as traced when the weights are already 16-bit,
    else half the fp32 figure (what the GPU holds when the fp32 master copy is offloaded or
    sharded)."""
    return parameters_bytes if parse_precision(precision).param_dtype != "fp32" \
        else parameters_bytes / 2


def trace_sample(workload: Workload, spec: Recipe, micro_batch: int, layers: int,
                 depth: Depth, device: Device, accumulation_steps: int,
                 parallel: Parallel | None = None) -> Sample:
    """One traced and costed step; ``parallel``: rank 0 of a data-parallel job, the micro-batch
    being one rank's (DeepSpeed ZeRO: modelled on the one-GPU trace)."""
    traced = None if parallel is not None and parallel.modelled else parallel
    tr = trace_point(workload, spec, micro_batch, layers, depth, device, accumulation_steps,
                     traced)
    return sample_from(tr, device, micro_batch, layers, parallel)


def sample_from(tr: Trace, device: Device, micro_batch: int, layers: int,
                parallel: Parallel | None) -> Sample:
    """The Sample of a traced step (``parallel`` modelled: DeepSpeed ZeRO's rank, modelled
    on this one-GPU trace)."""
    if parallel is not None and parallel.modelled:
        return zero_sample(tr, estimate_trace(tr, device), device, parallel, micro_batch,
                           layers)
    return sample_of(tr, estimate_trace(tr, device), micro_batch, layers)


def trace_point(workload: Workload, spec: Recipe, micro_batch: int, layers: int,
                depth: Depth, device: Device, accumulation_steps: int,
                parallel: Parallel | None) -> Trace:
    """The step of ``spec`` at ``micro_batch`` and ``layers`` (of ``depth``), traced."""
    return trace_step(point_step(workload, spec, micro_batch, layers, depth,
                                 accumulation_steps, parallel), device)


def trace_step(step: tuple[Workload, Recipe], device: Device) -> Trace:
    """A (workload, recipe) step of the planner traced: every trace of a plan is taken here
    (tracing.workload_traces.trace_workload, shared within the plan's scope)."""
    return trace_workload(*step, device)


def point_step(workload: Workload, spec: Recipe, micro_batch: int, layers: int, depth: Depth,
               accumulation_steps: int, parallel: Parallel | None) -> tuple[Workload, Recipe]:
    """The workload (at ``layers`` of ``depth``) and recipe of one sweep point."""
    work = depth.workload_at(workload, layers)
    recipe = spec.with_batch(micro_batch, accumulation_steps)
    if parallel is not None:
        recipe = replace(recipe, parallel=Parallelism(parallel.world_size, parallel.strategy))
    return work, recipe


def prefetch_points(workload: Workload, spec: Recipe, points: Sequence[tuple[int, int]],
                    depth: Depth, device: Device, parallel: Parallel | None) -> None:
    """Start the sweep's points ((layers, micro-batch)) on free cores, for trace_point to
    collect (tracing.workload_traces.prefetch: as many as there are free cores, none outside an
    audit's or plan's shared_traces scope)."""
    for layers, b in points:
        prefetch([point_step(workload, spec, b, layers, depth, SWEEP_ACCUMULATION, parallel)],
                 device)


def zero_sample(tr: Trace, base: Estimate, device: Device, parallel: Parallel,
                micro_batch: int, layers: int) -> Sample:
    """One rank of a DeepSpeed ZeRO job (``parallel``), modelled on the one-GPU trace ``tr``
    and its estimate ``base`` (tilefit.estimator.zero_step)."""
    from tilefit.estimator.zero_step import estimate_zero, zero_peaks

    peaks = zero_peaks(tr, parallel.strategy, parallel.world_size, offload=parallel.offload)
    est = estimate_zero(base, tr, device, parallel.strategy, parallel.world_size,
                        offload=parallel.offload, peaks=peaks)
    assert est.parallel is not None
    return sample_of(tr, est, micro_batch, layers,
                     peaks=(peaks.micro, peaks.micro_first, peaks.step),
                     host_bytes=est.parallel.details["memory"]["host_bytes"])


def sweep_points(workload: Workload, spec: Recipe, micro_batches: list[int]) -> list[int]:
    """The micro-batches a sweep traces: the smallest and the largest. A fused-loss recipe
    starts where its chunking does: below V/H tokens a chunk is one row and the chunk count
    grows with the tokens, above it the count is about V/H and the step is affine again
    (tilefit.models.fused_loss.chunk_rows)."""
    low = min(micro_batches)
    if spec.fused_ce:
        low = min((b for b in micro_batches if b * (workload.seq_len or 1) >=
                   fused_ce_affine_tokens(workload.config or {})), default=max(micro_batches))
    return sorted({low, max(micro_batches)})


def sweep(workload: Workload, spec: Recipe, micro_batches: list[int], depth: Depth,
          device: Device, parallel: Parallel | None = None,
          state_budget: int | None = None) -> SweepModel:
    """Trace the recipe at the sweep's points (``sweep_points``, at each traced depth): the
    smallest micro-batch first. With ``state_budget``, a recipe whose model state there
    (``state_over``) is over it is traced no further: no micro-batch can fit, and its
    sweep is that micro-batch's alone."""
    bs = sweep_points(workload, spec, micro_batches)
    samples = _trace_points(workload, spec, [(k, bs[0]) for k in depth.traced], depth,
                            device, parallel)
    if state_budget is not None and len(bs) > 1 and state_over(
            SweepModel(tuple(samples)), depth, state_budget) is not None:
        return SweepModel(tuple(samples))
    samples += _trace_points(workload, spec, [(k, b) for b in bs[1:] for k in depth.traced],
                             depth, device, parallel)
    return SweepModel(tuple(samples))


def _trace_points(workload: Workload, spec: Recipe, points: list[tuple[int, int]],
                  depth: Depth, device: Device, parallel: Parallel | None) -> list[Sample]:
    """``points`` ((layers, micro-batch)) traced in order, each next one started on a free
    core while this one traces."""
    traced = None if parallel is not None and parallel.modelled else parallel
    samples = []
    for i, (k, b) in enumerate(points):
        prefetch_points(workload, spec, points[i + 1:], depth, device, traced)
        samples.append(trace_sample(workload, spec, b, k, depth, device, SWEEP_ACCUMULATION,
                                    parallel))
    return samples


STATE_METRICS = tuple(f"{c}_bytes" for c in STATE_CATEGORIES)


def state_over(model: SweepModel, depth: Depth, budget: int) -> float | None:
    """The model state (parameters, gradients and optimizer state) at full depth, where it
    is over ``budget``; else None. All three are live in the optimizer step whatever the
    micro-batch, so every row of the recipe needs at least that much: none can fit. The
    state does not depend on the micro-batch: the sweep's smallest gives it."""
    layers = depth.full if depth.lever else None
    b = min(s.micro_batch for s in model.samples)
    state = sum(model.predict(m, b, layers) for m in STATE_METRICS)
    return state if state > budget else None


def zero_sweeps(workload: Workload, spec: Recipe, micro_batches: list[int], depth: Depth,
                device: Device, engines: Sequence[Parallel]) -> dict[Parallel, SweepModel]:
    """DeepSpeed ZeRO ``engines`` (stages, offload) share one set of one-GPU traces: each
    point is traced once and modelled as every engine's rank (tilefit.estimator.zero_step)."""
    samples: dict[Parallel, list[Sample]] = {e: [] for e in engines}
    points = [(k, b) for k in depth.traced for b in sweep_points(workload, spec, micro_batches)]
    for i, (k, b) in enumerate(points):
        prefetch_points(workload, spec, points[i + 1:], depth, device, None)
        tr = trace_point(workload, spec, b, k, depth, device, SWEEP_ACCUMULATION, None)
        base = estimate_trace(tr, device)
        for engine in engines:
            samples[engine].append(zero_sample(tr, base, device, engine, b, k))
    return {e: SweepModel(tuple(s)) for e, s in samples.items()}


def qlora_change(quantize: str, lora: Lora | None) -> str:
    """What QLoRA changes about training, in quality terms:
    docs/references.md, section 33."""
    lora = lora or Lora()
    return (f"QLoRA: LoRA r={lora.rank} alpha={lora.alpha} adapters on {lora.where} of "
            f"a frozen base quantized to 4-bit {quantize.upper()} (bitsandbytes, double "
            "quantization): in the QLoRA paper (Dettmers et al. 2023) it matched 16-bit LoRA "
            "and full fine-tuning on its benchmarks, but the base weights are 4-bit and only "
            "the adapters train (a different recipe from full fine-tuning)")


def changes_of(spec: Recipe, user_optimizer: str, offload: bool,
               parallel: Parallel | None = None) -> tuple[str, ...]:
    out: list[str] = []
    zero = parallel is not None and parallel.modelled
    if spec.quantize:
        out.append(qlora_change(spec.quantize, spec.lora))
    elif spec.lora is not None:
        out.append(f"{spec.lora.label()}, base weights frozen in 16 bits: trains adapters, "
                   "not the model (a different recipe)")
    if spec.optimizer != user_optimizer:
        same = same_update(spec.optimizer, user_optimizer)
        out.append(f"optimizer {OPTIMIZER_LABELS.get(user_optimizer, user_optimizer)} -> "
                   f"{OPTIMIZER_LABELS.get(spec.optimizer, spec.optimizer)}: " + (
                       "the same update in one kernel (fused=True)" if same else
                       "a different training algorithm (retune the learning rate)"))
    if spec.fused_ce:
        out.append("fused linear cross-entropy (Liger Kernel): the logits never whole (same "
                   "math)")
    if spec.compile:
        out.append("torch.compile (Inductor): fused kernels, fewer saved activations (same "
                   "math; compile time not counted)")
    prec = spec.spec
    if prec.float8_linears:
        out.append("nn.Linear GEMMs in fp8 (torchao float8, tensorwise scaling): fp8 "
                   "rounding, check the loss against bf16")
    if prec.autocast_dtype:
        out.append(f"{prec.autocast_dtype} autocast "
                   + ("(fp32 adapters)" if spec.peft else "(fp32 weights)"))
    elif prec.param_dtype != "fp32" and zero:
        out.append(f"DeepSpeed's {prec.param_dtype} mode: {prec.param_dtype} weights and "
                   "gradients, the fp32 master weights and optimizer state partitioned "
                   "over the GPUs")
    elif prec.param_dtype != "fp32" and offload:
        out.append(f"{prec.param_dtype} weights on the GPU, fp32 master copy on the CPU")
    elif prec.param_dtype != "fp32":
        out.append(f"pure {prec.param_dtype}: weights, gradients and optimizer state in "
                   f"{prec.param_dtype}, no fp32 master copy (updates below its resolution "
                   "round away: check the loss against mixed precision)")
    elif prec.allow_tf32:
        out.append("TF32 matmuls (10-bit mantissa inputs)")
    if spec.grad_checkpointing:
        out.append("recomputes activations in backward (same math)")
    if offload:
        out.append("optimizer on the CPU (DeepSpeed ZeRO-Offload; same math)")
    return tuple(out)


def row_from(spec: Recipe, model: SweepModel, micro_batch: int, global_batch: int,
             depth: Depth, device: Device, budget_bytes: int, tokens_per_sample: int | None,
             user_optimizer: str, *, offload: OffloadLink | None = None,
             parallel: Parallel | None = None) -> PlanRow:
    """The recipe at ``micro_batch``; with ``parallel`` the micro-batch is one rank's, the
    peak and MFU are per GPU, the throughput that of all GPUs."""
    layers = depth.full if depth.lever else None
    p = model.predict_all(micro_batch, layers)
    world = 1 if parallel is None else parallel.world_size
    # ZeRO-Offload's CPU step is in the modelled sample's fixed time already
    zero_offload = parallel is not None and parallel.offload
    accum = global_batch // (micro_batch * world)
    if offload is None:
        peak = max(p["peak_bytes"], p["peak_optimizer_bytes"]) if accum > 1 else max(
            p["peak_accumulation_1_bytes"],
            p.get("peak_optimizer_accumulation_1_bytes", p["peak_optimizer_bytes"]))
        step = accum * p["micro_time_s"] + p["fixed_time_s"]
    else:
        params16 = half_parameter_bytes(p["parameters_bytes"], spec.precision)
        peak = offload_peak_bytes(params16, p["work_peak_bytes"], p["param_count"])
        step = offload_step_time_s(p["micro_time_s"], accum, p["param_count"], offload)
    flops = accum * p["micro_flops"]
    mfu = flops / step / device.peak(mfu_dtype_for(spec.precision, device)) if step > 0 else 0.0
    return PlanRow(
        recipe=spec.with_batch(micro_batch, accum), predicted_peak_memory_bytes=round(peak),
        predicted_reserved_bytes=None if offload is not None else reserved_of(
            model, p, peak, micro_batch, in_bytes=depth.lever and spec.peft),
        predicted_step_time_s=step, samples_per_s=global_batch / step if step else 0.0,
        tokens_per_s=(global_batch * tokens_per_sample / step
                      if (tokens_per_sample and step) else None),
        mfu=mfu, budget_bytes=budget_bytes, offload=offload is not None or zero_offload,
        changes_optimizer=not same_update(spec.optimizer, user_optimizer),
        fuses_optimizer=spec.optimizer != user_optimizer and same_update(spec.optimizer,
                                                                          user_optimizer),
        changes=changes_of(spec, user_optimizer, offload is not None or zero_offload,
                           parallel),
        friendly=is_friendly(micro_batch), world_size=world,
        strategy=None if parallel is None else parallel.strategy,
        host_memory_bytes=host_bytes_of(spec, p, offload is not None, parallel))


def host_bytes_of(spec: Recipe, p: dict[str, float], offload: bool,
                  parallel: Parallel | None) -> int | None:
    """The CPU memory a row needs beyond the usual: a modelled DeepSpeed engine's (its
    estimator's figure, in the sample), one GPU's ZeRO-Offload (the same estimator, from the
    traced parameter count and optimizer state); None elsewhere."""
    if parallel is not None and parallel.modelled:
        return round(p["host_bytes"])
    if not offload:
        return None
    from tilefit.dtypes import parse_dtype

    w = parse_dtype(parse_precision(spec.precision).param_dtype).bytes
    return offload_host_bytes(p["param_count"], p["optimizer_state_bytes"], w)


def reserved_of(model: SweepModel, p: dict[str, float], peak: float, micro_batch: float,
                *, in_bytes: bool = False) -> int | None:
    """The caching allocator's predicted reserved peak at a swept point, None where no trace
    of the sweep had a reserved model: the allocated peak and the traced points' share of it
    reserved beyond it, along the sweep, held inside the shares the traces measured
    (fragmentation is not affine; this keeps it to what was replayed). ``in_bytes``
    (adapters on a frozen base, traced at a few layers and extrapolated in depth): the
    allocated peak plus the bytes reserved beyond it at the deepest traced depth
    (``deepest_excess``). Without per-parameter optimizer state to fragment with every
    layer, those come from the activations' and the logits' block sizes, which a layer
    more does not change, where their share of the peak falls with depth
    (docs/references.md, section 31)."""
    ratios = [s.fragmentation_ratio for s in model.samples]
    if not any(ratios):
        return None
    if in_bytes:
        return round(peak + deepest_excess(model, micro_batch))
    ratio = min(max(p["fragmentation_ratio"], min(ratios)), max(ratios))
    return round(peak * (1 + ratio))


def deepest_excess(model: SweepModel, micro_batch: float) -> float:
    """The bytes the allocator reserved beyond the traced peak at the sweep's deepest layer
    count, linear between its traced micro-batches and held inside what they measured."""
    deepest = max(s.layers for s in model.samples)
    points = sorted((s.micro_batch, s.fragmentation_ratio * max(s.peak_bytes,
                                                                s.peak_optimizer_bytes))
                    for s in model.samples if s.layers == deepest)
    (b0, y0), (b1, y1) = points[0], points[-1]
    y = y0 if b1 == b0 else y0 + (y1 - y0) * (micro_batch - b0) / (b1 - b0)
    return min(max(y, min(y0, y1)), max(y0, y1))


def safe_sweep(workload: Workload, spec: Recipe, micro_batches: list[int], depth: Depth,
               device: Device, notes: list[str], parallel: Parallel | None = None,
               state_budget: int | None = None) -> SweepModel | None:
    """The sweep, or None with a note when the recipe cannot run (e.g. Adafactor without
    torch.optim.Adafactor)."""
    try:
        return sweep(workload, spec, micro_batches, depth, device, parallel, state_budget)
    except TilefitError as exc:
        engine = "" if parallel is None else f"{parallel.strategy} "
        notes.append(f"skipped {engine}{spec.precision} {spec.optimizer}: {exc.problem}")
        return None
