"""Hugging Face Trainer: tune the micro-batch before ``trainer.train()``, keeping the effective
batch (per_device_train_batch_size * gradient_accumulation_steps) unchanged.

    from tilefit.tuning.integrations.hf import tune_trainer

    trainer = Trainer(model=model, args=args, train_dataset=ds, data_collator=collator)
    result = tune_trainer(trainer)          # sets args.per_device_train_batch_size and
    trainer.train()                         # args.gradient_accumulation_steps

The trials run what ``trainer.train()`` will run: the Trainer's own ``compute_loss`` (a
subclass's too), batches of its own dataset through the collator its train dataloader uses
(map-style or iterable), with the optimizer step's other micro-batches held on the device as
train() holds them, its optimizer, its precision flags (bf16 / fp16 / tf32), activation
(gradient) checkpointing when the arguments ask for it, and the model in train mode.

Unlike ``auto_find_batch_size`` (which halves on OOM and leaves accumulation alone, so the
effective batch shrinks), the effective batch stays exactly what the arguments said; the
micro-batch is the fastest hardware-friendly divisor of it that fits. Nothing else of the
Trainer, its arguments or its model is changed (checkpointing and modes are put back).

The Trainer reaches tune through ``TrainerAdapter`` (``adapter.py``), as Lightning does; its
batches are in ``hf_data.py``, its activation checkpointing in ``hf_checkpointing.py``.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from tilefit.compat.fake import FakeTensor
from tilefit.errors import TilefitError
from tilefit.recipe import Recipe
from tilefit.tuning.executor import LossFn, OptimizerArg, is_oom
from tilefit.tuning.integrations.adapter import (
    USER_ERRORS,
    first_line,
    noise_scale_with,
    tune_with,
)
from tilefit.tuning.integrations.hf_checkpointing import (
    checkpointing_as_trainer,
    checkpointing_requested,
)
from tilefit.tuning.integrations.hf_data import (
    describe,
    make_batch_fn,
    random_batch_fn,
    read_samples,
)
from tilefit.tuning.noise import NoiseScale
from tilefit.tuning.ranks import current_ranks
from tilefit.tuning.search import accumulation_for
from tilefit.tuning.tuner import DEFAULT_MARGIN, TuneResult
from tilefit.vocab import precision_from_hf

__all__ = [
    "TrainerAdapter",
    "apply_to_args",
    "checkpointing_as_trainer",
    "checkpointing_requested",
    "effective_batch",
    "loss_fn_of",
    "make_batch_fn",
    "noise_scale_trainer",
    "optimizer_of",
    "precision_of",
    "random_batch_fn",
    "read_samples",
    "split_effective_batch",
    "train_with_memory_limit",
    "tune_trainer",
]


def effective_batch(per_device: int, accumulation: int) -> int:
    """Samples per optimizer step on one device: per_device_train_batch_size x accumulation."""
    return per_device * accumulation


def split_effective_batch(effective: int, micro_batch: int) -> tuple[int, int]:
    """(per_device_train_batch_size, gradient_accumulation_steps) for ``micro_batch`` with the
    same effective batch; the micro-batch must divide it."""
    try:
        return micro_batch, accumulation_for(effective, micro_batch)
    except ValueError:
        raise TilefitError(
            f"batch {micro_batch} does not divide the effective batch {effective}",
            expected="a micro-batch that divides per_device_train_batch_size * "
            "gradient_accumulation_steps",
            given=str(micro_batch),
            fix="let tune choose among the divisors (it does so when global_batch is given)",
        ) from None


def precision_of(args: Any, model: Any = None) -> str:
    """The precision a Hugging Face TrainingArguments runs (tilefit.vocab's name). Without a
    bf16/fp16 switch, a model whose floating weights are all bf16 (loaded with
    torch_dtype=torch.bfloat16) trains in pure bf16."""
    spec = precision_from_hf(bool(getattr(args, "bf16", False)),
                             bool(getattr(args, "fp16", False)),
                             bool(getattr(args, "tf32", False)))
    if spec.autocast_dtype is None and model is not None:
        floating = [p.dtype for p in model.parameters() if p.is_floating_point()]
        if floating and all(d == torch.bfloat16 for d in floating):
            return "bf16-true"
    return spec.name



# ---- the loss: what Trainer.training_step runs ----------------------------------------------


def _accepts(func: Callable[..., Any], name: str) -> bool:
    params = inspect.signature(func).parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _num_items(trainer: Any, inputs: Any) -> Any:
    """num_items_in_batch as Trainer counts it for one micro-batch (labels not -100), or None.
    Counted on the batch's device (the estimator's trace runs on CPU fake tensors)."""
    counter = getattr(trainer, "get_batch_samples", None)
    if counter is None or "device" not in inspect.signature(counter).parameters:
        return None
    labels = inputs.get("labels") if isinstance(inputs, Mapping) else None
    device = getattr(labels, "device", None) or getattr(trainer.args, "device", None)
    return counter(iter([inputs]), 1, device)[1]


def loss_fn_of(trainer: Any) -> Callable[[Any, Any], Any]:
    """loss(model, batch) as Trainer.training_step computes it: model.train(), then the
    Trainer's (or a subclass's) compute_loss with num_items_in_batch where it takes one."""
    compute = trainer.compute_loss
    pass_count = _accepts(compute, "num_items_in_batch")

    def loss(model: Any, inputs: Any) -> Any:
        model.train()  # Trainer.training_step does; HF layers checkpoint only in train mode
        if pass_count:
            out = compute(model, inputs, num_items_in_batch=_num_items(trainer, inputs))
        else:
            out = compute(model, inputs)
        return out[0] if isinstance(out, tuple) else out

    return _explained(loss, trainer)


def _explained(loss: Callable[[Any, Any], Any], trainer: Any) -> Callable[[Any, Any], Any]:
    """The loss, its errors on a real batch worded as a TilefitError (the fake-tensor trace
    words its own, tracing/step.py); the device's OOM passes through for the search."""

    def wrapped(model: Any, inputs: Any) -> Any:
        try:
            return loss(model, inputs)
        except USER_ERRORS as exc:
            if is_oom(exc) or _is_fake(inputs):
                raise
            raise TilefitError(
                f"{type(trainer).__name__}.compute_loss failed on a batch of the Trainer's "
                f"dataset and collator: {type(exc).__name__}: {first_line(exc)}",
                expected=f"a batch with the arguments {_forward_args(model)} of "
                f"{type(model).__name__}.forward, with shapes that agree (causal-LM labels as long "
                "as input_ids)",
                given=f"batch {describe(inputs)}",
                fix="rename the dataset's columns to the forward's arguments, or set "
                "remove_unused_columns=False when a collator or compute_loss needs other "
                "columns; run trainer.compute_loss(model, batch) on one batch to see the full "
                "error",
            ) from None

    return wrapped


def _forward_args(model: Any) -> str:
    params = inspect.signature(model.forward).parameters.values()
    named = [p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                   inspect.Parameter.KEYWORD_ONLY)]
    return ", ".join(named[:8]) + (", ..." if len(named) > 8 else "")


def _is_fake(value: Any) -> bool:
    """Whether a batch holds fake tensors (the estimator's trace, not a real trial)."""
    if isinstance(value, Mapping):
        return any(_is_fake(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_is_fake(v) for v in value)
    return isinstance(value, FakeTensor)




# ---- the optimizer the Trainer will build ---------------------------------------------------


def optimizer_of(trainer: Any) -> Any:
    """The Trainer's optimizer (given with optimizers=(opt, sched): its state is restored) or
    a factory of the one train() creates (optimizer_cls_and_kwargs, else
    get_optimizer_cls_and_kwargs), built fresh per trial."""
    if isinstance(getattr(trainer, "optimizer", None), torch.optim.Optimizer):
        return trainer.optimizer
    chosen = getattr(trainer, "optimizer_cls_and_kwargs", None)

    def factory(params: Any) -> torch.optim.Optimizer:
        cls, kwargs = chosen or type(trainer).get_optimizer_cls_and_kwargs(trainer.args,
                                                                            trainer.model)
        kwargs = {k: v for k, v in kwargs.items() if k not in ("params", "model")}
        return cls(params, **kwargs)

    return factory


# ---- the Trainer as tune's adapter -----------------------------------------------------------


class TrainerAdapter:
    """A Hugging Face Trainer as a ``TrainingAdapter``: its model in train mode, its
    compute_loss, the optimizer train() will build, its precision flags, its dataset through
    its collator, and around the trials activation checkpointing as train() turns it on and
    the user's errors worded as TilefitErrors."""

    keep_modes = False  # Trainer.training_step calls model.train()

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    @property
    def model(self) -> nn.Module:
        return self.trainer.model

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def precision(self) -> str:
        return precision_of(self.trainer.args, self.model)

    @property
    def recipe(self) -> Recipe:
        """The Trainer's loop as its arguments set it: clipping at max_grad_norm (none
        where it is 0 or None, as Trainer skips it), the loss read of
        logging_nan_inf_filter, zero_grad freeing the gradients."""
        args = self.trainer.args
        clip = getattr(args, "max_grad_norm", None)
        return Recipe(precision=self.precision,
                      max_grad_norm=float(clip) if clip is not None and clip > 0 else None,
                      loss_sync=bool(getattr(args, "logging_nan_inf_filter", False)))

    @property
    def effective_batch(self) -> int:
        """per_device_train_batch_size x gradient_accumulation_steps: kept exact."""
        args = self.trainer.args
        return effective_batch(args.per_device_train_batch_size, args.gradient_accumulation_steps)

    def loss_fn(self) -> LossFn:
        return loss_fn_of(self.trainer)

    def optimizer(self) -> OptimizerArg:
        return optimizer_of(self.trainer)

    def held_optimizer(self) -> torch.optim.Optimizer | None:
        optimizer = getattr(self.trainer, "optimizer", None)
        return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None

    def trial_batches(self) -> Callable[[int], Any]:
        return make_batch_fn(self.trainer, self.effective_batch)

    def random_batches(self, seed: int) -> Callable[[int], Any]:
        return random_batch_fn(self.trainer, seed)

    @contextlib.contextmanager
    def around_trials(self) -> Iterator[None]:
        with _explain_step_errors(self.trainer), checkpointing_as_trainer(self.trainer):
            yield


# ---- tune ------------------------------------------------------------------------------------


def tune_trainer(
    trainer: Any,
    *,
    memory_limit_bytes: int | None = None,
    margin: float = DEFAULT_MARGIN,
    max_batch: int | None = None,
    predicted_max_batch: int | None = None,
    measure_throughput: bool = True,
    apply: bool = True,
    objective: str = "samples-per-s",
    noise_scale: float | NoiseScale | None = None,
) -> TuneResult:
    """Tune the trainer's micro-batch on what train() runs; with ``apply`` set the arguments.

    Keeps the effective batch (per_device_train_batch_size * gradient_accumulation_steps)
    exact: the chosen micro-batch divides it. Under torchrun, call it on every rank: the
    ranks agree (``tune``), each tunes its own device's micro-batch. With ``apply`` it sets exactly
    args.per_device_train_batch_size and args.gradient_accumulation_steps (and the Trainer's
    cached batch size); nothing else of the Trainer, its arguments or the model changes.
    Errors from the user's data or loss are TilefitErrors saying what to fix.

    objective="time-to-loss" (see ``tune``): the effective batch stays as the arguments say,
    so the micro-batch is the samples/s choice; the result adds the noise scale (measured on
    random samples of the train dataset with ``noise_scale_trainer`` unless given), the
    learning-rate advice and a warning when the effective batch is far above the noise scale.
    """
    adapter = TrainerAdapter(trainer)
    effective = adapter.effective_batch
    result = tune_with(
        adapter, global_batch=effective * current_ranks().world_size,  # tune takes the job's
        max_batch=max_batch, memory_limit_bytes=memory_limit_bytes, margin=margin,
        predicted_max_batch=predicted_max_batch, measure_throughput=measure_throughput,
        objective=objective, noise_scale=noise_scale)
    if apply:
        apply_to_args(trainer, effective, result.batch_size)
    return result


def noise_scale_trainer(
    trainer: Any,
    *,
    batch_sizes: tuple[int, int] | None = None,
    measurements: int | None = None,
    checkpoint: str | None = None,
    seed: int = 0,
) -> NoiseScale:
    """The gradient noise scale (``tilefit.noise_scale``) of the Trainer's model on random
    samples of its train dataset, with its compute_loss, precision, optimizer (state kept)
    and activation checkpointing. checkpoint: a checkpoint folder of this run
    (``output_dir/checkpoint-N``) to measure at; the model keeps its own weights. The noise
    scale grows as training proceeds: measure after warm-up, and from later checkpoints."""
    return noise_scale_with(TrainerAdapter(trainer), batch_sizes=batch_sizes,
                            measurements=measurements, checkpoint=checkpoint, seed=seed)


@contextlib.contextmanager
def _explain_step_errors(trainer: Any) -> Iterator[None]:
    """What escapes the batch and loss wrappers (backward, the optimizer step) as a
    TilefitError; the device's OOM and tilefit's own errors pass through."""
    try:
        yield
    except TilefitError:
        raise
    except USER_ERRORS as exc:
        if is_oom(exc):
            raise
        raise TilefitError(
            f"a training step of {type(trainer.model).__name__} failed while tuning: "
            f"{type(exc).__name__}: {first_line(exc)}",
            expected="a model, loss and optimizer whose step runs (trainer.train() would fail "
            "the same way)",
            given=f"{type(exc).__name__} in the backward pass or the optimizer step",
            fix="run trainer.train() with max_steps=1 to see the full error, fix it, then tune",
        ) from None


def apply_to_args(trainer: Any, effective: int, micro_batch: int) -> None:
    """Set the micro-batch and accumulation (their product stays ``effective``)."""
    per_device, accumulation = split_effective_batch(effective, micro_batch)
    trainer.args.per_device_train_batch_size = per_device
    trainer.args.gradient_accumulation_steps = accumulation
    # Trainer caches the batch size at __init__ (self._train_batch_size, used by train()'s
    # dataloader); keep it in step with the arguments.
    if hasattr(trainer, "_train_batch_size"):
        trainer._train_batch_size = trainer.args.train_batch_size


def train_with_memory_limit(trainer: Any, memory_limit_bytes: int, **train_kwargs: Any) -> Any:
    """trainer.train() on a simulated device of ``memory_limit_bytes`` (the simulation
    tune_trainer's memory_limit_bytes uses): torch.OutOfMemoryError where that device would run
    out. Returns train()'s output; the peak is in its metrics as ``tilefit_peak_bytes``."""
    from tilefit.tuning.simulate import MemoryLimitMode

    model = trainer.model
    mode = MemoryLimitMode(memory_limit_bytes, [*model.parameters(), *model.buffers()])
    with mode:
        out = trainer.train(**train_kwargs)
    out.metrics["tilefit_peak_bytes"] = mode.peak_bytes
    return out
