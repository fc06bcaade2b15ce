"""An audit's re-traces of a deep model: traced at two shallow depths, extrapolated to its own.

A stack of identical blocks makes each figure of a training step affine in the layer count:
every layer adds the same ops (time, FLOPs, parameters) and the same tensors. The peak is
the larger of two affine pieces (forward/backward and the optimizer step, whose maximum moves
from one to the other as the model deepens), so each piece is extrapolated and the larger
taken, as the planner's layer lever does (tilefit.planner.affine;
docs/references.md, section 38). The audited step itself is always traced in full; its
what-ifs (torch.compile, another batch, the fused loss, checkpointing, ...) of a model deeper than
``LAYER_LEVER_MIN_LAYERS`` are traced at ``LEVER_LAYERS`` and extrapolated. On full GPT-2
(12 layers) the compiled what-if extrapolates to 5e-8 of the full trace's step time and to
the byte of its peak (tests/test_audit_lever.py checks the rules' what-ifs on a 5-layer model
against full traces).

Not used where it would not hold: a config whose layers differ (``layer_types`` with more
than one kind, dense layers before the experts, experts every few layers), a step whose added
layer is bound neither by the host nor by the GPU alone (``one_side_binds``), and near the
out-of-memory line (within ``LEVER_MARGIN`` of it), where the verdict decides whether a fix
is recommended: those what-ifs are traced in full.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from tilefit.estimator import Estimate
from tilefit.models import Workload
from tilefit.planner.affine import Line
from tilefit.planner.sample import fragmentation_ratio
from tilefit.planner.search import Depth, depth_of
from tilefit.recipe import Recipe
from tilefit.tracing.records import Trace

# an extrapolated what-if this close to the out-of-memory line is traced in full instead
LEVER_MARGIN = 0.10


def lever_depth(work: Workload) -> Depth | None:
    """The depths a what-if of ``work`` is traced at, or None: trace it in full (a shallow
    model, no layer-count field, or layers that differ: planner.search.depth_of)."""
    depth = depth_of(work)
    return depth if depth.lever else None


# an added layer adds to the step what it adds to the host's or the GPU's busy time, to this
# share of the step's own increment, or the step is not affine in the layers
LEVER_SLOPE_TOLERANCE = 0.01


def one_side_binds(e0: Estimate, e1: Estimate) -> bool:
    """Whether the step at two depths grows by what one side's busy time grows (the host's
    issue time, or the GPU's work plus the communication it does not hide): each added layer
    is then bound by that side and the step is affine in the layers. Where neither (the host
    and the GPU overlap differently at each depth: a mixture of experts whose shallow steps
    are partly host-bound), an extrapolated step would be off (OLMoE-1B-7B in bf16-true on
    an H200: 111.2 ms from 1 and 2 layers, 128.2 ms traced in full), so it is traced in full."""
    step = e1.step_time_s - e0.step_time_s
    if step <= 0:
        return False

    def exposed(e: Estimate) -> float:
        return e.parallel.exposed_communication_s if e.parallel is not None else 0.0

    host = e1.host_time_s - e0.host_time_s
    device = e1.device_time_s - e0.device_time_s + exposed(e1) - exposed(e0)
    return any(abs(step - side) <= LEVER_SLOPE_TOLERANCE * step for side in (host, device))


def retrace_steps(work: Workload, recipe: Recipe) -> list[tuple[Workload, Recipe]]:
    """The steps a what-if of ``work`` under ``recipe`` traces: at each lever depth, or the
    step itself (what the audit may start on a free core before it needs them)."""
    depth = lever_depth(work)
    if depth is None or depth.field is None:
        return [(work, recipe)]
    return [(depth.workload_at(work, n), recipe) for n in depth.traced]


def extrapolate(shallow: tuple[tuple[Trace, Estimate], tuple[Trace, Estimate]],
                depth: Depth) -> Estimate:
    """The full-depth estimate from the (trace, estimate) at each of ``depth.traced``: its
    scalar figures (the per-op and per-module tables stay empty: they are not traced)."""
    (tr0, e0), (tr1, e1) = shallow
    l0, l1 = depth.traced

    def lin(a: float, b: float) -> float:
        return Line.through(l0, a, l1, b)(depth.full)

    rounded = e1.device.kind == "cuda"
    fb0, _, opt0 = tr0.phase_peaks(rounded=rounded)
    fb1, _, opt1 = tr1.phase_peaks(rounded=rounded)
    peak = round(max(lin(fb0, fb1), lin(opt0, opt1)))
    step = lin(e0.step_time_s, e1.step_time_s)
    flops = round(lin(e0.flops, e1.flops))
    waits = lin(e0.host_bound_fraction * e0.step_time_s, e1.host_bound_fraction * e1.step_time_s)
    tokens = e1.tokens_per_step
    return replace(
        e1, peak_memory_bytes=peak,
        memory_breakdown=_lin_dict(e0.memory_breakdown, e1.memory_breakdown, lin, whole=True),
        step_time_s=step, flops=flops, hardware_flops=round(lin(e0.hardware_flops,
                                                                e1.hardware_flops)),
        samples_per_s=e1.samples_per_step / step, tokens_per_s=tokens / step if tokens else None,
        mfu=e1.mfu * (flops / e1.flops) * (e1.step_time_s / step) if e1.flops else e1.mfu,
        time_by_phase_s=_lin_dict(e0.time_by_phase_s, e1.time_by_phase_s, lin),
        ops=(), modules=(), param_count=round(lin(e0.param_count, e1.param_count)),
        trainable_param_count=round(lin(e0.trainable_param_count, e1.trainable_param_count)),
        host_time_s=lin(e0.host_time_s, e1.host_time_s),
        device_time_s=lin(e0.device_time_s, e1.device_time_s),
        host_bound_fraction=max(0.0, waits / step), reserved=_reserved(e0, e1, peak),
        warnings=(*e1.warnings, f"extrapolated to {depth.layers} layers from traces at "
                  f"{depth.layers_text((l0, l1), ' and ')}"))


def near_the_line(est: Estimate) -> bool:
    """Whether the extrapolated step's memory lies within LEVER_MARGIN of the line the
    verdict draws (the allocator's limit, else the device's memory)."""
    if est.reserved is not None:
        used, line = est.reserved.peak_reserved_bytes, est.reserved.limit_bytes
    else:
        used, line = est.total_memory_bytes, est.device.memory_bytes
    return abs(used - line) <= LEVER_MARGIN * line


def _lin_dict(a: Mapping[str, Any], b: Mapping[str, Any], lin: Any, *,
              whole: bool = False) -> dict[str, Any]:
    out = {k: lin(a.get(k, 0), b.get(k, 0)) for k in {**a, **b}}
    return {k: round(v) for k, v in out.items()} if whole else out


def _reserved(e0: Estimate, e1: Estimate, peak: int) -> Any:
    """The caching allocator at full depth, as the planner extrapolates it
    (planner.search.reserved_of): under adapters on a frozen base, the extrapolated peak plus
    the bytes the deeper shallow replay reserved beyond its own; else the larger share
    beyond the peak of the two shallow replays (fragmentation is not affine: held inside
    what was measured)."""
    r1 = e1.reserved
    if e0.reserved is None or r1 is None:
        return r1
    if e1.trainable_param_count < e1.param_count:  # a frozen base: LoRA, QLoRA
        reserved = round(peak + fragmentation_ratio(e1) * e1.peak_memory_bytes)
    else:
        reserved = round(peak * (1 + max(fragmentation_ratio(e0), fragmentation_ratio(e1))))
    return replace(r1, peak_reserved_bytes=reserved, allocated_at_peak_bytes=peak,
                   peak_allocated_bytes=peak, fits=reserved <= r1.limit_bytes, released_bytes=0,
                   failed_request_bytes=None, failed_where=None,
                   notes=(*r1.notes, "extrapolated from shallower traces"))
