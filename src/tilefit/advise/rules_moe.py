"""The experts implementation a mixture-of-experts model runs, chosen by re-tracing the step.

transformers 5 runs a MoE layer's experts one of three ways, set by the config's
``experts_implementation`` (``from_pretrained(..., experts_implementation=...)``;
transformers/integrations/moe.py, docs/references.md, section 34): ``grouped_mm`` (its
default: one ``torch._grouped_mm`` per projection, a bf16 kernel on CUDA that falls back to
one matmul per expert in fp32 or fp16), ``batched_mm`` (each routed token's expert weights
gathered, one batched GEMM: memory grows with tokens x top_k) and ``eager`` (a loop over the
experts that received tokens, a GEMM pair each, autocast to the 16-bit dtype). Which is
fastest depends on the dtype, the GPU and the tokens per expert, so the audit re-traces the
step with each of the others and proposes the fastest that fits; the math is the same. Under
torch.compile (where grouped_mm with weights that are not bf16 is transformers' per-expert
loop: docs/references.md, section 40) eager is not tried: its data-dependent loop breaks the
graph, which tilefit does not predict.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tilefit.advise.findings import (
    MIN_RECOMMENDED_SPEEDUP,
    Change,
    Finding,
    effect,
    pace,
    severity_of,
)
from tilefit.advise.rules_dims import module_map

if TYPE_CHECKING:
    from tilefit.advise.whatif import WhatIf
    from tilefit.estimator import Estimate

RULE = "experts-implementation"
FIELD = "experts_implementation"
IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "eager")  # transformers' names
GIB = 2**30


def current_implementation(whatif: WhatIf) -> str | None:
    """What the audited model's experts run (compat.moe), None for a model without experts."""
    from tilefit.compat.moe import experts_implementation, experts_modules

    root = module_map(whatif).get("")
    found = experts_modules(root) if root is not None else []
    return experts_implementation(found[0]) if found else None


def experts_findings(whatif: WhatIf) -> list[Finding]:
    work = whatif.workload
    if work is None or work.config is None or not whatif.can_retrace:
        return []
    current = current_implementation(whatif)
    if current is None:
        return []
    tried: list[tuple[str, Estimate, Change]] = []
    for impl in IMPLEMENTATIONS:
        if impl == current:
            continue
        what = f"the step with {FIELD}={impl!r}"
        if impl == "eager" and whatif.recipe.compile:
            whatif.skipped(RULE, what, "under torch.compile the eager loop's questions to the "
                           "data (which experts are hit: nonzero) break the graph, and graph "
                           "breaks are not predicted")
            continue
        change = Change(config=((FIELD, impl),))
        after = whatif.try_apply(RULE, what, change)
        if after is not None:
            tried.append((impl, after, change))
    fitting = [t for t in tried if t[1].fits] or tried  # none fits: said, not recommended
    if not fitting:
        return []
    impl, after, change = min(fitting, key=lambda t: t[1].step_time_s)
    if after.step_time_s >= whatif.estimate.step_time_s:
        return []
    return [_finding(whatif, current, impl, after, change)]


def _finding(whatif: WhatIf, current: str, impl: str, after: Estimate,
             change: Change) -> Finding:
    est = whatif.estimate
    speedup = est.step_time_s / after.step_time_s
    ok = speedup >= MIN_RECOMMENDED_SPEEDUP and after.fits
    return Finding(
        rule=RULE, severity=severity_of(speedup) if ok else "info",
        title=f"the experts run as {current}; {impl} is {speedup:.2f}x faster here",
        modules=(), dimension=FIELD, current=current, suggested=impl,
        fix=f'AutoModelForCausalLM.from_pretrained(..., {FIELD}="{impl}") (or '
        f'config.{FIELD} = "{impl}" before the model is built): the same math',
        reason=f"transformers runs a mixture-of-experts layer's experts as grouped_mm, "
        f"batched_mm or eager; each was traced. Step {est.step_time_s * 1e3:.2f} -> "
        f"{after.step_time_s * 1e3:.2f} ms, peak {est.peak_memory_bytes / GIB:.2f} -> "
        f"{after.peak_memory_bytes / GIB:.2f} GiB (re-traced with {FIELD}={impl!r}).",
        **effect(est, after), method="retrace", recommended=ok, change=change)


def expert_loop_reason(whatif: WhatIf, precision: str | None = None) -> str:
    """Why a compiled what-if of a mixture of experts is slow, where it is: with weights that
    are not bf16 transformers runs its experts through its own per-expert loop under
    torch.compile (compat.moe.EXPERT_LOOP_OPS; "" where it does not)."""
    from tilefit.vocab import parse_precision

    weights = parse_precision(precision or whatif.recipe.precision).param_dtype
    if weights == "bf16" or current_implementation(whatif) != "grouped_mm":
        return ""
    return (" Compiled, with experts' weights in " + weights + ", transformers runs them "
            "through its own per-expert loop (one matmul per expert issued from Python after "
            "a read on the host) where eager mode calls torch's grouped GEMM (whose own "
            "fallback outside bf16 is a matmul per expert too, issued from C++); bf16 "
            "weights (Recipe(precision='bf16-true')) run the grouped kernel, compiled or not.")


DTYPE_RULE = "experts-dtype"
BF16_FIX = ('AutoModelForCausalLM.from_pretrained(..., dtype=torch.bfloat16) (or '
            'model.to(torch.bfloat16)) and no autocast; Lightning: Trainer(precision='
            '"bf16-true")')


def bf16_experts_findings(whatif: WhatIf) -> list[Finding]:
    """Experts whose weights are not bf16 miss torch's grouped GEMM (bf16 only): ATen's
    fallback or transformers' loop runs one matmul per expert after a read on the host. The
    step re-traced with bf16 weights (bf16-true) says what that costs."""
    from tilefit.tracing.records import reads_expert_offsets
    from tilefit.vocab import parse_precision

    precision = parse_precision(whatif.recipe.precision)
    if whatif.device.kind != "cuda" or not whatif.device.supports("bf16") or \
            not whatif.can_retrace or precision.autocast_dtype != "bf16":
        return []
    est = whatif.estimate
    slow_s = sum(c.time_s * c.repeats for c in est.ops
                 if reads_expert_offsets(c.record))
    if not slow_s:
        return []
    after = whatif.try_retrace(DTYPE_RULE, "the step with bf16 weights", precision="bf16-true")
    if after is None or after.step_time_s >= est.step_time_s:
        return []
    speedup = est.step_time_s / after.step_time_s
    ok = speedup >= MIN_RECOMMENDED_SPEEDUP and after.fits
    return [Finding(
        rule=DTYPE_RULE, severity=severity_of(speedup) if ok else "info",
        title=f"the experts' GEMMs run one matmul per expert in {precision.param_dtype} "
        f"({slow_s / est.step_time_s:.0%} of the GPU's time): with bf16 weights torch's "
        f"grouped GEMM runs them, {pace(speedup)}",
        modules=(), dimension="precision", current=precision.name, suggested="bf16-true",
        fix=BF16_FIX,
        reason="torch's grouped GEMM takes bf16 only; with fp32 weights the experts run "
        "ATen's fallback (eager) or transformers' own loop (compiled), each reading the "
        "experts' offsets on the host and launching a matmul per expert. Pure bf16 training "
        "keeps weights, gradients and optimizer state in bf16, with no fp32 master copy: "
        "updates below bf16's resolution round away, so check the loss curve against "
        f"{precision.name} for the first steps. Step {est.step_time_s * 1e3:.2f} -> "
        f"{after.step_time_s * 1e3:.2f} ms, peak {est.peak_memory_bytes / GIB:.2f} -> "
        f"{after.peak_memory_bytes / GIB:.2f} GiB (re-traced in bf16-true).",
        **effect(est, after), method="retrace", recommended=ok,
        change=Change(recipe=(("precision", "bf16-true"),)))]
