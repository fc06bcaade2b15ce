"""torch.compile: Inductor fuses the elementwise, normalization and softmax ops between the
GEMM and attention kernels into a few kernels that read and write each tensor once, and
AOTAutograd's partitioner saves fewer activations for backward
(docs/references.md, section 19). The gain is a re-trace with compile=True
(tilefit.tracing.compiled)."""

from __future__ import annotations

from tilefit.advise.findings import (
    MIN_RECOMMENDED_SPEEDUP,
    Change,
    Finding,
    effect,
    pace,
    severity_of,
)
from tilefit.advise.rules_moe import expert_loop_reason
from tilefit.advise.whatif import WhatIf
from tilefit.estimator import Estimate
from tilefit.hardware import Device
from tilefit.recipe import Compile, Recipe, variant
from tilefit.vocab import EXTERN_KINDS

GIB = 2**30
COMPILE_FIX = ("model = torch.compile(model) (plain PyTorch and Lightning, before "
               "trainer.fit); TrainingArguments(torch_compile=True) for the HF Trainer")
# with gradient checkpointing, transformers logs a use_cache warning inside the step, which
# breaks Dynamo's graph (docs/references.md, section 19, item 7)
CHECKPOINT_FIX = ("; with gradient checkpointing also model.config.use_cache = False "
                  "(transformers' use_cache warning would break the graph)")


def fusible_share(est: Estimate) -> float:
    """The share of the GPU's time in ops Inductor would fuse: everything but the extern
    kernels (GEMMs, convolutions, fused attention) and the optimizer step (not compiled)."""
    total = sum(c.time_s * c.repeats for c in est.ops)
    fusible = sum(c.time_s * c.repeats for c in est.ops
                  if c.record.kind not in EXTERN_KINDS and c.record.kind != "view"
                  and c.record.phase in ("forward", "backward", "loss_check"))
    return fusible / total if total > 0 else 0.0


def compile_variant(recipe: Recipe, device: Device) -> Recipe | None:
    """The recipe compile_findings re-traces (None where the rule does not run, or the
    Recipe refuses compile with the rest: the rule notes why): the audit starts it on a free
    core before tracing the step itself, being its longest re-trace."""
    if device.kind != "cuda" or recipe.compile:
        return None
    return variant(recipe, compile=Compile())


def compile_findings(whatif: WhatIf) -> list[Finding]:
    recipe = whatif.recipe
    if whatif.device.kind != "cuda" or recipe.compile or not whatif.can_retrace:
        return []
    est = whatif.estimate
    # a torch without Inductor, a step it cannot capture: a note, no finding
    change = Change(recipe=(("compile", Compile()),))
    after = whatif.try_apply("compile", "the step under torch.compile", change)
    if after is None:
        return []
    speedup = est.step_time_s / after.step_time_s
    # as every other fix: not recommended alone where the compiled step still does not fit
    # (the way forward and the combined fix say what does)
    ok = speedup >= MIN_RECOMMENDED_SPEEDUP and after.fits
    saved = est.peak_memory_bytes - after.peak_memory_bytes
    memory = (f"and use {saved / GIB:.2f} GiB less at the peak" if saved > 0 else
              f"and use {-saved / GIB:.2f} GiB more at the peak")
    return [Finding(
        rule="compile", severity=severity_of(speedup) if ok else "info",
        title=f"elementwise, normalization and softmax kernels are {fusible_share(est):.0%} "
        f"of the GPU's time: torch.compile is predicted to make the step {pace(speedup)} "
        f"{memory}",
        modules=(), dimension="compile", current="eager", suggested="torch.compile",
        fix=COMPILE_FIX + (CHECKPOINT_FIX if recipe.grad_checkpointing else ""),
        reason="Inductor fuses the ops between the GEMM and attention kernels, so each "
        "tensor is read and written once, and launches one kernel per fused group; its "
        "partitioner saves fewer activations for backward. Predicted for one graph (no "
        f"graph breaks), compile time excluded: step {est.step_time_s * 1e3:.1f} -> "
        f"{after.step_time_s * 1e3:.1f} ms, peak {est.peak_memory_bytes / GIB:.2f} -> "
        f"{after.peak_memory_bytes / GIB:.2f} GiB.{expert_loop_reason(whatif)}",
        **effect(est, after), method="retrace", recommended=ok, change=change)]
