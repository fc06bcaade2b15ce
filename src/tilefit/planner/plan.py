"""plan(): the recipe that trains fastest (or smallest) on one GPU, predicted before the run."""

from __future__ import annotations

import time
from typing import Any

from tilefit.errors import TilefitError
from tilefit.estimator.offload import HOST_BANDWIDTH_BYTES_PER_S, PCIE_BYTES_PER_S, OffloadLink
from tilefit.estimator.zero_step import is_zero
from tilefit.hardware import Device, get_device
from tilefit.models import Workload
from tilefit.models.lora import require_peft
from tilefit.planner import configs, multiplan, notes, policy, rank, space
from tilefit.planner.checks import check_fraction, check_gpu
from tilefit.planner.result import Confirmation, Plan
from tilefit.planner.rows import PlanRow
from tilefit.planner.search import SWEEP_ACCUMULATION, Depth, depth_of
from tilefit.planner.state import PlanState
from tilefit.tracing.distributed import parallel_spec
from tilefit.vocab import Recipe

# The share of the GPU's memory a plan may use: the caching allocator fragments (PyTorch's
# CUDA memory notes: reserved exceeds allocated by a few to ~10 percent on long runs), so
# 10 percent is kept as headroom by default.
DEFAULT_MEMORY_FRACTION = 0.9


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
    check_gpu(device)
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
    p = PlanState(work, device, global_batch, budget, optimizer, depth, link, user,
                  world_size=world_size)
    hf_model = not work.is_factory
    if world_size > 1:
        p.notes.extend(notes.not_on_gpus(allow_peft=allow_peft, compile=compile,
                                         allow_optimizer_change=allow_optimizer_change))
        policy.trace_on_gpus(p, strategy, hf_model=hf_model)
    else:
        if allow_peft and hf_model:
            require_peft()  # before any tracing: LoRA is traced with the peft library itself
        policy.trace_recipes(p, optimizer, hf_model=hf_model, allow_peft=allow_peft,
                             allow_optimizer_change=allow_optimizer_change)
    rows = rank.rank(rank.prune_unfriendly(p.rows), objective, allow_optimizer_change)
    best, conf, reason, rows = policy.choose(p, rows, objective, allow_optimizer_change,
                                             confirm=confirm)
    multi = None if world_size > 1 else policy.when_nothing_fits(p, rows, optimizer,
                                                                 hf_model, budget)
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


__all__ = ["DEFAULT_MEMORY_FRACTION", "SWEEP_ACCUMULATION", "Confirmation", "Plan", "plan"]
