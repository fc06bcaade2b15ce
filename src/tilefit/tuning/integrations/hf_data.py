"""The Hugging Face Trainer's batches for tune: its train dataset through the collator its
train dataloader uses (map-style or iterable), the same samples on every call for the trials,
random ones for the noise scale; errors in the user's data worded as TilefitErrors."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Mapping
from typing import Any

import torch

from tilefit.errors import TilefitError
from tilefit.tuning.executor import is_oom
from tilefit.tuning.integrations.adapter import USER_ERRORS, first_line


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
            f"{first_line(exc)}",
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
            f"{type(exc).__name__}: {first_line(exc)}",
            expected="samples the collator can stack: the same keys in each, equal lengths "
            "unless the collator pads",
            given=f"samples like {describe(samples[0])}",
            fix="pass a padding collator (DataCollatorWithPadding, "
            "DataCollatorForLanguageModeling) or pad/truncate the dataset to one length",
        ) from None


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

