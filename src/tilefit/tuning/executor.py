"""Real training steps at a given batch size: OOM-safe fit trials and timed throughput trials.

One step is what the user's training loop does: make a batch, then tilefit.loop's step of
plain PyTorch's loop (forward and loss under autocast for mixed precision, GradScaler where
the precision scales the loss, backward, optimizer step, zero_grad(set_to_none=True)), with
every module in train mode (``state.train_mode``: dropout on, as in training). After every trial the
weights, gradients, optimizer state and module attributes are put back
(``state.restore_weights``), so every trial starts from the state the user handed in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from tilefit.errors import TilefitError
from tilefit.loop import (
    autocast_for,
    clear_gradients,
    default_loss,
    micro_batch,
    optimizer_update,
)
from tilefit.recipe import Recipe
from tilefit.tuning.outlook import TrialShape
from tilefit.tuning.peaks import PeakWatch, trial_hooks
from tilefit.tuning.ranks import DOES_NOT_FIT, FAILED, FITS, Ranks, local_module
from tilefit.tuning.search import FitProbe
from tilefit.tuning.simulate import OOM_ERROR, MemoryLimitMode
from tilefit.tuning.state import Snapshot, restore_weights, train_mode

LossFn = Callable[[nn.Module, Any], torch.Tensor]
OptimizerArg = torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer]

MIN_REPEAT_S = 0.05  # each timed repeat lasts at least this long (timeit autorange uses 0.2 s)
MAX_CYCLES_PER_REPEAT = 20  # ... but never more optimizer steps than this per repeat


@dataclass(frozen=True)
class Trial:
    """One trial as the result reports it."""

    kind: str  # "fit" | "throughput"
    batch_size: int
    fits: bool
    samples_per_s: float | None  # throughput trials: the fastest repeat (choose_batch's score)
    peak_memory_bytes: int | None  # fit trials: highest memory in use
    time_s: float  # wall time of the whole trial

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def is_oom(exc: BaseException) -> bool:
    """The device's out-of-memory error: torch.OutOfMemoryError, or a RuntimeError whose
    message says "out of memory" (older builds, MPS, some CUDA paths)."""
    if isinstance(exc, OOM_ERROR):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device)
    if isinstance(batch, Mapping):
        return type(batch)({k: _to_device(v, device) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, list | tuple):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Executor:
    """Runs fit and throughput trials for one model on one device."""

    def __init__(
        self,
        *,
        model: nn.Module,
        make_batch: Callable[[int], Any],
        loss_fn: LossFn | None,
        optimizer: OptimizerArg,
        snap: Snapshot,
        recipe: Recipe,
        device: torch.device,
        memory_limit_bytes: int | None,
        margin: float,
        steps_per_trial: int,
        warmup_steps: int,
        repeats: int,
        min_timed_steps: int,
        on_trial: Callable[[Trial], None] | None = None,
        keep_modes: bool = False,
        ranks: Ranks | None = None,
    ) -> None:
        self.model = model
        self.ranks = ranks or Ranks()
        # fit trials run the unwrapped module: no collective inside (tuning/ranks.py)
        self.local = local_module(model, self.ranks)
        self.make_batch = make_batch
        self.loss_fn = loss_fn or default_loss
        self.optimizer = optimizer
        self.snap = snap
        self.recipe = recipe  # the step each trial runs; batch and accumulation vary
        self.device = device
        self.memory_limit_bytes = memory_limit_bytes
        self.steps_per_trial = steps_per_trial
        self.warmup_steps = warmup_steps
        self.repeats = repeats
        self.min_timed_steps = min_timed_steps
        self.on_trial = on_trial
        self.keep_modes = keep_modes  # trials run in the modules' own modes (Lightning)
        self.trials: list[Trial] = []
        capacity = memory_limit_bytes
        if capacity is None and device.type == "cuda":
            free_bytes, _total = torch.cuda.mem_get_info(device)
            capacity = free_bytes + torch.cuda.memory_reserved(device)  # what we could hold
        self.capacity_bytes = capacity
        # The margin is memory kept free: the caching allocator's fragmentation and longer
        # sequences later in training. A policy choice (default in options.DEFAULT_MARGIN).
        self.budget_bytes = None if capacity is None else int(capacity * (1 - margin))

    # --- one step ---

    def _new_optimizer(self) -> torch.optim.Optimizer:
        """The trial's optimizer; also puts the model in train mode for the trial (unless
        the loop being tuned keeps the modules' own modes)."""
        if not self.keep_modes:
            train_mode(self.model)
        if isinstance(self.optimizer, torch.optim.Optimizer):
            return self.optimizer
        opt = self.optimizer(self.model.parameters())
        if not isinstance(opt, torch.optim.Optimizer):
            raise TilefitError(
                "the optimizer factory did not return a torch optimizer",
                expected="optimizer=torch.optim.AdamW(model.parameters()) or a factory "
                "params -> Optimizer",
                given=f"a factory returning {type(opt).__name__}",
                fix="pass optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4)",
            )
        return opt

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        return autocast_for(self.device.type, self.recipe.spec)

    def _steps(self, batch_size: int, accumulation: int, cycles: int,
               opt: torch.optim.Optimizer, watch: PeakWatch | None = None,
               model: nn.Module | None = None) -> None:
        """``cycles`` optimizer steps of ``accumulation`` micro-batches, each tilefit.loop's
        step of plain PyTorch's loop in the trial's precision (with torch.amp's GradScaler
        where it scales the loss), written as the usual training loop: ``for batch in
        loader: loss = f(batch); loss.backward(); ...`` keeps the last batch and loss
        referenced through the optimizer step and while the next batch is made, so their
        memory counts where a real loop's would. ``model``: the module the loss runs
        (default: the user's, wrapped as given)."""
        model = self.model if model is None else model
        recipe = dataclasses.replace(self.recipe, accumulation_steps=accumulation)
        scaler = torch.amp.GradScaler(self.device.type) if recipe.spec.grad_scaler else None
        hooks = trial_hooks(watch, self._autocast)
        params = [p for group in opt.param_groups for p in group["params"]]
        held: list[Any] = [None, None]  # the loop's ``batch`` and ``loss`` variables

        def loss_of() -> torch.Tensor:
            held[1] = self.loss_fn(model, held[0])  # ``loss = f(batch)`` frees the last one
            return held[1]

        for _ in range(cycles):
            for _ in range(accumulation):
                if watch is not None:
                    watch.phase("forward")
                held[0] = self._on_device(self.make_batch(batch_size), watch)
                micro_batch(loss_of, recipe, scaler=scaler, hooks=hooks)
            optimizer_update(opt, params, recipe, scaler=scaler, hooks=hooks)
            clear_gradients(opt, recipe, hooks)
        if watch is not None:
            watch.end()
        held.clear()

    def _on_device(self, batch: Any, watch: PeakWatch | None) -> Any:
        """The batch as the device holds it. Under the simulated cap a tensor still on the
        host (a view of the user's dataset, say) is charged as the copy the device would
        receive, its own elements, never the dataset it is a view of."""
        batch = _to_device(batch, self.device)
        if watch is not None and watch.mode is not None:
            batch = watch.mode.device_copy(batch)
        return batch

    # --- memory bookkeeping ---

    def _state_tensors(self, opt: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
        for p in self.model.parameters():
            yield p
            if p.grad is not None:
                yield p.grad
        yield from self.model.buffers()
        for s in opt.state.values():
            yield from (v for v in s.values() if isinstance(v, torch.Tensor))

    @contextlib.contextmanager
    def _memory(self, opt: torch.optim.Optimizer, simulate: bool) -> Iterator[PeakWatch]:
        """A PeakWatch whose baseline, overall and per-phase peaks are filled in."""
        if simulate:
            mode = MemoryLimitMode(self.memory_limit_bytes, self._state_tensors(opt))
            watch = PeakWatch(mode=mode)
            watch.baseline_bytes = mode.baseline_bytes
            try:
                with mode:
                    yield watch
            finally:
                watch.peak_bytes = max(watch.peak_bytes or 0, mode.peak_bytes)
        elif self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            watch = PeakWatch(device=self.device)
            watch.baseline_bytes = torch.cuda.memory_allocated(self.device)
            yield watch
        else:
            yield PeakWatch()

    def _cleanup(self, opt: torch.optim.Optimizer, failed: bool) -> None:
        """Free everything the trial made and put the user's state back.

        Reference counting frees a finished trial's tensors; after a failure (OOM) reference
        cycles through the traceback's frames can hold activations, so only then do we pay
        for gc.collect (~0.2 s with torch loaded) and hand cached blocks back to CUDA.
        """
        opt.zero_grad(set_to_none=True)
        for p in self.model.parameters():
            p.grad = None
        restore_weights(self.snap)
        if failed:
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _record(self, trial: Trial) -> None:
        self.trials.append(trial)
        if self.on_trial is not None:
            self.on_trial(trial)

    @property
    def trial_shape(self) -> TrialShape:
        return TrialShape(self.steps_per_trial, self.warmup_steps, self.repeats,
                          self.min_timed_steps, MIN_REPEAT_S, MAX_CYCLES_PER_REPEAT)

    # --- trials ---

    def time_steps(self, batch_sizes: Sequence[int]) -> list[float] | None:
        """Wall time of one step at each batch size in turn, run as the fit trials run (under
        the simulated cap when there is one), or None on OOM. Not a recorded trial: it
        tells how long the trials will take before they run."""
        opt = self._new_optimizer()
        times_s: list[float] = []
        failed = True
        try:
            with self._memory(opt, self.memory_limit_bytes is not None) as watch:
                for b in batch_sizes:
                    _sync(self.device)
                    start = time.perf_counter()
                    self._steps(b, 1, 1, opt, watch, self.local)
                    _sync(self.device)
                    times_s.append(time.perf_counter() - start)
            failed = False
        except Exception as exc:
            if not is_oom(exc):
                raise
            traceback.clear_frames(exc.__traceback__)
            del exc
        finally:
            self._cleanup(opt, failed=failed)
        return None if failed else times_s

    def fit(self, batch_size: int) -> FitProbe:
        """Run ``steps_per_trial`` steps at ``batch_size``; did they fit within the budget?
        Under torchrun: on every rank (the worst rank's outcome, ``tuning/ranks.py``)."""
        opt = self._new_optimizer()
        t0 = time.perf_counter()
        ran = False
        simulate = self.memory_limit_bytes is not None
        watch = PeakWatch()
        try:
            with self._memory(opt, simulate) as watch:
                self._steps(batch_size, 1, self.steps_per_trial, opt, watch, self.local)
                _sync(self.device)
            ran = True
        except Exception as exc:  # KeyboardInterrupt and friends pass through untouched
            self._survive_oom(exc, 0)
            del exc
        finally:
            self._cleanup(opt, failed=not ran)
        peak = watch.peak_bytes
        fits = ran and (self.budget_bytes is None or peak is None or peak <= self.budget_bytes)
        fits = self._agree(FITS if fits else DOES_NOT_FIT, [])[0] == FITS
        self._record(Trial("fit", batch_size, fits, None, peak if ran else None,
                           time.perf_counter() - t0))
        return self.ranks.tightest(FitProbe(
            fits=fits,
            peak_bytes=peak if ran else None,
            budget_bytes=self.budget_bytes,
            baseline_bytes=watch.baseline_bytes,
            phase_peaks=dict(watch.phase_peaks) if ran and watch.phase_peaks else None,
        ))

    def _survive_oom(self, exc: Exception, n_times: int) -> None:
        """Out of memory: drop the frames holding activations and return. Any other error:
        tell the other ranks (they stop too, at the same all-reduce), then raise it."""
        if not is_oom(exc):
            self.ranks.agree(FAILED, [0.0] * n_times)
            raise exc
        traceback.clear_frames(exc.__traceback__)

    def _agree(self, code: int, times_s: list[float]) -> tuple[int, list[float]]:
        """The job's outcome and times (identity on one process); another rank's error
        stops this one too."""
        code, times_s = self.ranks.agree(code, times_s)
        if code == FAILED:
            raise TilefitError(
                "tune stopped: a trial failed on another rank",
                expected="every rank to run the trial (or to run out of memory)",
                given="an error other than out-of-memory on another rank",
                fix="read the other ranks' error in the torchrun log (each rank prints its "
                "own traceback)")
        return code, times_s

    def _attempt(self, body: Callable[[], list[float]], n_times: int
                 ) -> tuple[int, list[float]]:
        """Run ``body`` (its times), OOM-safe, then agree on the outcome with the other
        ranks: exactly one all-reduce on every rank, whatever happened."""
        try:
            times_s, code = body(), FITS
        except Exception as exc:
            self._survive_oom(exc, n_times)
            del exc
            times_s, code = [0.0] * n_times, DOES_NOT_FIT
        return self._agree(code, times_s)

    def _warm_up(self, batch_size: int, accumulation: int, opt: torch.optim.Optimizer
                 ) -> list[float]:
        """At least ``warmup_steps`` micro-batches, in whole optimizer steps; the last
        cycle's time."""
        cycle_s = 0.0
        for _ in range(max(1, -(-self.warmup_steps // accumulation))):
            _sync(self.device)
            warm_start = time.perf_counter()
            self._steps(batch_size, accumulation, 1, opt)
            _sync(self.device)
            cycle_s = time.perf_counter() - warm_start
        return [cycle_s]

    def _timed(self, batch_size: int, accumulation: int, cycles: int,
               opt: torch.optim.Optimizer) -> list[float]:
        elapsed_s: list[float] = []
        for _ in range(self.repeats):
            start = time.perf_counter()
            self._steps(batch_size, accumulation, cycles, opt)
            _sync(self.device)
            elapsed_s.append(time.perf_counter() - start)
        return elapsed_s

    def throughput(self, batch_size: int, accumulation: int) -> list[float] | None:
        """samples/s of ``repeats`` timed runs after warm-up, or None on OOM.

        One timed run is ``cycles`` optimizer steps of ``accumulation`` micro-batches each
        (so the optimizer step is amortised as in training), at least ``min_timed_steps``
        micro-batches, bracketed by device synchronisation. Runs without the memory
        simulation: its per-op bookkeeping would distort the timings (the fit search already
        proved every size up to the max fits). Under torchrun the wrapped model runs (its
        gradient all-reduce is in the time) and each time is the slowest rank's.
        """
        opt = self._new_optimizer()
        t0 = time.perf_counter()
        rates: list[float] | None = None
        try:
            code, (cycle_s,) = self._attempt(
                lambda: self._warm_up(batch_size, accumulation, opt), 1)
            if code == FITS:
                cycles = max(1, -(-self.min_timed_steps // accumulation))
                if cycle_s > 0:
                    # Like timeit's autorange: a repeat long enough that timer resolution
                    # and scheduler jitter stay small against it.
                    needed = math.ceil(MIN_REPEAT_S / max(cycle_s, 1e-9))
                    cycles = min(MAX_CYCLES_PER_REPEAT, max(cycles, needed))
                code, elapsed_s = self._attempt(
                    lambda: self._timed(batch_size, accumulation, cycles, opt), self.repeats)
                if code == FITS:
                    rates = [batch_size * accumulation * cycles / e for e in elapsed_s]
        finally:
            self._cleanup(opt, failed=not rates)
        best = None if not rates else max(rates)  # the score choose_batch uses
        self._record(Trial("throughput", batch_size, rates is not None, best, None,
                           time.perf_counter() - t0))
        return rates
