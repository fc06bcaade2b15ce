"""``tune``: the largest batch that fits on the live device, then the fastest aligned one.

Search (pure policy, ``search.py``) over real trials (``executor.py``); everything the trials
change is restored in ``finally`` (``state.py``), also on Ctrl-C or an error.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from tilefit.dtypes import parse_dtype
from tilefit.errors import TilefitError
from tilefit.tuning.executor import Executor, LossFn, OptimizerArg, Trial
from tilefit.tuning.noise import LearningRateAdvice, NoiseScale, TimeToLoss
from tilefit.tuning.objective import check_objective
from tilefit.tuning.outlook import Outlook, outlook, per_sample_s, timing_batch
from tilefit.tuning.ranks import Ranks, current_ranks, rank_share
from tilefit.tuning.search import (
    accumulation_for,
    candidate_sizes,
    choose_batch,
    find_max_batch,
)
from tilefit.tuning.state import restore, snapshot, train_mode
from tilefit.vocab import Precision, mixed_precision, parse_precision

# Fraction of device memory kept free. Not a measurement: a policy. The caching allocator
# fragments (PyTorch "CUDA memory management" notes: reserved > allocated), and batches later
# in training can be larger than the synthetic ones (longer sequences, more targets), which is
# how tuned runs OOM later. 10% is the default; pass margin=0 to pack the device full.
DEFAULT_MARGIN = 0.10
# Steps per fit trial: the optimizer state is created by the first step, so the second step is
# the first with weights + gradients + optimizer state + activations all live (the steady-state
# peak). Lightning runs 3 steps per trial (BatchSizeFinder steps_per_trial=3).
DEFAULT_STEPS_PER_TRIAL = 2
WARMUP_STEPS = 2  # untimed steps before timing (allocator, autotuning, caches)
REPEATS = 3  # timed repeats per candidate; their spread is the noise band of the choice
MIN_TIMED_STEPS = 3  # micro-batches per timed repeat at least
CPU_MULTIPLE = 8  # the CPU has no Tensor Core rule; multiples of 8 suit SIMD widths
# the mixed precision to suggest: bf16 autocast (tilefit.vocab)
MIXED = mixed_precision("bf16").name
OBJECTIVE_RATE = "samples-per-s"


@dataclass(frozen=True)
class TuneResult:
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

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["trials"] = [t.to_dict() for t in self.trials]
        d["candidates"] = list(self.candidates)
        d["time_to_loss"] = [r.to_dict() for r in self.time_to_loss]
        d["warnings"] = list(self.warnings)
        if self.noise_measurement is not None:
            d["noise_measurement"] = self.noise_measurement.to_dict()
        return d

    @property
    def fit_trials(self) -> int:
        return sum(1 for t in self.trials if t.kind == "fit")


def _positive(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise TilefitError(
            f"{name} must be a positive whole number",
            expected="an integer >= 1 or None",
            given=repr(value),
            fix=f"pass {name}=<n> with n >= 1",
        )


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise TilefitError(
            f"unknown device {device!r}",
            expected="cuda, cuda:N or cpu",
            given=repr(device),
            fix="pass device='cuda' or device='cpu'",
        ) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise TilefitError(
                "device cuda was asked for but there is no CUDA GPU",
                expected="a machine with a CUDA GPU and a CUDA build of PyTorch",
                given="torch.cuda.is_available() is False",
                fix="use device='cpu' (with memory_limit_bytes to simulate a GPU's memory)",
            )
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def preferred_multiple(device: torch.device, precision: str) -> int:
    """The batch multiple the device's Tensor Cores want for the dtype (Device.multiple:
    alignment bytes / element size, NVIDIA Matrix Multiplication guide Table 1)."""
    if device.type != "cuda":
        return CPU_MULTIPLE
    from tilefit.hardware import detect_live_device

    dtype = parse_precision(precision).compute_dtype
    try:
        return detect_live_device(device.index or 0).multiple(dtype)
    except TilefitError:  # a GPU missing from the catalog: the general 16-byte rule
        return max(1, 16 // parse_dtype(dtype).bytes)


@dataclass(frozen=True)
class TuneRequest:
    """tune's options, validated: what to search and under which limits."""

    precision: Precision
    device: torch.device
    global_batch: int | None
    max_batch: int | None
    memory_limit_bytes: int | None
    margin: float
    steps_per_trial: int
    predicted_max_batch: int | None
    predict: bool
    measure_throughput: bool
    objective: str = "samples-per-s"
    noise_scale: float | NoiseScale | None = None
    ranks: Ranks = dataclasses.field(default_factory=Ranks)  # under torchrun; global_batch
    # above is then this rank's share

    @property
    def cap(self) -> int | None:
        """The largest batch to try: max_batch, and no more than the global batch."""
        if self.global_batch is None:
            return self.max_batch
        return self.global_batch if self.max_batch is None else min(self.max_batch,
                                                                     self.global_batch)


def tune(
    model: nn.Module,
    make_batch: Callable[[int], Any],
    *,
    loss_fn: LossFn | None = None,
    optimizer: OptimizerArg,
    precision: str = "fp32",
    device: str | torch.device | None = None,
    global_batch: int | None = None,
    max_batch: int | None = None,
    memory_limit_bytes: int | None = None,
    margin: float = DEFAULT_MARGIN,
    steps_per_trial: int = DEFAULT_STEPS_PER_TRIAL,
    predicted_max_batch: int | None = None,
    predict: bool = True,
    measure_throughput: bool = True,
    on_trial: Callable[[Trial], None] | None = None,
    on_outlook: Callable[[Outlook], None] | None = None,
    keep_modes: bool = False,
    objective: str = "samples-per-s", noise_scale: float | NoiseScale | None = None,
) -> TuneResult:
    """Find the largest batch that fits, then the fastest hardware-friendly batch up to it.

    model: the user's module, already on the device. make_batch(b): a batch of b samples.
    loss_fn(model, batch): the scalar loss (default: model(**batch).loss for dict batches).
    optimizer: the user's optimizer (its state is restored) or a factory params -> Optimizer.
    global_batch: keep it exact with accumulation; the chosen batch divides it.
    memory_limit_bytes: simulate a device of this size (works on the CPU).
    margin: fraction of memory kept free (see DEFAULT_MARGIN).
    predicted_max_batch: the first probe; by default (``predict``) the estimator predicts it
    from two fake-tensor traces of the step (no run on the device).
    on_trial: called with each Trial as it completes (progress display).
    on_outlook: called once before the first trial with what tune expects to run: about how
    many trials and how long (from steps timed at batch 1 and at a quarter of the expected
    largest batch: three extra steps that run only when this is given). Not called when
    there is no batch to expect (no prediction, no cap) or those steps run out of memory.

    The trials run with every module in train mode (``model.train()``, as Hugging Face's
    Trainer and most loops train; a ``from_pretrained`` model arrives in eval mode, where
    dropout allocates nothing), unless ``keep_modes``: then in the modes the modules are in,
    for loops that train them as the user left them (Lightning 2.6's fit loop calls no
    ``train()``; a BatchNorm the user froze in eval mode stays so). Model (parameters,
    buffers, gradients, every module's own attributes, see ``tuning.state``), optimizer, RNG
    states and module modes are exactly as before when tune returns or raises
    (KeyboardInterrupt included).
    objective="time-to-loss": the timed batch soonest to a given loss, from ``noise_scale``
    (B_noise or a NoiseScale; else measured on make_batch's batches): ``tuning.objective``.
    Under ``torchrun`` call it on every rank: they agree on every trial (``tuning.ranks``);
    ``batch_size`` is per rank, ``global_batch`` the job's; rank 0 alone reports progress.
    """
    ranks = _job(objective, noise_scale)
    if not ranks.is_main:
        on_trial = on_outlook = None  # one rank reports progress
    request = dataclasses.replace(make_request(
        precision=precision, device=device, global_batch=rank_share(global_batch, ranks),
        max_batch=max_batch, memory_limit_bytes=memory_limit_bytes, margin=margin,
        steps_per_trial=steps_per_trial, predicted_max_batch=predicted_max_batch,
        predict=predict, measure_throughput=measure_throughput or objective != OBJECTIVE_RATE),
        objective=objective, noise_scale=noise_scale, ranks=ranks)
    check_model_and_optimizer(model, optimizer, request)
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
            precision=request.precision.name, device=request.device, on_trial=on_trial,
            keep_modes=keep_modes, ranks=ranks, **_trial_settings(request))
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
    first_probe = request.ranks.smallest_probe(
        _first_probe(ex.local, ex.make_batch, ex.loss_fn, ex.optimizer, request, ex))
    expected = None if on_outlook is None else _outlook(ex, request, first_probe)
    if on_outlook is not None and expected is not None:
        on_outlook(expected)
    return _search(ex, request, first_probe)


def _job(objective: str, noise_scale: float | NoiseScale | None) -> Ranks:
    """The torchrun job this process is in (rank 0 of 1 outside one); the objective
    checked for it."""
    ranks = current_ranks()
    check_objective(objective, noise_scale)
    if ranks.distributed and objective != OBJECTIVE_RATE and noise_scale is None:
        raise TilefitError(
            "under torchrun, objective='time-to-loss' needs the noise scale given",
            expected="noise_scale=B_noise (measured once, on one process)",
            given="noise_scale=None (each rank would measure its own)",
            fix="measure it with `tilefit noise-scale` and pass noise_scale= (CLI: "
            "--noise-scale)")
    return ranks


def _trial_settings(request: TuneRequest) -> dict[str, Any]:
    return {"memory_limit_bytes": request.memory_limit_bytes, "margin": request.margin,
            "steps_per_trial": request.steps_per_trial, "warmup_steps": WARMUP_STEPS,
            "repeats": REPEATS, "min_timed_steps": MIN_TIMED_STEPS}


def make_request(*, precision: str, device: str | torch.device | None,
                 global_batch: int | None, max_batch: int | None,
                 memory_limit_bytes: int | None, margin: float, steps_per_trial: int,
                 predicted_max_batch: int | None, predict: bool,
                 measure_throughput: bool) -> TuneRequest:
    """tune's options checked (each error says what was expected and the fix)."""
    for name, value in (("global_batch", global_batch), ("max_batch", max_batch),
                        ("memory_limit_bytes", memory_limit_bytes),
                        ("steps_per_trial", steps_per_trial),
                        ("predicted_max_batch", predicted_max_batch)):
        _positive(name, value)
    if not 0 <= margin < 1:
        raise TilefitError("margin must be a fraction in [0, 1)", expected="e.g. 0.1",
                           given=repr(margin), fix="pass margin=0.1 to keep 10% free")
    dev = resolve_device(device)
    if dev.type == "cpu" and memory_limit_bytes is None and max_batch is None:
        raise TilefitError(
            "on the CPU tune needs a memory limit or a largest batch to stop at",
            expected="memory_limit_bytes (simulate a GPU's memory) or max_batch",
            given="neither",
            fix="pass memory_limit_bytes=16 * 2**30 (CLI: --memory-limit 16GiB) or max_batch",
        )
    return TuneRequest(parse_precision(precision), dev, global_batch, max_batch,
                       memory_limit_bytes, margin, steps_per_trial, predicted_max_batch,
                       predict, measure_throughput)


def check_model_and_optimizer(model: nn.Module, optimizer: OptimizerArg,
                              request: TuneRequest) -> None:
    if not (isinstance(optimizer, torch.optim.Optimizer) or callable(optimizer)):
        raise TilefitError("optimizer must be an optimizer or a factory",
                           expected="torch.optim.AdamW(model.parameters()) or params -> Optimizer",
                           given=type(optimizer).__name__,
                           fix="pass optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4)")
    check_on_device(model, request.device)


def check_on_device(model: nn.Module, dev: torch.device) -> None:
    """An error unless every parameter is on ``dev`` (tilefit does not move the model)."""
    wrong = {str(p.device) for p in model.parameters() if p.device.type != dev.type
             or (dev.index is not None and p.device.index != dev.index)}
    if wrong:
        raise TilefitError(
            "the model is not on the device being tuned",
            expected=f"parameters on {dev}",
            given=f"parameters on {', '.join(sorted(wrong))}",
            fix=f"call model.to('{dev}') before tune (tilefit does not move your model)",
        )


def _first_probe(model: nn.Module, make_batch: Callable[[int], Any], loss_fn: LossFn | None,
                 optimizer: OptimizerArg, request: TuneRequest, ex: Executor) -> int | None:
    """The search's first batch: the user's, or the estimator's predicted largest fit."""
    if request.predicted_max_batch is not None or not request.predict:
        return request.predicted_max_batch
    from tilefit.tuning.predict import predict_max_batch

    return predict_max_batch(
        model, make_batch, loss_fn=loss_fn, optimizer=optimizer,
        precision=request.precision.name, device=request.device,
        budget_bytes=ex.budget_bytes, cap=request.cap)


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


def _search(ex: Executor, request: TuneRequest, first_probe: int | None) -> TuneResult:
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
        world_size=world, global_batch_size=chosen * world * accumulation, **extra,
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
            device=request.device, batch_sizes=objective.measuring_sizes(max_batch),
            precision=request.precision.name, keep_modes=ex.keep_modes)
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


def gib(nbytes: int) -> str:
    """Bytes in GiB, with the exact count where two decimals would read 0.00."""
    if nbytes >= 0.01 * 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    return f"{nbytes / 2**30:.2g} GiB ({nbytes:,} B)"


# What `tilefit plan` needs to rank every way of shrinking a step (its --global-batch is
# required; other optimizers and LoRA are ranked only when allowed).
PLAN_COMMAND = ("tilefit plan MODEL --gpu GPU --global-batch N --allow-optimizer-change "
                "--allow-peft")
PLAN_FIX = (f"`{PLAN_COMMAND}` ranks precisions, optimizers, gradient checkpointing, LoRA "
            "and offload by what fits")


def nothing_fits(ex: Executor, request: TuneRequest) -> TilefitError:
    """Why not even a batch of 1 fits: the persistent state alone exceeds the budget (say
    how much, and what would shrink it), or what it leaves is too little for one sample."""
    from tilefit.tuning.predict import persistent_state

    state = persistent_state(ex.local, ex.make_batch, loss_fn=ex.loss_fn,
                             optimizer=ex.optimizer, precision=request.precision.name,
                             device=request.device)
    budget = ex.budget_bytes
    of = "" if ex.capacity_bytes is None or budget == ex.capacity_bytes else \
        f" = {1 - request.margin:.0%} of {gib(ex.capacity_bytes)}"
    opt = ("optimizer state unknown (the step could not be traced)"
           if state.optimizer_state_bytes is None else
           f"optimizer state {gib(state.optimizer_state_bytes)} ({state.optimizer_source})")
    parts = (f"parameters and buffers {gib(state.parameters_bytes)} + gradients "
             f"{gib(state.gradients_bytes)} + {opt} = {gib(state.total_bytes)}")
    if budget is not None and state.total_bytes > budget:
        return TilefitError(
            f"the model's persistent state alone, {gib(state.total_bytes)}, exceeds the "
            f"memory budget of {gib(budget)}{of}: no batch can fit",
            expected="parameters, gradients and optimizer state within the budget, with "
            "room left for a batch's activations",
            given=parts,
            fix="a device with more memory, a lighter optimizer (--optimizer sgd, adafactor "
            "or adamw-8bit: less optimizer state), bf16 weights (--precision bf16: half the "
            f"parameters, gradients and state), or LoRA; {PLAN_FIX}")
    room = "" if budget is None else f", leaving {gib(budget - state.total_bytes)} of " \
        f"the {gib(budget)} budget{of}"
    return TilefitError(
        "not even a batch of 1 fits in the memory budget",
        expected="a step at batch 1 (its activations, and the optimizer step's temporaries) "
        "within the memory the persistent state leaves",
        given=f"batch size 1 ran out of memory; persistent state {parts}{room}",
        fix=f"gradient checkpointing, mixed precision (--precision {MIXED}), shorter "
        f"samples (--seq) or a smaller --margin; {PLAN_FIX}")
