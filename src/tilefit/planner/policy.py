"""The planner's policy: which recipes are traced and in what order, which plan is chosen
(confirmed by a full trace), and the fewest GPUs that fit when nothing fits one."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from tilefit.planner import configs, multiplan, notes, rank, space
from tilefit.planner.affine import SweepModel
from tilefit.planner.multigpu import smallest_setup
from tilefit.planner.result import Confirmation, MultiGpuPlan
from tilefit.planner.rows import PlanRow
from tilefit.planner.search import STATE_METRICS, half_parameter_bytes
from tilefit.planner.state import PlanState, state_kind
from tilefit.recipe import Lora, Recipe
from tilefit.vocab import ZERO_STRATEGIES

MAX_CONFIRMS = 3
# When nothing fits one GPU: the GPU counts traced from the formula's fewest up
FALLBACK_GPU_COUNTS = 3
# ... and how many of that GPU count's plans the fallback shows (by throughput)
FALLBACK_PLANS_SHOWN = 8


def trace_on_gpus(p: PlanState, strategy: str | None, *, hf_model: bool,
                  precisions: bool = True, replica_state_bytes: float | None = None,
                  shown: int | None = None, said: list[str] | None = None,
                  traced_done: Callable[[list[PlanRow]], object] | None = None,
                  lora: Lora | None = None) -> None:
    """The rows of ``p.world_size`` GPUs: every engine x recipe, swept from traces (DDP
    skipped where multiplan.replica_skipped says, named in ``said``; ``traced_done``:
    multiplan.MultiSpace's; ``lora``: also LoRA with these adapters, --allow-peft)."""
    world_size, depth = p.world_size, p.depth
    strategies = multiplan.strategies_for(strategy, world_size)
    recipes = multiplan.multi_recipes(p.device, p.optimizer, hf_model=hf_model,
                                      precisions=precisions, lora=lora)
    if any(r.peft for r in recipes) and set(strategies) & set(ZERO_STRATEGIES):
        p.notes.append(multiplan.PEFT_NOT_ON_ZERO)
    setup = multiplan.MultiSpace(
        world_size, strategies, tuple(recipes), depth,
        replica_state_bytes=replica_state_bytes, shown=shown, traced_done=traced_done)
    rows, traces = multiplan.search_rows(p.work, p.device, p.global_batch, p.budget,
                                         p.optimizer, setup, p.with_user, p.notes, said)
    p.add_rows(rows, traces)
    if depth.lever:
        where = f"on {world_size} ranks" if set(setup.strategies) - set(ZERO_STRATEGIES) \
            else "on one GPU (DeepSpeed ZeRO modelled on it)"
        p.notes.insert(0, notes.deep_model(depth, where))


def trace_recipes(p: PlanState, optimizer: str, *, hf_model: bool, allow_peft: bool,
                  allow_optimizer_change: bool, lora: Lora | None = None,
                  allow_quantize: bool = False) -> None:
    """The user's optimizer first; LoRA (``lora``'s adapters, default Lora()) and QLoRA when
    allowed; CPU offload when nothing fits; other optimizers when allowed or when still
    nothing fits."""
    device = p.device
    if (allow_peft or allow_quantize) and not hf_model:
        p.notes.append(notes.PEFT_FACTORY)
    for spec in space.base_recipes(device, optimizer, hf_model=hf_model):
        p.add(spec)
    for spec in space.same_math_recipes(device, optimizer,
                                        causal_lm=hf_model and p.work.task == "causal-lm"):
        p.add(spec)
    for spec in space.fp8_recipes(device, optimizer, hf_model=hf_model):
        p.add(spec)
    experts = hf_model and bool((p.work.config or {}).get("num_experts_per_tok"))
    for spec in space.moe_recipes(device, optimizer, experts=experts):
        p.add(spec)
    if allow_peft and hf_model:
        peft = space.peft_recipes(device, optimizer, lora or Lora())
        for spec in peft + space.compiled(device, peft):
            p.add(spec)
    if allow_quantize and hf_model:
        qlora = space.qlora_recipes(device, optimizer, lora)
        for spec in qlora + space.compiled(device, qlora):
            p.add(spec)
    if not p.any_fits(allow_optimizer_change=False, offload=False):
        off_prec = "bf16-true" if device.supports("bf16") else space.precisions(device)[0]
        att = "sdpa" if hf_model else "auto"
        for ckpt in (False, True):
            p.add(Recipe(precision=off_prec, optimizer=optimizer, grad_checkpointing=ckpt,
                         attention=att), offload=True)
    if allow_optimizer_change or not p.any_fits(allow_optimizer_change=False, offload=True):
        for spec in space.optimizer_recipes(device, optimizer, hf_model=hf_model):
            p.add(spec)
    said = p.state_note()
    if said is not None:
        p.notes.append(said)
    if p.depth.lever:
        p.notes.insert(0, notes.deep_model(p.depth))


def choose(p: PlanState, rows: list[PlanRow], objective: str, allow_change: bool, *,
           confirm: bool) -> tuple[PlanRow | None, Confirmation | None, str, list[PlanRow]]:
    """The best plan that fits, confirmed by a full trace (the next one when the full trace
    does not fit). The confirmed figures replace the chosen row's in the table: one plan,
    one set of figures."""
    candidates = [r for r in rows if r.fits]
    # a plan that fits only by the allocator releasing its cache every step: chosen only
    # when no other confirmed plan fits (its step time leaves the releases out)
    releasing: tuple[PlanRow, Confirmation, str] | None = None
    for _ in range(MAX_CONFIRMS):
        chosen = rank.choose(candidates, objective, allow_change)
        if chosen is None:
            break
        reason = notes.why(chosen, rows, objective, allow_change)
        if not confirm:
            return chosen, None, reason, rows
        confirmed, conf = p.confirm(chosen)
        candidates = [r for r in candidates if r is not chosen]
        if confirmed.fits:
            rows = [confirmed if r is chosen else r for r in rows]
        if confirmed.fits and not confirmed.steady_alloc_retries:
            return confirmed, conf, reason, releasing_last(rows)
        if confirmed.fits:
            p.notes.append(notes.releasing(confirmed))
            releasing = releasing or (confirmed, conf, reason)
        else:
            p.notes.append(notes.over_budget(chosen, confirmed))
    if releasing is not None:  # kept first: the plan chosen, for want of one without
        chosen = releasing[0]
        return (*releasing, [chosen, *(r for r in releasing_last(rows) if r is not chosen)])
    reason = notes.nothing_fits(p.device, p.world_size, p.budget, p.global_batch)
    return None, None, reason, rows


def releasing_last(rows: list[PlanRow]) -> list[PlanRow]:
    """The ranked rows with those that fit only by releasing the allocator's cache moved
    after the other fitting rows (rank.rank's order for them)."""
    fit = [r for r in rows if r.fits]
    return ([r for r in fit if not r.steady_alloc_retries]
            + [r for r in fit if r.steady_alloc_retries] + [r for r in rows if not r.fits])


def when_nothing_fits(p: PlanState, rows: list[PlanRow], optimizer: str, hf_model: bool,
                      budget: int, *, allow_peft: bool = True,
                      lora: Lora | None = None) -> Fallback | None:
    """When no plan keeps the optimizer on one GPU: a note with the smallest one (over
    every micro-batch, the unfriendly ones ``rows`` pruned included), what LoRA would need
    when --allow-peft was not given (``allow_peft`` False), and the fewest GPUs that would
    fit, searched (``confirm_fallback`` confirms it). Nothing here depends on the one-GPU
    plan's confirmation (``choose``): a confirmed row replaces a chosen one only where both
    fit, and fitting decides everything here."""
    def keeps(r: PlanRow) -> bool:
        return not r.offload and not r.changes_optimizer and not r.peft

    kept = [r for r in (*rows, *p.rows) if keeps(r)]
    if not kept or any(r.fits for r in kept):
        return None
    smallest = min(kept, key=lambda r: (r.memory_bytes, -r.samples_per_s))
    p.notes.append(notes.smallest_on_one_gpu(optimizer, smallest, budget,
                                             p.state_over.get(state_kind(smallest.recipe))))
    if not allow_peft and hf_model:
        p.notes.append(_lora_note(p, rows, budget, lora))
    return _multi_gpu(p, optimizer, hf_model, budget)


def _lora_note(p: PlanState, rows: list[PlanRow], budget: int, lora: Lora | None) -> str:
    """What LoRA (checkpointed, its smallest recipe) would need, traced for the note only."""
    from tilefit.errors import TilefitError
    from tilefit.models.lora import require_peft

    try:
        require_peft()
    except TilefitError:
        return notes.lora_would(None, budget, offload_or_change_fits=False)
    best = _probe_best(p, space.peft_recipes(p.device, p.optimizer, lora or Lora())[-1])
    qlora = None
    if best is not None and not best.fits and _has_bitsandbytes():
        # LoRA's 16-bit base does not fit either: what a 4-bit base (QLoRA) would need
        qlora = _probe_best(p, space.qlora_recipes(p.device, p.optimizer, lora)[-1])
    return notes.lora_would(best, budget, offload_or_change_fits=any(r.fits for r in rows),
                            qlora=qlora)


def _probe_best(p: PlanState, spec: Recipe) -> PlanRow | None:
    """``spec`` (checkpointed adapters) traced for a note: its fastest row that fits, else
    its smallest."""
    probed = p.probe(spec)
    fitting = [r for r in probed if r.fits]
    return max(fitting, key=lambda r: r.samples_per_s) if fitting else \
        min(probed, key=lambda r: r.memory_bytes, default=None)


def _has_bitsandbytes() -> bool:
    from tilefit.compat.bitsandbytes import require_bitsandbytes
    from tilefit.errors import TilefitError

    try:
        require_bitsandbytes("QLoRA")
    except TilefitError:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class Fallback:
    """The multi-GPU fallback searched: ``found`` (the GPU count, its plans; or why none),
    and where one fits, the row to confirm (``best`` of ``sub``), its full trace started on
    a free core (PlanState.prefetch_confirmation) for ``confirm_fallback`` to collect."""

    found: MultiGpuPlan
    sub: PlanState | None = None
    best: PlanRow | None = None


def _multi_gpu(p: PlanState, optimizer: str, hf_model: bool, budget: int) -> Fallback:
    """The fewest GPUs that fit, from traces: the ZeRO-3 formula (tilefit.planner.multigpu)
    only proposes where to start; each engine x recipe is then traced on that many ranks
    (tilefit.planner.multiplan), and on the next GPU counts dividing the global batch when
    nothing traced fits."""
    first = _formula_gpus(p, optimizer, hf_model, budget)
    if first is None:
        return Fallback(MultiGpuPlan(gpus=None, note=notes.NO_SHARDED_SETUP))
    for gpus in multiplan.candidate_world_sizes(p.global_batch, first, FALLBACK_GPU_COUNTS):
        sub = PlanState(p.work, p.device, p.global_batch, budget, optimizer, p.depth, p.link,
                        p.user, world_size=gpus, host=p.host)
        trace_on_gpus(sub, None, hf_model=hf_model, precisions=False,
                      replica_state_bytes=_model_state(p, optimizer, hf_model),
                      shown=FALLBACK_PLANS_SHOWN, said=p.notes,
                      traced_done=functools.partial(_confirm_early, sub))
        p.count(sub.traces)
        best = multiplan.best_fitting(sub.rows)
        if best is None:
            continue
        sub.prefetch_confirmation(best)  # overlaps what the caller does before confirming
        return Fallback(MultiGpuPlan(
            gpus=gpus, formula_gpus=first,
            plans=tuple(rank.rank(sub.rows, "throughput", False)[:FALLBACK_PLANS_SHOWN])),
            sub, best)
    return Fallback(MultiGpuPlan(gpus=None, note=notes.nothing_traced_fits(
        first, FALLBACK_GPU_COUNTS, p.global_batch)))


def _confirm_early(sub: PlanState, traced: list[PlanRow]) -> None:
    """The best traced row's confirmation, started on the next free core while ZeRO is
    modelled: no modelled row outranks a traced one that fits (multiplan.best_fitting)."""
    best = multiplan.best_fitting(traced)
    if best is not None:
        sub.prefetch_confirmation(best)


def confirm_fallback(p: PlanState, fallback: Fallback | None) -> MultiGpuPlan | None:
    """The fallback's plan, its chosen row confirmed by a full trace (counted in ``p``)."""
    if fallback is None or fallback.sub is None or fallback.best is None:
        return None if fallback is None else fallback.found
    confirmed, conf = fallback.sub.confirm(fallback.best)
    p.count(1)
    return dataclasses.replace(
        fallback.found, best=confirmed, confirmation=conf,
        configs=configs.multi_gpu_configs(confirmed, p.work),
        method=notes.engine_model(confirmed.strategy, fallback.sub.world_size))


def _mixed_sweep(p: PlanState, optimizer: str, hf_model: bool) -> SweepModel | None:
    """The one-GPU sweep of the user's optimizer in mixed precision (SDPA, no
    checkpointing), where it was traced."""
    att = "sdpa" if hf_model else "auto"
    return p.sweeps.get((p.with_user(Recipe(precision=space.precisions(p.device)[0],
                                            optimizer=optimizer, attention=att)), False))


def _model_state(p: PlanState, optimizer: str, hf_model: bool) -> float | None:
    """Parameters, gradients and optimizer state of the mixed-precision sweep at full depth:
    what every rank of a replicating engine (DDP) holds of the fallback's recipes (the same
    precision and optimizer)."""
    mixed = _mixed_sweep(p, optimizer, hf_model)
    if mixed is None:
        return None
    layers = p.depth.full if p.depth.lever else None
    states = [sum(mixed.predict(m, b, layers) for m in STATE_METRICS)
              for b in (min(p.micro_batches), max(p.micro_batches))]
    return min(states)  # affine in the micro-batch: the least over every one swept


def _formula_gpus(p: PlanState, optimizer: str, hf_model: bool, budget: int) -> int | None:
    """The ZeRO-3 formula's fewest GPUs (a fast prefilter): model state of the mixed-precision
    sweep divided by N plus the 16-bit working set of the offload sweep."""
    mixed = _mixed_sweep(p, optimizer, hf_model)
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
        setup = smallest_setup(p.global_batch, cands, p.depth.layers, budget)
        if setup is not None and (fewest is None or setup.gpus < fewest):
            fewest = setup.gpus
    return fewest
