"""tune's outlook: about how many trials and how long, said before the first trial."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn

from tilefit.recipe import Recipe
from tilefit.tuning import Outlook, TuneSearch, tune
from tilefit.tuning.outlook import (
    TrialShape,
    outlook,
    per_sample_s,
    timed_trial_steps,
    timing_batch,
)

# the executor's settings (tuner: 2 steps per fit trial, 2 warm-up steps, 3 repeats of at
# least 3 steps; executor: a repeat lasts 0.05 s, at most 20 optimizer steps)
SHAPE = TrialShape(steps_per_trial=2, warmup_steps=2, repeats=3, min_timed_steps=3,
                   min_repeat_s=0.05, max_cycles_per_repeat=20)


def test_the_slope_is_measured_wide_and_kept_physical() -> None:
    assert timing_batch(40, None) == 10 and timing_batch(None, 8) == 2
    assert timing_batch(None, None) == 2 and timing_batch(3, 3) == 2
    assert per_sample_s(0.1, 9, 0.5) == pytest.approx(0.05)  # (0.5 - 0.1) / 8
    # 2 samples cannot take more than twice 1 sample's time: the excess is noise
    assert per_sample_s(0.1, 2, 0.5) == 0.1
    assert per_sample_s(0.1, 9, 0.08) == 0.0  # faster at 9 than at 1: noise, flat


def test_timed_trial_steps_by_hand() -> None:
    # 0.2 s a cycle: 2 warm-up + 3 repeats x 3 cycles (0.2 s > 0.05 s already) = 11
    assert timed_trial_steps(0.2, 1, SHAPE) == 11
    # 1 ms a cycle: 50 cycles would last 0.05 s, capped at 20: 2 + 3 x 20 = 62
    assert timed_trial_steps(0.001, 1, SHAPE) == 62
    # accumulation 4: 1 warm-up cycle, 1 cycle per repeat (0.4 s): 4 x (1 + 3) = 16
    assert timed_trial_steps(0.4, 4, SHAPE) == 16


def test_outlook_by_hand() -> None:
    o = outlook(step_s_at_1=0.1, step_s_per_sample=0.01, first_probe=20, cap=None,
                has_peaks=True, multiple=8, global_batch=None, measure_throughput=True,
                shape=SHAPE)
    assert o is not None
    # friendly sizes up to 20: 1 2 4 8 16 (powers of two, multiples of 8) and 20 itself
    assert o.timed_batches == (1, 2, 4, 8, 16, 20) and o.fit_trials == 3 and o.trials == 9
    # fit: 3 trials x 2 steps x t(20) = 6 x 0.29; timed: 11 steps at each size (every step
    # is over 0.05 s), at t(b) = 0.1 + 0.01 (b - 1): 0.10 + 0.11 + 0.13 + 0.17 + 0.25 + 0.29
    assert o.expected_s == pytest.approx(6 * 0.29 + 11 * 1.05)
    untimed = outlook(step_s_at_1=0.1, step_s_per_sample=0.01, first_probe=None, cap=16,
                      has_peaks=False, multiple=8, global_batch=None,
                      measure_throughput=False, shape=SHAPE)
    assert untimed is not None and untimed.timed_batches == ()
    assert untimed.fit_trials == 4  # 2, 4, 8, 16: doubling from 2 to the cap
    assert untimed.expected_s == pytest.approx(4 * 2 * 0.25)
    assert outlook(step_s_at_1=0.1, step_s_per_sample=0, first_probe=None, cap=None,
                   has_peaks=True, multiple=8, global_batch=None, measure_throughput=True,
                   shape=SHAPE) is None


def test_a_timed_trial_runs_the_steps_the_outlook_counts() -> None:
    # A second method: count the batches a real throughput trial makes. Each step sleeps
    # 0.06 s, over the 0.05 s a repeat must last, so the count is timed_trial_steps' 11.
    from tilefit.tuning.executor import Executor
    from tilefit.tuning.state import snapshot

    model = nn.Linear(4, 2)
    calls = []

    def slow_batch(b: int) -> torch.Tensor:
        calls.append(b)
        time.sleep(0.06)
        return torch.randn(b, 4)

    ex = Executor(model=model, make_batch=slow_batch, loss_fn=lambda m, x: m(x).sum(),
                  optimizer=lambda p: torch.optim.SGD(p, lr=0.1), snap=snapshot(model, None),
                  recipe=Recipe(precision="fp32"), device=torch.device("cpu"),
                  memory_limit_bytes=None,
                  margin=0.1, steps_per_trial=2, warmup_steps=2, repeats=3,
                  min_timed_steps=3)
    assert ex.trial_shape == SHAPE
    ex.throughput(2, 1)
    assert len(calls) == timed_trial_steps(0.06, 1, SHAPE) == 11


def test_tune_says_its_outlook_before_the_first_trial() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    events: list[Any] = []
    result = tune(model, lambda b: torch.randn(b, 16), loss_fn=lambda m, x: m(x).sum(),
                  optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                  search=TuneSearch(memory_limit_bytes=10**6, global_batch=32, max_batch=20,
                                    predicted_max_batch=20, on_trial=events.append,
                                    on_outlook=events.append))
    first, *trials = events
    assert isinstance(first, Outlook) and not any(isinstance(e, Outlook) for e in trials)
    assert len(trials) == len(result.trials)  # the timing steps are not trials
    # the probe is the cap, so it is the one fit trial; the sizes timed are the candidates
    assert first.fit_trials == result.fit_trials == 1
    assert first.timed_batches == result.candidates == (1, 2, 4, 8, 16)
    assert first.step_s_at_1 > 0 and first.expected_s > 0
