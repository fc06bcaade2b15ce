"""The optimizer step's implementation: torch.optim's foreach AdamW makes eight passes over
the parameters and state (80 bytes per fp32 parameter), the fused kernel one (28 bytes);
docs/references.md, section 16. The gain is re-traced with AdamW(fused=True)."""

from __future__ import annotations

from tilefit.advise.findings import (
    MIN_RECOMMENDED_SPEEDUP,
    Change,
    Finding,
    effect,
    severity_of,
)
from tilefit.advise.whatif import WhatIf

GIB = 1024**3

FUSED_FIX = {
    "adamw": "torch.optim.AdamW(model.parameters(), lr=lr, fused=True); "
             "TrainingArguments(optim='adamw_torch_fused')",
    "adam": "torch.optim.Adam(model.parameters(), lr=lr, fused=True)",
}


def fused_optimizer_findings(whatif: WhatIf) -> list[Finding]:
    """Adam or AdamW as torch defaults it on a GPU (foreach): the fused kernel instead."""
    opt = whatif.recipe.optimizer
    if whatif.device.kind != "cuda" or opt not in FUSED_FIX or not whatif.can_retrace:
        return []
    est = whatif.estimate
    change = Change(recipe=(("optimizer", "adamw-fused"),))
    after = whatif.apply(change)  # Adam's fused kernel moves the same bytes
    speedup = est.step_time_s / after.step_time_s
    ok = speedup >= MIN_RECOMMENDED_SPEEDUP
    before_s = est.time_by_phase_s.get("optimizer", 0.0)
    after_s = after.time_by_phase_s.get("optimizer", 0.0)
    return [Finding(
        rule="fused-optimizer", severity=severity_of(speedup) if ok else "info",
        title=f"the {opt} step makes eight passes over the parameters and its state "
        f"({before_s * 1e3:.2f} ms of GPU time); the fused kernel makes one",
        modules=(), dimension="optimizer", current=opt, suggested=f"{opt} (fused=True)",
        fix=FUSED_FIX[opt],
        reason=f"fused=True does the whole update in one multi-tensor kernel, with the same "
        f"math: the optimizer step {before_s * 1e3:.2f} -> {after_s * 1e3:.2f} ms, peak "
        f"{est.peak_memory_bytes / GIB:.2f} -> {after.peak_memory_bytes / GIB:.2f} GiB",
        **effect(est, after), method="retrace", recommended=ok, change=change)]

