"""transformers' optional kernels that ran as its reference PyTorch code, and what they cost.

Mamba, Mamba-2, their hybrids and the gated-delta-rule models call scans and convolutions
from mamba-ssm, causal-conv1d and flash-linear-attention when those are installed, else
transformers' reference PyTorch code, which is what tilefit traces (tilefit.tracing.kernels;
docs/references.md, section 41). The finding says how much of the predicted step that code
is, on the GPU and on the host that issues it: the time installing the packages goes after.
The kernels themselves are not modelled, so no step after the fix is predicted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tilefit.advise.findings import Finding

if TYPE_CHECKING:
    from tilefit.advise.whatif import WhatIf

RULE = "reference-kernels"


def reference_kernel_findings(whatif: WhatIf) -> list[Finding]:
    from tilefit.estimator.result import fold_layer_indices
    from tilefit.estimator.steptime import issue_time_s
    from tilefit.tracing.kernels import distributions

    kernels = whatif.trace.reference_kernels
    est = whatif.estimate
    if not kernels or est.device.kind != "cuda":
        return []
    callers = {k.module for k in kernels}
    ops = [c for c in est.ops if c.record.module in callers]
    gpu_s = sum(c.time_s * c.repeats for c in ops)
    host_s = issue_time_s(ops, est.device)
    step = est.step_time_s
    names = ", ".join(sorted({k.name for k in kernels}))
    folded = tuple(sorted({fold_layer_indices(m) for m in callers}))
    n_ops = sum(c.repeats for c in ops)
    return [Finding(
        rule=RULE, severity="info",
        title=f"{names} ran as transformers' reference PyTorch code: its modules' own ops "
              f"are {gpu_s / est.device_time_s:.0%} of the GPU's busy time and "
              f"{host_s / est.host_time_s:.0%} of the host's issue time",
        modules=folded, dimension=None, current=None, suggested=None,
        fix=f"pip install {' '.join(distributions(kernels))} on the GPU machine: "
            "transformers then calls their fused kernels (not modelled by tilefit: no step "
            "is predicted after)",
        reason=f"{n_ops} ops a step in {', '.join(folded)} outside their child layers "
               f"(the reference code and its glue): {gpu_s * 1e3:.2f} ms of GPU time and "
               f"{host_s * 1e3:.2f} ms of host issue time of the {step * 1e3:.2f} ms step "
               "(the GPU waits for the host "
               f"{est.host_bound_fraction:.0%} of it); tilefit costs that code as it runs",
        step_time_before_s=step, step_time_after_s=step,
        peak_memory_before_bytes=est.peak_memory_bytes,
        peak_memory_after_bytes=est.peak_memory_bytes, method="none", recommended=False)]
