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
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import random
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from tilefit.compat.fake import FakeTensor
from tilefit.errors import TilefitError
from tilefit.tuning.executor import is_oom
from tilefit.tuning.noise import NoiseScale
from tilefit.tuning.ranks import current_ranks
from tilefit.tuning.search import accumulation_for
from tilefit.tuning.tuner import DEFAULT_MARGIN, TuneResult, tune
from tilefit.vocab import precision_from_hf

# What a failing user step raises (the model's own ValueError / TypeError, a shape mismatch's
# RuntimeError); tracing/step.py words the same families for the fake-tensor trace.
USER_ERRORS = (RuntimeError, ValueError, TypeError, IndexError, KeyError, AttributeError,
               AssertionError, NotImplementedError)
_ABSENT = object()
# Instance attributes model.activation_checkpointing_enable() sets (transformers
# modeling_utils: _set_gradient_checkpointing, enable_input_require_grads).
_CHECKPOINTING_ATTRS = ("gradient_checkpointing", "_gradient_checkpointing_func",
                        "_require_grads_hooks", "_require_grads_hook")


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


# ---- batches: the Trainer's dataset through the collator its train dataloader uses ----------


def _trainer_data(trainer: Any) -> tuple[Any, Callable[[list[Any]], Any]]:
    """The dataset and collate function of the Trainer's own train dataloader (unused columns
    removed as Trainer does; a subclass's get_train_dataloader is honoured)."""
    if getattr(trainer, "train_dataset", None) is None:
        raise TilefitError(
            "tune_trainer needs the Trainer's train_dataset",
            expected="Trainer(train_dataset=...)", given="train_dataset=None",
            fix="pass the training dataset to the Trainer before tuning")
    accelerator = getattr(trainer, "accelerator", None)
    registered = getattr(accelerator, "_dataloaders", None)
    n_before = len(registered) if isinstance(registered, list) else None
    try:
        loader = trainer.get_train_dataloader()
    except USER_ERRORS as exc:
        raise TilefitError(
            f"the Trainer could not make its train dataloader: {type(exc).__name__}: "
            f"{_first_line(exc)}",
            expected="a train_dataset and data_collator that trainer.get_train_dataloader() "
            "accepts", given=f"train_dataset {type(trainer.train_dataset).__name__}",
            fix="call trainer.get_train_dataloader() to see the full error") from None
    finally:
        # accelerator.prepare() registered the loader (for save_state); train() makes its own
        if n_before is not None:
            del registered[n_before:]
    return loader.dataset, loader.collate_fn


def read_samples(dataset: Any, n: int) -> list[Any]:
    """The first ``n`` samples of the dataset (all of them when it has fewer), read once
    before tuning so that every trial draws on host memory, as a data loader does. An
    iterable (streaming) dataset is read only that far."""
    if not isinstance(dataset, torch.utils.data.IterableDataset) and hasattr(dataset, "__len__"):
        pool = [dataset[i] for i in range(min(n, len(dataset)))]
    else:
        pool = list(itertools.islice(iter(dataset), n))
    if not pool:
        raise _empty_dataset(dataset)
    return pool


def _pick(pool: list[Any], start: int, stop: int) -> list[Any]:
    """Samples start..stop-1, wrapping around the pool; dict samples copied so that a
    collator that pops or sets keys leaves the pool intact."""
    picked = (pool[i % len(pool)] for i in range(start, stop))
    return [dict(s) if isinstance(s, dict) else s for s in picked]


def _empty_dataset(dataset: Any) -> TilefitError:
    return TilefitError("the Trainer's train_dataset has no samples",
                        expected="at least one training sample", given=type(dataset).__name__,
                        fix="check the dataset (filters, split) before tuning")


def describe(value: Any) -> str:
    """A batch or sample in a line: keys with dtype[shape] for tensors."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {describe(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        inner = ", ".join(describe(v) for v in value[:4])
        return f"{type(value).__name__}[{inner}{', ...' if len(value) > 4 else ''}]"
    return type(value).__name__


def make_batch_fn(trainer: Any, effective: int) -> Callable[[int], Any]:
    """make_batch(b): b samples through the Trainer's train collator.

    train() fetches every micro-batch of an optimizer step before the first forward
    (Trainer.get_batch_samples; accelerate moves each to the device) and holds them through
    the step; so each call also puts the step's other ``effective - b`` samples on the model's
    device, held until the next call: their memory counts as it will in training.
    """
    from accelerate.utils import send_to_device

    dataset, collate = _trainer_data(trainer)
    pool = read_samples(dataset, effective)
    device = next(trainer.model.parameters()).device
    held: list[Any] = []

    def make_batch(b: int) -> Any:
        held.clear()
        batch = _collate(collate, _pick(pool, 0, b))
        if b < effective:
            held.append(send_to_device(_collate(collate, _pick(pool, b, effective)), device))
        return batch

    return make_batch


def _collate(collate: Callable[[list[Any]], Any], samples: list[Any]) -> Any:
    try:
        return collate(samples)
    except USER_ERRORS as exc:
        if is_oom(exc):
            raise
        raise TilefitError(
            f"the Trainer's data collator could not batch {len(samples)} samples: "
            f"{type(exc).__name__}: {_first_line(exc)}",
            expected="samples the collator can stack: the same keys in each, equal lengths "
            "unless the collator pads",
            given=f"samples like {describe(samples[0])}",
            fix="pass a padding collator (DataCollatorWithPadding, "
            "DataCollatorForLanguageModeling) or pad/truncate the dataset to one length",
        ) from None


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
                f"dataset and collator: {type(exc).__name__}: {_first_line(exc)}",
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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


# ---- activation checkpointing, as Trainer.train() turns it on -------------------------------


def checkpointing_requested(args: Any) -> tuple[bool, dict[str, Any]]:
    """Whether the arguments ask for activation checkpointing, and its keyword arguments
    (transformers 5: activation_checkpointing[_kwargs]; before: gradient_checkpointing[_kwargs],
    an alias since)."""
    on = getattr(args, "activation_checkpointing", None)
    if on is None:
        on = getattr(args, "gradient_checkpointing", False)
    kwargs = getattr(args, "activation_checkpointing_kwargs", None)
    if kwargs is None:
        kwargs = getattr(args, "gradient_checkpointing_kwargs", None)
    return bool(on), dict(kwargs or {})


def _enable_checkpointing(model: Any, kwargs: dict[str, Any]) -> None:
    """What Trainer.train() calls: every_n_layers and offload are options of the enable call,
    the rest goes to torch.utils.checkpoint."""
    every_n_layers = kwargs.pop("every_n_layers", 1)
    offload = kwargs.pop("offload", False)
    try:
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(
                activation_checkpointing_kwargs=kwargs or None, every_n_layers=every_n_layers,
                offload=offload)
        elif hasattr(model, "gradient_checkpointing_enable"):
            extra = {} if every_n_layers == 1 and not offload else {
                "every_n_layers": every_n_layers, "offload": offload}
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None,
                                                **extra)
        else:
            raise _cannot_checkpoint(model, "no gradient_checkpointing_enable()")
    except (ValueError, TypeError) as exc:  # "... does not support activation checkpointing"
        raise _cannot_checkpoint(model, _first_line(exc)) from None


def _cannot_checkpoint(model: Any, why: str) -> TilefitError:
    return TilefitError(
        f"the arguments ask for gradient checkpointing but {type(model).__name__} cannot "
        "turn it on",
        expected="a model with activation_checkpointing_enable() or "
        "gradient_checkpointing_enable() (a transformers PreTrainedModel that supports it)",
        given=f"{type(model).__name__}: {why}",
        fix="set gradient_checkpointing=False, or checkpoint inside the model's forward")


@contextlib.contextmanager
def checkpointing_as_trainer(trainer: Any) -> Iterator[None]:
    """Activation checkpointing on the model as trainer.train() will turn it on, for the
    trials; afterwards every module's checkpointing attributes and the input-grad hooks that
    enabling added are put back exactly as they were."""
    on, kwargs = checkpointing_requested(trainer.args)
    if not on:
        yield
        return
    model = trainer.model
    saved = [(m, name, m.__dict__.get(name, _ABSENT))
             for m in model.modules() for name in _CHECKPOINTING_ATTRS]
    hooks_before = {id(h) for m in model.modules()
                    for h in (m.__dict__.get("_require_grads_hooks") or [])}
    try:
        _enable_checkpointing(model, kwargs)
        yield
    finally:
        for m in model.modules():
            for hook in m.__dict__.get("_require_grads_hooks") or []:
                if id(hook) not in hooks_before:
                    hook.remove()
        for m, name, value in saved:
            if value is _ABSENT:
                m.__dict__.pop(name, None)
            else:
                m.__dict__[name] = value


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
    args = trainer.args
    model = trainer.model
    effective = effective_batch(args.per_device_train_batch_size, args.gradient_accumulation_steps)
    if objective == "time-to-loss" and noise_scale is None:
        noise_scale = noise_scale_trainer(trainer)
    make_batch = make_batch_fn(trainer, effective)
    device = next(model.parameters()).device
    with _explain_step_errors(trainer), checkpointing_as_trainer(trainer):
        result = tune(
            model, make_batch, loss_fn=loss_fn_of(trainer), optimizer=optimizer_of(trainer),
            precision=precision_of(args, model), device=device,
            global_batch=effective * current_ranks().world_size,  # tune takes the job's
            max_batch=max_batch, memory_limit_bytes=memory_limit_bytes, margin=margin,
            predicted_max_batch=predicted_max_batch, measure_throughput=measure_throughput,
            objective=objective, noise_scale=noise_scale,
        )
    if apply:
        apply_to_args(trainer, effective, result.batch_size)
    return result


def random_batch_fn(trainer: Any, seed: int = 0) -> Callable[[int], Any]:
    """make_batch(b): b samples drawn at random (with replacement, from a private
    generator) from the Trainer's train dataset, through its train collator; a streamed
    dataset is read on in its own order."""
    dataset, collate = _trainer_data(trainer)
    rng = random.Random(seed)
    if not isinstance(dataset, torch.utils.data.IterableDataset) and hasattr(dataset, "__len__"):
        n = len(dataset)
        if n == 0:
            raise _empty_dataset(dataset)

        def take(b: int) -> list[Any]:
            return _pick([dataset[rng.randrange(n)] for _ in range(b)], 0, b)
    else:
        stream = iter(dataset)

        def take(b: int) -> list[Any]:
            samples = list(itertools.islice(stream, b))
            if len(samples) < b:
                raise TilefitError(
                    "the streamed train dataset ran out while measuring the noise scale",
                    expected="at least measurements x B_big samples",
                    given=f"{len(samples)} samples left for a batch of {b}",
                    fix="pass fewer measurements or smaller batch_sizes")
            return samples

    return lambda b: _collate(collate, take(b))


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
    from tilefit.tuning.noise_measure import DEFAULT_MEASUREMENTS, noise_scale

    model = trainer.model
    optimizer = getattr(trainer, "optimizer", None)
    with _explain_step_errors(trainer), checkpointing_as_trainer(trainer):
        return noise_scale(
            model, random_batch_fn(trainer, seed), loss_fn=loss_fn_of(trainer),
            optimizer=optimizer if isinstance(optimizer, torch.optim.Optimizer) else None,
            device=next(model.parameters()).device, batch_sizes=batch_sizes,
            measurements=measurements or DEFAULT_MEASUREMENTS,
            precision=precision_of(trainer.args, model), checkpoint=checkpoint)


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
            f"{type(exc).__name__}: {_first_line(exc)}",
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
