"""Batch-size findings: GEMMs memory-bound because the batch is small, and wave quantization
that a nearby batch size fills.

Both compare time per sample (a bigger batch does more work per step). Candidates are screened
with a GEMM-only what-if (token dimensions scaled in the traced GEMM shapes, costed by
tilefit.gemm) and the chosen one is confirmed by re-tracing the step at that batch, which also
says whether it fits.
"""

from __future__ import annotations

from dataclasses import replace

from tilefit.advise.findings import MIN_RECOMMENDED_SPEEDUP, Finding, severity_of
from tilefit.advise.whatif import WhatIf, gemm_time_with
from tilefit.batches import REAL_GAIN, is_friendly
from tilefit.gemm import analyze_gemm
from tilefit.tracing.records import GemmShape

# memory-bound GEMMs must take at least this share of the step for a finding
MIN_MEMORY_BOUND_SHARE = 0.05
MAX_BATCH_FACTOR = 64  # look up to 64x the current batch
# a nearby batch must cut GEMM time per sample by this much (screen) to be re-traced
MIN_WAVE_GAIN = 0.02
WAVE_NEIGHBOURS = 4


def _tokens(w: WhatIf) -> int | None:
    if w.workload is None or w.workload.seq_len is None:
        return None
    return w.recipe.batch_size * w.workload.seq_len


def _scaler(old_tokens: int, new_tokens: int):  # type: ignore[no-untyped-def]
    def swap(g: GemmShape) -> GemmShape:
        return replace(g, m=new_tokens if g.m == old_tokens else g.m,
                       n=new_tokens if g.n == old_tokens else g.n,
                       k=new_tokens if g.k == old_tokens else g.k)
    return swap


def _batch_finding(w: WhatIf, rule: str, new_b: int, title: str, reason: str) -> Finding | None:
    after = w.retrace(batch_size=new_b)
    b = w.recipe.batch_size
    f = Finding(
        rule=rule, severity="info", title=title, modules=(), dimension="batch size",
        current=b, suggested=new_b,
        fix=f"per_device_train_batch_size={new_b} in TrainingArguments (or your DataLoader's "
            f"batch_size={new_b}); keep the global batch with gradient_accumulation_steps if "
            "the recipe needs it",
        reason=reason + (f" At batch {new_b} the step is predicted to "
                         f"{'fit' if after.fits else 'NOT fit'} "
                         f"({after.total_memory_bytes / 2**30:.1f} GiB of "
                         f"{w.device.memory_bytes / 2**30:.0f} GiB)."),
        step_time_before_s=w.estimate.step_time_s, step_time_after_s=after.step_time_s,
        peak_memory_before_bytes=w.estimate.peak_memory_bytes,
        peak_memory_after_bytes=after.peak_memory_bytes, method="retrace", per_sample=True,
        samples_before=b, samples_after=new_b)
    # a batch off the hardware-friendly sizes must win by a real margin (tilefit.batches)
    needed = MIN_RECOMMENDED_SPEEDUP if is_friendly(new_b) else 1 + REAL_GAIN
    ok = after.fits and f.predicted_speedup >= needed
    return replace(f, recommended=ok, severity=severity_of(f.predicted_speedup) if ok else "info")


def memory_bound_findings(w: WhatIf) -> list[Finding]:
    tokens = _tokens(w)
    if tokens is None or not w.can_retrace:
        return []
    bound_ops = [(c, g, dt) for c, g, dt in w.estimate.gemms()
                 if c.record.kind == "gemm" and tokens in (g.m, g.n, g.k)
                 and analyze_gemm(g.m, g.n, g.k, dt, w.device, batch=g.batch).bound == "memory"]
    share = sum(c.time_s * c.repeats for c, _, _ in bound_ops) / w.estimate.step_time_s
    if share < MIN_MEMORY_BOUND_SHARE:
        return []
    b = w.recipe.batch_size
    seq = w.workload.seq_len
    new_b = None
    for factor in (2, 4, 8, 16, 32, MAX_BATCH_FACTOR):
        nt = b * factor * seq
        if all(analyze_gemm(*(nt if d == tokens else d for d in (g.m, g.n, g.k)), dt, w.device,
                            batch=g.batch).bound == "math" for _, g, dt in bound_ops):
            new_b = b * factor
            break
    if new_b is None:
        return []
    reason = (f"{len(bound_ops)} GEMM op(s) with {tokens} tokens (batch {b} x seq {seq}) are "
              f"memory-bound, {share:.1%} of the step: their arithmetic intensity is below the "
              f"{w.device.name}'s FLOP/byte ratio. From batch {new_b} all of them are "
              "math-bound.")
    f = _batch_finding(w, "small-batch", new_b,
                       f"GEMMs are memory-bound at batch {b}; math-bound from batch {new_b}",
                       reason)
    return [f] if f else []


def wave_findings(w: WhatIf) -> list[Finding]:
    tokens = _tokens(w)
    if tokens is None or not w.can_retrace:
        return []
    b = w.recipe.batch_size
    seq = w.workload.seq_len
    base = gemm_time_with(w.estimate, lambda g: g) / b
    best, best_b = base, b
    for nb in range(max(1, b - WAVE_NEIGHBOURS), b + WAVE_NEIGHBOURS + 1):
        if nb == b:
            continue
        t = gemm_time_with(w.estimate, _scaler(tokens, nb * seq)) / nb
        # a batch off the friendly sizes must win by a real margin (tilefit.batches)
        if not is_friendly(nb) and t > base * (1 - REAL_GAIN):
            continue
        if t < best * (1 - 1e-9):
            best, best_b = t, nb
    if best_b == b or best > base * (1 - MIN_WAVE_GAIN):
        return []
    reason = (f"wave quantization: at {tokens} tokens the GEMM tiles fill the last wave of "
              f"{w.device.sms} SMs poorly; at batch {best_b} the GEMMs are predicted "
              f"{base / best:.3f}x faster per sample (GEMM-only screen, confirmed by re-tracing "
              "the step).")
    f = _batch_finding(w, "wave-quantization", best_b,
                       f"batch {best_b} fills the GEMMs' last wave better than batch {b}", reason)
    return [f] if f else []
