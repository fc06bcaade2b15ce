"""Host-bound steps: the GPU waits for eager PyTorch to issue its kernels.

When kernels are short (small batches, small layers, many small optimizer tensors) the host's
issue time (tilefit.hardware.host) exceeds the GPU's work and the GPU idles between kernels.
CUDA graphs replay the whole step's kernels with one launch; torch.compile's
mode="reduce-overhead" captures them for you. The gain is re-estimated with the host's
per-op cost removed (one graph launch per step instead)."""

from __future__ import annotations

from dataclasses import replace

from tilefit.advise.findings import MIN_RECOMMENDED_SPEEDUP, Finding, severity_of
from tilefit.advise.whatif import WhatIf
from tilefit.hardware.host import HostModel

# Below this share of the step spent waiting for the host, no finding: the gain would be
# within the model's own error (docs/references.md, section 10).
MIN_HOST_BOUND_FRACTION = 0.10
GRAPH_FIX = ('model = torch.compile(model, mode="reduce-overhead") (CUDA graphs: static shapes, '
             "e.g. padded batches; TrainingArguments(torch_compile=True, torch_compile_mode="
             '"reduce-overhead")), or torch.cuda.make_graphed_callables for the model')


def graphed_host(host: HostModel) -> HostModel:
    """A step replayed as a CUDA graph: no per-op issue cost; the graph's own launch is
    charged as one op's launch (on the first op)."""
    return replace(host, forward_op_s=0.0, backward_op_s=0.0, optimizer_op_s=0.0,
                   optimizer_tensor_s=0.0, launch_s=0.0)


def host_findings(whatif: WhatIf) -> list[Finding]:
    est = whatif.estimate
    if whatif.device.kind != "cuda" or est.host_bound_fraction < MIN_HOST_BOUND_FRACTION:
        return []
    after = whatif.with_host(graphed_host(whatif.device.host))
    graph_launch_s = whatif.device.host.launch_s
    after = replace(after, step_time_s=after.step_time_s + graph_launch_s)
    speedup = est.step_time_s / after.step_time_s
    ok = speedup >= MIN_RECOMMENDED_SPEEDUP
    return [Finding(
        rule="host-bound", severity=severity_of(speedup) if ok else "info",
        title=f"the GPU waits for the host {est.host_bound_fraction:.0%} of the step "
        "(eager PyTorch issues kernels slower than they run)",
        modules=(), dimension="launches", current="eager", suggested="CUDA graphs",
        fix=GRAPH_FIX,
        reason=f"issuing the step's ops takes {est.host_time_s * 1e3:.2f} ms of host time "
        f"against {est.device_time_s * 1e3:.2f} ms of GPU work; a larger batch also helps "
        "(more work per kernel, same number of kernels)",
        step_time_before_s=est.step_time_s, step_time_after_s=after.step_time_s,
        peak_memory_before_bytes=est.peak_memory_bytes,
        peak_memory_after_bytes=est.peak_memory_bytes, method="host", recommended=ok)]
