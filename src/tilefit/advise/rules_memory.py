"""Memory findings: optimizer state or activations dominating the peak, and a step that does not
fit (with the candidates that would make it fit). Every candidate is re-traced: memory depends
on what is live when, which only the trace knows."""

from __future__ import annotations

from tilefit.advise.findings import Finding
from tilefit.advise.whatif import WhatIf
from tilefit.errors import TilefitError

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
GIB = 2**30


def _mem_finding(w: WhatIf, rule: str, title: str, dimension: str, current: object,
                 suggested: object, fix: str, reason: str, after) -> Finding:  # type: ignore[no-untyped-def]
    e = w.estimate
    saved = e.peak_memory_bytes - after.peak_memory_bytes
    share = saved / max(e.peak_memory_bytes, 1)
    # recommended when it makes the step fit, or saves memory without slowing the step; a
    # memory fix that costs time on a step that already fits is shown as a trade-off (info)
    ok = saved > 0 and after.fits and (not e.fits or after.step_time_s <= e.step_time_s * 1.005)
    severity = ("high" if (not e.fits and after.fits) or share >= 0.25 else
                "medium" if share >= 0.10 else "low") if ok else "info"
    if not e.fits:  # say first that the step does not fit, and whether this fix is enough
        title = (f"the step needs {e.total_memory_bytes / GIB:.1f} GiB of "
                 f"{e.device.memory_bytes / GIB:.0f} GiB; "
                 + ("this makes it fit: " if after.fits else "not enough alone: ") + title)
    return Finding(
        rule=rule, severity=severity, title=title, modules=(), dimension=dimension,
        current=current, suggested=suggested, fix=fix,
        reason=reason + f" Predicted peak {e.peak_memory_bytes / GIB:.2f} -> "
        f"{after.peak_memory_bytes / GIB:.2f} GiB ({'fits' if after.fits else 'does not fit'}),"
        f" step {e.step_time_s * 1e3:.1f} -> {after.step_time_s * 1e3:.1f} ms.",
        step_time_before_s=e.step_time_s, step_time_after_s=after.step_time_s,
        peak_memory_before_bytes=e.peak_memory_bytes,
        peak_memory_after_bytes=after.peak_memory_bytes, method="retrace", recommended=ok)


def _optimizer_candidate(w: WhatIf) -> Finding | None:
    opt = w.recipe.optimizer
    if opt not in ("adam", "adamw"):
        return None
    after = w.retrace(optimizer="adamw-8bit")
    state = w.estimate.memory_breakdown.get("optimizer_state", 0)
    return _mem_finding(
        w, "optimizer-memory", f"{opt} state is {state / GIB:.2f} GiB of the peak",
        "optimizer", opt, "adamw-8bit",
        "optim='adamw_bnb_8bit' in TrainingArguments (bitsandbytes.optim.AdamW8bit), or "
        "optim='adafactor'",
        "Adam keeps two fp32 moments per parameter (8 bytes/param); 8-bit AdamW keeps 2 "
        "bytes/param.", after)


def _checkpoint_candidate(w: WhatIf) -> Finding | None:
    if w.recipe.grad_checkpointing or w.workload.is_factory:
        return None
    try:
        after = w.retrace(grad_checkpointing=True)
    except TilefitError:
        return None
    act = w.estimate.memory_breakdown.get("activations", 0)
    return _mem_finding(
        w, "activation-memory", f"activations are {act / GIB:.2f} GiB of the peak",
        "grad_checkpointing", False, True,
        "TrainingArguments(gradient_checkpointing=True) or model.gradient_checkpointing_"
        "enable()",
        "each layer's saved activations are dropped and recomputed in backward (one extra "
        "forward of each layer).", after)


def _smaller_batch_candidate(w: WhatIf) -> Finding | None:
    b = w.recipe.batch_size
    if b < 2:
        return None
    nb = b // 2
    acc = w.recipe.accumulation_steps * 2
    after = w.retrace(batch_size=nb, accumulation_steps=acc)
    return _mem_finding(
        w, "does-not-fit", f"batch {nb} x {acc} accumulation steps keeps the global batch",
        "batch size", b, nb,
        f"per_device_train_batch_size={nb}, gradient_accumulation_steps={acc}",
        "halving the micro-batch halves the activations; accumulation keeps the samples per "
        "optimizer step.", after)


def memory_findings(w: WhatIf) -> list[Finding]:
    if not w.can_retrace:
        return []
    e = w.estimate
    if e.fits and e.total_memory_bytes < MEMORY_PRESSURE * e.device.memory_bytes:
        return []
    peak = max(e.peak_memory_bytes, 1)
    out: list[Finding] = []
    opt_share = e.memory_breakdown.get("optimizer_state", 0) / peak
    act_share = e.memory_breakdown.get("activations", 0) / peak
    if opt_share >= OPTIMIZER_SHARE or not e.fits:
        f = _optimizer_candidate(w)
        if f:
            out.append(f)
    # checkpointing shrinks activations only: no use when the peak holds few of them (a peak
    # in the optimizer step)
    if act_share >= DOMINANT_SHARE or (not e.fits and act_share >= MIN_ACTIVATION_SHARE):
        f = _checkpoint_candidate(w)
        if f:
            out.append(f)
    if not e.fits:
        f = _smaller_batch_candidate(w)
        if f:
            out.append(f)
    return out
