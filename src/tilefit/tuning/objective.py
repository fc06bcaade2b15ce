"""tune's ``objective="time-to-loss"``: the batch that reaches a given loss soonest.

Measured samples/s per batch (tune's throughput trials) and the gradient noise scale (given,
or measured by ``noise_measure.noise_scale`` on tune's own batches) give the time to a loss at
each batch, S(B) steps of B / rate(B) seconds (eq. 2.11 of McCandlish et al.,
docs/references.md, section 18). Larger batches through accumulation are never faster: their
samples/s is the largest fitting batch's while S(B) B = S_min (B + B_noise) keeps growing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tilefit.errors import TilefitError
from tilefit.tuning.noise import (
    LearningRateAdvice,
    NoiseScale,
    TimeToLoss,
    choose_time_to_loss,
    far_above_noise_scale,
    learning_rate_advice,
    lr_rule_of,
    time_to_loss,
)

OBJECTIVES = ("samples-per-s", "time-to-loss")


def check_objective(objective: str, noise_scale: float | NoiseScale | None) -> None:
    if objective not in OBJECTIVES:
        raise TilefitError(f"unknown objective {objective!r}",
                           expected=" or ".join(OBJECTIVES), given=repr(objective),
                           fix='pass objective="time-to-loss" or "samples-per-s"')
    if isinstance(noise_scale, bool) or (noise_scale is not None and not isinstance(
            noise_scale, NoiseScale) and not (isinstance(noise_scale, int | float)
                                              and noise_scale > 0)):
        raise TilefitError("noise_scale must be a positive number or a NoiseScale",
                           expected="B_noise in samples, e.g. 512, or tilefit.noise_scale(...)",
                           given=repr(noise_scale), fix="pass noise_scale=512, or leave it out "
                           "to measure it on the batches make_batch draws")


def b_noise_of(noise_scale: float | NoiseScale) -> float:
    return noise_scale.b_simple if isinstance(noise_scale, NoiseScale) else float(noise_scale)


@dataclass(frozen=True)
class TimeToLossChoice:
    """What the time-to-loss objective adds to tune's result."""

    batch_size: int  # the batch reaching the loss soonest (the micro-batch with a global one)
    b_noise: float
    rows: tuple[TimeToLoss, ...]
    samples_per_s_batch: int  # the samples/s objective's choice
    slowdown: float  # time to the loss of the samples/s choice / that of this choice
    learning_rate: LearningRateAdvice
    warnings: tuple[str, ...]


def choose(rates: Mapping[int, Sequence[float]], noise: float, samples_per_s_batch: int,
           noise_scale: float | NoiseScale, global_batch: int | None,
           optimizer_name: str | None) -> TimeToLossChoice:
    """The time-to-loss batch among the measured ones. With a global batch, every candidate
    takes the same optimizer steps, so the fastest micro-batch (the samples/s choice) is also
    the soonest to the loss: only the advice and the warning change."""
    b_noise = b_noise_of(noise_scale)
    best_rates = {b: max(v) for b, v in rates.items() if v}
    rows = time_to_loss(best_rates, b_noise)
    if global_batch is None:
        chosen = choose_time_to_loss(rows, noise).batch_size
        by_batch = {r.batch_size: r for r in rows}
        slowdown = by_batch[samples_per_s_batch].time_factor / by_batch[chosen].time_factor
        optimizer_batch = chosen
    else:
        chosen, slowdown, optimizer_batch = samples_per_s_batch, 1.0, global_batch
    advice = learning_rate_advice(optimizer_batch, b_noise, lr_rule_of(optimizer_name))
    warning = far_above_noise_scale(optimizer_batch, b_noise)
    return TimeToLossChoice(chosen, b_noise, rows, samples_per_s_batch, slowdown, advice,
                            () if warning is None else (warning,))


def measuring_sizes(max_batch: int) -> tuple[int, int]:
    """(B_small, B_big) for tune's own measurement: the default small batch of 8 or the
    largest that fits below it, and 8 micro-batches of it."""
    from tilefit.tuning.options import DEFAULT_BATCH_SIZES

    b_small = min(DEFAULT_BATCH_SIZES[0], max_batch)
    if b_small < 2:
        raise TilefitError(
            "the noise scale cannot be measured: only a batch of 1 fits",
            expected="a batch of at least 2 in memory (B_small >= 2)",
            given=f"largest fitting batch {max_batch}",
            fix="pass search=TuneSearch(noise_scale=<B_noise>) measured elsewhere "
            "(tilefit.noise_scale on a larger device), or objective='samples-per-s'")
    return b_small, b_small * DEFAULT_BATCH_SIZES[1] // DEFAULT_BATCH_SIZES[0]


def summary(choice: TimeToLossChoice) -> dict[str, Any]:
    """The TuneResult fields of the choice."""
    return {"b_noise": choice.b_noise, "time_to_loss": choice.rows,
            "samples_per_s_batch": choice.samples_per_s_batch,
            "time_to_loss_slowdown": choice.slowdown, "learning_rate": choice.learning_rate,
            "warnings": choice.warnings}
