"""Planning on N GPUs from traces: strategy x micro-batch x accumulation x checkpointing x
precision, each recipe traced as rank 0 of the real engine under PyTorch's fake process group
(tilefit.tracing.distributed) and swept with the single-GPU machinery (the affine model in
the micro-batch and the layer count, tilefit.planner.affine): the per-rank trace is the same
kind of object as a one-GPU trace, its peak per GPU, its step with the communication the
compute does not hide.

DeepSpeed ZeRO (vocab.ZERO_STRATEGIES; stages 2 and 3 also with the optimizer offloaded to
the CPU) is modelled on one-GPU traces (tilefit.estimator.zero_step): one trace per point
serves every stage, in DeepSpeed's own precisions (its bf16 or fp16 mode, or fp32).

Every plan keeps micro_batch x accumulation_steps x N == the global batch. The engines are
vocab.STRATEGIES and vocab.ZERO_STRATEGIES (a strategy added there is searched here).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from tilefit.batches import divisors
from tilefit.errors import TilefitError
from tilefit.hardware import Device
from tilefit.models import Workload
from tilefit.planner import space
from tilefit.planner.affine import SweepModel
from tilefit.planner.rank import modelled
from tilefit.planner.rows import PlanRow
from tilefit.planner.search import Depth, row_from, safe_sweep, zero_sweeps
from tilefit.recipe import Lora, Recipe
from tilefit.tracing.distributed import Parallel, parallel_spec
from tilefit.vocab import PRECISIONS, STRATEGIES, ZERO_STRATEGIES

# FSDP2 wraps each block of a list of two or more (tilefit.tracing.distributed.
# find_layer_list): a deep model is traced at 2 and 3 layers (not 1 and 2, where one block
# would leave FSDP2 nothing but the root to wrap) and extrapolated in the layer count.
MULTI_LEVER_LAYERS = (2, 3)
# the ZeRO stages also searched with the optimizer on the CPU: ZeRO-Offload was built on
# stage 2 and ZeRO-Infinity on stage 3 (docs/references.md, section 24, item 5)
OFFLOAD_STAGES = ("zero2", "zero3")
PEFT_NOT_ON_ZERO = ("LoRA rows on ddp and fsdp2 only: DeepSpeed ZeRO with adapters on a "
                    "frozen base is not modelled")


def nearest_multiples(global_batch: int, world_size: int) -> tuple[int, int]:
    """The multiples of ``world_size`` nearest ``global_batch`` below (at least
    ``world_size``) and above."""
    lower = max(world_size, global_batch // world_size * world_size)
    upper = (global_batch // world_size + 1) * world_size
    return lower, upper


def nearest_world_sizes(global_batch: int, world_size: int) -> tuple[int, ...]:
    """Divisors of ``global_batch`` nearest ``world_size`` (below and above, when any)."""
    ds = [d for d in divisors(global_batch) if d > 1]
    below = [d for d in ds if d < world_size]
    above = [d for d in ds if d > world_size]
    return tuple(x for x in (below[-1] if below else None, above[0] if above else None)
                 if x is not None)


def check_divisible(global_batch: int, world_size: int) -> None:
    """Each of the N ranks takes global_batch / N samples per optimizer step."""
    if global_batch % world_size == 0:
        return
    lower, upper = nearest_multiples(global_batch, world_size)
    gpus = nearest_world_sizes(global_batch, world_size)
    other = (", or " + " or ".join(f"Parallelism(world_size={g})" for g in gpus)
             + " for this batch") if gpus else ""
    raise TilefitError(
        f"the global batch {global_batch} does not divide among {world_size} GPUs",
        expected=f"a global batch that is a multiple of the GPU count ({world_size}): each "
        "rank takes global batch / GPUs samples, split into micro-batches",
        given=f"plan(..., global_batch={global_batch}) on Parallelism(world_size={world_size})",
        fix=f"use plan(..., global_batch={lower}) or plan(..., global_batch={upper}){other}")


def strategies_for(strategy: str | None, world_size: int) -> tuple[str, ...]:
    """The engines to search: the one asked for (checked), else every vocab.STRATEGIES and
    ZERO_STRATEGIES."""
    if strategy is None:
        return (*STRATEGIES, *ZERO_STRATEGIES)
    key = str(strategy).strip().lower()
    if key in ZERO_STRATEGIES:
        return (key,)
    spec = parallel_spec(max(world_size, 2), strategy)
    assert spec is not None
    return (spec.strategy,)


def engines_of(strategies: Sequence[str], world_size: int) -> list[Parallel]:
    """Each strategy on ``world_size`` GPUs; the OFFLOAD_STAGES also with ZeRO-Offload."""
    out = [Parallel(s, world_size) for s in strategies]
    out += [Parallel(s, world_size, offload=True) for s in strategies if s in OFFLOAD_STAGES]
    return out


def zero_recipe(spec: Recipe) -> Recipe | None:
    """The recipe as DeepSpeed runs it: a 16-bit autocast becomes its bf16 or fp16 mode
    (16-bit weights and gradients, tilefit's precision "bf16-true" or "fp16-true", the fp32
    master in the partitioned optimizer, the fp16 mode's loss scaling DeepSpeed's own);
    fp32 and TF32 as they are; None for fp8, which DeepSpeed does not run this way, and for
    LoRA adapters, whose frozen base ZeRO's model (tilefit.estimator.zero) does not
    partition apart from what trains (PEFT_NOT_ON_ZERO)."""
    prec = spec.spec
    if prec.float8_linears or spec.peft:
        return None
    for pure in PRECISIONS:
        if prec.autocast_dtype and pure.autocast_dtype is None and \
                pure.param_dtype == prec.autocast_dtype:
            return dataclasses.replace(spec, precision=pure.name)
    return spec


def multi_depth(depth: Depth) -> Depth:
    """The layer lever at MULTI_LEVER_LAYERS, or the full depth when too shallow for it."""
    if not depth.lever:
        return depth
    if depth.full <= max(MULTI_LEVER_LAYERS):
        return depth.in_full()
    return Depth(depth.field, depth.full, MULTI_LEVER_LAYERS, depth.period)


def multi_recipes(device: Device, optimizer: str, *, hf_model: bool,
                  precisions: bool = True, lora: Lora | None = None) -> list[Recipe]:
    """Mixed precision with and without checkpointing; the other precisions the device
    supports without it (``precisions``); ``lora``'s adapters (a Hugging Face model's, with
    --allow-peft: space.peft_recipes), which DDP and FSDP2 run and ZeRO does not
    (``zero_recipe``). The user's optimizer; no QLoRA or torch.compile on several GPUs (not
    planned there yet); offload with ZeRO only (``engines_of``)."""
    precs = space.precisions(device)
    att = "sdpa" if hf_model else "auto"
    out = [Recipe(precision=precs[0], optimizer=optimizer, grad_checkpointing=ckpt,
                  attention=att) for ckpt in (False, True)]
    if precisions:
        out.extend(Recipe(precision=p, optimizer=optimizer, attention=att) for p in precs[1:])
    if lora is not None and hf_model:
        out.extend(space.peft_recipes(device, optimizer, lora))
    return out


@dataclasses.dataclass(frozen=True)
class MultiSpace:
    """What one search on N GPUs covers."""

    world_size: int
    strategies: tuple[str, ...]
    recipes: tuple[Recipe, ...]
    depth: Depth
    # the model state every DDP rank holds whole (parameters, gradients, optimizer state of
    # the caller's one-GPU traces, at full depth) and how many ranked rows the caller shows:
    # DDP goes untraced when that state is over the budget and enough rows fit to fill what
    # is shown (replica_skipped). None: every engine traced, every row kept.
    replica_state_bytes: float | None = None
    shown: int | None = None
    # told the traced engines' rows once no traced row is to come (before ZeRO is modelled):
    # the caller may start confirming the best of them, which no modelled row outranks
    # (best_fitting)
    traced_done: Callable[[list[PlanRow]], object] | None = None


def replicates(engine: Parallel) -> bool:
    """Whether every rank holds the whole model state: DDP (FSDP2 and ZeRO shard it)."""
    return engine.strategy == "ddp"


def replica_skipped(space_: MultiSpace, budget_bytes: int, rows: Sequence[PlanRow]) -> bool:
    """Whether a replicating engine may go untraced: the model state each of its ranks holds
    (the one-GPU traces', a floor under its optimizer step's peak and so under every row's)
    is over the budget, so none of its rows fits (none is chosen), and ``rows`` has at least
    ``space_.shown`` rows that fit, which rank before any that does not (none is shown)."""
    return _replica_over_budget(space_, budget_bytes) and space_.shown is not None and \
        sum(r.fits for r in rows) >= space_.shown


def _replica_over_budget(space_: MultiSpace, budget_bytes: int) -> bool:
    """Whether a replicating engine's every rank holds more model state than the budget:
    none of its rows fits."""
    state = space_.replica_state_bytes
    return state is not None and state > budget_bytes


def replica_note(engine: Parallel, space_: MultiSpace, budget_bytes: int) -> str:
    state = space_.replica_state_bytes or 0.0
    return (f"{engine.strategy} on {engine.world_size} GPUs was not traced: each rank holds "
            f"the whole model state, {state / 2**30:.1f} GiB (parameters, gradients and "
            f"optimizer state, traced on one GPU), over the {budget_bytes / 2**30:.1f} GiB "
            "budget")


def search_rows(work: Workload, device: Device, global_batch: int, budget_bytes: int,
                optimizer: str, space_: MultiSpace, user: Callable[[Recipe], Recipe],
                notes: list[str], said: list[str] | None = None
                ) -> tuple[list[PlanRow], int]:
    """Every (engine, recipe) swept over the micro-batches dividing global_batch / N:
    rows per GPU, and the number of traces taken. A replicating engine that may be skipped
    (``replica_skipped``) is searched last and, when skipped, named in ``said`` (default
    ``notes``); the rows keep the engines' order."""
    engines = engines_of(space_.strategies, space_.world_size)
    traced = [e for e in engines if not e.modelled]
    zero = [e for e in engines if e.modelled]
    late = [e for e in traced if replicates(e)] if space_.shown is not None else []
    found: dict[Parallel | None, list[PlanRow]] = {}  # None: the ZeRO engines' rows
    traces = 0
    for engine in [*(e for e in traced if e not in late), None, *late]:
        if engine is None and space_.traced_done is not None and \
                (not late or _replica_over_budget(space_, budget_bytes)):
            space_.traced_done([r for v in found.values() for r in v])
        if engine is None and not zero:
            continue
        if engine is not None and engine in late and replica_skipped(space_, budget_bytes,
                                                                  [r for v in found.values()
                                                                   for r in v]):
            (notes if said is None else said).append(replica_note(engine, space_,
                                                                  budget_bytes))
            continue
        found[engine], n = _traced_rows(work, device, global_batch, budget_bytes, optimizer,
                                        space_, user, notes, engine) if engine is not None \
            else _zero_rows(work, device, global_batch, budget_bytes, optimizer, space_,
                            user, notes, zero)
        traces += n
    return [r for e in (*traced, None) for r in found.get(e, [])], traces


def _traced_rows(work: Workload, device: Device, global_batch: int, budget_bytes: int,
                 optimizer: str, space_: MultiSpace, user: Callable[[Recipe], Recipe],
                 notes: list[str], parallel: Parallel) -> tuple[list[PlanRow], int]:
    """One traced engine (DDP, FSDP2) x every recipe: its rows and trace count."""
    n = space_.world_size
    micro = divisors(global_batch // n)
    rows: list[PlanRow] = []
    traces = 0
    over: set[Lora | None] = set()  # the adapters (None: full) whose state is over budget
    for i, spec in enumerate(space_.recipes):
        key = spec.lora
        if key in over:
            continue
        spec = dataclasses.replace(user(spec), compile=False)
        model = safe_sweep(work, spec, micro, space_.depth, device, notes, parallel)
        traces += len(space_.depth.traced) * len({min(micro), max(micro)})
        if model is None:
            continue
        rows.extend(row_from(spec, model, b, global_batch, space_.depth, device,
                             budget_bytes, work.tokens_per_sample, optimizer,
                             parallel=parallel) for b in micro)
        floor = optimizer_step_floor(model, min(micro), space_.depth)
        if floor > budget_bytes and any(r.lora == key for r in space_.recipes[i + 1:]):
            over.add(key)
            notes.append(f"{parallel.strategy} on {n} GPUs: its optimizer step alone needs "
                         f"{floor / 2**30:.1f} GiB per GPU (traced), over the "
                         f"{budget_bytes / 2**30:.1f} GiB budget: its other "
                         + ("LoRA " if spec.peft else "") + "recipes were not traced")
    return rows, traces


def _zero_rows(work: Workload, device: Device, global_batch: int, budget_bytes: int,
               optimizer: str, space_: MultiSpace, user: Callable[[Recipe], Recipe],
               notes: list[str], engines: list[Parallel]) -> tuple[list[PlanRow], int]:
    """The DeepSpeed ZeRO engines x every recipe DeepSpeed runs (``zero_recipe``), each
    recipe's one-GPU traces shared by every engine."""
    micro = divisors(global_batch // space_.world_size)
    specs = list(dict.fromkeys(
        r for r in (zero_recipe(dataclasses.replace(user(s), compile=False))
                    for s in space_.recipes) if r is not None))
    rows: list[PlanRow] = []
    traces = 0
    for spec in specs:
        try:
            sweeps = zero_sweeps(work, spec, micro, space_.depth, device, engines)
        except TilefitError as exc:
            notes.append(f"skipped DeepSpeed ZeRO {spec.precision} {spec.optimizer}: "
                         f"{exc.problem}")
            continue
        finally:
            traces += len(space_.depth.traced) * len({min(micro), max(micro)})
        for engine, model in sweeps.items():
            rows.extend(row_from(spec, model, b, global_batch, space_.depth, device,
                                 budget_bytes, work.tokens_per_sample, optimizer,
                                 parallel=engine) for b in micro)
    if rows:
        notes.append("DeepSpeed ZeRO rows are modelled on one-GPU traces: their collectives "
                     "are costed, DeepSpeed's bucket copies and its hooks' host time are not "
                     "(their step time is a lower bound; their memory matched DeepSpeed's "
                     "engine on the CPU, docs/references.md, section 24)")
    return rows, traces


def optimizer_step_floor(model: SweepModel, micro_batch: int, depth: Depth) -> float:
    """The traced peak of the optimizer step (parameters, gradients, optimizer state and
    the step's temporaries) at the full depth: a floor under every recipe of the engine
    (checkpointing, the micro-batch and the precisions searched here, all with fp32 weights,
    leave it as it is; under CUDA graphs the lower of the peaks with and without
    accumulation, tilefit.planner.sample.Sample)."""
    layers = depth.full if depth.lever else None
    metrics = ["peak_optimizer_bytes"]
    if all(s.peak_optimizer_accumulation_1_bytes is not None for s in model.samples):
        metrics.append("peak_optimizer_accumulation_1_bytes")
    return min(model.predict(m, micro_batch, layers) for m in metrics)


def parallel_of(row: PlanRow) -> Parallel | None:
    return None if row.strategy is None else Parallel(
        row.strategy, row.world_size, offload=row.offload and row.strategy in ZERO_STRATEGIES)


def candidate_world_sizes(global_batch: int, first: int, count: int) -> list[int]:
    """``count`` GPU counts from ``first`` up that divide the global batch."""
    return [n for n in divisors(global_batch) if n >= first][:count]


def best_fitting(rows: Sequence[PlanRow]) -> PlanRow | None:
    """The fastest row that fits, a traced one before any whose step time is a modelled
    lower bound (tilefit.planner.rank.modelled)."""
    fits = [r for r in rows if r.fits]
    return max(fits, key=lambda r: (not modelled(r), r.samples_per_s)) if fits else None


__all__ = ["MULTI_LEVER_LAYERS", "OFFLOAD_STAGES", "MultiSpace", "best_fitting",
           "candidate_world_sizes", "check_divisible", "engines_of", "multi_depth",
           "multi_recipes", "nearest_multiples", "parallel_of", "search_rows",
           "strategies_for", "zero_recipe"]
