"""fp8 training where the GPU has fp8 Tensor Cores: torchao's float8 training runs the
nn.Linear GEMMs in fp8 at twice the bf16 peak, at the price of the scaling and casting
kernels, which torch.compile fuses (docs/references.md, section 21). The gain is a re-trace
with precision fp8-mixed (tilefit.tracing.float8), compiled (checkpointed recipes too);
the finding appears only where that re-estimate gains."""

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
from tilefit.recipe import Compile
from tilefit.vocab import PRECISIONS, Precision

GIB = 2**30
FP8_FIX = ("from torchao.float8 import convert_to_float8_training; "
           "convert_to_float8_training(model, module_filter_fn=lambda m, fqn: "
           "m.in_features % 16 == 0 and m.out_features % 16 == 0) before "
           "torch.compile(model), training under bf16 autocast as now (pip install torchao); "
           "with accelerate: Accelerator(mixed_precision='fp8', "
           "kwargs_handlers=[AORecipeKwargs()])")


def fp8_precision() -> Precision:
    """The vocabulary's fp8 training precision."""
    return next(p for p in PRECISIONS if p.float8_linears)


def fp8_gemm_share(est: Estimate) -> float:
    """The share of the GPU's time in GEMMs (what fp8 speeds up)."""
    total = sum(c.time_s * c.repeats for c in est.ops)
    gemm = sum(c.time_s * c.repeats for c in est.ops if c.record.kind == "gemm")
    return gemm / total if total > 0 else 0.0


def fp8_findings(whatif: WhatIf) -> list[Finding]:
    recipe, device = whatif.recipe, whatif.device
    fp8 = fp8_precision()
    if (device.kind != "cuda" or not fp8.supported_by(device) or not whatif.can_retrace
            or recipe.spec.autocast_dtype != fp8.autocast_dtype
            or recipe.spec.float8_linears):
        return []
    # torchao not installed, a step Inductor cannot capture: a note, no finding
    after = whatif.try_apply("fp8", f"the step in {fp8.name} under torch.compile",
                             _change())
    if after is None:
        return []
    # fp8's own share of the gain: against bf16 compiled alike
    same = whatif.estimate if recipe.compile == Compile() else whatif.try_apply(
        "fp8", "the step under torch.compile (fp8's baseline)",
        Change(recipe=(("compile", Compile()),)))
    if same is None:
        return []
    speedup = whatif.estimate.step_time_s / after.step_time_s
    own = same.step_time_s / after.step_time_s
    if own < MIN_RECOMMENDED_SPEEDUP or not after.fits:
        return []
    return [_finding(whatif, after, speedup, own, not recipe.compile)]


def _finding(whatif: WhatIf, after: Estimate, speedup: float, own: float,
             adds_compile: bool) -> Finding:
    est = whatif.estimate
    how = "with torch.compile " if adds_compile else ""
    compile_part = (f" ({own:.2f}x of it over torch.compile in bf16 alone)"
                    if adds_compile else "")
    return Finding(
        rule="fp8", severity=severity_of(speedup),
        title=f"GEMMs are {fp8_gemm_share(est):.0%} of the GPU's time and "
        f"{whatif.device.name} has fp8 Tensor Cores: torchao's float8 training {how}is "
        f"predicted to make the step {pace(speedup)}{compile_part}",
        modules=(), dimension="precision", current=whatif.recipe.precision,
        suggested=fp8_precision().name + (" + torch.compile" if adds_compile else ""),
        fix=FP8_FIX,
        reason="the nn.Linear layers' forward and both backward GEMMs run in fp8 "
        "(e4m3 inputs and weights, e5m2 gradients, dynamic tensorwise scales) at twice the "
        "bf16 peak; each costs an amax and a cast of its operands, which torch.compile "
        "fuses; fp32 master weights, the bf16 input saved for backward as before. "
        f"Step {est.step_time_s * 1e3:.1f} -> {after.step_time_s * 1e3:.1f} ms, peak "
        f"{est.peak_memory_bytes / GIB:.2f} -> {after.peak_memory_bytes / GIB:.2f} GiB; "
        "loss curves should be checked against bf16 for the first steps."
        + expert_loop_reason(whatif, fp8_precision().name),
        **effect(est, after), method="retrace", recommended=speedup >= MIN_RECOMMENDED_SPEEDUP,
        change=_change())


def _change() -> Change:
    """fp8 training compiled (torch.compile fuses torchao's casts)."""
    return Change(recipe=(("precision", fp8_precision().name), ("compile", Compile())))
