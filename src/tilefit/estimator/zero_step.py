"""One rank's step under DeepSpeed ZeRO, modelled on the one-GPU trace (estimator/zero.py).

- Memory: the larger of two points. Forward/backward: at every point of the one-GPU
  trace, its activations, temporaries and inputs (ZeRO does not partition them) plus
  DeepSpeed's model states and buffers as they stand once backward has made the
  gradients the trace has made by then (estimator/zero.py, ``zero_points``). The
  optimizer step: its peak, the traced step's temporaries sized for one flat fp32
  partition, and DeepSpeed's states at the step. Measured against DeepSpeed's engine on
  the CPU: docs/references.md, section 24, items 3 and 4.
- Time: the traced step, its optimizer phases over one partition (1/N of the parameters),
  plus the collectives that the compute does not hide (estimator/collectives.py's ring
  formulas and overlap rule); with ``offload`` the optimizer step runs on the CPU instead,
  its PCIe copies and CPU-Adam step added (the ZeRO-Offload model of estimator/offload.py).
  The module rows (Estimate.modules) are rewritten the same way, so they add up to the
  modelled step as a traced estimate's do.
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from typing import Any

from tilefit.dtypes import parse_dtype
from tilefit.estimator.collectives import (
    ParallelSummary,
    bus_bandwidth_bytes_per_s,
    collective_time_s,
    exposed_s,
    link_description,
)
from tilefit.estimator.offload import OffloadLink, offload_step_time_s
from tilefit.estimator.result import (
    EXPOSED_COMMUNICATION,
    OUTSIDE_MODULES,
    Estimate,
    ModuleSummary,
)
from tilefit.estimator.zero import (
    DEEPSPEED_DEFAULTS,
    MASTER_BYTES,
    ZeroCollective,
    ZeroConfig,
    ZeroInputs,
    ZeroMemory,
    zero_collectives,
    zero_memory,
    zero_points,
    zero_stage,
)
from tilefit.hardware import Device
from tilefit.recipe import ONE_GPU, Recipe
from tilefit.tracing.records import Trace
from tilefit.vocab import (
    MICRO_PHASES,
    OPTIMIZER_PHASES,
    ZERO_STRATEGIES,
    parse_precision,
)

STATE_CATEGORIES = ("parameters", "gradients", "optimizer_state")
# the row of Estimate.modules for ZeRO-Offload's PCIe copies and CPU-Adam step
OFFLOAD_ROW = "(ZeRO-Offload: optimizer step on the CPU, PCIe copies)"


def is_zero(strategy: str | None) -> bool:
    return strategy is not None and str(strategy).strip().lower() in ZERO_STRATEGIES


def traced_recipe(recipe: Recipe) -> Recipe:
    """The recipe to trace: ZeRO is modelled on the one-GPU trace (tilefit.estimator.zero);
    DDP and FSDP2 are traced as they are."""
    if is_zero(recipe.parallel.strategy):
        return replace(recipe, parallel=ONE_GPU)
    return recipe


def zero_inputs(tr: Trace) -> ZeroInputs:
    """Psi, bytes per weight, the optimizer's state per parameter (what the trace's optimizer
    keeps after its step) and the largest parameter tensor, standing for DeepSpeed's largest
    layer (a module's own parameters: the bias it leaves out is small beside the weight)."""
    w = parse_dtype(parse_precision(tr.precision).param_dtype).bytes
    psi = max(tr.trainable_param_count, 1)
    state = sum(s.nbytes for s in tr.storages
                if s.category == "optimizer_state" and s.free_at is None)
    sizes = tuple(s.nbytes // w for s in tr.storages
                  if s.category == "parameters" and s.alloc_at < 0)
    # the tracer registers model.parameters() (DeepSpeed's flattening order) before the
    # buffers
    sizes = sizes[:tr.trainable_param_tensors or len(sizes)]
    # DeepSpeed's optimizer steps the fp32 partition (stage_1_and_2.py:577, stage3.py:1172),
    # so its state is fp32 whatever the weights: a 16-bit trace's state, widened
    state *= MASTER_BYTES / w
    return ZeroInputs(params=psi, weight_bytes=w, optimizer_bytes_per_param=state / psi,
                      largest_layer_params=max(sizes, default=0), param_sizes=sizes)


def estimate_zero(base: Estimate, tr: Trace, device: Device, strategy: str, world_size: int,
                  *, offload: bool = False, config: ZeroConfig = DEEPSPEED_DEFAULTS,
                  peaks: ZeroPeaks | None = None) -> Estimate:
    """``base`` (the one-GPU estimate of ``tr``) as one of ``world_size`` ranks under
    ZeRO ``strategy`` ("zero1", "zero2", "zero3"); ``peaks``: its ``zero_peaks`` when the
    caller has them already (the planner keeps all three)."""
    stage = zero_stage(strategy)
    strategy = ZERO_STRATEGIES[stage - 1]
    inp = zero_inputs(tr)
    mem = zero_memory(inp, stage, world_size, offload=offload, config=config,
                      gpus_per_node=device.gpus_per_node)
    if peaks is None:
        peaks = ZeroPeaks(*_peak_points(tr, inp, stage, world_size, offload, config))
    # the larger of the forward/backward point and the optimizer step's (module docstring)
    breakdown = max((peaks.micro, peaks.step), key=lambda p: sum(p.values()))
    peak = sum(breakdown.values())
    collectives = zero_collectives(inp, stage, base.accumulation_steps, config)
    by_phase, exposed = _communication(collectives, world_size, device, base.time_by_phase_s)
    phases = _partitioned_phases(base.time_by_phase_s, world_size, offload)
    saved = sum(base.time_by_phase_s.values()) - sum(phases.values())
    offload_s = _offload_s(inp.params / world_size) if offload else 0.0
    step = base.step_time_s - saved + sum(exposed.values()) + offload_s
    summary = ParallelSummary(
        strategy=strategy, world_size=world_size, link=link_description(device, world_size),
        bus_bandwidth_bytes_per_s=bus_bandwidth_bytes_per_s(device, world_size),
        communication_time_s=sum(by_phase.values()),
        exposed_communication_s=sum(exposed.values()), communication_by_phase_s=by_phase,
        one_gpu_step_time_s=base.step_time_s, step_time_s=step,
        samples_per_step=base.samples_per_step, tokens_per_step=base.tokens_per_step,
        modelled=True, details=_details(mem, collectives, offload_s),
        exposed_by_phase_s=exposed)
    return dataclasses.replace(
        base, peak_memory_bytes=peak, memory_breakdown=breakdown, step_time_s=step,
        samples_per_s=base.samples_per_step / step if step else 0.0,
        tokens_per_s=base.tokens_per_step / step if (base.tokens_per_step and step) else None,
        mfu=base.mfu * base.step_time_s / step if step else 0.0, time_by_phase_s=phases,
        modules=_rank_modules(base.modules, phases, base.time_by_phase_s,
                              sum(exposed.values()), offload_s),
        warnings=(*base.warnings, _note(strategy, world_size, offload)), parallel=summary)


@dataclasses.dataclass(frozen=True)
class ZeroPeaks:
    """One rank's peak bytes by category under ZeRO, as the planner's sweep keeps them
    (tilefit.planner.sample): over forward/backward, over micro-batch 0 only (the peak
    without accumulation), and over the optimizer step."""

    micro: dict[str, int]
    micro_first: dict[str, int]
    step: dict[str, int]


def zero_peaks(tr: Trace, strategy: str, world_size: int, *, offload: bool = False,
               config: ZeroConfig = DEEPSPEED_DEFAULTS) -> ZeroPeaks:
    """The three peaks of one rank of ``world_size`` under ZeRO ``strategy``, modelled on
    the one-GPU trace ``tr`` (the same points as estimate_zero's peak)."""
    return ZeroPeaks(*_peak_points(tr, zero_inputs(tr), zero_stage(strategy), world_size,
                                   offload, config))


def _peak_points(tr: Trace, inp: ZeroInputs, stage: int, world_size: int, offload: bool,
                 config: ZeroConfig) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """The largest point of forward/backward, of micro-batch 0's, and the optimizer step's."""
    rounded = tr.target.kind == "cuda"
    _, opt = tr.phase_peak_indices(rounded=rounded)
    flat = 0.0 if offload else _flat_step_share(tr, inp, world_size)
    micro: dict[str, int] = {}
    first: dict[str, int] = {}
    states: dict[int, dict[str, int]] = {}
    for j, at in _micro_breakdowns(tr, rounded):
        made = at.get("gradients", 0)
        if made not in states:
            states[made] = zero_points(inp, stage, world_size, offload=offload, config=config,
                                       grads_made=made)[0]
        point = _point(at, states[made], 1.0)
        if sum(point.values()) > sum(micro.values()):
            micro = point
        op = tr.ops[j - 1] if 0 < j <= len(tr.ops) else None
        if (op is None or op.micro == 0) and sum(point.values()) > sum(first.values()):
            first = point
    step = zero_points(inp, stage, world_size, offload=offload, config=config)[1]
    return micro, first, _point(tr.breakdown_at(opt, rounded=rounded), step, flat)


def _point(at: dict[str, int], state: dict[str, int], scale: float) -> dict[str, int]:
    others = {c: int(v * scale) if c == "temporaries" else v
              for c, v in at.items() if c not in STATE_CATEGORIES}
    return {**{c: v for c, v in state.items() if c != "communication"}, **others,
            "communication": others.get("communication", 0) + state["communication"]}


def _micro_breakdowns(tr: Trace, rounded: bool) -> list[tuple[int, dict[str, int]]]:
    """(timeline index, live bytes by category) at every point of forward/backward (the
    micro-batch phases), by one sweep over the storages."""
    n = tr.n_events + 2
    deltas = {c: [0] * (n + 1) for c in tr.categories}
    for s in tr.storages:
        nbytes = tr.target.round(s.nbytes) if rounded else s.nbytes
        born = max(s.alloc_at + 1, 0)
        dead = n if s.free_at is None else min(s.free_at + 1, n)
        deltas[s.category][min(born, n)] += nbytes
        deltas[s.category][dead] -= nbytes
    live = dict.fromkeys(tr.categories, 0)
    out = []
    for j in range(n):
        for c in live:
            live[c] += deltas[c][j]
        op = tr.ops[j - 1] if 0 < j <= len(tr.ops) else None
        if op is None or op.phase in MICRO_PHASES:
            out.append((j, dict(live)))
    return out


def _flat_step_share(tr: Trace, inp: ZeroInputs, world_size: int) -> float:
    """DeepSpeed steps its optimizer on one flat partition of Psi / N elements, so the
    step's temporaries are those of one tensor that size: the traced step's temporaries
    times Psi / N over the elements the traced optimizer takes at once (every parameter
    for a multi-tensor (foreach, fused) step, the largest tensor for a per-tensor loop),
    widened to fp32."""
    multi = any(o.multi_tensor is not None for o in tr.ops if o.phase in OPTIMIZER_PHASES)
    at_once = inp.params if multi or not inp.largest_layer_params else inp.largest_layer_params
    # in fp32, as the partition is, whatever the traced weights
    return inp.params / world_size / at_once * MASTER_BYTES / inp.weight_bytes


def _communication(collectives: tuple[ZeroCollective, ...], world_size: int, device: Device,
                   compute_by_phase_s: dict[str, float]
                   ) -> tuple[dict[str, float], dict[str, float]]:
    """Each phase's collectives in order (every micro-batch's), their sum and what the
    phase's compute does not hide."""
    times: dict[str, list[float]] = {}
    for c in collectives:
        one = collective_time_s(c.name, c.nbytes, world_size, device)
        times.setdefault(c.phase, []).extend([one] * (c.count * c.repeats))
    by_phase = {p: sum(t) for p, t in times.items()}
    exposed = {p: exposed_s(p, t, compute_by_phase_s.get(p, 0.0)) for p, t in times.items()}
    return by_phase, exposed


def _partitioned_phases(one_gpu: dict[str, float], world_size: int, offload: bool
                        ) -> dict[str, float]:
    """Phase times on one rank: the optimizer phases step one partition (none on the GPU
    with offload)."""
    share = 0.0 if offload else 1 / world_size
    return {p: t * share if p in OPTIMIZER_PHASES else t for p, t in one_gpu.items()}


def _rank_modules(one_gpu: tuple[ModuleSummary, ...], phases: dict[str, float],
                  one_gpu_phases: dict[str, float], exposed_s: float, offload_s: float
                  ) -> tuple[ModuleSummary, ...]:
    """The one-GPU trace's module rows as one rank's: the optimizer phases' rows scaled as
    their phases are (one partition; none on the GPU with offload), the communication
    not hidden and the offloaded step as rows of their own, so the rows add up to the
    modelled step time as Estimate.modules' do."""
    scale = {OUTSIDE_MODULES[p]: phases[p] / t for p, t in one_gpu_phases.items()
             if p in OPTIMIZER_PHASES and t > 0}
    rows = [replace(m, time_s=m.time_s * scale.get(m.module, 1.0),
                    flops=round(m.flops * scale.get(m.module, 1.0)),
                    bytes=round(m.bytes * scale.get(m.module, 1.0))) for m in one_gpu
            if m.module != EXPOSED_COMMUNICATION]
    rest = {EXPOSED_COMMUNICATION: exposed_s, OFFLOAD_ROW: offload_s}
    rows += [ModuleSummary(k, v, 0, 0, 0) for k, v in rest.items() if v > 0]
    return tuple(sorted(rows, key=lambda s: -s.time_s))


def _offload_s(partition_params: float) -> float:
    """The partition's 16-bit gradients to the CPU and parameters back over PCIe, and the
    CPU-Adam step (estimator/offload.py's ZeRO-Offload model, no overlap: an upper bound)."""
    return offload_step_time_s(0.0, 0, partition_params, OffloadLink())


def _details(mem: ZeroMemory, collectives: tuple[ZeroCollective, ...], offload_s: float
             ) -> dict[str, Any]:
    return {"memory": mem.to_dict(),
            "collectives": [dataclasses.asdict(c) for c in collectives],
            "offload_time_s": offload_s}


def _note(strategy: str, world_size: int, offload: bool) -> str:
    cpu = ", optimizer offloaded to the CPU" if offload else ""
    return (f"modelled, not traced: DeepSpeed {strategy} on {world_size} GPUs{cpu} "
            "(DeepSpeed's engine does not run on fake tensors): per-GPU model states as "
            "DeepSpeed's estimate_zero2/zero3_model_states_mem_needs count them, its default "
            "buffers, and its collectives on top of the one-GPU trace "
            "(docs/references.md, section 24, item 2)")
