"""plan(): the recipe that trains fastest (or smallest) on one GPU, predicted before the run."""

from __future__ import annotations

import time
from typing import Any

from tilefit.compat.bitsandbytes import require_bitsandbytes
from tilefit.errors import TilefitError
from tilefit.estimator.offload import HOST_BANDWIDTH_BYTES_PER_S, PCIE_BYTES_PER_S, OffloadLink
from tilefit.estimator.zero_step import is_zero
from tilefit.hardware import Device, get_device
from tilefit.models import Workload
from tilefit.models.lora import require_peft
from tilefit.planner import configs, host, multiplan, notes, policy, rank, space
from tilefit.planner.api import DEFAULT_MEMORY_FRACTION, PlanSearch, searched_fields_note
from tilefit.planner.checks import check_fraction, check_gpu
from tilefit.planner.result import Confirmation, MultiGpuPlan, Plan
from tilefit.planner.rows import PlanRow
from tilefit.planner.search import SWEEP_ACCUMULATION, Depth, depth_of
from tilefit.planner.state import PlanState
from tilefit.recipe import Lora, Recipe
from tilefit.tracing.distributed import parallel_spec

# how a plan goes without LoRA when peft is missing, in Python words (the CLI: its flag)
_WITHOUT_LORA = "plan without LoRA (PlanSearch(allow_lora=False))"


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


def search_plan(model: str | Workload, *, gpu: str | Device, global_batch: int,
                seq_len: int | None, recipe: Recipe, search: PlanSearch,
                input_shape: tuple[int, ...] | None = None, task: str | None = None) -> Plan:
    """Search training recipes for ``model`` on ``gpu`` at a fixed global batch
    (tilefit.plan, tilefit.planner.api, is the public entry point).

    Every plan keeps micro_batch x accumulation_steps == global_batch. Recipes that keep the
    user's ``optimizer`` are searched first (precision the GPU supports, SDPA/eager attention,
    gradient checkpointing); CPU offload when none fits; other optimizers when allowed or
    when nothing else fits; a multi-GPU setup when nothing fits on one GPU. Each recipe is
    traced at two micro-batches (and, for deep models, two layer counts) and the rest of the
    sweep is predicted (``tilefit.planner.affine``); the chosen plan is traced in full.

    ``recipe.parallel.world_size`` > 1: plans for that many GPUs
    (``tilefit.planner.multiplan``): each strategy (every vocab.STRATEGIES when
    ``recipe.parallel.strategy`` is None) x micro-batch x accumulation x checkpointing x
    precision, traced as rank 0 of the real engine; memory per GPU, the throughput of all
    GPUs, configs that launch (``tilefit.planner.launch``).
    """
    started = time.perf_counter()
    device = _check(global_batch, recipe, search, gpu)
    work = _load(model, seq_len, input_shape, task)
    p = _state(work, device, global_batch, recipe, search)
    world_size, strategy = recipe.parallel.world_size, recipe.parallel.strategy
    optimizer, hf_model = p.optimizer, not work.is_factory
    if world_size > 1:
        if search.allow_lora and not hf_model:
            p.notes.append(notes.PEFT_FACTORY)
        p.notes.extend(notes.not_on_gpus(allow_quantize=search.allow_quantize,
                                         compile=recipe.compile is not None,
                                         allow_optimizer_change=search.allow_optimizer_change))
        lora = (search.lora or Lora()) if search.allow_lora and hf_model else None
        if lora is not None:  # before any tracing: LoRA is traced with the peft library
            require_peft(_WITHOUT_LORA)
        policy.trace_on_gpus(p, strategy, hf_model=hf_model, lora=lora)
    else:
        _trace_one_gpu(p, search, optimizer, hf_model)
    best, conf, reason, rows, multi = _choose(p, search, hf_model)
    reason = _host_said(p, rows, best, multi, search, reason)
    return Plan(
        model=work.name, device=device, global_batch=global_batch, seq_len=work.seq_len,
        objective=search.objective, memory_fraction=search.memory_fraction,
        budget_bytes=p.budget, overhead_bytes=budget_of(device, search.memory_fraction)[1],
        rows=tuple(rows), best=best, reason=reason, confirmation=conf,
        configs=_configs_of(best, work), multi_gpu=multi, notes=tuple(p.notes),
        traces=p.traces, wall_time_s=time.perf_counter() - started, world_size=world_size,
        host_budget=p.host)


def _trace_one_gpu(p: PlanState, search: PlanSearch, optimizer: str, hf_model: bool) -> None:
    """The one-GPU search's traces: what the user's recipe allows, and what ``search``
    allows beyond it (LoRA and QLoRA need their libraries before anything is traced)."""
    if (search.allow_lora or search.allow_quantize) and hf_model:
        require_peft(_WITHOUT_LORA)  # before any tracing: LoRA is traced with peft itself
    if search.allow_quantize and hf_model:
        # QLoRA's base: bitsandbytes' layers
        require_bitsandbytes("PlanSearch(allow_quantize=True)")
    policy.trace_recipes(p, optimizer, hf_model=hf_model, allow_peft=search.allow_lora,
                         allow_optimizer_change=search.allow_optimizer_change,
                         lora=search.lora, allow_quantize=search.allow_quantize)


def _choose(p: PlanState, search: PlanSearch, hf_model: bool
            ) -> tuple[PlanRow | None, Confirmation | None, str, list[PlanRow],
                       MultiGpuPlan | None]:
    """The chosen plan, confirmed (policy.choose), the ranked rows, and on one GPU the
    multi-GPU fallback when nothing fits (policy.when_nothing_fits). The fallback is
    searched first (it does not depend on the confirmation) so that its own confirming
    trace runs on a free core while this one confirms the one-GPU plan; its notes keep
    their place after the confirmation's."""
    change = search.allow_optimizer_change
    rows = rank.rank(rank.prune_unfriendly(p.rows), search.objective, change)
    mark = len(p.notes)
    fallback = None if p.world_size > 1 else policy.when_nothing_fits(
        p, rows, p.optimizer, hf_model, p.budget, allow_peft=search.allow_lora,
        lora=search.lora)
    later = p.notes[mark:]
    del p.notes[mark:]
    best, conf, reason, rows = policy.choose(p, rows, search.objective, change,
                                             confirm=search.confirm)
    p.notes.extend(later)
    return best, conf, reason, rows, policy.confirm_fallback(p, fallback)


def _host_said(p: PlanState, rows: list[PlanRow], best: PlanRow | None,
               multi: MultiGpuPlan | None, search: PlanSearch, reason: str) -> str:
    """Where the host's memory ruled out the plan the GPU alone would have chosen: a note
    saying so and what fits both; where nothing was chosen, the reason says it too. Where
    this machine's RAM is unknown and a row needs CPU memory: a note that it went
    unchecked."""
    if p.host is None:
        if any(r.host_memory_bytes is not None for r in rows):
            p.notes.append(host.UNREAD)
        return reason
    dropped = host.dropped_for_host(rows, search.objective, search.allow_optimizer_change)
    if dropped is None:
        return reason
    p.notes.append(host.over_host_note(dropped, p.host, best, multi))
    if best is not None:
        return reason
    return (f"{reason}; {host.engine_words(dropped)} fits the GPU, not the host's memory "
            "(see the notes)")


def _check(global_batch: int, recipe: Recipe, search: PlanSearch, gpu: str | Device
           ) -> Device:
    """The plan's inputs checked before any trace; the GPU planned for."""
    check_fraction(search.memory_fraction)
    rank.check_objective(search.objective)
    space.check_global_batch(global_batch)
    world_size, strategy = recipe.parallel.world_size, recipe.parallel.strategy
    # a whole number of GPUs, a known strategy (ZeRO's stages are checked by strategies_for)
    parallel_spec(world_size, None if is_zero(strategy) else strategy)
    if world_size > 1:
        multiplan.check_divisible(global_batch, world_size)
        multiplan.strategies_for(strategy, world_size)
    device = get_device(gpu)
    check_gpu(device)
    return device


def _state(work: Workload, device: Device, global_batch: int, recipe: Recipe,
           search: PlanSearch) -> PlanState:
    """The search's state: the budget, the offload link, the traced depth, and the user's
    recipe, whose fields the search does not vary every row keeps (PlanState.with_user)."""
    budget, _ = budget_of(device, search.memory_fraction)
    link = OffloadLink(search.pcie_bytes_per_s or PCIE_BYTES_PER_S,
                       search.host_bandwidth_bytes_per_s or HOST_BANDWIDTH_BYTES_PER_S)
    try:
        depth = depth_of(work, use_lever=search.layer_lever)
    except TilefitError:
        depth = Depth(None, 1, (1,))
    p = PlanState(work, device, global_batch, budget, _optimizer_name(recipe), depth, link,
                  recipe, world_size=recipe.parallel.world_size,
                  host=host.host_budget(search.host_memory_bytes, device))
    note = searched_fields_note(recipe)
    p.notes.extend([*recipe.notes, *([note] if note else [])])
    return p


def _optimizer_name(recipe: Recipe) -> str:
    if callable(recipe.optimizer):
        raise TilefitError("plan searches optimizers by name", expected="Recipe(optimizer="
                           "'adamw') or another name of tilefit.vocab.OPTIMIZER_NAMES",
                           given=repr(recipe.optimizer), fix="name the optimizer")
    return recipe.optimizer


def _configs_of(best: PlanRow | None, work: Workload) -> dict[str, Any]:
    if best is None:
        return {}
    if best.strategy is not None:
        return configs.multi_gpu_configs(best, work)
    return configs.single_gpu_configs(best, work.task, hf_model=not work.is_factory)


__all__ = ["DEFAULT_MEMORY_FRACTION", "SWEEP_ACCUMULATION", "Confirmation", "Plan",
           "search_plan"]
