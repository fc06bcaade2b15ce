"""Precision and attention-kernel findings: fp32 GEMMs that Tensor Cores could run (TF32 or
autocast), and attention falling back to the math kernel."""

from __future__ import annotations

from tilefit.advise.findings import MIN_RECOMMENDED_SPEEDUP, Change, Finding, severity_of
from tilefit.advise.origins import config_fields
from tilefit.advise.whatif import WhatIf
from tilefit.estimator import Estimate, OpCost
from tilefit.vocab import default_precision, parse_precision


def _finding(whatif: WhatIf, rule: str, title: str, dimension: str, current: str,
             suggested: str, fix: str, reason: str, after: Estimate, method: str,
             change: Change) -> Finding:
    step = whatif.estimate.step_time_s
    speedup = step / after.step_time_s
    ok = speedup >= MIN_RECOMMENDED_SPEEDUP and after.fits
    return Finding(rule=rule, severity=severity_of(speedup) if ok else "info", title=title,
                   modules=(), dimension=dimension, current=current, suggested=suggested,
                   fix=fix, reason=reason, step_time_before_s=step,
                   step_time_after_s=after.step_time_s,
                   peak_memory_before_bytes=whatif.estimate.peak_memory_bytes,
                   peak_memory_after_bytes=after.peak_memory_bytes, method=method,
                   recommended=ok, change=change)


def precision_findings(whatif: WhatIf) -> list[Finding]:
    if whatif.trace.precision != "fp32" or whatif.device.kind != "cuda":
        return []
    gemm_s = sum(c.time_s * c.repeats for c in whatif.estimate.ops
                 if c.record.kind == "gemm" and any(g.dtype == "fp32" for g in c.record.gemms))
    share = gemm_s / whatif.estimate.step_time_s
    out = []
    if whatif.device.supports("tf32"):
        after = whatif.with_precision_cost("tf32")  # same ops, GEMMs on TF32 Tensor Cores
        out.append(_finding(
            whatif, "fp32-gemms", "fp32 GEMMs run on CUDA cores; TF32 would use Tensor Cores",
            "precision", "fp32", "tf32",
            "torch.backends.cuda.matmul.allow_tf32 = True (or torch.set_float32_matmul_"
            "precision('high'); TrainingArguments(tf32=True))",
            f"fp32 GEMMs take {share:.1%} of the step; PyTorch runs fp32 matmuls without TF32 "
            "by default since 1.12 (convolutions already use it).", after, "precision",
            Change(recipe=(("precision", "tf32"),))))
    mixed = default_precision(whatif.device)
    if parse_precision(mixed).autocast_dtype == "bf16" and whatif.can_retrace:
        after = whatif.try_retrace("fp32-gemms", f"the step in {mixed}", precision=mixed)
        if after is not None:
            out.append(_finding(
                whatif, "fp32-gemms", "the step runs in fp32; bf16 autocast halves activation "
                "memory and uses Tensor Cores", "precision", "fp32", mixed,
                "TrainingArguments(bf16=True), or torch.autocast('cuda', dtype=torch.bfloat16) "
                "around the forward and loss",
                f"fp32 GEMMs take {share:.1%} of the step; under autocast they run in bf16 and "
                "attention can use the flash kernel.", after, "retrace",
                Change(recipe=(("precision", mixed),))))
    return out


def _in_attention(module: str) -> bool:
    last = module.rsplit(".", 1)[-1].lower()
    return "attn" in last or "attention" in last


def _head_dim(whatif: WhatIf, ops: list[OpCost]) -> int | None:
    if whatif.workload is not None and whatif.workload.config is not None:
        configured = next((origin.value for origin in config_fields(whatif.workload)
                           if origin.dimension == "head_dim"), None)
        if configured:
            return configured
    batched = [g for c in ops for g in c.record.gemms if g.batch > 1]
    return min((min(g.m, g.n, g.k) for g in batched), default=None)


def attention_findings(whatif: WhatIf) -> list[Finding]:
    warned = any("math kernel" in warning for warning in whatif.trace.warnings)
    eager = whatif.recipe.attention == "eager"
    # the math kernel is decomposed into batched GEMMs (scores, weighted values), softmax and
    # friends inside the attention module: the trace records them as ordinary ops
    math_ops = [c for c in whatif.estimate.ops
                if (c.record.attention or {}).get("backend") == "math"
                or ((warned or eager) and _in_attention(c.record.module))]
    if not (math_ops or eager or warned):
        return []
    causes = []
    if whatif.trace.precision == "fp32" and whatif.device.kind == "cuda":
        causes.append("fp32 inputs (flash needs fp16/bf16)")
    head_dim = _head_dim(whatif, math_ops)
    if head_dim is not None and (head_dim % 8 or head_dim > 256):
        causes.append(f"head_dim {head_dim} (flash needs a multiple of 8, at most 256)")
    if eager:
        causes.append("attn_implementation='eager' (no fused kernel at all)")
    if not causes:
        causes.append("an explicit attention mask (flash takes none; pass is_causal or let "
                      "SDPA use the memory-efficient kernel)")
    modules = tuple(sorted({c.record.module for c in math_ops}))[:6]
    if eager and whatif.can_retrace and not whatif.workload.is_factory:
        after = whatif.retrace(attention="sdpa")
        return [_finding(whatif, "attention-kernel", "attention runs unfused (eager)",
                         "attention", "eager", "sdpa",
                         "AutoModel.from_pretrained(..., attn_implementation='sdpa')",
                         "the S x S score matrix is materialised: " + "; ".join(causes),
                         after, "retrace", Change(recipe=(("attention", "sdpa"),)))]
    step = whatif.estimate.step_time_s
    math_s = sum(c.time_s * c.repeats for c in math_ops)
    return [Finding(rule="attention-kernel", severity="info",
                    title="attention falls back to the math kernel", modules=modules,
                    dimension="attention", current="math", suggested="flash",
                    fix="see the precision finding (autocast to bf16)"
                    if whatif.trace.precision == "fp32"
                    else "make head_dim a multiple of 8 (<= 256) / drop the explicit mask",
                    reason=f"{len(math_ops)} attention op(s), {math_s / step:.1%} of the step, run "
                    "the math kernel because of " + "; ".join(causes) + ".",
                    step_time_before_s=step, step_time_after_s=step,
                    peak_memory_before_bytes=whatif.estimate.peak_memory_bytes,
                    peak_memory_after_bytes=whatif.estimate.peak_memory_bytes, method="none",
                    recommended=False)]
