"""tilefit's Lightning callbacks, as module-level classes (so they can be subclassed and
pickled). Importing this module imports Lightning (an error saying how to install it when it
is missing); ``tilefit.tuning.integrations.lightning`` makes them without importing Lightning
until then (``tilefit_batch_size_finder``, ``simulated_memory_limit``, ``noise_scale_monitor``).

    from tilefit.tuning.integrations.lightning_callbacks import TilefitBatchSizeFinder

    class LoggedFinder(TilefitBatchSizeFinder):
        def on_fit_start(self, trainer, pl_module):
            super().on_fit_start(trainer, pl_module)
            print(self.result.batch_size)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from tilefit.errors import TilefitError
from tilefit.tuning.integrations.lightning import (
    FinderOptions,
    LightningTuneResult,
    apply_batch_size,
    check_trainer,
    import_lightning,
    noise_scale_lightning,
    tune_lightning,
)

pl = import_lightning()


class TilefitBatchSizeFinder(pl.Callback):  # type: ignore[misc, name-defined]
    """Tunes the batch size at fit start and applies it (see ``tuning.integrations.lightning``).
    Its ``result`` is a LightningTuneResult once the fit has started."""

    def __init__(self, options: FinderOptions | None = None) -> None:
        super().__init__()
        self.options = FinderOptions() if options is None else options
        self.result: LightningTuneResult | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            check_trainer(trainer, pl_module, self.options.batch_arg_name)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.result = tune_lightning(trainer, pl_module, self.options)
        apply_batch_size(trainer, pl_module, self.options.batch_arg_name,
                         self.result.batch_size)
        if self.options.global_batch is not None:
            trainer.accumulate_grad_batches = self.result.accumulation_steps


def _training_state(pl_module: Any, optimizers: Iterable[Any]) -> Iterator[Any]:
    """Weights, gradients, buffers and optimizer state: what lives before a step."""
    import torch

    for p in pl_module.parameters():
        yield p
        if p.grad is not None:
            yield p.grad
    yield from pl_module.buffers()
    for opt in optimizers:
        for state in opt.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


class SimulatedMemoryLimit(pl.Callback):  # type: ignore[misc, name-defined]
    """Trains on tilefit's simulated device of ``limit_bytes`` (tilefit.tuning.simulate): from
    on_train_start to the end of training, live tensor storage is counted and an allocation
    past the limit raises torch.OutOfMemoryError. ``peak_bytes`` is the highest total seen."""

    def __init__(self, limit_bytes: int) -> None:
        super().__init__()
        self.limit_bytes = limit_bytes
        self.peak_bytes: int | None = None
        self._mode: Any = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        from tilefit.tuning.simulate import MemoryLimitMode

        self._mode = MemoryLimitMode(self.limit_bytes,
                                     _training_state(pl_module, trainer.optimizers))
        self._mode.__enter__()

    def _stop(self) -> None:
        if self._mode is not None:
            mode, self._mode = self._mode, None
            self.peak_bytes = mode.peak_bytes
            mode.__exit__(None, None, None)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._stop()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._stop()


class NoiseScaleMonitor(pl.Callback):  # type: ignore[misc, name-defined]
    """Measures the gradient noise scale after the optimizer steps in ``at_steps``
    (trainer.global_step); ``results`` holds (global_step, NoiseScale) pairs. The training
    run itself is not changed."""

    def __init__(self, at_steps: Iterable[int], batch_sizes: tuple[int, int] | None = None,
                 measurements: int | None = None) -> None:
        steps = sorted(set(at_steps))
        if not steps or any(isinstance(s, bool) or not isinstance(s, int) or s < 0
                            for s in steps):
            raise TilefitError("at_steps must be optimizer steps (whole numbers >= 0)",
                               expected="e.g. at_steps=(200, 2000)", given=repr(at_steps),
                               fix="pass the global steps after which to measure")
        super().__init__()
        self.at_steps = steps
        self.batch_sizes = batch_sizes
        self.measurements = measurements
        self.results: list[tuple[int, Any]] = []

    def _measure(self, trainer: Any, pl_module: Any) -> None:
        step = trainer.global_step
        if step in self.at_steps and all(s != step for s, _ in self.results):
            self.results.append((step, noise_scale_lightning(
                trainer, pl_module, batch_sizes=self.batch_sizes,
                measurements=self.measurements)))

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._measure(trainer, pl_module)  # at_steps may include 0

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._measure(trainer, pl_module)
