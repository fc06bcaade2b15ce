"""What a simulated run found in the user's code, and the Trace of its last step.

The last step is the events between the last two step boundaries (tilefit.simulation.watch);
its ops are labelled step 1, the steady step the estimator costs, everything before step 0.
Every forward and backward of that step was run (none replayed), so the trace's
accumulation is the step's backward passes, all traced. Storages in host memory (the
script's CPU tensors: its data before the copy to the GPU, torch.optim's step counters) are
not GPU memory and are left out; so is what the code did after its last step."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from tilefit.recipe import Recipe
from tilefit.tracing.records import Trace
from tilefit.tracing.target import Target
from tilefit.vocab import MICRO_PHASES, OPTIMIZER_PHASES, REDUCE_OVERHEAD

if TYPE_CHECKING:
    from tilefit.simulation.devices import DevicePlacement
    from tilefit.simulation.session import _Readings
    from tilefit.simulation.values import HostRead, SimulationRecorder
    from tilefit.simulation.watch import OptimizerSeen, StepWatch


@dataclasses.dataclass(frozen=True)
class Findings:
    """What the code was seen to do (the report's 'found in the script')."""

    precision: str  # a vocab precision name, read off the step's GEMMs and weights
    autocast_dtype: str | None  # the dtype the step's GEMMs ran in under autocast
    grad_scaler: bool
    optimizers: tuple[OptimizerSeen, ...]
    clipping: tuple[str, ...]  # clip_grad_norm_ / clip_grad_value_
    accumulation_steps: int  # backward passes in the last step
    grad_checkpointing: bool  # the backward recomputed forward ops
    compiled: bool  # the code called torch.compile
    max_grad_norm: float | None  # the norm it clipped gradients to, where it did
    zero_grad_to_none: bool | None  # None where zero_grad was not called
    models: tuple[str, ...]  # the classes of the modules the code called at the top
    host_reads: tuple[HostRead, ...]  # .item() and the like: host synchronizations
    syncs: tuple[str, ...]  # torch.cuda.synchronize() and Event.synchronize() calls
    copies_to_gpu: int  # host-to-device copies (.to("cuda") of CPU tensors)
    host_ops_per_step: int  # the script's own ops on CPU tensors in its last step
    steps_run: int  # optimizer steps (of the first optimizer) the code made
    stopped: bool  # stopped after the asked steps; else the code ended by itself
    # this machine's wall clock between steps (data loading, logging), under the simulation
    between_steps_s: tuple[float, ...] = ()
    compiled_modules: int = 0  # modules torch.compile'd: predicted as Inductor runs them

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["host_reads"] = [dataclasses.asdict(r) for r in self.host_reads]
        return out


def _precision(ops: list[Any], weights: str, tf32: bool) -> tuple[str, str | None]:
    """The precision name and the autocast dtype, from the step's GEMM dtypes, the dtype
    most parameter bytes have and whether fp32 matmuls may run as TF32."""
    gemm = {g.dtype for op in ops for g in op.gemms if op.phase == "forward"}
    low = next((d for d in ("bf16", "fp16") if d in gemm), None)
    if weights in ("bf16", "fp16"):
        return f"{weights}-true", None
    if low is None:
        return ("tf32" if tf32 else "fp32"), None
    return f"{low}-mixed", low


def _weights_dtype(params: list[torch.Tensor]) -> str:
    by_dtype: dict[torch.dtype, int] = {}
    for p in params:
        by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel() * p.element_size()
    top = max(by_dtype, key=by_dtype.__getitem__) if by_dtype else torch.float32
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(top, "fp32")


# torch.compile of a function (or Module.compile) under the simulation: the recorder sees
# the eager aten ops (observed with torch 2.13: no graph is captured under the modes)
COMPILED_NOTE = ("the script calls torch.compile on a function, whose graphs ran eagerly "
                 "under the simulation: that part of the step is the eager one (torch.compile "
                 "of a module is predicted as Inductor runs it)")
# torch.compile(module): simulation.compiled
COMPILED_MODULE_NOTE = (
    "torch.compile: each compiled module's forward and backward are predicted as Inductor "
    "runs them (AOTAutograd's capture, Inductor's decompositions, partitioner and fused "
    "kernels, as estimate(..., recipe=Recipe(compile=Compile())) predicts; "
    "docs/references.md, section 19), one graph per call signature (graph breaks are not "
    "predicted); the code outside the module (a loss computed on its output, the optimizer "
    "step) runs eager, as under torch.compile(model)")


def script_host_op(op: Any) -> bool:
    """An op of the script's own on tensors in host memory (its data loading, collation,
    CPU preprocessing): the machine's CPU runs it, not the GPU's host thread issuing kernels,
    so the step's prediction leaves it out (torch.optim's step counts, host tensors too, are
    the optimizer's and stay)."""
    return bool(op.on_host) and op.phase not in OPTIMIZER_PHASES


def findings_of(watch: StepWatch, recorder: SimulationRecorder, placement: DevicePlacement,
                readings: _Readings, stopped: bool, steps: int) -> Findings:
    start, end = _last_step(watch)
    ops = recorder.ops[start:end]
    precision, autocast = _precision(ops, _weights_dtype(watch.every_param),
                                     watch.facts.tf32)
    facts = watch.facts
    if precision == "fp16-mixed" and not facts.grad_scaler:  # autocast, never scaled
        precision = "fp16-mixed-unscaled"
    return Findings(
        precision=precision, autocast_dtype=autocast, grad_scaler=facts.grad_scaler,
        optimizers=tuple(facts.optimizers), clipping=tuple(sorted(facts.clipping)),
        accumulation_steps=max(facts.backward_calls[-1], 1),
        grad_checkpointing=any(op.phase == "recompute" for op in ops),
        compiled=facts.compiled, max_grad_norm=facts.max_grad_norm,
        zero_grad_to_none=(None if not facts.zero_grad_to_none
                           else all(facts.zero_grad_to_none)),
        models=tuple(facts.models), host_reads=recorder.host_reads(),
        syncs=tuple(readings.syncs), copies_to_gpu=placement.copies_in,
        host_ops_per_step=sum(script_host_op(op) for op in ops),
        steps_run=len(watch.boundaries), stopped=stopped,
        between_steps_s=tuple(facts.between_steps_s),
        compiled_modules=facts.compiled_modules)


# torch.optim's classes as tilefit's optimizer names (vocab.OPTIMIZER_NAMES)
_OPTIMIZERS = {"SGD": "sgd", "Adam": "adam", "AdamW": "adamw", "Adafactor": "adafactor"}


def recipe_of(found: Findings, samples: int) -> Recipe:
    """The Recipe that describes what the script was seen to do: what the audit of its step
    reads (a script's optimizer that tilefit does not name is described as AdamW)."""
    opt = found.optimizers[0] if found.optimizers else None
    name = _OPTIMIZERS.get(opt.name, "adamw") if opt is not None else "adamw"
    if name == "adamw" and opt is not None and opt.fused:
        name = "adamw-fused"
    return Recipe(batch_size=samples, precision=found.precision, optimizer=name,
                  grad_checkpointing=found.grad_checkpointing,
                  accumulation_steps=found.accumulation_steps,
                  max_grad_norm=found.max_grad_norm,
                  loss_sync=bool(found.host_reads),
                  zero_grad_to_none=found.zero_grad_to_none is not False)


def _last_step(watch: StepWatch) -> tuple[int, int]:
    b = watch.boundaries
    return (b[-2] if len(b) > 1 else 0), b[-1]


def build_trace(recorder: SimulationRecorder, watch: StepWatch, target: Target,
                found: Findings, notes: list[str], sync_at: list[int]) -> Trace:
    """The Trace of the run up to its last step, that step labelled the steady one (the ops
    after which the code synchronized marked so)."""
    start, end = _last_step(watch)
    waits = {i - 1 for i in sync_at}
    ops = tuple(dataclasses.replace(op, step=1 if i >= start and not script_host_op(op) else 0,
                                    micro=op.micro if op.phase in MICRO_PHASES else 0,
                                    then_synchronized=i in waits)
                for i, op in enumerate(recorder.ops[:end]))
    storages = tuple(
        s if s.free_at is None or s.free_at <= end else dataclasses.replace(s, free_at=None)
        for s in recorder.storages() if s.alloc_at < end)
    samples, tokens = watch.batch_size or (1, None)
    warnings = list(notes)
    if found.compiled_modules:
        warnings.append(COMPILED_MODULE_NOTE)
        if watch.facts.compile_mode == REDUCE_OVERHEAD:
            warnings.append("torch.compile(mode='reduce-overhead'): each graph is replayed as "
                            "a CUDA graph, as "
                            "Recipe(compile=Compile(mode='reduce-overhead')) models it "
                            "(docs/references.md, section 22)")
        if watch.facts.compile_options:
            warnings.append("torch.compile's options " + ", ".join(sorted(
                watch.facts.compile_options)) + " are not simulated: predicted as the default "
                "mode")
    elif found.compiled:
        warnings.append(COMPILED_NOTE)
    if len(watch.boundaries) < 2:
        warnings.append("the code made one optimizer step: the step shown is the first, "
                        "which also creates the optimizer state (run 2 or more steps)")
    return Trace(
        target=target, precision=found.precision,
        optimizer=", ".join(o.name for o in found.optimizers) or "none",
        attention="auto", grad_checkpointing=found.grad_checkpointing,
        accumulation_steps=found.accumulation_steps,
        traced_micro_steps=found.accumulation_steps, ops=ops, storages=storages,
        n_events=end, param_count=watch.param_count,
        trainable_param_count=sum(p.numel() for p in watch.params if p.requires_grad),
        trainable_param_tensors=sum(o.param_tensors for o in found.optimizers),
        samples_per_micro_batch=samples, tokens_per_micro_batch=tokens,
        warnings=tuple(warnings), compiled=any(op.compiled for op in ops),
        compile_mode=watch.facts.compile_mode)


def trace_so_far(recorder: SimulationRecorder, target: Target) -> Trace:
    """The record up to now as a Trace of one unfinished step: what the caching allocator
    has reserved so far is replayed from it (torch.cuda.memory_reserved)."""
    return Trace(target=target, precision="fp32", optimizer="none", attention="auto",
                 grad_checkpointing=False, accumulation_steps=1, traced_micro_steps=1,
                 ops=tuple(recorder.ops), n_events=recorder.events,
                 storages=recorder.storages(),
                 param_count=0, trainable_param_count=0, samples_per_micro_batch=1,
                 tokens_per_micro_batch=None)
