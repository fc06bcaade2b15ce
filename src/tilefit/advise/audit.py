"""audit(): estimate the step, run every rule, re-estimate each fix, order by predicted gain."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tilefit.advise.combined import CombinedFix, combine
from tilefit.advise.findings import Finding, RewriteConfirmation
from tilefit.advise.lever import retrace_steps
from tilefit.advise.rules_activation import activation_findings
from tilefit.advise.rules_allocator import fragmentation_findings
from tilefit.advise.rules_batch import memory_bound_findings, wave_findings
from tilefit.advise.rules_compile import compile_findings, compile_variant
from tilefit.advise.rules_dims import dimension_findings
from tilefit.advise.rules_fp8 import fp8_findings
from tilefit.advise.rules_fp32_regions import fp32_region_findings
from tilefit.advise.rules_host import host_findings
from tilefit.advise.rules_kernels import reference_kernel_findings
from tilefit.advise.rules_memory import memory_findings
from tilefit.advise.rules_moe import bf16_experts_findings, experts_findings
from tilefit.advise.rules_optimizer import fused_optimizer_findings
from tilefit.advise.rules_precision import attention_findings, precision_findings
from tilefit.advise.way_forward import way_forward
from tilefit.advise.whatif import WhatIf
from tilefit.errors import TilefitError
from tilefit.estimator import Estimate, estimate_trace
from tilefit.hardware import Device, get_device
from tilefit.html_repr import HtmlRepr
from tilefit.models.module import module_workload
from tilefit.old_keywords import refuses_old_keywords
from tilefit.recipe import (
    DEFAULT_GPU,
    Recipe,
    batch_recipe,
    is_named_model,
)
from tilefit.tracing.records import Trace
from tilefit.tracing.workload_traces import prefetch, shared_traces
from tilefit.units import fmt_time

if TYPE_CHECKING:
    from tilefit.models import Workload
    from tilefit.planner.result import Plan


# the compiled what-ifs last: the audit starts the compile what-if on a free core while it
# traces the step, and runs the other rules' re-traces meanwhile (findings are ordered by
# gain afterwards, so the order here only decides when each what-if runs)
RULES: tuple[Callable[[WhatIf], list[Finding]], ...] = (
    dimension_findings, memory_bound_findings, wave_findings, precision_findings,
    attention_findings, host_findings, fused_optimizer_findings, memory_findings,
    fragmentation_findings, activation_findings, experts_findings, bf16_experts_findings,
    compile_findings, fp8_findings, reference_kernel_findings, fp32_region_findings)


@dataclass(frozen=True)
class Audit(HtmlRepr):
    model: str
    device: Device
    recipe: Recipe
    seq_len: int | None
    estimate: Estimate
    findings: tuple[Finding, ...]
    retraces: int  # full re-traces the what-ifs needed
    elapsed_s: float
    confirmation: RewriteConfirmation | None = None  # top finding: cheap what-if vs. re-trace
    notes: tuple[str, ...] = field(default=())
    # when the step does not fit: the plan behind the first finding (its configs to paste)
    plan: Plan | None = None
    # when the step fits: the compatible recommended fixes re-estimated together as one step
    combined: CombinedFix | None = None

    def __repr__(self) -> str:
        """One line (print() of a result; its detail is in the fields)."""
        top = f", top={self.findings[0].title!r}" if self.findings else ""
        return (f"Audit(model={self.model!r}, gpu={self.device.name!r}, step_time="
                f"{fmt_time(self.estimate.step_time_s)}, findings={len(self.findings)}{top})")

    @property
    def recommended(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.recommended)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "gpu": self.device.name, "seq_len": self.seq_len,
                "recipe": self.recipe.to_dict(),
                "estimate": self.estimate.to_dict(include_ops=False),
                "findings": [f.to_dict() for f in self.findings],
                "retraces": self.retraces, "elapsed_s": self.elapsed_s,
                "confirmation": None if self.confirmation is None
                else self.confirmation.to_dict(), "notes": list(self.notes),
                "way_forward": None if self.plan is None else self.plan.to_dict(),
                "combined": None if self.combined is None else self.combined.to_dict()}


def order(findings: list[Finding]) -> tuple[Finding, ...]:
    """Recommended first, then by predicted speedup, then by memory saved."""
    return tuple(sorted(findings, key=lambda f: (not f.recommended, -f.predicted_speedup,
                                                 -f.memory_saved_bytes)))


@dataclass(frozen=True)
class _Subject:
    """What is audited: the traced step, its recipe, and how to trace a variant of it."""

    name: str
    seq_len: int | None
    recipe: Recipe
    trace: Trace
    workload: Workload | None  # None for an nn.Module: no what-if that needs a re-trace
    retrace_fn: Callable[[Workload, Recipe], Trace] | None
    modules: dict[str, Any] | None  # the module's layers by name (nn.Module input)
    notes: tuple[str, ...] = ()


@refuses_old_keywords
def audit(model: Any, batch: Any = None, *, recipe: Recipe | None = None,
          gpu: str | Device = DEFAULT_GPU, loss_fn: Any = None, seq_len: int | None = None,
          confirm: bool = False) -> Audit:
    """Audit one training step of ``model`` under ``recipe`` on ``gpu``.

    ``model``: a catalog name, a config.json path, ``package.module:function``, a Workload
    (``batch``: the micro-batch size, default ``recipe.batch_size``), or an nn.Module /
    zero-argument factory with an example ``batch`` (a Hugging Face module with its own
    loss is audited as its config, so every what-if can re-trace it; a plain module is
    traced as given, with ``loss_fn``, and the what-ifs that need a re-trace are skipped,
    with a note). ``recipe``: default ``Recipe.for_model(model)``, the loop the model's
    framework runs (the CLI's own default). ``confirm``: re-trace the top weight-dimension
    finding's fix and record how close the cheap rewrite was (Audit.confirmation). 0.1.0's
    keywords (batch_size=, precision=, peft=, ...) are refused with their new spelling
    (tilefit.old_keywords)."""
    t0 = time.perf_counter()
    device = get_device(gpu)
    recipe = recipe or Recipe.for_model(model)
    if not is_named_model(model):
        found = None if loss_fn is not None else module_workload(model, batch)
        if found is not None:  # a Hugging Face module: audited as its config
            model, batch = found
    with shared_traces():  # the what-ifs and the way forward's plan share their traces
        if is_named_model(model):
            subject = _workload_subject(model, batch_recipe(recipe, batch).on(device), device,
                                        seq_len=seq_len)
        else:
            subject = _module_subject(model, batch, recipe.on(device), device,
                                      loss_fn=loss_fn)
        return _run_rules(subject, device, confirm=confirm, started_s=t0)


def _workload_subject(model: str | Workload, recipe: Recipe, device: Device, *,
                      seq_len: int | None) -> _Subject:
    """A catalog model, config.json or factory: every what-if can re-trace it."""
    from tilefit.models import Workload, load_workload
    from tilefit.tracing.workload_traces import trace_workload

    work = model if isinstance(model, Workload) else load_workload(model, seq_len=seq_len)
    notes = recipe.notes + (("the loss is a stand-in (mean of the model's output)",)
                            if work.is_factory else ())
    early = compile_variant(recipe, device)  # the longest what-if, on a free core meanwhile
    if early is not None:
        prefetch(retrace_steps(work, early), device)
    return _Subject(name=work.name, seq_len=work.seq_len, recipe=recipe,
                    trace=trace_workload(work, recipe, device), workload=work,
                    retrace_fn=lambda wk, rc: trace_workload(wk, rc, device), modules=None,
                    notes=notes)


def _module_subject(model: Any, batch: Any, recipe: Recipe, device: Device, *,
                    loss_fn: Any) -> _Subject:
    """An nn.Module (or factory) with an example batch: traced as given, never re-traced."""
    if recipe.peft:
        raise TilefitError("peft wraps a named model's linear layers; an nn.Module is traced "
                           "as given", expected="a catalog name or config.json",
                           given=type(model).__name__,
                           fix="drop peft, or pass your model after peft.get_peft_model")
    if recipe.fused_ce:
        raise TilefitError("fused_ce replaces a Hugging Face causal LM's loss; an nn.Module "
                           "is traced with its own loss_fn", expected="a catalog name or "
                           "config.json", given=type(model).__name__,
                           fix="drop fused_ce, or call your fused loss in loss_fn")
    if batch is None:
        raise TilefitError("an nn.Module (or factory) needs an example batch",
                           expected="audit(model, batch, ...)", given="no batch",
                           fix="pass one batch as your DataLoader yields it")
    from tilefit.tracing.step import trace_module

    notes = list(recipe.notes)
    if loss_fn is None and not isinstance(batch, dict):
        from tilefit.models.factory import stand_in_loss

        def loss_fn(m: Any, b: Any) -> Any:
            return stand_in_loss(m(b))
        notes.append("no loss_fn given: the loss is a stand-in (mean of the output)")
    tr = trace_module(model, batch, recipe, device, loss_fn=loss_fn)
    notes.append("model given as an nn.Module: batch, sequence and memory what-ifs need a "
                 "re-trace and were skipped; pass a catalog name, config.json or factory for "
                 "them")
    name = type(model).__name__ if not callable(model) or hasattr(model, "forward") else \
        getattr(model, "__name__", "model")
    return _Subject(name=name, seq_len=None,
                    recipe=recipe.with_batch(tr.samples_per_micro_batch), trace=tr,
                    workload=None, retrace_fn=None,
                    modules=dict(model.named_modules()) if hasattr(model, "named_modules")
                    else None, notes=tuple(notes))


def audit_trace(trace: Trace, recipe: Recipe, device: Device, *, name: str,
                notes: tuple[str, ...] = ()) -> Audit:
    """The audit of a step traced elsewhere (a user's script run under the simulated GPU:
    tilefit.simulation), ``recipe`` what that step was seen to do: every rule that needs no
    re-trace; the what-ifs that do are skipped, with a note, as for an nn.Module."""
    subject = _Subject(name=name, seq_len=None, recipe=recipe, trace=trace, workload=None,
                       retrace_fn=None, modules=None, notes=(
                           *notes, "a script's step cannot be re-traced: the batch, sequence "
                           "and memory what-ifs were skipped (tilefit audit MODEL runs them "
                           "for a model tilefit can build)"))
    return _run_rules(subject, device, confirm=False, started_s=time.perf_counter())


def _run_rules(subject: _Subject, device: Device, *, confirm: bool,
               started_s: float) -> Audit:
    est = estimate_trace(subject.trace, device)
    whatif = WhatIf(workload=subject.workload, recipe=subject.recipe, device=device,
                    trace=subject.trace, estimate=est, retrace_fn=subject.retrace_fn,
                    named_modules=subject.modules)
    forward = way_forward(whatif)
    ordered = order([f for rule in RULES for f in rule(whatif)])
    confirmation = _confirm(whatif, ordered) if confirm else None
    combined = combine(whatif, ordered)
    if forward is not None:  # a step that does not fit: the way forward comes first
        ordered = (forward[0], *ordered)
    return Audit(model=subject.name, device=device, recipe=subject.recipe,
                 seq_len=subject.seq_len, estimate=est, findings=ordered,
                 retraces=whatif.retraces, elapsed_s=time.perf_counter() - started_s,
                 confirmation=confirmation, notes=(*subject.notes, *whatif.notes),
                 plan=None if forward is None else forward[1], combined=combined)


def _confirm(whatif: WhatIf, findings: tuple[Finding, ...]) -> RewriteConfirmation | None:
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
    return RewriteConfirmation(
        rewrite_step_time_s=top.step_time_after_s, retrace_step_time_s=full.step_time_s,
        rewrite_speedup=top.predicted_speedup,
        retrace_speedup=whatif.estimate.step_time_s / full.step_time_s)
