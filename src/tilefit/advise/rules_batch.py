"""Batch-size findings: GEMMs memory-bound because the batch is small, and wave quantization
that a nearby batch size fills.

Both compare time per sample (a bigger batch does more work per step). Candidates are screened
with a GEMM-only what-if (token dimensions scaled in the traced GEMM shapes, costed by
tilefit.gemm) and the chosen one is confirmed by re-tracing the step at that batch, which also
says whether it fits.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from tilefit.advise.findings import (
    MIN_RECOMMENDED_SPEEDUP,
    Change,
    Finding,
    effect,
    severity_of,
)
from tilefit.advise.whatif import WhatIf, gemm_time_with, swap_gemm_dim
from tilefit.batches import REAL_GAIN, is_friendly
from tilefit.gemm import analyze_gemm
from tilefit.tracing.records import GemmShape

# memory-bound GEMMs must take at least this share of the step for a finding
MIN_MEMORY_BOUND_SHARE = 0.05
MAX_BATCH_FACTOR = 64  # look up to 64x the current batch
# a nearby batch must cut GEMM time per sample by this much (screen) to be re-traced
MIN_WAVE_GAIN = 0.02
WAVE_NEIGHBOURS = 4


def _token_step(whatif: WhatIf) -> tuple[int, int, int] | None:
    """(batch size, sequence length, tokens = batch x seq) of a step with a token dimension
    that can be re-traced; None otherwise (no finding then)."""
    work = whatif.workload
    if work is None or work.seq_len is None or not whatif.can_retrace:
        return None
    batch = whatif.recipe.batch_size
    return batch, work.seq_len, batch * work.seq_len


def _batch_finding(whatif: WhatIf, rule: str, new_batch: int, title: str,
                   reason: str) -> Finding:
    after = whatif.retrace(batch_size=new_batch)
    batch = whatif.recipe.batch_size
    f = Finding(
        rule=rule, severity="info", title=title, modules=(), dimension="batch size",
        current=batch, suggested=new_batch,
        fix=f"per_device_train_batch_size={new_batch} in TrainingArguments (or your "
            f"DataLoader's batch_size={new_batch}); keep the global batch with "
            "gradient_accumulation_steps if the recipe needs it",
        reason=reason + (f" At batch {new_batch} the step is predicted to "
                         f"{'fit' if after.fits else 'NOT fit'} "
                         f"({after.total_memory_bytes / 2**30:.1f} GiB of "
                         f"{whatif.device.memory_bytes / 2**30:.0f} GiB)."),
        **effect(whatif.estimate, after), method="retrace", per_sample=True,
        samples_before=batch, samples_after=new_batch,
        change=Change(recipe=(("batch_size", new_batch),)))
    # a batch off the hardware-friendly sizes must win by a real margin (tilefit.batches)
    needed = MIN_RECOMMENDED_SPEEDUP if is_friendly(new_batch) else 1 + REAL_GAIN
    ok = after.fits and f.predicted_speedup >= needed
    return replace(f, recommended=ok, severity=severity_of(f.predicted_speedup) if ok else "info")


def _bound(whatif: WhatIf, g: GemmShape, dtype: str) -> str:
    return analyze_gemm(g.m, g.n, g.k, dtype, whatif.device, batch=g.batch).bound


def memory_bound_findings(whatif: WhatIf) -> list[Finding]:
    step = _token_step(whatif)
    if step is None:
        return []
    batch, seq, tokens = step
    bound_ops = [(c, g, dt) for c, g, dt in whatif.estimate.gemms()
                 if c.record.kind == "gemm" and tokens in (g.m, g.n, g.k)
                 and _bound(whatif, g, dt) == "memory"]
    share = sum(c.time_s * c.repeats for c, _, _ in bound_ops) / whatif.estimate.step_time_s
    if share < MIN_MEMORY_BOUND_SHARE:
        return []
    new_batch = next((batch * factor for factor in (2, 4, 8, 16, 32, MAX_BATCH_FACTOR)
                      if all(_bound(whatif, swap_gemm_dim(g, tokens, batch * factor * seq), dt)
                             == "math" for _, g, dt in bound_ops)), None)
    if new_batch is None:
        return []
    reason = (f"{len(bound_ops)} GEMM op(s) with {tokens} tokens (batch {batch} x seq {seq}) "
              f"are memory-bound, {share:.1%} of the step: their arithmetic intensity is below "
              f"the {whatif.device.name}'s FLOP/byte ratio. From batch {new_batch} all of them "
              "are math-bound.")
    return [_batch_finding(
        whatif, "small-batch", new_batch,
        f"GEMMs are memory-bound at batch {batch}; math-bound from batch {new_batch}", reason)]


def wave_findings(whatif: WhatIf) -> list[Finding]:
    step = _token_step(whatif)
    if step is None:
        return []
    batch, seq, tokens = step
    base = gemm_time_with(whatif.estimate, lambda g: g) / batch
    best, best_batch = base, batch
    for candidate in range(max(1, batch - WAVE_NEIGHBOURS), batch + WAVE_NEIGHBOURS + 1):
        if candidate == batch:
            continue
        swap = partial(swap_gemm_dim, old=tokens, new=candidate * seq)
        per_sample_s = gemm_time_with(whatif.estimate, swap) / candidate
        # a batch off the friendly sizes must win by a real margin (tilefit.batches)
        if not is_friendly(candidate) and per_sample_s > base * (1 - REAL_GAIN):
            continue
        if per_sample_s < best * (1 - 1e-9):
            best, best_batch = per_sample_s, candidate
    if best_batch == batch or best > base * (1 - MIN_WAVE_GAIN):
        return []
    reason = (f"wave quantization: at {tokens} tokens the GEMM tiles fill the last wave of "
              f"{whatif.device.sms} SMs poorly; at batch {best_batch} the GEMMs are predicted "
              f"{base / best:.3f}x faster per sample (GEMM-only screen, confirmed by re-tracing "
              "the step).")
    return [_batch_finding(
        whatif, "wave-quantization", best_batch,
        f"batch {best_batch} fills the GEMMs' last wave better than batch {batch}", reason)]
