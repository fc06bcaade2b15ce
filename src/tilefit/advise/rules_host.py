"""Host-bound steps: the GPU waits for eager PyTorch to issue its kernels.

When kernels are short (small batches, small layers, many small optimizer tensors) the host's
issue time (tilefit.hardware.host) exceeds the GPU's work and the GPU idles between kernels.
torch.compile's mode="reduce-overhead" replays the compiled forward and backward as CUDA
graphs: one replay per graph instead of a launch per kernel; the optimizer step and the
loop's own work stay eager. The gain is a re-estimate in that mode
(tilefit.estimator.cudagraphs): the same trace for a compiled step, a compiled re-trace for
an eager one."""

from __future__ import annotations

from tilefit.advise.findings import (
    MIN_RECOMMENDED_SPEEDUP,
    Change,
    Finding,
    effect,
    severity_of,
)
from tilefit.advise.whatif import WhatIf
from tilefit.errors import TilefitError
from tilefit.estimator import Estimate
from tilefit.recipe import Compile
from tilefit.vocab import REDUCE_OVERHEAD

# Below this share of the step spent waiting for the host, no finding: the gain would be
# within the model's own error (docs/references.md, section 10).
MIN_HOST_BOUND_FRACTION = 0.10
GIB = 2**30
GRAPH_FIX = ('model = torch.compile(model, mode="reduce-overhead") (CUDA graphs: static shapes, '
             "e.g. padded batches; TrainingArguments(torch_compile=True, torch_compile_mode="
             '"reduce-overhead") for the HF Trainer)')


def graphed_estimate(whatif: WhatIf) -> Estimate | None:
    """The step under torch.compile(mode="reduce-overhead"), or None where it is not
    predicted (already in that mode; no re-trace for an nn.Module; checkpointing or several
    GPUs, which CUDA graphs are not predicted with; a step Inductor cannot capture), with a note
    where the step needed it."""
    recipe, tr = whatif.recipe, whatif.trace
    if tr.compiled:
        if tr.compile_mode == REDUCE_OVERHEAD:
            return None
        try:
            return whatif.with_compile_mode(REDUCE_OVERHEAD)
        except TilefitError as err:  # a graph CUDA cannot capture
            whatif.skipped("host-bound", "the step replayed as CUDA graphs", err)
            return None
    if not whatif.can_retrace:
        return None  # an nn.Module: the audit's own note says re-traces were skipped
    what = "the step replayed as CUDA graphs"
    if recipe.grad_checkpointing or tr.world_size > 1:
        whatif.skipped("host-bound", what, "CUDA graphs are not predicted with "
                       + ("gradient checkpointing" if recipe.grad_checkpointing
                          else "several GPUs"))
        return None
    # a torch without Inductor, a step it cannot capture: a note, no finding
    return whatif.try_retrace("host-bound", what, compile=Compile(REDUCE_OVERHEAD))


def host_findings(whatif: WhatIf) -> list[Finding]:
    est = whatif.estimate
    if whatif.device.kind != "cuda" or est.host_bound_fraction < MIN_HOST_BOUND_FRACTION:
        return []
    after = graphed_estimate(whatif)
    if after is None:
        return []
    speedup = est.step_time_s / after.step_time_s
    ok = speedup >= MIN_RECOMMENDED_SPEEDUP
    current = "torch.compile" if whatif.trace.compiled else "eager"
    return [Finding(
        rule="host-bound", severity=severity_of(speedup) if ok else "info",
        title=f"the GPU waits for the host {est.host_bound_fraction:.0%} of the step "
        f"({current} PyTorch issues kernels slower than they run)",
        modules=(), dimension="launches", current=current,
        suggested='torch.compile(mode="reduce-overhead")', fix=GRAPH_FIX,
        reason=f"issuing the step's ops takes {est.host_time_s * 1e3:.2f} ms of host time "
        f"against {est.device_time_s * 1e3:.2f} ms of GPU work; replayed as CUDA graphs "
        f"the host takes {after.host_time_s * 1e3:.2f} ms (one replay per graph; the "
        "optimizer step, zero_grad and loss reads stay eager) and the step "
        f"{after.step_time_s * 1e3:.2f} ms; peak {est.peak_memory_bytes / GIB:.2f} -> "
        f"{after.peak_memory_bytes / GIB:.2f} GiB (the graphs' private memory pool). A "
        "larger batch also helps (more work per kernel, same number of kernels)",
        **effect(est, after), method="retrace" if not whatif.trace.compiled else "host",
        recommended=ok, change=Change(recipe=(("compile", Compile(REDUCE_OVERHEAD)),)))]
