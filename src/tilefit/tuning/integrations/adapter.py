"""What a training framework gives tune: one protocol, and the one place tune and the noise
scale run through it.

A framework (the Hugging Face Trainer in ``hf.py``, Lightning in ``lightning.py``) adapts
itself as a ``TrainingAdapter``: the model and its device, the precision it trains in, the
step's loss, the optimizer, two batch sources (the same samples on every call for tune's
trials, random ones for the noise scale) and the context around the trials, which sets what
the framework's own training would set and puts it back afterwards (tune itself snapshots and
restores the model, the optimizer and the RNG: ``tuning/state.py``). ``tune_with`` and
``noise_scale_with`` do the rest the same way for every framework; what each applies
afterwards (Trainer arguments, a Lightning batch-size attribute) stays the framework's own.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import nn

from tilefit.recipe import Recipe
from tilefit.tuning.executor import LossFn, OptimizerArg
from tilefit.tuning.noise import NoiseScale
from tilefit.tuning.options import DEFAULT_MARGIN, DEFAULT_MEASUREMENTS, NoiseMeasure, TuneSearch
from tilefit.tuning.tuner import TuneResult, tune

# What a failing user step raises (the model's own ValueError / TypeError, a shape mismatch's
# RuntimeError); tracing/step.py words the same families for the fake-tensor trace.
USER_ERRORS = (RuntimeError, ValueError, TypeError, IndexError, KeyError, AttributeError,
               AssertionError, NotImplementedError)
TIME_TO_LOSS = "time-to-loss"


class TrainingAdapter(Protocol):
    """How a training framework gives tune what its own training loop will run."""

    @property
    def model(self) -> nn.Module:
        """The module trained, already on its device."""
        ...

    @property
    def device(self) -> torch.device:
        ...

    @property
    def precision(self) -> str:
        """The precision the framework trains in (a ``tilefit.vocab`` name)."""
        ...

    @property
    def recipe(self) -> Recipe:
        """The framework's loop as a Recipe: its precision, clipping and loss read (the
        step tune's trials run, tilefit.loop's)."""
        ...

    @property
    def keep_modes(self) -> bool:
        """Whether modules train in the modes they are in (else ``model.train()``)."""
        ...

    def loss_fn(self) -> LossFn:
        """loss(model, batch): the framework's training step, its loss."""
        ...

    def optimizer(self) -> OptimizerArg:
        """The optimizer the trials step (its state is restored), or a factory of it."""
        ...

    def held_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer already built, if any: not stepped by the noise scale, its state
        kept and its class and learning rate reported."""
        ...

    def trial_batches(self) -> Callable[[int], Any]:
        """make_batch(b) for tune: the same samples on every call, as training batches them."""
        ...

    def random_batches(self, seed: int) -> Callable[[int], Any]:
        """make_batch(b) for the noise scale: b samples drawn at random on every call."""
        ...

    def around_trials(self) -> AbstractContextManager[None]:
        """What the framework's training sets around a step (and tilefit puts back after)."""
        ...


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def tune_with(
    adapter: TrainingAdapter,
    *,
    global_batch: int | None = None,
    max_batch: int | None = None,
    memory_limit_bytes: int | None = None,
    margin: float = DEFAULT_MARGIN,
    predicted_max_batch: int | None = None,
    measure_throughput: bool = True,
    objective: str = "samples-per-s",
    noise_scale: float | NoiseScale | None = None,
) -> TuneResult:
    """``tune`` on what the framework trains: with objective="time-to-loss" and no noise
    scale given, it is measured first on random samples (``noise_scale_with``)."""
    if objective == TIME_TO_LOSS and noise_scale is None:
        noise_scale = noise_scale_with(adapter)
    make_batch = adapter.trial_batches()  # outside the trial context: a data error is its own
    with adapter.around_trials():
        return tune(
            adapter.model, make_batch, optimizer=adapter.optimizer(), loss_fn=adapter.loss_fn(),
            recipe=adapter.recipe, device=adapter.device, search=TuneSearch(
                global_batch=global_batch, max_batch=max_batch,
                memory_limit_bytes=memory_limit_bytes, margin=margin,
                predicted_max_batch=predicted_max_batch, measure_throughput=measure_throughput,
                keep_modes=adapter.keep_modes, objective=objective, noise_scale=noise_scale),
        )


def noise_scale_with(
    adapter: TrainingAdapter,
    *,
    batch_sizes: tuple[int, int] | None = None,
    measurements: int | None = None,
    checkpoint: str | None = None,
    seed: int = 0,
) -> NoiseScale:
    """``tilefit.noise_scale`` on the framework's model, loss, precision and random samples of
    its training data, the optimizer's state kept."""
    from tilefit.tuning.noise_measure import noise_scale

    with adapter.around_trials():
        return noise_scale(
            adapter.model, adapter.random_batches(seed), optimizer=adapter.held_optimizer(),
            loss_fn=adapter.loss_fn(), precision=adapter.precision, device=adapter.device,
            measure=NoiseMeasure(batch_sizes=batch_sizes,
                                 measurements=measurements or DEFAULT_MEASUREMENTS,
                                 checkpoint=checkpoint, keep_modes=adapter.keep_modes))
