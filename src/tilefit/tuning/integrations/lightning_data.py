"""Lightning's train data for tune: where the Trainer gets its dataloader, the samples of one
epoch, batches prepared as the fit loop prepares them (the same samples on every call for the
trials, random ones for the noise scale), and a plain DataLoader rebuilt at another batch size."""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Iterator
from typing import Any

from tilefit.errors import TilefitError

DATALOADER_IDX = 0  # the one train dataloader tuned


def _length(obj: Any) -> int | None:
    try:
        return len(obj)
    except (TypeError, NotImplementedError):
        return None


def samples_per_epoch(loader: Any) -> int | None:
    """Samples one epoch of a DataLoader draws: its sampler's length (the dataset's, for the
    usual samplers); an IterableDataset's own length if it has one; else None."""
    from torch.utils.data import IterableDataset

    if isinstance(loader.dataset, IterableDataset):
        return _length(loader.dataset)
    n = _length(loader.sampler)
    return n if n is not None else _length(loader.dataset)


def _samples_of(dataset: Any) -> Callable[[int], list[Any]]:
    """take(b): b samples of the dataset, the same ones each call (wrapping around), so that
    trials at different sizes see the same data. An IterableDataset is read once, lazily."""
    from torch.utils.data import IterableDataset

    n = None if isinstance(dataset, IterableDataset) else _length(dataset)
    if n is not None:
        return lambda b: [dataset[i % n] for i in range(b)]
    cache: list[Any] = []
    stream: Iterator[Any] = iter(dataset)

    def take(b: int) -> list[Any]:
        for sample in stream:
            cache.append(sample)
            if len(cache) >= b:
                break
        if not cache:
            raise TilefitError("the train dataset is empty", expected="at least one sample",
                               given="an IterableDataset that yielded nothing",
                               fix="check the dataset the train dataloader reads")
        return [cache[i % len(cache)] for i in range(b)]

    return take


def rebatch_loader(loader: Any, batch_size: int) -> Any:
    """A copy of a plain DataLoader making batches of ``batch_size``, the same in every other
    respect (same sampler, so the same shuffling); DataLoader forbids changing batch_size
    after construction."""
    from torch.utils.data import DataLoader, IterableDataset

    if type(loader) is not DataLoader or loader.batch_size is None:
        raise TilefitError(
            "tilefit can only change the batch size of a plain DataLoader passed to fit()",
            expected="DataLoader(dataset, batch_size=...) (no batch_sampler, no subclass)",
            given=f"{type(loader).__name__} with batch_size={loader.batch_size}",
            fix="build the DataLoader in train_dataloader() from self.batch_size instead")
    skip = {"dataset", "batch_size", "shuffle", "sampler", "batch_sampler"}
    kwargs = {name: getattr(loader, name) for name in inspect.signature(DataLoader).parameters
              if name not in skip and hasattr(loader, name)}
    if not isinstance(loader.dataset, IterableDataset):
        kwargs["sampler"] = loader.sampler
    return DataLoader(loader.dataset, batch_size=batch_size, **kwargs)


def data_source(trainer: Any) -> Any:
    """Where the Trainer gets its train dataloader: a LightningModule or LightningDataModule
    (whose ``train_dataloader()`` it calls) or the dataloader given to
    ``fit(train_dataloaders=...)``. Lightning keeps it in ``fit_loop._data_source`` (no
    public API names it before the loop builds the loader; BatchSizeFinder reads it too)."""
    source = getattr(getattr(trainer, "fit_loop", None), "_data_source", None)
    if source is None or not hasattr(source, "dataloader") or not hasattr(source, "instance"):
        raise TilefitError(
            "this Lightning version does not keep the train dataloader where tilefit looks",
            expected="lightning 2.x (trainer.fit_loop._data_source)",
            given=type(trainer).__module__,
            fix="use lightning>=2.0, or tilefit.tune with your own make_batch")
    return source


def train_dataloader_of(trainer: Any) -> Any:
    """The one train DataLoader the Trainer will use, from whichever source fit() was given;
    an error when its batch size cannot be changed (it makes its own batches)."""
    from torch.utils.data import DataLoader

    loader = data_source(trainer).dataloader()
    if not isinstance(loader, DataLoader):
        raise TilefitError(
            "tilefit tunes the batch size of one torch DataLoader",
            expected="train_dataloader() or fit(train_dataloaders=) giving one DataLoader",
            given=type(loader).__name__,
            fix="train on a single DataLoader (tune a combination with tilefit.tune)")
    if loader.batch_size is None:
        raise TilefitError(
            "the train dataloader makes its own batches, so its batch size cannot be changed",
            expected="DataLoader(dataset, batch_size=self.batch_size)",
            given="batch_size=None (a batch_sampler, or a dataset that yields whole batches)",
            fix="let the DataLoader batch single samples with batch_size=...")
    return loader


def lightning_batch_maker(trainer: Any, pl_module: Any,
                          loader: Any) -> Callable[[int], Any]:
    """make_batch(b): b samples collated by the loader's collate_fn, then prepared as the fit
    loop prepares a batch: precision conversion, on_before_batch_transfer, batch_to_device."""
    take = _samples_of(loader.dataset)
    collate = loader.collate_fn
    return lambda b: prepare_batch(trainer, pl_module, collate(take(b)))


def prepare_batch(trainer: Any, pl_module: Any, batch: Any) -> Any:
    """A collated batch as the fit loop prepares it: the precision plugin's conversion, the
    module's or datamodule's on_before_batch_transfer, the strategy's batch_to_device."""
    batch = trainer.precision_plugin.convert_input(batch)
    # the module's or datamodule's hook, whichever the Trainer would call (private:
    # Lightning's own loop calls it so; the public hook alone skips the datamodule's)
    batch = pl_module._on_before_batch_transfer(batch, dataloader_idx=DATALOADER_IDX)
    return trainer.strategy.batch_to_device(batch, dataloader_idx=DATALOADER_IDX)


def random_lightning_batches(trainer: Any, pl_module: Any, loader: Any,
                             seed: int = 0) -> Callable[[int], Any]:
    """make_batch(b): b samples drawn at random (with replacement, from a private generator)
    from the loader's map-style dataset, prepared as the fit loop prepares a batch (collate,
    precision conversion, on_before_batch_transfer, batch_to_device)."""
    from torch.utils.data import IterableDataset

    n = _length(loader.dataset)
    if n is None or isinstance(loader.dataset, IterableDataset) or n == 0:
        raise TilefitError(
            "the noise scale draws random samples from a map-style dataset",
            expected="a train dataset with __len__ and __getitem__",
            given=f"{type(loader.dataset).__name__} (streamed or empty)",
            fix="measure with tilefit.noise_scale and a make_batch that draws from your stream")
    rng = random.Random(seed)
    collate = loader.collate_fn

    def make_batch(b: int) -> Any:
        batch = collate([loader.dataset[rng.randrange(n)] for _ in range(b)])
        return prepare_batch(trainer, pl_module, batch)

    return make_batch
