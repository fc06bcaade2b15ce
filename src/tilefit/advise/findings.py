"""The Finding: one thing that slows the step or does not fit, with its fix and predicted gain."""

from __future__ import annotations

from dataclasses import asdict, dataclass, is_dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tilefit.estimator.result import Estimate

SEVERITIES = ("high", "medium", "low", "info")
# A fix must gain at least this much to be recommended: below it the prediction is within the
# cost model's own error (docs/references.md, section 10), so calling it a speedup would be
# noise.
MIN_RECOMMENDED_SPEEDUP = 1.005


Pairs = tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class Change:
    """A fix as the what-ifs apply it (``WhatIf.apply``): fields of the Recipe and of the
    model's config, the sequence length, and weight dimensions rewritten in the trace (a
    factory's layers, which no config field holds). Recipe values are written as the Recipe
    holds them (``Compile()``, not True), so two fixes that agree compare equal."""

    recipe: Pairs = ()
    config: Pairs = ()
    seq_len: int | None = None
    rewrite: tuple[tuple[int, int], ...] = ()  # (old, new) dimension values

    @property
    def retraces(self) -> bool:
        """Whether applying it needs a re-trace (anything but a dimension rewrite)."""
        return bool(self.recipe or self.config or self.seq_len is not None)

    def merged(self, other: Change) -> Change | None:
        """Both fixes at once; None where a field would take two values (two batch sizes,
        two precisions, two compile modes): those fixes conflict."""
        recipe, config = _union(self.recipe, other.recipe), _union(self.config, other.config)
        rewrite = _union(self.rewrite, other.rewrite)
        seq = {s for s in (self.seq_len, other.seq_len) if s is not None}
        if recipe is None or config is None or rewrite is None or len(seq) > 1:
            return None
        return Change(recipe=recipe, config=config, seq_len=next(iter(seq), None),
                      rewrite=rewrite)

    def to_dict(self) -> dict[str, Any]:
        return {"recipe": {k: asdict(v) if is_dataclass(v) and not isinstance(v, type)
                           else v for k, v in self.recipe},
                "config": dict(self.config), "seq_len": self.seq_len,
                "rewrite": [list(pair) for pair in self.rewrite]}


def _union(a: tuple[tuple[Any, Any], ...],
           b: tuple[tuple[Any, Any], ...]) -> tuple[tuple[Any, Any], ...] | None:
    """The pairs of both, keyed by their first item; None where a key has two values."""
    out = dict(a)
    for key, value in b:
        if key in out and out[key] != value:
            return None
        out[key] = value
    return tuple(out.items())


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
    # the fix as the what-if applies it, for the audit's combined prediction; None where
    # it is no change of the step (information, a memory setting, a plan)
    change: Change | None = None

    @property
    def predicted_speedup(self) -> float:
        """Step time before over after (per sample when the fix changes the batch)."""
        before = self.step_time_before_s / (self.samples_before if self.per_sample else 1)
        after = self.step_time_after_s / (self.samples_after if self.per_sample else 1)
        return before / after if after > 0 else 1.0

    @property
    def memory_saved_bytes(self) -> int:
        return self.peak_memory_before_bytes - self.peak_memory_after_bytes

    @property
    def changes_a_dimension(self) -> bool:
        """Whether the fix changes a dimension the user names, to a value (the reports'
        "change: dimension current -> suggested" line); a recipe has no such line."""
        return bool(self.dimension) and self.suggested is not None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["modules"] = list(self.modules)
        d["change"] = None if self.change is None else self.change.to_dict()
        d["predicted_speedup"] = self.predicted_speedup
        d["memory_saved_bytes"] = self.memory_saved_bytes
        return d


def pace(speedup: float) -> str:
    """A predicted speed-up in words: "1.29x faster", or "1.45x slower" below 1."""
    return f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower"


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
