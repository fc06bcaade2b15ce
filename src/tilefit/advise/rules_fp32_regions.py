"""GEMMs the user's own code keeps in fp32 under a mixed-precision recipe, and what they cost.

The trace keeps what the GPU runs: a region with autocast disabled, a ``.float()`` before a
matmul, or a module kept in fp32 runs its GEMMs in fp32 under bf16 or fp16 autocast
(tracing.autocast). Keeping a region in fp32 can be deliberate (a loss, a router, a head),
so the finding says what it costs, for information: the step re-costed with those GEMMs in
the autocast dtype (the trace rewritten, each GEMM's operands and output in the low dtype),
not a call to change it. Only a region that is at least ``MIN_SHARE`` of the step is named:
Llama's rotary embeddings run their tiny matmul in fp32 on purpose in every step.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from tilefit.advise.findings import Finding
from tilefit.advise.whatif import WhatIf
from tilefit.dtypes import parse_dtype
from tilefit.estimator import estimate_trace
from tilefit.estimator.result import fold_layer_indices
from tilefit.tracing.records import OpRecord, Trace
from tilefit.vocab import parse_precision

RULE = "fp32-regions"
MIN_SHARE = 0.01  # of the step time: smaller regions are not named
_STEP_PHASES = ("forward", "backward", "recompute")


def _in_fp32(op: OpRecord) -> bool:
    return (op.kind == "gemm" and op.phase in _STEP_PHASES and bool(op.gemms)
            and all(g.dtype == "fp32" for g in op.gemms))


def in_low_precision(op: OpRecord, low: str) -> OpRecord:
    """The GEMM op as autocast would run it: its GEMMs in ``low``, its bytes scaled to
    the low dtype's element size (operands and output all cast)."""
    dtype = parse_dtype(low)
    return replace(op, gemms=tuple(replace(g, dtype=low) for g in op.gemms),
                   bytes=round(op.bytes * dtype.bytes / 4), dtype=dtype.torch_name)


def fp32_region_findings(whatif: WhatIf) -> list[Finding]:
    low = parse_precision(whatif.trace.precision).autocast_dtype
    est = whatif.estimate
    if low is None or est.device.kind != "cuda":
        return []
    by_module: dict[str, float] = defaultdict(float)
    for c in est.ops:
        if _in_fp32(c.record):
            by_module[fold_layer_indices(c.record.module) or "(top level)"] += c.time_s * c.repeats
    named = {m: s for m, s in by_module.items() if s >= MIN_SHARE * est.step_time_s}
    if not named:
        return []
    folded = set(named)
    rewritten = replace(whatif.trace, ops=tuple(
        in_low_precision(op, low) if _in_fp32(op) and (
            fold_layer_indices(op.module) or "(top level)") in folded else op
        for op in whatif.trace.ops))
    return [_finding(whatif, rewritten, named, low)]


def _finding(whatif: WhatIf, rewritten: Trace, named: dict[str, float], low: str) -> Finding:
    est = whatif.estimate
    after = estimate_trace(rewritten, whatif.device)
    gemm_s = sum(named.values())
    modules = tuple(sorted(named, key=lambda m: -named[m]))
    shares = ", ".join(f"{m} {named[m] / est.step_time_s:.1%}" for m in modules)
    return Finding(
        rule=RULE, severity="info",
        title=f"GEMMs kept in fp32 under {low} autocast take "
              f"{gemm_s / est.step_time_s:.1%} of the step ({', '.join(modules)})",
        modules=modules, dimension="precision", current="fp32", suggested=low,
        fix=f"where it is not deliberate, let autocast run these modules' matmuls in {low}: "
            "drop the torch.autocast(enabled=False) region or the .float() before the matmul, "
            "or stop keeping the module in fp32 (a loss, a router or a head is often kept so "
            "on purpose)",
        reason=f"fp32 GEMM time by module: {shares} of the {est.step_time_s * 1e3:.2f} ms "
               f"step; re-costed in {low} (the trace rewritten: the same GEMMs with {low} "
               "operands) the step is "
               f"{after.step_time_s * 1e3:.2f} ms",
        step_time_before_s=est.step_time_s, step_time_after_s=after.step_time_s,
        peak_memory_before_bytes=est.peak_memory_bytes,
        peak_memory_after_bytes=est.peak_memory_bytes, method="rewrite", recommended=False)
