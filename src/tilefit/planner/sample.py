"""What the planner keeps from one traced and costed step: a Sample of a few numbers."""

from __future__ import annotations

from dataclasses import dataclass, fields

from tilefit.estimator import Estimate
from tilefit.estimator.cudagraphs import graphed, graphed_phase_peaks
from tilefit.tracing import Trace
from tilefit.tracing.records import MICRO_PHASES
from tilefit.vocab import REDUCE_OVERHEAD

STATE_CATEGORIES = ("parameters", "gradients", "optimizer_state")
WORK_PHASES = MICRO_PHASES


@dataclass(frozen=True)
class Sample:
    """One trace's figures, per micro-batch where they scale with accumulation.

    peak_bytes: peak live tensor bytes (allocator-rounded) with accumulation >= 2 (the steady
      peak of any accumulation >= 2: the previous micro-batch's gradients are live during the
      next forward).
    peak_accumulation_1_bytes: the same trace's peak outside the later micro-batches' forward
      and backward: the peak of accumulation 1 (the first micro-batch of the steady step
      starts with no gradients, as a step without accumulation does).
    The two peaks above are taken over forward and backward only; peak_optimizer_bytes is
    the peak during the optimizer step (and zero_grad, loss scaler). Each piece is close to
    affine in the micro-batch and the layer count, while their maximum is not (the peak
    moves from backward to the optimizer step as the model deepens): the sweep extrapolates
    each piece and takes the maximum.
    micro_time_s: forward + backward (+ recompute) of one micro-batch: the longer of
      micro_device_s (the GPU's work, with the communication it does not hide) and
      micro_host_s (the host's time to issue it; 0 on a CPU target). Each of the two is
      affine in the micro-batch and the layers, their maximum is not (a shallow step can be
      host-bound where the full one is GPU-bound): the sweep extrapolates each and takes the
      larger (tilefit.planner.affine.SweepModel.predict).
    fixed_time_s: once per optimizer step: optimizer, zero_grad, loss scaler.
    *_bytes: the largest live bytes of each model-state category.
    work_peak_bytes: the largest live bytes of what forward/backward allocate apart from the
      model state (activations, temporaries, inputs); what stays on the GPU under offload.
    micro_flops: model FLOPs of one micro-batch (checkpoint recompute excluded).
    host_bytes: CPU memory per node a modelled engine needs (DeepSpeed ZeRO: its own
      estimator's figure, tilefit.estimator.zero.ZeroMemory.host_bytes); 0 otherwise.
    fragmentation_ratio: what the caching allocator reserves beyond the allocated peak, as a
      share of it (the trace replayed through the allocator, Estimate.reserved); 0 where no
      reserved model applies (a modelled engine, the CPU).
    peak_optimizer_accumulation_1_bytes: the optimizer step's peak without accumulation,
      where it differs from peak_optimizer_bytes: under CUDA graphs (reduce-overhead) the
      graphs' pool is held through the step and, with accumulation, holds the gradients of
      two micro-batches at once (tilefit.estimator.cudagraphs.graphed_phase_peaks); None
      elsewhere.
    """

    micro_batch: float
    layers: float
    peak_bytes: float
    peak_accumulation_1_bytes: float
    peak_optimizer_bytes: float
    micro_time_s: float
    fixed_time_s: float
    parameters_bytes: float
    gradients_bytes: float
    optimizer_state_bytes: float
    work_peak_bytes: float
    micro_flops: float
    param_count: float
    host_bytes: float = 0.0
    fragmentation_ratio: float = 0.0
    micro_device_s: float | None = None  # None: micro_time_s is the device's alone
    micro_host_s: float = 0.0
    peak_optimizer_accumulation_1_bytes: float | None = None  # None: peak_optimizer_bytes
    # ReservedMemory.alloc_retries and steady_alloc_retries: counts at this very step, not
    # quantities the sweep extrapolates (left out of metrics)
    alloc_retries: int = 0
    steady_alloc_retries: int = 0

    def metrics(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("micro_batch", "layers", "alloc_retries",
                                  "steady_alloc_retries")
                and getattr(self, f.name) is not None}


def category_peaks(tr: Trace, *, rounded: bool) -> dict[str, int]:
    """The largest live bytes of each category over the whole trace."""
    cats = {s.category for s in tr.storages}
    return {cat: max(tr.live_bytes_timeline(rounded=rounded,
                                            keep=lambda s, c=cat: s.category == c))
            for cat in cats}


def work_peak(tr: Trace, *, rounded: bool) -> int:
    """Peak live bytes of non-state storages allocated by forward, backward or recompute."""
    return max(tr.live_bytes_timeline(
        rounded=rounded,
        keep=lambda s: s.category not in STATE_CATEGORIES and s.phase in WORK_PHASES))


def micro_step_s(est: Estimate) -> tuple[float, float]:
    """One micro-batch's GPU time and the host's time to issue it (0 on a CPU target: the
    sum of the ops' times is the step there); the micro-batch takes the longer of the two
    (a host-bound micro-batch takes what the host takes). On several GPUs the
    communication the compute does not hide is shared among the micro-batches: FSDP2
    gathers and reduce-scatters, DDP all-reduces, at every micro-batch (no no_sync); under
    DeepSpeed ZeRO only the forward/backward phases' share (the parameters' all-gather after
    the optimizer step is once per step: the fixed time)."""
    a = est.accumulation_steps
    device_s = sum(est.time_by_phase_s.get(p, 0.0) for p in MICRO_PHASES) / a
    if est.parallel is not None:
        by_phase = est.parallel.exposed_by_phase_s
        device_s += (sum(by_phase.get(p, 0.0) for p in MICRO_PHASES) if by_phase
                     else est.parallel.exposed_communication_s) / a
    if est.device.kind != "cuda":
        return device_s, 0.0
    from tilefit.estimator.steptime import issue_time_s

    return device_s, issue_time_s((c for c in est.ops if c.record.phase in MICRO_PHASES),
                                  est.device, graphs=est.compile_mode == REDUCE_OVERHEAD) / a


def sample_of(tr: Trace, est: Estimate, micro_batch: int, layers: int, *,
              peaks: tuple[dict[str, int], dict[str, int], dict[str, int]] | None = None,
              host_bytes: int = 0) -> Sample:
    """The planner's figures of one traced step. ``peaks``: a modelled rank's bytes by
    category at its forward/backward peak, micro-batch 0's and the optimizer step's
    (DeepSpeed ZeRO, tilefit.estimator.zero_step.zero_peaks), in place of the trace's;
    ``host_bytes``: the CPU memory per node such an engine needs."""
    a = est.accumulation_steps
    device_s, host_s = micro_step_s(est)
    micro_time = max(device_s, host_s)
    fixed_time = est.step_time_s - micro_time * a
    rounded = tr.target.kind == "cuda"
    if peaks is None:
        cats = category_peaks(tr, rounded=rounded)
        fb, fb1, opt, opt1 = (graphed_phase_peaks(tr, rounded=rounded) if graphed(tr)
                              else (*tr.phase_peaks(rounded=rounded), None))
    else:
        cats = {c: max(p.get(c, 0) for p in peaks) for c in STATE_CATEGORIES}
        fb, fb1, opt = (sum(p.values()) for p in peaks)
        opt1 = None
    if max(fb, opt) != est.peak_memory_bytes:  # the pieces cover every event
        raise AssertionError(f"phase peaks {fb}, {opt} miss the trace peak "
                             f"{est.peak_memory_bytes}")
    return Sample(
        micro_batch=micro_batch, layers=layers, peak_bytes=fb, peak_accumulation_1_bytes=fb1,
        peak_optimizer_bytes=opt, peak_optimizer_accumulation_1_bytes=opt1,
        micro_time_s=micro_time, fixed_time_s=fixed_time,
        parameters_bytes=cats.get("parameters", 0), gradients_bytes=cats.get("gradients", 0),
        optimizer_state_bytes=cats.get("optimizer_state", 0),
        work_peak_bytes=work_peak(tr, rounded=rounded), micro_flops=est.flops / a,
        param_count=tr.param_count, host_bytes=host_bytes,
        fragmentation_ratio=0.0 if peaks is not None else fragmentation_ratio(est),
        micro_device_s=device_s, micro_host_s=host_s,
        **retry_counts(est if peaks is None else None))


def retry_counts(est: Estimate | None) -> dict[str, int]:
    """The estimate's cudaMalloc retries after a release of the cache (none without a
    reserved model)."""
    r = None if est is None else est.reserved
    return {"alloc_retries": 0 if r is None else r.alloc_retries,
            "steady_alloc_retries": 0 if r is None else r.steady_alloc_retries}


def fragmentation_ratio(est: Estimate) -> float:
    """The reserved peak's excess over the traced peak, as a share of the traced peak (0
    without a reserved model)."""
    r, peak = est.reserved, est.peak_memory_bytes
    if r is None or peak <= 0:
        return 0.0
    return max(0, r.peak_reserved_bytes - peak) / peak
