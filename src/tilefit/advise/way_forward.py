"""When the step does not fit: the way forward, as the audit's first finding.

The answer is the planner's (tilefit.planner.plan) for this model, GPU and the user's global
batch, with the user's recipe as what every plan keeps: the same recipe `tilefit plan` chooses,
with everything it changes at once (micro-batch and accumulation, checkpointing, precision,
the optimizer's implementation or the optimizer, CPU offload) and one predicted result,
confirmed by a full trace. The memory rules' single fixes stay below it, each saying whether
it is enough alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tilefit.advise.findings import Finding
from tilefit.advise.whatif import WhatIf
from tilefit.errors import TilefitError

if TYPE_CHECKING:
    from tilefit.estimator import Estimate
    from tilefit.planner.result import Plan
    from tilefit.planner.rows import PlanRow

GIB = 2**30
RULE = "way-forward"
# what each memory category is, in a user's words
CATEGORY_WORDS = {"parameters": "the weights", "gradients": "the gradients",
                  "optimizer_state": "the optimizer state", "activations": "the activations",
                  "temporaries": "temporaries", "inputs": "the batch",
                  "communication": "communication buffers"}


def way_forward(whatif: WhatIf) -> tuple[Finding, Plan] | None:
    """The planner's cheapest recipe that fits (its finding and the plan, configs
    included), when the audited step does not fit a GPU; None when it fits, on a CPU, or
    for a module that cannot be re-traced (said in the notes)."""
    est = whatif.estimate
    if est.fits or est.device.kind != "cuda":
        return None
    if not whatif.can_retrace:
        whatif.skipped(RULE, "the recipe that would make the step fit",
                       "an nn.Module cannot be re-planned; pass its config.json or factory")
        return None
    from tilefit.planner import plan

    try:
        found = plan(whatif.workload, global_batch=whatif.recipe.global_batch,
                     gpu=whatif.device, recipe=whatif.recipe)
    except TilefitError as exc:
        whatif.skipped(RULE, "the recipe that would make the step fit", exc)
        return None
    return _finding(whatif, found), found


def biggest_consumer(est: Estimate) -> str:
    """The largest category of the step's peak, in bytes and share: "the optimizer state
    59.8 GiB (34% of the peak)"."""
    cats = est.memory_breakdown
    name, size = max(cats.items(), key=lambda kv: kv[1])
    share = size / max(sum(cats.values()), 1)
    return f"{CATEGORY_WORDS.get(name, name)} {size / GIB:.1f} GiB ({share:.0%} of the peak)"


def _label(row: PlanRow) -> str:
    return (f"{row.recipe_label()}, micro-batch {row.micro_batch} x {row.accumulation_steps} "
            "accumulation steps")


def _adapters_hint(found: Plan) -> str:
    """What the plan's note says adapters would need (LoRA, else QLoRA, traced for it:
    planner.policy), or the flag that plans them where it said nothing."""
    from tilefit.planner.notes import is_adapters_note

    said = next((n for n in found.notes if is_adapters_note(n)), None)
    return said or ("LoRA adapters train a fraction of the weights: "
                    "PlanSearch(allow_lora=True)")


def _finding(whatif: WhatIf, found: Plan) -> Finding:
    est = whatif.estimate
    need = (f"the step needs {est.total_memory_bytes / GIB:.1f} GiB of "
            f"{est.device.memory_bytes / GIB:.0f} GiB")
    command = (f"`tilefit plan {whatif.workload.name} --gpu {est.device.name} --global-batch "
               f"{whatif.recipe.global_batch}` gives its configs to paste")
    current = f"{whatif.recipe.precision} {whatif.recipe.optimizer}, micro-batch " \
        f"{whatif.recipe.batch_size} x {whatif.recipe.accumulation_steps}"
    best = found.best
    if best is None:
        multi = found.multi_gpu
        gpus = "" if multi is None or multi.gpus is None else \
            f"; {multi.gpus} GPUs fit ({multi.best.recipe_label() if multi.best else ''})"
        return Finding(
            rule=RULE, severity="high", title=f"{need}; no recipe fits one GPU{gpus}",
            modules=(), dimension="recipe", current=current, suggested=None,
            fix=f"{command}; {_adapters_hint(found)}",
            reason=f"Biggest consumer: {biggest_consumer(est)}. {found.reason}.",
            step_time_before_s=est.step_time_s, step_time_after_s=est.step_time_s,
            peak_memory_before_bytes=est.peak_memory_bytes,
            peak_memory_after_bytes=est.peak_memory_bytes, method="plan", recommended=False)
    after = best.memory_bytes + found.overhead_bytes  # as est.total_memory_bytes counts
    slower = est.step_time_s / best.predicted_step_time_s
    return Finding(
        rule=RULE, severity="high",
        title=f"{need}; {_label(best)} fits ({after / GIB:.2f} GiB), "
        f"{slower:.2f}x the step's speed",
        modules=(), dimension="recipe", current=current, suggested=_label(best),
        fix="; ".join((*best.changes, f"micro-batch {best.micro_batch} x "
                       f"{best.accumulation_steps} accumulation steps (the global batch "
                       f"{best.global_batch} is kept)", command)),
        reason=f"Biggest consumer: {biggest_consumer(est)}. Chosen: {found.reason}. "
        f"Predicted {est.total_memory_bytes / GIB:.1f} -> {after / GIB:.1f} GiB, step "
        f"{est.step_time_s * 1e3:.1f} -> {best.predicted_step_time_s * 1e3:.1f} ms "
        "(one full trace of the chosen plan confirms it).",
        step_time_before_s=est.step_time_s, step_time_after_s=best.predicted_step_time_s,
        peak_memory_before_bytes=est.peak_memory_bytes,
        peak_memory_after_bytes=best.predicted_peak_memory_bytes, method="plan",
        recommended=True)
