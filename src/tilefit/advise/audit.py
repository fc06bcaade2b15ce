"""audit(): estimate the step, run every rule, re-estimate each fix, order by predicted gain."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from tilefit.advise.findings import Finding
from tilefit.advise.rules_batch import memory_bound_findings, wave_findings
from tilefit.advise.rules_dims import dimension_findings
from tilefit.advise.rules_memory import memory_findings
from tilefit.advise.rules_precision import attention_findings, precision_findings
from tilefit.advise.whatif import WhatIf
from tilefit.errors import TilefitError
from tilefit.estimator import Estimate, estimate_trace
from tilefit.estimator.workloads import Recipe, default_precision, trace_workload
from tilefit.hardware import Device, get_device
from tilefit.models import Workload, load_workload
from tilefit.tracing.records import Trace

if TYPE_CHECKING:
    import torch.nn as nn

DEFAULT_GPU = "a100-80gb"
DEFAULT_BATCH = 8

RULES: tuple[Callable[[WhatIf], list[Finding]], ...] = (
    dimension_findings, memory_bound_findings, wave_findings, precision_findings,
    attention_findings, memory_findings)


@dataclass(frozen=True)
class Audit:
    model: str
    device: Device
    recipe: Recipe
    seq_len: int | None
    estimate: Estimate
    findings: tuple[Finding, ...]
    retraces: int  # full re-traces the what-ifs needed
    elapsed_s: float
    confirmation: dict[str, float] | None = None  # top finding: cheap what-if vs. re-trace
    notes: tuple[str, ...] = field(default=())

    @property
    def recommended(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.recommended)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "gpu": self.device.name, "seq_len": self.seq_len,
                "recipe": self.recipe.to_dict(),
                "estimate": self.estimate.to_dict(include_ops=False),
                "findings": [f.to_dict() for f in self.findings],
                "retraces": self.retraces, "elapsed_s": self.elapsed_s,
                "confirmation": self.confirmation, "notes": list(self.notes)}


@dataclass(frozen=True)
class _Traced:
    """The audited step before any rule: its trace and recipe, and how to re-trace it."""

    name: str
    seq_len: int | None
    workload: Workload | None  # None for an nn.Module: no re-traces
    recipe: Recipe
    trace: Trace
    retrace_fn: Callable[[Workload, Recipe], Trace] | None
    named_modules: dict[str, nn.Module] | None  # an nn.Module's own layers
    notes: tuple[str, ...]


def order(findings: list[Finding]) -> tuple[Finding, ...]:
    """Recommended first, then by predicted speedup, then by memory saved."""
    return tuple(sorted(findings, key=lambda f: (not f.recommended, -f.predicted_speedup,
                                                 -f.memory_saved_bytes)))


def audit(model: Any, batch: Any = None, *, gpu: str | Device = DEFAULT_GPU,
          batch_size: int = DEFAULT_BATCH, seq_len: int | None = None,
          precision: str | None = None, optimizer: str = "adamw",
          grad_checkpointing: bool = False, accumulation_steps: int = 1,
          attention: str = "auto", input_shape: tuple[int, ...] | None = None,
          task: str | None = None, loss_fn: Any = None, confirm: bool = False) -> Audit:
    """Audit one training step of ``model`` on ``gpu``.

    ``model``: a catalog name, a config.json path, ``package.module:function`` (with
    ``input_shape``), a Workload, or an nn.Module / zero-argument factory with an example
    ``batch`` (then ``loss_fn`` as for tilefit.estimate; fixes that need a new trace, such as
    batch or memory what-ifs, are skipped for it).
    ``confirm``: re-trace the top weight-dimension finding's fix and record how close the
    cheap rewrite was (Audit.confirmation).
    """
    t0 = time.perf_counter()
    device = get_device(gpu)
    recipe = Recipe(batch_size=batch_size, precision=precision or default_precision(device),
                    optimizer=optimizer, grad_checkpointing=grad_checkpointing,
                    accumulation_steps=accumulation_steps, attention=attention)
    if isinstance(model, str | Workload):
        step = _trace_named(model, batch, recipe, device, seq_len=seq_len,
                            input_shape=input_shape, task=task)
    else:
        step = _trace_module(model, batch, recipe, device, loss_fn)
    estimate = estimate_trace(step.trace, device)
    whatif = WhatIf(workload=step.workload, recipe=step.recipe, device=device, trace=step.trace,
                    estimate=estimate, retrace_fn=step.retrace_fn,
                    named_modules=step.named_modules)
    ordered = order([f for rule in RULES for f in rule(whatif)])
    confirmation = _confirm(whatif, ordered) if confirm else None
    return Audit(model=step.name, device=device, recipe=step.recipe, seq_len=step.seq_len,
                 estimate=estimate, findings=ordered, retraces=whatif.retraces,
                 elapsed_s=time.perf_counter() - t0, confirmation=confirmation,
                 notes=step.notes)


def _trace_named(model: str | Workload, batch: Any, recipe: Recipe, device: Device, *,
                 seq_len: int | None, input_shape: tuple[int, ...] | None,
                 task: str | None) -> _Traced:
    """A catalog name, config.json, factory or Workload: traced, and re-traceable."""
    if batch is not None:
        raise TilefitError("a batch is given with a named model",
                           expected="batch_size= for catalog/config models; batch= only "
                           "with an nn.Module", given=type(batch).__name__,
                           fix="drop batch= and pass batch_size=")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = model if isinstance(model, Workload) else load_workload(
        model, seq_len=seq_len, input_shape=input_shape, task=task)

    def retrace_fn(workload: Workload, changed: Recipe) -> Trace:
        return trace_workload(workload, changed, device)

    notes = ("the loss is a stand-in (mean of the model's output)",) if work.is_factory else ()
    return _Traced(name=work.name, seq_len=work.seq_len, workload=work, recipe=recipe,
                   trace=trace_workload(work, recipe, device), retrace_fn=retrace_fn,
                   named_modules=None, notes=notes)


def _trace_module(model: Any, batch: Any, recipe: Recipe, device: Device,
                  loss_fn: Any) -> _Traced:
    """An nn.Module or factory with an example batch: traced once, no re-traces."""
    if batch is None:
        raise TilefitError("an nn.Module (or factory) needs an example batch",
                           expected="audit(model, batch, ...)", given="no batch",
                           fix="pass one batch as your DataLoader yields it")
    from tilefit.tracing import trace

    stand_in = loss_fn is None and not isinstance(batch, dict)
    tr = trace(model, batch, loss_fn=_mean_output_loss if stand_in else loss_fn,
               optimizer=recipe.optimizer, precision=recipe.precision,
               grad_checkpointing=recipe.grad_checkpointing,
               accumulation_steps=recipe.accumulation_steps, attention=recipe.attention,
               device=device)
    notes = ["no loss_fn given: the loss is a stand-in (mean of the output)"] if stand_in else []
    notes.append("model given as an nn.Module: batch, sequence and memory what-ifs need a "
                 "re-trace and were skipped; pass a catalog name, config.json or factory for "
                 "them")
    name = type(model).__name__ if not callable(model) or hasattr(model, "forward") else \
        getattr(model, "__name__", "model")
    return _Traced(name=name, seq_len=None, workload=None,
                   recipe=replace(recipe, batch_size=tr.samples_per_micro_batch,
                                  optimizer=str(recipe.optimizer)),
                   trace=tr, retrace_fn=None,
                   named_modules=(dict(model.named_modules())
                                  if hasattr(model, "named_modules") else None),
                   notes=tuple(notes))


def _mean_output_loss(net: Any, inputs: Any) -> Any:
    from tilefit.models.factory import stand_in_loss

    return stand_in_loss(net(inputs))


def _confirm(whatif: WhatIf, findings: tuple[Finding, ...]) -> dict[str, float] | None:
    """Re-trace the top rewrite finding's fix: how close is the cheap what-if?"""
    top = next((f for f in findings if f.method == "rewrite" and f.recommended), None)
    if top is None or not whatif.can_retrace or whatif.workload.config is None:
        return None
    from tilefit.advise.origins import config_fields

    field_ = next((origin.config_field for origin in config_fields(whatif.workload)
                   if origin.value == top.current and origin.dimension == top.dimension), None)
    if field_ is None:
        return None
    full = whatif.retrace(whatif.workload.with_config(**{field_: top.suggested}))
    return {"rewrite_step_time_s": top.step_time_after_s, "retrace_step_time_s":
            full.step_time_s, "rewrite_speedup": top.predicted_speedup,
            "retrace_speedup": whatif.estimate.step_time_s / full.step_time_s}
