"""Memory findings: optimizer state or activations dominating the peak, and a step that does not
fit (with the candidates that would make it fit). Every candidate is re-traced: memory depends
on what is live when, which only the trace knows."""

from __future__ import annotations

from collections.abc import Callable

from tilefit.advise.findings import Change, Finding, effect
from tilefit.advise.whatif import WhatIf
from tilefit.estimator import Estimate

# a category "dominates" the peak above this share (one half: it is the majority of the memory)
DOMINANT_SHARE = 0.5
# optimizer state is worth shrinking above this share even when it is not the majority: Adam's
# 8 bytes/param are 2x the fp32 weights, so a large share is the usual case for big models
OPTIMIZER_SHARE = 0.3
# below this share of the GPU's memory, memory is not what limits the step: no memory findings
# (each costs a re-trace), unless the step does not fit
MEMORY_PRESSURE = 0.5
# below this share of the peak, activations are not worth recomputing
MIN_ACTIVATION_SHARE = 0.05
# a causal LM's logits are worth not materialising above this share of the peak (one fp32 copy;
# the eager loss holds more than one: tilefit.models.fused_loss)
LOGITS_SHARE = 0.05
GIB = 2**30
LIGER_FIX = ("TrainingArguments(use_liger_kernel=True, liger_kernel_config={"
             "'fused_linear_cross_entropy': True, 'cross_entropy': False, 'rope': False, "
             "'rms_norm': False, 'swiglu': False}) (pip install liger-kernel), or "
             "liger_kernel.transformers.apply_liger_kernel_to_<model>(fused_linear_cross_"
             "entropy=True) before building the model")


def _mem_finding(whatif: WhatIf, rule: str, title: str, dimension: str, current: object,
                 suggested: object, fix: str, reason: str, after: Estimate,
                 change: Change) -> Finding:
    before = whatif.estimate
    saved = before.peak_memory_bytes - after.peak_memory_bytes
    share = saved / max(before.peak_memory_bytes, 1)
    # recommended when it makes the step fit, or saves memory without slowing the step; a
    # memory fix that costs time on a step that already fits is shown as a trade-off (info)
    ok = saved > 0 and after.fits and (
        not before.fits or after.step_time_s <= before.step_time_s * 1.005)
    severity = ("high" if (not before.fits and after.fits) or share >= 0.25 else
                "medium" if share >= 0.10 else "low") if ok else "info"
    if not before.fits:  # say first that the step does not fit, and whether this fix is enough
        title = (f"the step needs {before.total_memory_bytes / GIB:.1f} GiB of "
                 f"{before.device.memory_bytes / GIB:.0f} GiB; "
                 + ("this makes it fit: " if after.fits else "not enough alone: ") + title)
    return Finding(
        rule=rule, severity=severity, title=title, modules=(), dimension=dimension,
        current=current, suggested=suggested, fix=fix,
        reason=reason + f" Predicted peak {before.peak_memory_bytes / GIB:.2f} -> "
        f"{after.peak_memory_bytes / GIB:.2f} GiB ({'fits' if after.fits else 'does not fit'}),"
        f" step {before.step_time_s * 1e3:.1f} -> {after.step_time_s * 1e3:.1f} ms.",
        **effect(before, after), method="retrace", recommended=ok, change=change)


def _optimizer_candidate(whatif: WhatIf) -> Finding | None:
    opt = whatif.recipe.optimizer
    if opt not in ("adam", "adamw"):
        return None
    change = Change(recipe=(("optimizer", "adamw-8bit"),))
    after = whatif.apply(change)
    state = whatif.estimate.memory_breakdown.get("optimizer_state", 0)
    return _mem_finding(
        whatif, "optimizer-memory", f"{opt} state is {state / GIB:.2f} GiB of the peak",
        "optimizer", opt, "adamw-8bit",
        "optim='adamw_bnb_8bit' in TrainingArguments (bitsandbytes.optim.AdamW8bit), or "
        "optim='adafactor'",
        "Adam keeps two fp32 moments per parameter (8 bytes/param); 8-bit AdamW keeps 2 "
        "bytes/param.", after, change)


def _checkpoint_candidate(whatif: WhatIf) -> Finding | None:
    if whatif.recipe.grad_checkpointing:
        return None
    what = "the step with gradient checkpointing"
    if whatif.workload.is_factory:
        whatif.skipped("activation-memory", what, "tilefit checkpoints a Hugging Face model's "
                       "layers; a factory's model is traced as its code runs")
        return None
    change = Change(recipe=(("grad_checkpointing", True),))
    after = whatif.try_apply("activation-memory", what, change)
    if after is None:
        return None
    activations = whatif.estimate.memory_breakdown.get("activations", 0)
    return _mem_finding(
        whatif, "activation-memory", f"activations are {activations / GIB:.2f} GiB of the peak",
        "grad_checkpointing", False, True,
        "TrainingArguments(gradient_checkpointing=True) or model.gradient_checkpointing_"
        "enable()",
        "each layer's saved activations are dropped and recomputed in backward (one extra "
        "forward of each layer).", after, change)


def logits_fp32_bytes(whatif: WhatIf) -> int:
    """One fp32 copy of a causal LM's logits per micro-batch (transformers' loss upcasts
    them): tokens x vocabulary x 4 bytes; 0 for other tasks."""
    work = whatif.workload
    if work is None or work.task != "causal-lm" or not work.seq_len or work.config is None:
        return 0
    return whatif.recipe.batch_size * work.seq_len * int(work.config.get("vocab_size", 0)) * 4


def _fused_ce_candidate(whatif: WhatIf) -> Finding | None:
    if whatif.recipe.fused_ce or whatif.recipe.compile or logits_fp32_bytes(whatif) == 0:
        return None  # under torch.compile the fused loss is not predicted (tilefit.vocab)
    change = Change(recipe=(("fused_ce", True),))
    after = whatif.apply(change)
    logits = logits_fp32_bytes(whatif)
    return _mem_finding(
        whatif, "loss-logits", f"the loss's logits are {logits / GIB:.2f} GiB per fp32 copy, "
        "held whole", "loss", "cross-entropy on full logits", "fused linear cross-entropy",
        LIGER_FIX, "fused linear cross-entropy (Liger Kernel) computes the logits and their "
        "gradient a chunk of tokens at a time inside the forward, so they are never whole; "
        "with fp32 weights under autocast it re-casts the head's weight for each chunk.", after,
        change)


def _smaller_batch_candidate(whatif: WhatIf) -> Finding | None:
    batch = whatif.recipe.batch_size
    if batch < 2:
        return None
    half = batch // 2
    accumulation_steps = whatif.recipe.accumulation_steps * 2
    change = Change(recipe=(("batch_size", half), ("accumulation_steps", accumulation_steps)))
    after = whatif.apply(change)
    return _mem_finding(
        whatif, "does-not-fit",
        f"batch {half} x {accumulation_steps} accumulation steps keeps the global batch",
        "batch size", batch, half,
        f"per_device_train_batch_size={half}, gradient_accumulation_steps={accumulation_steps}",
        "halving the micro-batch halves the activations; accumulation keeps the samples per "
        "optimizer step.", after, change)


def memory_findings(whatif: WhatIf) -> list[Finding]:
    if not whatif.can_retrace:
        return []
    estimate = whatif.estimate
    fits = estimate.fits
    found_loss = []
    if logits_fp32_bytes(whatif) >= LOGITS_SHARE * estimate.peak_memory_bytes:
        found_loss = [f for f in (_fused_ce_candidate(whatif),) if f is not None]
    if fits and estimate.total_memory_bytes < MEMORY_PRESSURE * estimate.device.memory_bytes:
        return found_loss
    peak = max(estimate.peak_memory_bytes, 1)
    opt_share = estimate.memory_breakdown.get("optimizer_state", 0) / peak
    act_share = estimate.memory_breakdown.get("activations", 0) / peak
    candidates: list[Callable[[WhatIf], Finding | None]] = []
    if opt_share >= OPTIMIZER_SHARE or not fits:
        candidates.append(_optimizer_candidate)
    # checkpointing shrinks activations only: no use when the peak holds few of them (a peak
    # in the optimizer step)
    if act_share >= DOMINANT_SHARE or (not fits and act_share >= MIN_ACTIVATION_SHARE):
        candidates.append(_checkpoint_candidate)
    if not fits:
        candidates.append(_smaller_batch_candidate)
    found = (candidate(whatif) for candidate in candidates)
    return found_loss + [f for f in found if f is not None]
