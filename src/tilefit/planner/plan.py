"""plan(): the recipe that trains fastest (or smallest) on one GPU, predicted before the run."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from tilefit.errors import TilefitError
from tilefit.estimator.offload import (
    HOST_BANDWIDTH_BYTES_PER_S,
    PCIE_BYTES_PER_S,
    OffloadLink,
    offload_peak_bytes,
    offload_step_time_s,
)
from tilefit.estimator.zero_step import is_zero
from tilefit.hardware import Device, get_device
from tilefit.models import Workload
from tilefit.models.lora import require_peft
from tilefit.planner import configs, multiplan, rank, space
from tilefit.planner.affine import SweepModel
from tilefit.planner.multigpu import MAX_GPUS, smallest_setup
from tilefit.planner.rows import PlanRow
from tilefit.planner.search import (
    SWEEP_ACCUMULATION,
    Depth,
    depth_of,
    half_parameter_bytes,
    row_from,
    safe_sweep,
    trace_sample,
)
from tilefit.tracing.distributed import parallel_spec
from tilefit.vocab import ZERO_STRATEGIES, Recipe

# The share of the GPU's memory a plan may use: the caching allocator fragments (PyTorch's
# CUDA memory notes: reserved exceeds allocated by a few to ~10 percent on long runs), so
# 10 percent is kept as headroom by default.
DEFAULT_MEMORY_FRACTION = 0.9
MAX_CONFIRMS = 3
# When nothing fits one GPU: the GPU counts traced from the formula's fewest up
FALLBACK_GPU_COUNTS = 3


@dataclass(frozen=True)
class Confirmation:
    """The chosen plan traced in full, against the affine sweep's prediction."""

    affine_peak_bytes: int
    traced_peak_bytes: int
    affine_step_time_s: float
    traced_step_time_s: float

    @property
    def peak_error(self) -> float:
        return self.affine_peak_bytes / self.traced_peak_bytes - 1

    @property
    def time_error(self) -> float:
        return self.affine_step_time_s / self.traced_step_time_s - 1

    def to_dict(self) -> dict[str, Any]:
        return {"affine_peak_bytes": self.affine_peak_bytes,
                "traced_peak_bytes": self.traced_peak_bytes,
                "affine_step_time_s": self.affine_step_time_s,
                "traced_step_time_s": self.traced_step_time_s,
                "peak_error": self.peak_error, "time_error": self.time_error}


@dataclass(frozen=True)
class Plan:
    model: str
    device: Device
    global_batch: int
    seq_len: int | None
    objective: str
    memory_fraction: float
    budget_bytes: int  # device memory x fraction - CUDA context and workspaces
    overhead_bytes: int
    rows: tuple[PlanRow, ...]  # ranked; affine predictions
    best: PlanRow | None  # the chosen plan, with the figures of its confirming trace
    reason: str
    confirmation: Confirmation | None
    configs: dict[str, Any]
    multi_gpu: dict[str, Any] | None
    notes: tuple[str, ...] = field(default=())
    traces: int = 0
    wall_time_s: float = 0.0
    world_size: int = 1  # GPUs the plan is for (rows per GPU; --gpus)

    def to_dict(self) -> dict[str, Any]:
        best = None
        if self.best is not None:
            best = self.best.to_dict()
            if self.confirmation is not None:
                best["confirmation"] = self.confirmation.to_dict()
        return {
            "model": self.model, "gpu": self.device.name, "global_batch": self.global_batch,
            "seq_len": self.seq_len, "objective": self.objective,
            "memory_fraction": self.memory_fraction, "budget_bytes": self.budget_bytes,
            "overhead_bytes": self.overhead_bytes,
            "plans": [r.to_dict() for r in self.rows], "best": best, "reason": self.reason,
            "configs": self.configs, "multi_gpu": self.multi_gpu, "notes": list(self.notes),
            "traces": self.traces, "wall_time_s": self.wall_time_s,
            "world_size": self.world_size,
        }


def check_fraction(memory_fraction: float) -> None:
    if isinstance(memory_fraction, bool) or not isinstance(memory_fraction, int | float) \
            or not 0 < memory_fraction <= 1:
        raise TilefitError("the memory fraction must be in (0, 1]",
                           expected="the share of GPU memory a plan may use, e.g. 0.9",
                           given=repr(memory_fraction),
                           fix="pass --memory-fraction 0.9 (10% headroom for fragmentation)")


def budget_of(device: Device, memory_fraction: float) -> tuple[int, int]:
    from tilefit.estimator import overhead_bytes

    over = overhead_bytes(device)
    return int(device.memory_bytes * memory_fraction) - over, over


def _load(model: str | Workload, seq_len: int | None, input_shape: tuple[int, ...] | None,
          task: str | None) -> Workload:
    if isinstance(model, Workload):
        return model.with_seq_len(seq_len) if seq_len is not None else model
    from tilefit.models import load_workload

    return load_workload(model, seq_len=seq_len, input_shape=input_shape, task=task)


class _Planner:
    """The search's state: sweeps traced so far, rows, notes, the trace count."""

    def __init__(self, work: Workload, device: Device, global_batch: int, budget: int,
                 optimizer: str, depth: Depth, link: OffloadLink,
                 user: Recipe | None = None) -> None:
        self.work, self.device, self.global_batch = work, device, global_batch
        self.budget, self.optimizer, self.depth, self.link = budget, optimizer, depth, link
        # what every recipe keeps of the user's: the clip, the loop's loss read, the fused
        # loss and torch.compile (the last two may also be proposed)
        self.user = user or Recipe()
        friendly, others = space.micro_batch_candidates(global_batch)
        self.micro_batches = sorted(friendly + others)
        self.sweeps: dict[tuple[Recipe, bool], SweepModel] = {}
        self.tried: set[tuple[Recipe, bool]] = set()  # recipes swept (or that failed)
        self.rows: list[PlanRow] = []
        self.notes: list[str] = []
        self.traces = 0
        self.world_size = 1  # GPUs planned for (rows per GPU)

    def with_user(self, spec: Recipe) -> Recipe:
        """The recipe with the user's loop settings, as it is traced and keyed."""
        user = self.user
        return dataclasses.replace(spec, max_grad_norm=user.max_grad_norm,
                                   loss_sync=user.loss_sync,
                                   fused_ce=user.fused_ce or spec.fused_ce,
                                   compile=user.compile or spec.compile)

    def add(self, spec: Recipe, *, offload: bool = False) -> None:
        if (self.user.fused_ce or spec.fused_ce) and (self.user.compile or spec.compile):
            note = ("fused linear cross-entropy is not predicted under torch.compile "
                    "(docs/references.md, section 17): recipes with both are left out")
            if note not in self.notes:
                self.notes.append(note)
            return
        spec = self.with_user(spec)
        if (spec, offload) in self.tried:  # the user's flags can make two recipes one
            return
        self.tried.add((spec, offload))
        model = safe_sweep(self.work, spec, self.micro_batches, self.depth, self.device,
                           self.notes)
        self.traces += len(self.depth.traced) * len({min(self.micro_batches),
                                                     max(self.micro_batches)})
        if model is None and self.depth.lever and not self.sweeps:
            # the model may not build with fewer layers (per-layer config lists): trace it
            # at full depth instead
            self.notes.append("the model did not trace at fewer layers; traced at full depth")
            self.depth = Depth(None, self.depth.full, (self.depth.full,))
            model = safe_sweep(self.work, spec, self.micro_batches, self.depth, self.device,
                               self.notes)
            self.traces += len({min(self.micro_batches), max(self.micro_batches)})
        if model is None:
            return
        self.sweeps[(spec, offload)] = model
        for b in self.micro_batches:
            self.rows.append(row_from(
                spec, model, b, self.global_batch, self.depth, self.device, self.budget,
                self.work.tokens_per_sample, self.optimizer,
                offload=self.link if offload else None))

    def any_fits(self, *, allow_optimizer_change: bool, offload: bool) -> bool:
        """Whether a full fine-tuning plan (PEFT aside) of the kind fits."""
        return any(r.fits and not r.peft and (allow_optimizer_change or not r.changes_optimizer)
                   and (offload or not r.offload) for r in self.rows)

    def confirm(self, row: PlanRow) -> tuple[PlanRow, Confirmation]:
        spec = row.recipe
        s = trace_sample(self.work, spec, row.micro_batch, self.depth.full,
                         Depth(None, self.depth.full, (self.depth.full,)), self.device,
                         row.accumulation_steps, multiplan.parallel_of(row))
        self.traces += 1
        if row.offload and row.strategy is None:  # ZeRO-Offload: modelled in the sample
            params16 = half_parameter_bytes(s.parameters_bytes, row.precision)
            peak = offload_peak_bytes(params16, s.work_peak_bytes, s.param_count)
            step = offload_step_time_s(s.micro_time_s, row.accumulation_steps,
                                       s.param_count, self.link)
        else:
            peak = max(s.peak_bytes, s.peak_optimizer_bytes)
            step = row.accumulation_steps * s.micro_time_s + s.fixed_time_s
        conf = Confirmation(row.predicted_peak_memory_bytes, round(peak),
                            row.predicted_step_time_s, step)
        scale = row.predicted_step_time_s / step if step else 1.0
        tokens = row.tokens_per_s * scale if row.tokens_per_s is not None else None
        confirmed = dataclasses.replace(
            row, predicted_peak_memory_bytes=round(peak), predicted_step_time_s=step,
            samples_per_s=self.global_batch / step if step else 0.0, tokens_per_s=tokens,
            mfu=row.mfu * scale)
        return confirmed, conf


def plan(model: str | Workload, *, gpu: str | Device, global_batch: int,
         seq_len: int | None = None, memory_fraction: float = DEFAULT_MEMORY_FRACTION,
         objective: str = "throughput", optimizer: str = "adamw",
         allow_optimizer_change: bool = False, allow_peft: bool = False,
         max_grad_norm: float | None = None, loss_sync: bool = False, fused_ce: bool = False,
         compile: bool = False, input_shape: tuple[int, ...] | None = None, task: str | None = None,
         confirm: bool = True, layer_lever: bool | None = None,
         pcie_bytes_per_s: float | None = None,
         host_bandwidth_bytes_per_s: float | None = None,
         world_size: int = 1, strategy: str | None = None) -> Plan:
    """Search training recipes for ``model`` on ``gpu`` at a fixed global batch.

    Every plan keeps micro_batch x accumulation_steps == global_batch. Recipes that keep the
    user's ``optimizer`` are searched first (precision the GPU supports, SDPA/eager attention,
    gradient checkpointing); CPU offload when none fits; other optimizers when allowed or
    when nothing else fits; a multi-GPU setup when nothing fits on one GPU. Each recipe is
    traced at two micro-batches (and, for deep models, two layer counts) and the rest of the
    sweep is predicted (``tilefit.planner.affine``); the chosen plan is traced in full.

    ``world_size`` > 1: plans for that many GPUs (``tilefit.planner.multiplan``): each
    ``strategy`` (every vocab.STRATEGIES when None) x micro-batch x accumulation x
    checkpointing x precision, traced as rank 0 of the real engine; memory per GPU, the
    throughput of all GPUs, configs that launch (``tilefit.planner.launch``).
    """
    started = time.perf_counter()
    check_fraction(memory_fraction)
    rank.check_objective(objective)
    space.check_global_batch(global_batch)
    # a whole number of GPUs, a known strategy (ZeRO's stages are checked by strategies_for)
    parallel_spec(world_size, None if is_zero(strategy) else strategy)
    if world_size > 1:
        multiplan.check_divisible(global_batch, world_size)
        multiplan.strategies_for(strategy, world_size)
    device = get_device(gpu)
    if device.kind != "cuda":
        raise TilefitError("plan needs a GPU to plan for",
                           expected="a GPU from the catalog (`tilefit gpus`)",
                           given=device.name, fix="pass --gpu a100-80gb (or your GPU)")
    work = _load(model, seq_len, input_shape, task)
    budget, overhead = budget_of(device, memory_fraction)
    link = OffloadLink(pcie_bytes_per_s or PCIE_BYTES_PER_S,
                       host_bandwidth_bytes_per_s or HOST_BANDWIDTH_BYTES_PER_S)
    try:
        depth = depth_of(work, use_lever=layer_lever)
    except TilefitError:
        depth = Depth(None, 1, (1,))
    user = Recipe(max_grad_norm=max_grad_norm, loss_sync=loss_sync, fused_ce=fused_ce,
                  compile=compile)
    p = _Planner(work, device, global_batch, budget, optimizer, depth, link, user)
    p.world_size = world_size
    hf_model = not work.is_factory
    if world_size > 1:
        p.notes.extend(_not_on_gpus(allow_peft=allow_peft, compile=compile,
                                    allow_optimizer_change=allow_optimizer_change))
        _trace_on_gpus(p, world_size, strategy, hf_model=hf_model)
    else:
        if allow_peft and hf_model:
            require_peft()  # before any tracing: LoRA is traced with the peft library itself
        _trace_recipes(p, optimizer, hf_model=hf_model, allow_peft=allow_peft,
                       allow_optimizer_change=allow_optimizer_change)
    rows = rank.rank(rank.prune_unfriendly(p.rows), objective, allow_optimizer_change)
    best, conf, reason, rows = _choose(p, rows, objective, allow_optimizer_change,
                                       confirm=confirm)
    multi = None if world_size > 1 else _when_nothing_fits(p, rows, optimizer, hf_model,
                                                           budget)
    cfg = _configs_of(best, work)
    return Plan(
        model=work.name, device=device, global_batch=global_batch, seq_len=work.seq_len,
        objective=objective, memory_fraction=memory_fraction, budget_bytes=budget,
        overhead_bytes=overhead, rows=tuple(rows), best=best, reason=reason, confirmation=conf,
        configs=cfg, multi_gpu=multi, notes=tuple(p.notes), traces=p.traces,
        wall_time_s=time.perf_counter() - started, world_size=world_size)


def _configs_of(best: PlanRow | None, work: Workload) -> dict[str, Any]:
    if best is None:
        return {}
    if best.strategy is not None:
        return configs.multi_gpu_configs(best, work)
    return configs.single_gpu_configs(best, work.task)


def _not_on_gpus(*, allow_peft: bool, compile: bool, allow_optimizer_change: bool
                 ) -> list[str]:
    """Notes for the options a multi-GPU plan does not search yet."""
    out = [f"{flag} is not planned on several GPUs yet: ignored" for flag, on in (
        ("--allow-peft", allow_peft), ("--compile", compile),
        ("--allow-optimizer-change", allow_optimizer_change)) if on]
    out.append("on several GPUs other optimizers are not searched, and CPU offload only with "
               "DeepSpeed ZeRO-Offload (one GPU plans them: drop --gpus)")
    return out


def _trace_on_gpus(p: _Planner, world_size: int, strategy: str | None, *,
                   hf_model: bool, precisions: bool = True) -> None:
    """The rows of ``world_size`` GPUs: every engine x recipe, swept from traces."""
    depth = multiplan.multi_depth(p.depth)
    p.depth = depth  # the confirming trace and the notes follow the multi-GPU sweep
    setup = multiplan.MultiSpace(
        world_size, multiplan.strategies_for(strategy, world_size),
        tuple(multiplan.multi_recipes(p.device, p.optimizer, hf_model=hf_model,
                                      precisions=precisions)), depth)
    rows, traces = multiplan.search_rows(p.work, p.device, p.global_batch, p.budget,
                                         p.optimizer, setup, p.with_user, p.notes)
    p.rows.extend(rows)
    p.traces += traces
    if depth.lever:
        where = f"on {world_size} ranks" if set(setup.strategies) - set(ZERO_STRATEGIES) \
            else "on one GPU (DeepSpeed ZeRO modelled on it)"
        p.notes.insert(0, f"deep model: each recipe traced {where} at "
                       f"{', '.join(map(str, depth.traced))} of {depth.full} layers and "
                       "extrapolated (affine in the layer count)")


def _trace_recipes(p: _Planner, optimizer: str, *, hf_model: bool, allow_peft: bool,
                   allow_optimizer_change: bool) -> None:
    """The user's optimizer first; LoRA when allowed; CPU offload when nothing fits; other
    optimizers when allowed or when still nothing fits."""
    device = p.device
    if allow_peft and not hf_model:
        p.notes.append("PEFT/LoRA is planned for Hugging Face models only (the adapters wrap "
                       "their linear layers): --allow-peft adds no plans for a factory")
    for spec in space.base_recipes(device, optimizer, hf_model=hf_model):
        p.add(spec)
    for spec in space.same_math_recipes(device, optimizer,
                                        causal_lm=hf_model and p.work.task == "causal-lm"):
        p.add(spec)
    for spec in space.fp8_recipes(device, optimizer, hf_model=hf_model):
        p.add(spec)
    if allow_peft and hf_model:
        for spec in space.peft_recipes(device, optimizer):
            p.add(spec)
    if not p.any_fits(allow_optimizer_change=False, offload=False):
        off_prec = "bf16" if device.supports("bf16") else space.precisions(device)[0]
        att = "sdpa" if hf_model else "auto"
        for ckpt in (False, True):
            p.add(Recipe(precision=off_prec, optimizer=optimizer, grad_checkpointing=ckpt,
                         attention=att), offload=True)
    if allow_optimizer_change or not p.any_fits(allow_optimizer_change=False, offload=True):
        for spec in space.optimizer_recipes(device, optimizer, hf_model=hf_model):
            p.add(spec)
    if p.depth.lever:
        p.notes.insert(0, "deep model: each recipe traced at "
                       f"{', '.join(map(str, p.depth.traced))} of {p.depth.full} layers and "
                       "extrapolated (affine in the layer count)")


def _choose(p: _Planner, rows: list[PlanRow], objective: str, allow_change: bool, *,
            confirm: bool) -> tuple[PlanRow | None, Confirmation | None, str, list[PlanRow]]:
    """The best plan that fits, confirmed by a full trace (the next one when the full trace
    does not fit). The confirmed figures replace the chosen row's in the table: one plan,
    one set of figures."""
    candidates = [r for r in rows if r.fits]
    for _ in range(MAX_CONFIRMS):
        chosen = rank.choose(candidates, objective, allow_change)
        if chosen is None:
            break
        reason = _why(chosen, rows, objective, allow_change)
        if not confirm:
            return chosen, None, reason, rows
        confirmed, conf = p.confirm(chosen)
        if confirmed.fits:
            return confirmed, conf, reason, [confirmed if r is chosen else r for r in rows]
        p.notes.append(f"{chosen.recipe_label()} at micro-batch {chosen.micro_batch}: the full "
                       f"trace needs {confirmed.predicted_peak_memory_bytes / 2**30:.1f} GiB, "
                       "over the budget; next plan tried")
        candidates = [r for r in candidates if r is not chosen]
    where = f"one {p.device.display_name}" if p.world_size == 1 else \
        f"{p.world_size} x {p.device.display_name}"
    reason = (f"nothing fits on {where} "
              f"(budget {p.budget / 2**30:.1f} GiB per GPU) at global batch {p.global_batch}")
    return None, None, reason, rows


def _when_nothing_fits(p: _Planner, rows: list[PlanRow], optimizer: str, hf_model: bool,
                       budget: int) -> dict[str, Any] | None:
    """When no plan keeps the optimizer on one GPU: a note with the smallest one, and the
    fewest GPUs that would fit."""
    keeps = [r for r in rows if not r.offload and not r.changes_optimizer and not r.peft]
    if not keeps or any(r.fits for r in keeps):
        return None
    smallest = min(keeps, key=lambda r: r.predicted_peak_memory_bytes)
    p.notes.append(
        f"with {optimizer} on the GPU alone nothing fits: the smallest plan "
        f"({smallest.recipe_label()}, micro-batch {smallest.micro_batch}) needs "
        f"{smallest.predicted_peak_memory_bytes / 2**30:.1f} GiB of "
        f"{budget / 2**30:.1f} GiB")
    return _multi_gpu(p, optimizer, hf_model, budget)


def _why(row: PlanRow, rows: list[PlanRow], objective: str, allow_change: bool) -> str:
    fits = [r for r in rows if r.fits]
    what = ("the most samples/s" if objective == "throughput" else "the smallest peak memory")
    tiers = {0: "keeps your training algorithm on the GPU",
             1: "no plan fits with the optimizer on the GPU; CPU offload keeps the algorithm",
             2: "nothing else fits: it CHANGES THE OPTIMIZER"}
    t = rank.tier(row, allow_change)
    how = tiers[t]
    if row.changes_optimizer and allow_change:
        how = f"it changes the optimizer to {row.optimizer} (allowed)"
    if row.peft:
        how = "it trains LoRA adapters instead of the full model (allowed by --allow-peft)"
    gpus = f" x {row.world_size} GPUs ({row.strategy})" if row.strategy else ""
    return (f"{what} of the {len(fits)} plans that fit the budget; "
            f"{how}; micro-batch {row.micro_batch} x {row.accumulation_steps} "
            f"accumulation steps{gpus} = global batch {row.global_batch}")


def _multi_gpu(p: _Planner, optimizer: str, hf_model: bool, budget: int
               ) -> dict[str, Any] | None:
    """The fewest GPUs that fit, from traces: the ZeRO-3 formula (tilefit.planner.multigpu)
    only proposes where to start; each engine x recipe is then traced on that many ranks
    (tilefit.planner.multiplan), and on the next GPU counts dividing the global batch when
    nothing traced fits."""
    first = _formula_gpus(p, optimizer, hf_model, budget)
    if first is None:
        return {"gpus": None, "note": f"no sharded setup of up to {MAX_GPUS} GPUs fits "
                "(ZeRO-3 formula)"}
    for gpus in multiplan.candidate_world_sizes(p.global_batch, first, FALLBACK_GPU_COUNTS):
        sub = _Planner(p.work, p.device, p.global_batch, budget, optimizer, p.depth, p.link,
                       p.user)
        sub.world_size = gpus
        _trace_on_gpus(sub, gpus, None, hf_model=hf_model, precisions=False)
        p.traces += sub.traces
        best = multiplan.best_fitting(sub.rows)
        if best is None:
            continue
        confirmed, conf = sub.confirm(best)
        p.traces += 1
        return {"gpus": gpus, "engine": confirmed.strategy,
                "micro_batch": confirmed.micro_batch,
                "accumulation_steps": confirmed.accumulation_steps,
                "predicted_per_gpu_memory_bytes": confirmed.predicted_peak_memory_bytes,
                "fits": confirmed.fits, "step_time_s": confirmed.predicted_step_time_s,
                "samples_per_s_all_gpus": confirmed.samples_per_s,
                "confirmation": conf.to_dict(), "formula_gpus": first,
                "recipe": {"precision": confirmed.precision, "optimizer": optimizer,
                           "grad_checkpointing": confirmed.grad_checkpointing,
                           "attention": confirmed.attention},
                "plans": [r.to_dict() for r in rank.rank(sub.rows, "throughput", False)[:8]],
                "configs": configs.multi_gpu_configs(confirmed, p.work),
                "model": _engine_model(confirmed.strategy, gpus)}
    return {"gpus": None, "note": f"nothing traced fits on {first} or the next "
            f"{FALLBACK_GPU_COUNTS - 1} GPU counts dividing global batch {p.global_batch}"}


def _engine_model(strategy: str | None, gpus: int) -> str:
    """How the chosen engine's figures were made, in words."""
    if is_zero(strategy):
        return (f"modelled: DeepSpeed {strategy} on {gpus} GPUs on top of one-GPU traces "
                "(DeepSpeed's engine does not run on fake tensors), its peak per GPU and its "
                "step with the communication the compute does not hide")
    return (f"traced: rank 0 of {gpus} under {strategy} (PyTorch's fake process group), its "
            "peak per GPU and its step with the communication the compute does not hide")


def _formula_gpus(p: _Planner, optimizer: str, hf_model: bool, budget: int) -> int | None:
    """The ZeRO-3 formula's fewest GPUs (a fast prefilter): model state of the mixed-precision
    sweep divided by N plus the 16-bit working set of the offload sweep."""
    att = "sdpa" if hf_model else "auto"
    mixed_recipe = p.with_user(Recipe(precision=space.precisions(p.device)[0],
                                      optimizer=optimizer, attention=att))
    mixed = p.sweeps.get((mixed_recipe, False))
    if mixed is None:
        return None
    layers = p.depth.full if p.depth.lever else None
    fewest: int | None = None
    for (spec, offload), model16 in p.sweeps.items():
        if not offload:
            continue
        cands = []
        for b in p.micro_batches:
            x = mixed.predict_all(b, layers)
            y = model16.predict_all(b, layers)
            state = x["parameters_bytes"] + x["gradients_bytes"] + x["optimizer_state_bytes"]
            params16 = half_parameter_bytes(y["parameters_bytes"], spec.precision)
            cands.append((b, state, params16, y["work_peak_bytes"], y["micro_time_s"]))
        setup = smallest_setup(p.global_batch, cands, p.depth.full, budget)
        if setup is not None and (fewest is None or setup.gpus < fewest):
            fewest = setup.gpus
    return fewest


__all__ = ["DEFAULT_MEMORY_FRACTION", "SWEEP_ACCUMULATION", "Confirmation", "Plan", "plan"]
