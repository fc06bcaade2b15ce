"""Ranking plan rows and choosing the best one (a pure policy over rows).

Tiers, best first: plans that keep the training algorithm on the GPU alone; CPU offload
(same algorithm, slower: proposed only when no plan of the first tier fits); plans that change
the optimizer (proposed only when the user allows it, where they join the first tiers, or when
nothing else fits). Within the chosen tier, the throughput objective takes the most samples/s,
the memory objective the smallest peak (then the most samples/s).

A DeepSpeed ZeRO row on several GPUs is modelled on one-GPU traces, and its step time is a
lower bound (its engine's bucket copies and hooks' host time are not costed): for the
throughput objective, traced rows of the same tier rank before it, so a lower bound never
wins against a traced time; it is chosen when no traced row of the tier fits. Its memory
is not a bound (it matched DeepSpeed's engine), so the memory objective ranks it as any row.
"""

from __future__ import annotations

from collections.abc import Sequence

from tilefit.batches import REAL_GAIN
from tilefit.errors import TilefitError
from tilefit.planner.rows import PlanRow
from tilefit.vocab import ZERO_STRATEGIES

OBJECTIVES = ("throughput", "memory")


def check_objective(objective: str) -> None:
    if objective not in OBJECTIVES:
        raise TilefitError(f"unknown objective {objective!r}",
                           expected="throughput or memory", given=repr(objective),
                           fix="pass PlanSearch(objective='throughput') (the fastest plan that "
                           "fits) or PlanSearch(objective='memory') (the smallest)")


def tier(row: PlanRow, allow_optimizer_change: bool) -> int:
    changes = row.changes_optimizer and not allow_optimizer_change
    return 2 if changes else (1 if row.offload else 0)


def modelled(row: PlanRow) -> bool:
    """Whether the row's step time is a modelled lower bound (DeepSpeed ZeRO on several
    GPUs: its engine does not run on fake tensors), not a traced time."""
    return row.world_size > 1 and row.strategy in ZERO_STRATEGIES


def bound_tier(row: PlanRow, objective: str) -> int:
    """1 for a modelled lower bound under the throughput objective (after the traced rows
    of its tier), else 0."""
    return int(objective == "throughput" and modelled(row))


# Peaks within this share of the budget are a tie for the memory objective (the faster wins):
# a few MiB is below what the model resolves (allocator rounding, fragmentation).
MEMORY_TIE = 0.01


def sort_key(row: PlanRow, objective: str) -> tuple[float, ...]:
    if objective == "memory":
        bucket = max(1, int(row.budget_bytes * MEMORY_TIE))
        return (row.memory_bytes // bucket, -row.samples_per_s)
    return (-row.samples_per_s, row.memory_bytes)


def rank(rows: Sequence[PlanRow], objective: str, allow_optimizer_change: bool
         ) -> list[PlanRow]:
    """Fitting rows by (tier, objective), then the rest by peak memory."""
    fit = [r for r in rows if r.fits]
    rest = [r for r in rows if not r.fits]
    fit.sort(key=lambda r: (tier(r, allow_optimizer_change), bound_tier(r, objective),
                            *sort_key(r, objective)))
    rest.sort(key=lambda r: (r.memory_bytes, -r.samples_per_s))
    return fit + rest


def choose(rows: Sequence[PlanRow], objective: str, allow_optimizer_change: bool
           ) -> PlanRow | None:
    ranked = rank(rows, objective, allow_optimizer_change)
    return ranked[0] if ranked and ranked[0].fits else None


def prune_unfriendly(rows: Sequence[PlanRow]) -> list[PlanRow]:
    """Drop unfriendly micro-batches that show no real gain over a friendly one of the same
    recipe (kept when no friendly micro-batch of the recipe fits)."""
    def recipe(r: PlanRow) -> tuple[object, ...]:
        return (r.precision, r.optimizer, r.grad_checkpointing, r.attention, r.offload, r.peft,
                r.strategy, r.recipe.quantize)

    best_friendly: dict[tuple[object, ...], float] = {}
    for r in rows:
        if r.friendly and r.fits:
            k = recipe(r)
            best_friendly[k] = max(best_friendly.get(k, 0.0), r.samples_per_s)
    out = []
    for r in rows:
        if r.friendly:
            out.append(r)
            continue
        ref = best_friendly.get(recipe(r))
        if r.fits and (ref is None or r.samples_per_s > ref * (1 + REAL_GAIN)):
            out.append(r)
    return out
