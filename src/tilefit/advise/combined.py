"""The audit's combined prediction: when the step fits, its recommended speed fixes applied
together and re-estimated as one step (``WhatIf.apply`` of their merged ``Change``), never
their speedups multiplied. Fixes that set one field two ways (two batch sizes, two
precisions, two compile modes) or that the Recipe refuses together (the fused loss under
torch.compile) conflict: the one with the larger predicted gain is kept, the findings coming
ordered by gain. A fix that torch.compile makes moot (its rule does not fire on a compiled
step) is subsumed when compile is among the fixes: applied with it, it changes nothing the
model costs, and would cost one more compiled re-trace."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from tilefit.advise import rules_activation
from tilefit.advise.findings import MIN_RECOMMENDED_SPEEDUP, Change, Finding
from tilefit.advise.whatif import WhatIf
from tilefit.errors import TilefitError

RULE = "combined"
# rules whose fix Inductor does itself: the tanh-GELU chain is fused either way (full GPT-2
# on an A100, compiled: gelu_new and gelu_pytorch_tanh both 51.88 ms and 5.46 GiB; the
# test re-checks it on a small GPT-2)
MOOT_UNDER_COMPILE = frozenset({rules_activation.RULE})


@dataclass(frozen=True)
class CombinedFix:
    """The compatible recommended fixes applied at once (``Audit.combined``)."""

    fixes: tuple[str, ...]  # each applied fix, "dimension current -> suggested" (label)
    left_out: tuple[str, ...]  # recommended fixes that conflict with a larger one
    change: Change  # what was applied, merged
    step_time_before_s: float
    step_time_after_s: float
    samples_before: int  # samples per optimizer step (a batch fix changes them)
    samples_after: int
    peak_memory_before_bytes: int
    peak_memory_after_bytes: int
    fits: bool  # whether the combined step fits the GPU
    subsumed: tuple[str, ...] = ()  # recommended fixes torch.compile, among them, does itself

    @property
    def per_sample(self) -> bool:
        return self.samples_before != self.samples_after

    @property
    def predicted_speedup(self) -> float:
        """Step time before over after, per sample where the fixes change the batch."""
        before = self.step_time_before_s / self.samples_before
        after = self.step_time_after_s / self.samples_after
        return before / after if after > 0 else 1.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(fixes=list(self.fixes), left_out=list(self.left_out),
                 subsumed=list(self.subsumed),
                 change=self.change.to_dict(), per_sample=self.per_sample,
                 predicted_speedup=self.predicted_speedup)
        return d


def label(f: Finding) -> str:
    """A finding's fix in a few words, as its "change:" line says it: "vocab_size 50257 ->
    50304" ("compile eager -> torch.compile")."""
    return f"{f.dimension} {f.current} -> {f.suggested}"


def _recipe_accepts(whatif: WhatIf, change: Change, f: Finding) -> bool:
    """Whether the Recipe takes the merged fixes together (noted where it refuses)."""
    try:
        replace(whatif.recipe, **dict(change.recipe))
    except TilefitError as err:
        whatif.skipped(RULE, f"{label(f)} with the larger fixes", err)
        return False
    return True


def combine(whatif: WhatIf, findings: tuple[Finding, ...]) -> CombinedFix | None:
    """The recommended speed fixes of ``findings`` (ordered by gain) that go together,
    re-estimated as one step; None where the step does not fit (the way forward is the
    plan), fewer than two fixes combine, or the combined step cannot be traced (noted)."""
    est = whatif.estimate
    if not est.fits:
        return None
    chosen, left_out, merged = _merge(whatif, findings)
    moot = [f for f in chosen if f.rule in MOOT_UNDER_COMPILE]
    if moot and dict(merged.recipe).get("compile") is not None:
        chosen, left_out, merged = _merge(
            whatif, tuple(f for f in findings if all(f is not m for m in moot)))
    subsumed = tuple(label(f) for f in moot if dict(merged.recipe).get("compile") is not None)
    if len(chosen) < 2:
        return None
    after = whatif.try_apply(RULE, f"the {len(chosen)} fixes together", merged)
    if after is None:
        return None
    result = CombinedFix(
        fixes=tuple(label(f) for f in chosen), left_out=tuple(left_out), change=merged,
        step_time_before_s=est.step_time_s, step_time_after_s=after.step_time_s,
        samples_before=est.samples_per_step, samples_after=after.samples_per_step,
        peak_memory_before_bytes=est.peak_memory_bytes,
        peak_memory_after_bytes=after.peak_memory_bytes, fits=after.fits, subsumed=subsumed)
    best = max(chosen, key=lambda f: f.predicted_speedup)
    if result.predicted_speedup < best.predicted_speedup:
        whatif.notes.append(
            f"{RULE}: the fixes interact: together {result.predicted_speedup:.2f}x, "
            f"{best.rule} alone {best.predicted_speedup:.2f}x")
    return result


def _merge(whatif: WhatIf, findings: tuple[Finding, ...]
           ) -> tuple[list[Finding], list[str], Change]:
    """The recommended fixes that go together (in order of gain), the labels of those left
    out as conflicting with a larger one, and their merged Change."""
    chosen: list[Finding] = []
    left_out: list[str] = []
    merged = Change()
    for f in findings:
        if (not f.recommended or f.change is None
                or f.predicted_speedup < MIN_RECOMMENDED_SPEEDUP):
            continue
        both = merged.merged(f.change)
        if both is None or not _recipe_accepts(whatif, both, f):
            left_out.append(label(f))
            continue
        merged = both
        chosen.append(f)
    return chosen, left_out, merged
