"""Turning a Trace into predicted step time and peak memory on a Device."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

from tilefit.estimator.collectives import (
    Communication,
    ParallelSummary,
    bus_bandwidth_bytes_per_s,
    check_world_size,
    communication,
    link_description,
    one_gpu_step_time_s,
    without_communication,
)
from tilefit.estimator.compiled_cost import compiled_op_time_s
from tilefit.estimator.cost import DEFAULT_EFFICIENCY, CostContext, KernelEfficiency, op_time_s
from tilefit.estimator.cudagraphs import check_capturable, graphed, graphed_memory
from tilefit.estimator.reserved import ReservedMemory, allocator_config_of, reserved_memory
from tilefit.estimator.result import (
    EXPOSED_COMMUNICATION,
    HOST_WAIT,
    Estimate,
    ModuleSummary,
    OpCost,
    module_key,
)
from tilefit.estimator.steptime import step_timeline
from tilefit.estimator.timeline import Timeline
from tilefit.estimator.zero_step import estimate_zero, is_zero, traced_recipe
from tilefit.hardware import Device, get_device
from tilefit.old_keywords import refuses_old_keywords
from tilefit.recipe import (
    DEFAULT_GPU,
    Parallelism,
    Recipe,
    ZeroConfig,
    batch_recipe,
    is_named_model,
)
from tilefit.tracing.records import Trace
from tilefit.vocab import parse_precision

__all__ = ["Estimate", "ModuleSummary", "OpCost", "ParallelSummary", "ZeroConfig",
           "cublas_workspace_bytes",
           "estimate", "estimate_trace", "overhead_bytes"]

MIB = 1024**2
# Memory a GPU process holds beyond its tensors: the CUDA context of a PyTorch process
# (Device.cuda_context_bytes, by default tilefit.hardware.device.CUDA_CONTEXT_BYTES: 512 MiB
# with lazy module loading, the default since CUDA 11.7; docs/references.md, section 7) and
# cuBLAS's workspace (PyTorch's default CUBLAS_WORKSPACE_CONFIG: :4096:8 = 32 MiB on sm90+,
# :4096:2:16:8 = 8 MiB + 128 KiB before).
CUBLAS_WORKSPACE_BYTES_SM90 = 32 * MIB
CUBLAS_WORKSPACE_BYTES = 8 * MIB + 128 * 1024


def cublas_workspace_bytes(device: Device) -> int:
    """cuBLAS's workspace for one stream. PyTorch takes it from the caching allocator, so it
    shows in torch.cuda.memory_allocated (compare a measured peak with tensors + this)."""
    if device.kind != "cuda":
        return 0
    cc = device.compute_capability or (0, 0)
    return CUBLAS_WORKSPACE_BYTES_SM90 if cc >= (9, 0) else CUBLAS_WORKSPACE_BYTES


def overhead_bytes(device: Device) -> int:
    """Memory beyond the step's tensors: the CUDA context and cuBLAS's workspace."""
    if device.kind != "cuda":
        return 0
    return device.cuda_context_bytes + cublas_workspace_bytes(device)


@refuses_old_keywords
def estimate(model: Any, batch: Any = None, *, recipe: Recipe | None = None,
             gpu: str | Device | None = None, loss_fn: Any = None) -> Estimate:
    """Predict one training step's time and peak memory on ``gpu`` (a catalog name, a
    Device, or "cpu" for this machine; default DEFAULT_GPU) without running it: the step is
    traced on fake tensors as the GPU would run it (``tilefit.trace``: ``model``, ``batch``,
    ``recipe`` and ``loss_fn`` as there), then costed op by op.

    ``recipe.compile``: the forward and backward as torch.compile (Inductor) runs them,
    costed kernel by kernel (tilefit.estimator.compiled_cost; mode "reduce-overhead": replayed as
    CUDA graphs, tilefit.estimator.cudagraphs; ``graph_breaks``: Dynamo's breaks listed in
    the notes). ``recipe.parallel``: one rank's step of ``world_size`` GPUs with the
    engine's collectives (ddp, fsdp2), ``Estimate.parallel`` summarising communication,
    throughput and scaling; DeepSpeed ZeRO (zero1-3, ``offload``, the ``zero`` buckets)
    modelled on the one-GPU trace (``Estimate.parallel.modelled``; tilefit.estimator.zero).
    0.1.0's keywords (precision=, device=, ...) are refused with their new spelling
    (tilefit.old_keywords)."""
    recipe = recipe or Recipe.for_model(model)
    if is_named_model(model):
        recipe = batch_recipe(recipe, batch)
    device = get_device(DEFAULT_GPU if gpu is None else gpu)
    return estimate_recipe(model, batch, recipe, device, loss_fn=loss_fn)


def estimate_recipe(model: Any, batch: Any, recipe: Recipe, device: Device, *,
                    loss_fn: Any = None) -> Estimate:
    """The estimate of ``model`` (named, or a module with its example ``batch``) under a
    validated ``recipe`` on ``device``: the one path estimate, the CLI and the audit take."""
    from tilefit.tracing.gc_pause import gc_paused
    from tilefit.tracing.step import trace_module
    from tilefit.tracing.workload_traces import trace_workload

    if recipe.parallel.world_size > 1:
        check_world_size(device, recipe.parallel.world_size)
    traced = traced_recipe(recipe)
    with gc_paused():  # the trace's objects are all alive until it is costed
        tr = (trace_workload(model, traced, device) if is_named_model(model)
              else trace_module(model, batch, traced, device, loss_fn=loss_fn))
        return estimate_strategy(tr, device, recipe.parallel)


def estimate_strategy(tr: Trace, device: Device, parallel: Parallelism) -> Estimate:
    """The trace's estimate; under a ZeRO strategy, one of ``world_size`` ranks, modelled."""
    base = estimate_trace(tr, device)
    if not is_zero(parallel.strategy):
        return base
    assert parallel.strategy is not None
    # ZeRO is modelled on the one-GPU trace: its partitions were never allocated, so there
    # is nothing to replay through the allocator
    return dataclasses.replace(estimate_zero(
        base, tr, device, parallel.strategy, parallel.world_size, offload=parallel.offload,
        config=parallel.zero), reserved=None)


def estimate_trace(tr: Trace, device: Device,
                   efficiency: KernelEfficiency = DEFAULT_EFFICIENCY) -> Estimate:
    """Cost a trace on a device: the steady-state step's ops for time, the whole run's
    memory timeline for the peak. ``efficiency``: the kernel efficiencies beyond the
    device's own terms (tilefit.estimator.cost; the corpus benchmark varies them)."""
    check_capturable(tr)
    a = tr.accumulation_steps
    costs = _op_costs(tr, device, CostContext(precision=tr.precision, efficiency=efficiency))
    timeline, comm, step_time = _step_time(tr, costs, device)
    hw_flops = sum(c.record.flops * c.repeats for c in costs)
    model_flops = sum(c.record.flops * c.repeats for c in costs if c.record.phase != "recompute")
    by_phase, by_module = _by_phase_and_module(costs)
    peak, breakdown = _peak_memory(tr)
    samples = tr.samples_per_micro_batch * a
    tokens = tr.tokens_per_micro_batch * a if tr.tokens_per_micro_batch is not None else None
    mfu_dtype = parse_precision(tr.precision).compute_dtype
    if not device.supports(mfu_dtype):
        mfu_dtype = "fp32"
    mfu = model_flops / step_time / device.peak(mfu_dtype) if step_time > 0 else 0.0
    warnings = [*tr.warnings, *_cost_warnings(costs)]
    if device.kind != "cuda":
        warnings.append(f"no reserved-memory figure on a {device.kind.upper()} target: its "
                        "allocator is not PyTorch's CUDA caching allocator, so the memory "
                        "shown, and whether it fits, is the tensors' peak")
    return Estimate(
        device=device, precision=tr.precision, optimizer=tr.optimizer,
        peak_memory_bytes=peak, memory_breakdown=breakdown,
        overhead_bytes=overhead_bytes(device), step_time_s=step_time, flops=int(model_flops),
        hardware_flops=int(hw_flops), samples_per_step=samples, tokens_per_step=tokens,
        samples_per_s=samples / step_time if step_time else 0.0,
        tokens_per_s=tokens / step_time if (tokens and step_time) else None,
        mfu=mfu, mfu_dtype=mfu_dtype, time_by_phase_s=by_phase, ops=tuple(costs),
        modules=_module_summaries(by_module, timeline, comm), warnings=tuple(warnings),
        param_count=tr.param_count,
        trainable_param_count=tr.trainable_param_count, accumulation_steps=a,
        host_time_s=timeline.host_s, device_time_s=timeline.device_s,
        host_bound_fraction=timeline.host_bound_fraction,
        parallel=_parallel_summary(tr, device, costs, comm, step_time),
        compile_mode=tr.compile_mode if tr.compiled else None,
        reserved=_reserved(tr, device),
    )


def _reserved(tr: Trace, device: Device) -> ReservedMemory | None:
    """The caching allocator's replay on a GPU (the CPU's allocator is not CUDA's)."""
    if device.kind != "cuda":
        return None
    limit = device.memory_bytes - overhead_bytes(device)
    return reserved_memory(tr, limit, allocator_config_of(tr))


def _op_costs(tr: Trace, device: Device, ctx: CostContext) -> list[OpCost]:
    """The steady step's ops, each costed once, with how often it runs per optimizer step."""
    costs: list[OpCost] = []
    for op in tr.ops_of_step(1):
        time_s = compiled_op_time_s(op, device, ctx) if op.compiled else \
            op_time_s(op, device, ctx)
        costs.append(OpCost(op, time_s, tr.repeats_per_step(op)))
    return costs


def _by_phase_and_module(costs: list[OpCost]
                         ) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Device time by phase and by module (collectives left out of both: they run on their
    own stream, Estimate.parallel has them); ops outside every module by what they are."""
    by_phase: dict[str, float] = defaultdict(float)
    modules: dict[str, list[float]] = {}
    for c in costs:
        if c.record.kind == "collective":
            continue
        by_phase[c.record.phase] += c.time_s * c.repeats
        m = modules.setdefault(module_key(c.record), [0.0, 0, 0, 0])
        m[0] += c.time_s * c.repeats
        m[1] += c.record.flops * c.repeats
        m[2] += c.record.bytes * c.repeats
        m[3] += 1
    return dict(by_phase), modules


def _module_summaries(modules: dict[str, list[float]], timeline: Timeline,
                      comm: Communication | None) -> tuple[ModuleSummary, ...]:
    """The modules' device time, and the rest of the step (the GPU waiting for the host,
    communication the compute does not hide): together, the step time."""
    rows = [ModuleSummary(k, v[0], int(v[1]), int(v[2]), int(v[3])) for k, v in modules.items()]
    rest = {HOST_WAIT: timeline.step_time_s - timeline.device_s,
            EXPOSED_COMMUNICATION: 0.0 if comm is None else comm.exposed_s}
    rows += [ModuleSummary(k, v, 0, 0, 0) for k, v in rest.items() if v > 0]
    return tuple(sorted(rows, key=lambda s: -s.time_s))


def _cost_warnings(costs: list[OpCost]) -> list[str]:
    """Ops the cost model could not count exactly, named."""
    out = []
    unknown = sorted({c.record.op for c in costs if c.record.kind == "unknown"
                      and not c.record.fused})  # a fused op is costed by its kernel
    if unknown:
        out.append("ops with no FLOP formula, costed as memory-bound (bytes / bandwidth): "
                   + ", ".join(unknown))
    failed = sorted({f"{c.record.op} ({c.record.flops_error})" for c in costs
                     if c.record.flops_error is not None})
    if failed:
        out.append("ops whose FLOP formula failed, counted as 0 FLOPs (the MFU leaves them "
                   "out): " + ", ".join(failed))
    return out


def _peak_memory(tr: Trace) -> tuple[int, dict[str, int]]:
    """The peak of the memory timeline and the live bytes by category there (CUDA graphs:
    tilefit.estimator.cudagraphs)."""
    rounded = tr.target.kind == "cuda"
    if graphed(tr):
        return graphed_memory(tr, rounded=rounded)
    peak, at = tr.peak(rounded=rounded)
    return peak, tr.breakdown_at(at, rounded=rounded)


def _step_time(tr: Trace, costs: list[OpCost], device: Device
               ) -> tuple[Timeline, Communication | None, float]:
    """The timelines and the step time; on several GPUs the collectives run on their own
    stream and the step waits for what the compute does not hide."""
    comm = communication(costs) if tr.strategy is not None else None
    timeline = step_timeline(costs if comm is None else without_communication(costs), device,
                             tr.trainable_param_tensors, graphs=graphed(tr))
    return timeline, comm, timeline.step_time_s + (0.0 if comm is None else comm.exposed_s)


def _parallel_summary(tr: Trace, device: Device, costs: list[OpCost],
                      comm: Communication | None, step_time: float) -> ParallelSummary | None:
    if comm is None:
        return None
    strategy = tr.strategy or ""
    return ParallelSummary(
        strategy=strategy, world_size=tr.world_size, link=link_description(device, tr.world_size),
        bus_bandwidth_bytes_per_s=bus_bandwidth_bytes_per_s(device, tr.world_size),
        communication_time_s=comm.time_s, exposed_communication_s=comm.exposed_s,
        communication_by_phase_s=comm.by_phase_s,
        one_gpu_step_time_s=one_gpu_step_time_s(costs, step_time, comm.exposed_s, strategy,
                                                tr.world_size),
        step_time_s=step_time,
        samples_per_step=tr.samples_per_micro_batch * tr.accumulation_steps,
        tokens_per_step=(tr.tokens_per_micro_batch * tr.accumulation_steps
                         if tr.tokens_per_micro_batch is not None else None))
