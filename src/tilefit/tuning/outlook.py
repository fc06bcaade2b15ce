"""What tune will run, said before it runs it: about how many trials, and how long they take.

Pure arithmetic over numbers the tuner measured (the time of one step at batch 1 and 2): no
torch, no device, no clock. The step counts mirror the executor's trials (a fit trial runs
``steps_per_trial`` steps; a timed trial warms up, then repeats cycles of accumulation), and
the step time is taken as affine in the batch (t(b) = t(1) + slope * (b - 1)), the slope
measured between batch 1 and a quarter of the expected largest batch: what a step's compute
does once the batch fills the device; below that the estimate errs long.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from tilefit.tuning.search import accumulation_for, candidate_sizes

# Fit trials with the estimator's prediction as the first probe: the prediction, the batch
# above it (to prove it the largest), and one correction when the prediction was off.
FIT_TRIALS_PREDICTED = 3
# Without a prediction but with measured peaks: the first probe (2), then affine
# extrapolation from the peaks, confirmation and a correction or two.
FIT_TRIALS_EXTRAPOLATED = 5


@dataclass(frozen=True)
class TrialShape:
    """How many steps the executor's trials run (its settings)."""

    steps_per_trial: int  # steps per fit trial
    warmup_steps: int  # untimed micro-batches before timing
    repeats: int  # timed repeats per throughput trial
    min_timed_steps: int  # micro-batches per timed repeat at least
    min_repeat_s: float  # a repeat lasts at least this long ...
    max_cycles_per_repeat: int  # ... in no more optimizer steps than this


@dataclass(frozen=True)
class Outlook:
    """tune's plan before its first trial."""

    fit_trials: int  # expected, near ``batch_guess``
    timed_batches: tuple[int, ...]  # the candidates a throughput phase would time
    batch_guess: int  # the largest batch expected to fit (first probe, or the cap)
    step_s_at_1: float  # measured: one step at batch 1
    step_s_per_sample: float  # measured: each further sample adds this (see per_sample_s)
    expected_s: float  # all trials together, roughly

    @property
    def trials(self) -> int:
        return self.fit_trials + len(self.timed_batches)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["timed_batches"] = list(self.timed_batches)
        return d


def step_s(batch_size: int, step_s_at_1: float, step_s_per_sample: float) -> float:
    return step_s_at_1 + step_s_per_sample * (batch_size - 1)


def timing_batch(first_probe: int | None, cap: int | None) -> int:
    """The second batch to time a step at (the first is 1): a quarter of the batch expected
    to fit, so that the slope is measured over a span much wider than the timing noise, at
    a batch that fits with room to spare (at least 2)."""
    guess = first_probe if first_probe is not None else cap
    return max(2, (guess or 0) // 4)


def per_sample_s(step_s_at_1: float, batch_size: int, step_s_at_b: float) -> float:
    """The slope of step time in the batch, between batch 1 and ``batch_size``, kept within
    [0, step_s_at_1]: a step at b samples does at most b times the work of a step at 1 (its
    fixed costs are shared), so a steeper slope is timing noise (another process's load)."""
    slope = (step_s_at_b - step_s_at_1) / max(1, batch_size - 1)
    return min(max(0.0, slope), step_s_at_1)


def timed_trial_steps(cycle_s: float, accumulation: int, shape: TrialShape) -> int:
    """Micro-batches one throughput trial runs (as Executor.throughput counts them): warm-up
    in whole optimizer steps, then ``repeats`` timed runs of ``cycles`` optimizer steps."""
    warm_cycles = max(1, -(-shape.warmup_steps // accumulation))
    cycles = max(1, -(-shape.min_timed_steps // accumulation))
    if cycle_s > 0:
        needed = math.ceil(shape.min_repeat_s / cycle_s)
        cycles = min(shape.max_cycles_per_repeat, max(cycles, needed))
    return accumulation * (warm_cycles + shape.repeats * cycles)


def expected_fit_trials(first_probe: int | None, cap: int | None, has_peaks: bool) -> int:
    if first_probe is not None:
        return 1 if first_probe == cap else FIT_TRIALS_PREDICTED
    if has_peaks or cap is None:
        return FIT_TRIALS_EXTRAPOLATED
    return 1 + max(0, math.ceil(math.log2(cap / 2)))  # doubling from 2 up to the cap


def outlook(*, step_s_at_1: float, step_s_per_sample: float, first_probe: int | None,
            cap: int | None, has_peaks: bool, multiple: int, global_batch: int | None,
            measure_throughput: bool, shape: TrialShape) -> Outlook | None:
    """The expected trials and their time; None when there is no batch to expect (neither a
    prediction nor a cap)."""
    guess = first_probe if first_probe is not None else cap
    if guess is None:
        return None
    slope = step_s_per_sample
    fit_trials = expected_fit_trials(first_probe, cap, has_peaks)
    total_s = fit_trials * shape.steps_per_trial * step_s(guess, step_s_at_1, slope)
    timed: tuple[int, ...] = ()
    if measure_throughput:
        timed = candidate_sizes(guess, multiple=multiple, global_batch=global_batch)
        for b in timed:
            accumulation = accumulation_for(global_batch, b)
            per_step_s = step_s(b, step_s_at_1, slope)
            steps = timed_trial_steps(per_step_s * accumulation, accumulation, shape)
            total_s += steps * per_step_s
    return Outlook(fit_trials, timed, guess, step_s_at_1, slope, total_s)
