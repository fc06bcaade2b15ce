"""Hugging Face Trainer: tune the micro-batch before ``trainer.train()``, keeping the effective
batch (per_device_train_batch_size * gradient_accumulation_steps) unchanged.

    from tilefit.tuning.integrations.hf import tune_trainer

    trainer = Trainer(model=model, args=args, train_dataset=ds, data_collator=collator)
    result = tune_trainer(trainer)          # sets args.per_device_train_batch_size and
    trainer.train()                         # args.gradient_accumulation_steps

Unlike ``auto_find_batch_size`` (which halves on OOM and leaves accumulation alone, so the
effective batch shrinks), the effective batch stays exactly what the arguments said; the
micro-batch is the fastest hardware-friendly divisor of it that fits.
"""

from __future__ import annotations

import inspect
from typing import Any

from tilefit.errors import TilefitError
from tilefit.tuning.search import accumulation_for
from tilefit.tuning.tuner import DEFAULT_MARGIN, TuneResult, tune
from tilefit.vocab import precision_from_hf


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


def precision_of(args: Any) -> str:
    """The precision a Hugging Face TrainingArguments runs (tilefit.vocab's name)."""
    return precision_from_hf(bool(getattr(args, "bf16", False)),
                             bool(getattr(args, "fp16", False)),
                             bool(getattr(args, "tf32", False))).name


def _make_batch_fn(trainer: Any, model: Any) -> Any:
    dataset = trainer.train_dataset
    if dataset is None or not hasattr(dataset, "__getitem__"):
        raise TilefitError(
            "tune_trainer needs a map-style train_dataset",
            expected="Trainer(train_dataset=...) supporting len() and indexing",
            given=type(dataset).__name__,
            fix="pass a datasets.Dataset or a torch Dataset to the Trainer",
        )
    n = len(dataset)
    keep: set[str] | None = None
    if getattr(trainer.args, "remove_unused_columns", True):
        keep = set(inspect.signature(model.forward).parameters)
        keep |= {"label", "label_ids", *(getattr(trainer, "label_names", None) or [])}

    def make_batch(b: int) -> Any:
        samples = [dataset[i % n] for i in range(b)]
        if keep is not None:
            samples = [{k: v for k, v in s.items() if k in keep} for s in samples]
        return trainer.data_collator(samples)

    return make_batch


def tune_trainer(
    trainer: Any,
    *,
    memory_limit_bytes: int | None = None,
    margin: float = DEFAULT_MARGIN,
    max_batch: int | None = None,
    predicted_max_batch: int | None = None,
    measure_throughput: bool = True,
    apply: bool = True,
) -> TuneResult:
    """Tune the trainer's micro-batch on its model and data; with ``apply`` set the arguments.

    The Trainer's own optimizer class and arguments are used (Trainer.get_optimizer_cls_and_
    kwargs), built fresh per trial; model, RNG and modes are restored afterwards.
    """
    import torch

    args = trainer.args
    model = trainer.model
    effective = effective_batch(args.per_device_train_batch_size, args.gradient_accumulation_steps)

    def optimizer(params: Any) -> torch.optim.Optimizer:
        cls, kwargs = type(trainer).get_optimizer_cls_and_kwargs(args, model)
        return cls(params, **kwargs)

    device = next(model.parameters()).device
    result = tune(
        model, _make_batch_fn(trainer, model), optimizer=optimizer, precision=precision_of(args),
        device=device, global_batch=effective, max_batch=max_batch,
        memory_limit_bytes=memory_limit_bytes, margin=margin,
        predicted_max_batch=predicted_max_batch, measure_throughput=measure_throughput,
    )
    if apply:
        apply_to_args(trainer, effective, result.batch_size)
    return result


def apply_to_args(trainer: Any, effective: int, micro_batch: int) -> None:
    per_device, accumulation = split_effective_batch(effective, micro_batch)
    trainer.args.per_device_train_batch_size = per_device
    trainer.args.gradient_accumulation_steps = accumulation
    # Trainer caches the batch size at __init__ (self._train_batch_size, used by train()'s
    # dataloader); keep it in step with the arguments.
    if hasattr(trainer, "_train_batch_size"):
        trainer._train_batch_size = trainer.args.train_batch_size
