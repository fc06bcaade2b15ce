"""The caching allocator's own cost: memory it reserves beyond the tensors (cached blocks,
the remainders of split segments) and what expandable segments would give back. The what-if
re-replays the same trace under the other PYTORCH_CUDA_ALLOC_CONF: no re-trace, the tensors
are the same (docs/references.md, section 31)."""

from __future__ import annotations

from dataclasses import replace

from tilefit.advise.findings import Finding, severity_of
from tilefit.advise.whatif import WhatIf
from tilefit.estimator import estimate_trace

# fragmentation worth a finding: this share of what the allocator reserves at its peak
FRAGMENTATION_SHARE = 0.05
GIB = 2**30
EXPANDABLE = "expandable_segments:True"


def fragmentation_findings(whatif: WhatIf) -> list[Finding]:
    before = whatif.estimate
    r = before.reserved
    if r is None or EXPANDABLE in r.alloc_conf:
        return []
    frag_share = r.fragmentation_bytes / max(r.peak_reserved_bytes, 1)
    if r.fits and frag_share < FRAGMENTATION_SHARE and not r.fits_by_releasing:
        return []
    conf = f"{r.alloc_conf},{EXPANDABLE}" if r.alloc_conf else EXPANDABLE
    after = estimate_trace(replace(whatif.trace, alloc_conf=conf), whatif.device)
    a = after.reserved
    if a is None:
        return []
    saved = r.peak_reserved_bytes - a.peak_reserved_bytes if r.fits else 0
    calms = r.fits_by_releasing and a.fits and not a.steady_alloc_retries
    ok = (not before.fits and after.fits) or saved > 0 or calms
    verdict = ("makes the step fit" if not before.fits and after.fits else
               "ends the releases" + (f" and saves {saved / GIB:.2f} GiB" if saved > 0
                                      else "") if calms else
               f"saves {saved / GIB:.2f} GiB of reserved memory" if saved > 0 else
               "does not help here")
    held = f"the caching allocator holds {r.fragmentation_bytes / GIB:.2f} GiB beyond the " \
        f"tensors' peak ({frag_share:.0%} of what it reserves)"
    if r.fits_by_releasing:
        n = r.steady_alloc_retries
        held = ("the step fits only by the caching allocator releasing its cache "
                f"({n} retr{'ies' if n > 1 else 'y'} in every step; each release "
                "synchronizes the GPU)")
    return [Finding(
        rule="allocator-fragmentation",
        severity=("high" if not before.fits and after.fits else "medium" if calms else
                  severity_of(1.0, saved / max(r.peak_reserved_bytes, 1))) if ok else "info",
        title=f"{held}; expandable segments {verdict}",
        modules=(), dimension="PYTORCH_CUDA_ALLOC_CONF",
        current=r.alloc_conf or "(PyTorch's defaults)", suggested=conf,
        fix=f"export PYTORCH_CUDA_ALLOC_CONF={conf} before the training process starts (or "
        f"os.environ['PYTORCH_CUDA_ALLOC_CONF'] = '{conf}' before torch touches the GPU)",
        reason=f"The step's allocations replayed through PyTorch's caching allocator: "
        f"{r.peak_reserved_bytes / GIB:.2f} GiB reserved in {r.segments} segments for "
        f"a tensors' peak of {r.peak_allocated_bytes / GIB:.2f} GiB; with one "
        f"growing segment per pool: {a.peak_reserved_bytes / GIB:.2f} GiB "
        f"({'fits' if after.fits else 'does not fit'} in {a.limit_bytes / GIB:.2f} GiB).",
        step_time_before_s=before.step_time_s, step_time_after_s=after.step_time_s,
        peak_memory_before_bytes=r.peak_reserved_bytes,
        peak_memory_after_bytes=a.peak_reserved_bytes, method="replay", recommended=ok)]
