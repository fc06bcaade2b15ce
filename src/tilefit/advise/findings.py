"""The Finding: one thing that slows the step or does not fit, with its fix and predicted gain."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tilefit.estimator.result import Estimate

SEVERITIES = ("high", "medium", "low", "info")
# A fix must gain at least this much to be recommended: below it the prediction is within the
# cost model's own error (docs/references.md, section 10), so calling it a speedup would be
# noise.
MIN_RECOMMENDED_SPEEDUP = 1.005


@dataclass(frozen=True)
class Finding:
    rule: str  # e.g. "weight-dim-alignment", "token-dim-alignment", "optimizer-memory"
    severity: str  # high | medium | low | info
    title: str  # one line
    modules: tuple[str, ...]  # module paths involved
    dimension: str | None  # in the user's terms: "vocab_size", "batch x seq", "in_features"
    current: Any  # the value now (int, str, bool)
    suggested: Any  # the value after the fix
    fix: str  # what to write, in the user's own terms
    reason: str  # which GEMMs/ops in which phase, bound, tile or wave loss
    step_time_before_s: float
    step_time_after_s: float  # re-estimated with the fix applied
    peak_memory_before_bytes: int = 0
    peak_memory_after_bytes: int = 0
    # how the after-figures were obtained: rewrite | retrace | precision | replay (the same
    # trace through the caching allocator under other settings) | plan (the planner's
    # recipe, confirmed by a full trace: the way forward of a step that does not fit)
    method: str = "rewrite"
    per_sample: bool = False  # speedup compares time per sample (batch what-ifs)
    recommended: bool = True
    samples_before: int = 1
    samples_after: int = 1

    @property
    def predicted_speedup(self) -> float:
        """Step time before over after (per sample when the fix changes the batch)."""
        before = self.step_time_before_s / (self.samples_before if self.per_sample else 1)
        after = self.step_time_after_s / (self.samples_after if self.per_sample else 1)
        return before / after if after > 0 else 1.0

    @property
    def memory_saved_bytes(self) -> int:
        return self.peak_memory_before_bytes - self.peak_memory_after_bytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["modules"] = list(self.modules)
        d["predicted_speedup"] = self.predicted_speedup
        d["memory_saved_bytes"] = self.memory_saved_bytes
        return d


def severity_of(speedup: float, memory_share_saved: float = 0.0) -> str:
    """high: >= 5% faster or >= 25% of the peak memory saved; medium: >= 1% / 10%; else low."""
    if speedup >= 1.05 or memory_share_saved >= 0.25:
        return "high"
    if speedup >= 1.01 or memory_share_saved >= 0.10:
        return "medium"
    return "low"


def effect(before: Estimate, after: Estimate) -> dict[str, Any]:
    """A Finding's predicted effect, from the estimate before the fix and the re-estimate
    after it: its step time and peak memory on both sides (Finding's keyword arguments)."""
    return {"step_time_before_s": before.step_time_s, "step_time_after_s": after.step_time_s,
            "peak_memory_before_bytes": before.peak_memory_bytes,
            "peak_memory_after_bytes": after.peak_memory_bytes}


@dataclass(frozen=True)
class RewriteConfirmation:
    """The top rewrite finding's fix re-traced in full (``Audit.confirmation``): the cheap
    what-if's step time and speedup against the re-trace's."""

    rewrite_step_time_s: float
    retrace_step_time_s: float
    rewrite_speedup: float
    retrace_speedup: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)
