"""``tune``: the largest batch that fits on the live device, then the fastest aligned one.

Search (pure policy, ``search.py``) over real trials (``executor.py``); everything the trials
change is restored in ``finally`` (``state.py``), also on Ctrl-C or an error.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from tilefit.html_repr import HtmlRepr
from tilefit.old_keywords import refuses_old_keywords
from tilefit.recipe import Recipe
from tilefit.tuning.diagnose import PLAN_COMMAND as PLAN_COMMAND  # re-exported
from tilefit.tuning.diagnose import gib as gib  # re-exported
from tilefit.tuning.diagnose import nothing_fits
from tilefit.tuning.executor import Executor, LossFn, OptimizerArg, Trial
from tilefit.tuning.noise import LearningRateAdvice, NoiseScale, TimeToLoss
from tilefit.tuning.options import DEFAULT_MARGIN as DEFAULT_MARGIN  # re-exported
from tilefit.tuning.options import NoiseMeasure, TuneSearch
from tilefit.tuning.outlook import Outlook, outlook, per_sample_s, timing_batch
from tilefit.tuning.predict import Prediction, predict_max_batch
from tilefit.tuning.request import (
    OBJECTIVE_RATE,
    TuneRequest,
    check_model_and_optimizer,
    current_job,
    live_recipe,
    make_request,
    preferred_multiple,
)
from tilefit.tuning.request import check_on_device as check_on_device  # re-exported
from tilefit.tuning.request import resolve_device as resolve_device  # re-exported
from tilefit.tuning.search import (
    accumulation_for,
    candidate_sizes,
    choose_batch,
    find_max_batch,
)
from tilefit.tuning.state import restore, snapshot, train_mode

WARMUP_STEPS = 2  # untimed steps before timing (allocator, autotuning, caches)
REPEATS = 3  # timed repeats per candidate; their spread is the noise band of the choice
MIN_TIMED_STEPS = 3  # micro-batches per timed repeat at least


@dataclass(frozen=True)
class TuneResult(HtmlRepr):
    batch_size: int  # the chosen micro-batch
    max_fitting_batch_size: int  # the exact largest batch that fits within the budget
    accumulation_steps: int  # global_batch / batch_size (1 without a global batch)
    samples_per_s: float | None  # measured at the chosen size
    trials: tuple[Trial, ...]
    budget_bytes: int | None = None  # memory allowed per step (capacity * (1 - margin))
    capacity_bytes: int | None = None
    global_batch: int | None = None
    candidates: tuple[int, ...] = ()
    noise: float = 0.0  # relative spread of the repeated timings
    predicted_max_batch: int | None = None  # the first probe (the estimator's prediction)
    # objective="time-to-loss" (tuning/objective.py): the noise scale used, the time to the
    # loss per measured batch, the samples/s choice beside it and how much slower it is
    objective: str = "samples-per-s"
    b_noise: float | None = None
    noise_measurement: NoiseScale | None = None  # when tune measured it
    time_to_loss: tuple[TimeToLoss, ...] = ()
    samples_per_s_batch: int | None = None
    time_to_loss_slowdown: float | None = None  # time of the samples/s choice / the chosen's
    learning_rate: LearningRateAdvice | None = None
    warnings: tuple[str, ...] = ()
    # under torchrun: batch_size is each rank's micro-batch, samples_per_s one rank's rate
    # (the slowest rank's times), global_batch_size = batch_size x world_size x accumulation
    world_size: int = 1
    global_batch_size: int | None = None
    # what tune skipped or could not do, and why (the estimator's prediction, when it could
    # not run); the CLI shows them
    notes: tuple[str, ...] = ()

    def __repr__(self) -> str:
        """One line (print() of a result; its detail is in the fields)."""
        rate = "" if self.samples_per_s is None else f", {self.samples_per_s:,.1f} samples/s"
        return (f"TuneResult(batch_size={self.batch_size}, max_fitting_batch_size="
                f"{self.max_fitting_batch_size}, trials={len(self.trials)}{rate})")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["trials"] = [t.to_dict() for t in self.trials]
        d["candidates"] = list(self.candidates)
        d["time_to_loss"] = [r.to_dict() for r in self.time_to_loss]
        d["warnings"] = list(self.warnings)
        d["notes"] = list(self.notes)
        if self.noise_measurement is not None:
            d["noise_measurement"] = self.noise_measurement.to_dict()
        return d

    @property
    def fit_trials(self) -> int:
        return sum(1 for t in self.trials if t.kind == "fit")


@refuses_old_keywords
def tune(
    model: nn.Module,
    make_batch: Callable[[int], Any],
    *,
    optimizer: OptimizerArg,
    loss_fn: LossFn | None = None,
    recipe: Recipe | None = None,
    precision: str | None = None,
    device: str | torch.device | None = None,
    search: TuneSearch | None = None,
) -> TuneResult:
    """Find the largest batch that fits, then the fastest hardware-friendly batch up to it.

    model: the user's module, already on the device. make_batch(b): a batch of b samples.
    loss_fn(model, batch): the scalar loss (default: model(**batch).loss for dict batches).
    optimizer: the user's optimizer (its state is restored) or a factory params -> Optimizer.
    recipe: the loop each trial runs (tilefit.loop's step of that Recipe: its precision,
    gradient clipping, loss read and zero_grad; batch and accumulation are what tune
    searches; fields that describe how the model is built, such as grad_checkpointing or
    lora, are refused: build the model that way); precision= alone is plain PyTorch's loop
    in that precision (default fp32).
    search (``TuneSearch``, default ``TuneSearch()``): global_batch, kept exact with
    accumulation (the chosen batch divides it); max_batch; memory_limit_bytes, a simulated
    device of that size (works on the CPU); margin, the fraction of memory kept free
    (DEFAULT_MARGIN); predicted_max_batch, the first probe: by default (``predict``) the
    estimator predicts it from fake-tensor traces of the step (no run on the device), and when
    it cannot, the result's ``notes`` say why. on_trial: called with each Trial as it
    completes. on_outlook: called once before the first trial with what tune expects to run:
    about how many trials and how long (from steps timed at batch 1 and at a quarter of the
    expected largest batch: three extra steps that run only when it is given); not called when
    there is no batch to expect (no prediction, no cap) or those steps run out of memory.
    0.1.0's keywords (``max_batch=``, ``margin=``, ...) are refused with their new spelling
    (tilefit.old_keywords).

    The trials run with every module in train mode (``model.train()``, as Hugging Face's
    Trainer and most loops train; a ``from_pretrained`` model arrives in eval mode, where
    dropout allocates nothing), unless ``keep_modes``: then in the modes the modules are in,
    for loops that train them as the user left them (Lightning 2.6's fit loop calls no
    ``train()``; a BatchNorm the user froze in eval mode stays so). Model (parameters,
    buffers, gradients, every module's own attributes, see ``tuning.state``), optimizer, RNG
    states and module modes are exactly as before when tune returns or raises.
    objective="time-to-loss": the timed batch soonest to a given loss, from ``noise_scale``
    (B_noise or a NoiseScale; else measured on make_batch's batches): ``tuning.objective``.
    Under ``torchrun`` call it on every rank: they agree on every trial (``tuning.ranks``);
    ``batch_size`` is per rank, ``global_batch`` the job's; rank 0 alone reports progress.
    """
    search = search or TuneSearch()
    ranks = current_job(search.objective, search.noise_scale)
    request = make_request(search, recipe=live_recipe(recipe, precision), device=device,
                           ranks=ranks)
    check_model_and_optimizer(model, optimizer, request)
    return _run(model, make_batch, loss_fn, optimizer, request, keep_modes=search.keep_modes,
                on_trial=search.on_trial, on_outlook=search.on_outlook)


def _run(model: nn.Module, make_batch: Callable[[int], Any], loss_fn: LossFn | None,
         optimizer: OptimizerArg, request: TuneRequest, *, keep_modes: bool,
         on_trial: Callable[[Trial], None] | None,
         on_outlook: Callable[[Outlook], None] | None) -> TuneResult:
    """The trials, with the model, optimizer, RNG, modes and TF32 flags put back in
    ``finally`` (KeyboardInterrupt included); progress from rank 0 alone."""
    if not request.ranks.is_main:
        on_trial = on_outlook = None  # one rank reports progress
    user_opt = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
    snap = snapshot(model, user_opt)
    tf32_before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        if not keep_modes:
            train_mode(model)  # trials run as training does (from_pretrained leaves eval mode)
        if request.precision.allow_tf32:
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        ex = Executor(
            model=model, make_batch=make_batch, loss_fn=loss_fn, optimizer=optimizer, snap=snap,
            recipe=request.recipe, device=request.device, on_trial=on_trial,
            keep_modes=keep_modes, ranks=request.ranks, **_trial_settings(request))
        return _probe_and_search(ex, request, on_outlook)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32_before
        restore(snap)
        gc.collect()
        if request.device.type == "cuda":
            torch.cuda.empty_cache()


def _probe_and_search(ex: Executor, request: TuneRequest,
                      on_outlook: Callable[[Outlook], None] | None) -> TuneResult:
    """The first probe (the ranks' smallest), the outlook when asked for, the search."""
    prediction = _first_probe(ex, request)
    first_probe = request.ranks.smallest_probe(prediction.max_batch)
    expected = None if on_outlook is None else _outlook(ex, request, first_probe)
    if on_outlook is not None and expected is not None:
        on_outlook(expected)
    notes = () if prediction.skipped is None else (prediction.skipped,)
    return _search(ex, request, first_probe, notes)


def _trial_settings(request: TuneRequest) -> dict[str, Any]:
    return {"memory_limit_bytes": request.memory_limit_bytes, "margin": request.margin,
            "steps_per_trial": request.steps_per_trial, "warmup_steps": WARMUP_STEPS,
            "repeats": REPEATS, "min_timed_steps": MIN_TIMED_STEPS}


def _first_probe(ex: Executor, request: TuneRequest) -> Prediction:
    """The search's first batch: the user's, or the estimator's predicted largest fit (with
    the reason when it could not be predicted)."""
    if request.predicted_max_batch is not None or not request.predict:
        return Prediction(request.predicted_max_batch)
    return predict_max_batch(
        ex.local, ex.make_batch, loss_fn=ex.loss_fn, optimizer=ex.optimizer,
        recipe=request.recipe, device=request.device,
        budget_bytes=ex.budget_bytes, cap=request.cap, routing=request.routing)


def _outlook(ex: Executor, request: TuneRequest, first_probe: int | None) -> Outlook | None:
    """Time a step at batch 1 (twice: the first warms up) and at a larger batch, and
    expect."""
    b = timing_batch(first_probe, request.cap)
    times_s = ex.time_steps([1, 1, b])
    if times_s is None:
        return None
    _, at_1, at_b = times_s
    has_peaks = request.memory_limit_bytes is not None or request.device.type == "cuda"
    return outlook(
        step_s_at_1=at_1, step_s_per_sample=per_sample_s(at_1, b, at_b),
        first_probe=first_probe,
        cap=request.cap, has_peaks=has_peaks,
        multiple=preferred_multiple(request.device, request.precision.name),
        global_batch=request.global_batch, measure_throughput=request.measure_throughput,
        shape=ex.trial_shape)


def _search(ex: Executor, request: TuneRequest, first_probe: int | None,
            notes: tuple[str, ...] = ()) -> TuneResult:
    """The exact largest batch that fits, then the fastest friendly batch up to it (or the
    soonest to a loss, objective="time-to-loss")."""
    search = find_max_batch(ex.fit, start=first_probe, max_batch=request.cap)
    if search.max_batch == 0:
        raise nothing_fits(ex, request)
    candidates = candidate_sizes(
        search.max_batch, multiple=preferred_multiple(request.device, request.precision.name),
        global_batch=request.global_batch,
    )
    chosen, rate, noise = candidates[-1], None, 0.0
    measured: dict[int, list[float]] = {}
    if request.measure_throughput:
        for b in candidates:
            rates = ex.throughput(b, accumulation_for(request.global_batch, b))
            if rates:
                measured[b] = rates
        if measured:
            choice = choose_batch(measured)
            chosen, rate, noise = choice.batch_size, choice.samples_per_s, choice.noise
    extra: dict[str, Any] = {}
    if request.objective != OBJECTIVE_RATE and measured:
        extra = _time_to_loss(ex, request, measured, noise, chosen, search.max_batch)
        chosen = extra.pop("batch_size")
        rate = max(measured[chosen])
    accumulation = accumulation_for(request.global_batch, chosen)
    world = request.ranks.world_size
    return TuneResult(
        batch_size=chosen, max_fitting_batch_size=search.max_batch,
        accumulation_steps=accumulation,
        samples_per_s=rate, trials=tuple(ex.trials),
        budget_bytes=ex.budget_bytes, capacity_bytes=ex.capacity_bytes,
        global_batch=None if request.global_batch is None else request.global_batch * world,
        candidates=candidates, noise=noise,
        predicted_max_batch=first_probe, objective=request.objective,
        world_size=world, global_batch_size=chosen * world * accumulation, notes=notes,
        **extra,
    )


def _time_to_loss(ex: Executor, request: TuneRequest, measured: dict[int, list[float]],
                  noise: float, rate_choice: int, max_batch: int) -> dict[str, Any]:
    """The time-to-loss choice and the fields it adds; measures the noise scale on the
    executor's batches when none was given."""
    from tilefit.tuning import objective

    noise_scale = request.noise_scale
    if noise_scale is None:
        from tilefit.tuning.noise_measure import noise_scale as measure

        user_opt = ex.optimizer if isinstance(ex.optimizer, torch.optim.Optimizer) else None
        noise_scale = measure(
            ex.model, ex.make_batch, loss_fn=ex.loss_fn, optimizer=user_opt,
            precision=request.precision.name, device=request.device,
            measure=NoiseMeasure(batch_sizes=objective.measuring_sizes(max_batch),
                                 keep_modes=ex.keep_modes))
    choice = objective.choose(measured, noise, rate_choice, noise_scale, request.global_batch,
                              _optimizer_name(ex))
    fields = objective.summary(choice)
    fields["batch_size"] = choice.batch_size
    fields["noise_measurement"] = noise_scale if isinstance(noise_scale, NoiseScale) else None
    return fields


def _optimizer_name(ex: Executor) -> str:
    """The optimizer's class name (a factory builds one, stateless until it steps)."""
    if isinstance(ex.optimizer, torch.optim.Optimizer):
        return type(ex.optimizer).__name__
    return type(ex.optimizer(ex.model.parameters())).__name__
