"""The tilefit Lightning callback against the real lightning.Trainer, on the CPU with a simulated
memory cap: self.log in training_step, fit(train_dataloaders=), a DataModule, the Trainer's
precision, the dataset-length cap, fast errors, and training at the chosen batch under the
same cap without OOM."""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, TensorDataset

from tilefit.errors import TilefitError
from tilefit.tuning.integrations import lightning as tl
from tilefit.tuning.integrations.lightning import FinderOptions

L = pytest.importorskip("lightning.pytorch")
cb = pytest.importorskip("tilefit.tuning.integrations.lightning_callbacks")  # needs Lightning
torchmetrics = pytest.importorskip("torchmetrics")

LIMIT_BYTES = 1_200_000  # the simulated device: weights + AdamW state ~0.3 MB, ~3 KB/sample
FEATURES = 16
CLASSES = 4


@pytest.fixture(autouse=True)
def _quiet_lightning() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # num_workers, small epochs, litlogger tips
        yield


def dataset(rows: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(rows, FEATURES, generator=gen),
                         torch.randint(0, CLASSES, (rows,), generator=gen))


class Net(L.LightningModule):
    """An MLP that logs its loss (and with ``metric`` a torchmetrics accuracy: its bincount
    has no fake-tensor kernel, so tune starts without a prediction), with a BatchNorm left in
    eval mode (Lightning trains modules in the modes they are in)."""

    def __init__(self, rows: int = 512, batch_size: int | None = 4,
                 metric: bool = False) -> None:
        super().__init__()
        if batch_size is not None:
            self.batch_size = batch_size
        self.rows = rows
        self.net = nn.Sequential(nn.Linear(FEATURES, 128), nn.ReLU(), nn.Dropout(0.1),
                                 nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, CLASSES))
        self.norm = nn.BatchNorm1d(FEATURES).eval()
        self.acc = (torchmetrics.classification.MulticlassAccuracy(num_classes=CLASSES)
                    if metric else None)
        self.steps_run = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps_run += 1
        x, y = batch
        out = self.net(self.norm(x))
        loss = nn.functional.cross_entropy(out, y)
        self.log("train_loss", loss)
        if self.acc is not None:
            self.acc(out, y)
            self.log_dict({"train_acc": self.acc})
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class ModuleData(Net):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(dataset(self.rows), batch_size=self.batch_size, shuffle=True)


class FixedBatch(Net):
    """train_dataloader() with a hard-coded batch size: nothing tilefit could set."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(dataset(self.rows), batch_size=2)


class Data(L.LightningDataModule):
    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(dataset(512), batch_size=self.batch_size, shuffle=True)


class Stream(IterableDataset):
    """Samples without a length; ``batched`` yields whole batches instead."""

    def __init__(self, batched: bool = False) -> None:
        self.batched = batched

    def __iter__(self) -> Iterator[Any]:
        gen = torch.Generator().manual_seed(0)
        rows: tuple[int, ...] = (8,) if self.batched else ()
        for _ in range(100_000):
            yield (torch.randn(*rows, FEATURES, generator=gen),
                   torch.randint(0, CLASSES, rows, generator=gen))


class StreamData(Net):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(Stream(), batch_size=self.batch_size)


class BatchSizes(L.Callback):
    """The batch sizes the real fit loop trains on."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        self.seen.append(len(batch[0]))


def fit(module: Any, *, precision: str = "32-true", max_steps: int = 2,
        limit_bytes: int = LIMIT_BYTES, **finder: Any) -> tuple[Any, Any, Any, Any]:
    """trainer.fit with the finder, then the simulated cap and a batch-size recorder for the
    training that follows. Returns (trainer, finder, cap, sizes)."""
    finder.setdefault("measure_throughput", False)
    data = finder.pop("fit_kwargs", {})
    tuner = tl.tilefit_batch_size_finder(memory_limit_bytes=limit_bytes, **finder)
    cap, sizes = tl.simulated_memory_limit(limit_bytes), BatchSizes()
    trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, precision=precision,
                        enable_progress_bar=False, logger=False, enable_checkpointing=False,
                        enable_model_summary=False, callbacks=[tuner, cap, sizes])
    trainer.fit(module, **data)
    return trainer, tuner, cap, sizes


@pytest.fixture(scope="module")
def fp32_run() -> tuple[Any, Any, Any, Any, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = ModuleData()
        return (module, *fit(module, max_steps=3))


def test_training_at_the_chosen_batch_fits_the_same_cap(fp32_run: Any) -> None:
    module, trainer, tuner, cap, sizes = fp32_run
    result = tuner.result
    assert result.precision == "fp32"
    assert 1 < result.batch_size == module.batch_size <= result.max_fitting_batch_size < 512
    assert sizes.seen[0] == result.batch_size and max(sizes.seen) == result.batch_size
    assert trainer.global_step == 3  # trained on, no OOM under the same cap
    assert cap.peak_bytes <= LIMIT_BYTES
    assert not module.norm.training and module.net.training  # modes kept


def test_self_log_in_training_step() -> None:
    module = ModuleData(metric=True)
    trainer, tuner, _, sizes = fit(module, max_steps=1)
    assert sizes.seen == [tuner.result.batch_size] and trainer.global_step == 1
    assert {"train_loss", "train_acc"} <= set(trainer.callback_metrics)  # logs after tuning
    (note,) = tuner.result.notes  # the metric's bincount stopped the prediction: said so
    assert "could not be traced on fake tensors" in note and "bincount" in note
    assert "log" not in vars(module) and "log_dict" not in vars(module)


def test_dataloader_passed_to_fit_is_rebuilt_at_the_chosen_batch() -> None:
    module = Net(batch_size=None)  # no batch_size attribute needed: the loader is rebuilt
    loader = DataLoader(dataset(512), batch_size=4, shuffle=True)
    trainer, tuner, _, sizes = fit(module, fit_kwargs={"train_dataloaders": loader})
    chosen = tuner.result.batch_size
    # 512 samples: the second batch holds what is left when the chosen size does not divide it
    assert chosen > 4 and sizes.seen == [chosen, min(chosen, 512 - chosen)]
    rebuilt = trainer.fit_loop._data_source.instance
    assert rebuilt.batch_size == chosen and isinstance(rebuilt.sampler, RandomSampler)


def test_datamodule_batch_size_and_global_batch() -> None:
    data = Data()
    trainer, tuner, _, sizes = fit(Net(batch_size=None), global_batch=64,
                                   fit_kwargs={"datamodule": data})
    result = tuner.result
    assert data.batch_size == result.batch_size == sizes.seen[0]
    assert result.batch_size * trainer.accumulate_grad_batches == 64


def test_bf16_mixed_is_tuned_in_bf16_mixed(fp32_run: Any) -> None:
    fp32 = fp32_run[2]
    trainer, bf16, cap, sizes = fit(ModuleData(), precision="bf16-mixed", max_steps=2)
    assert bf16.result.precision == "bf16-mixed"
    # bf16 activations: a larger batch fits than in fp32 on the same simulated device
    assert bf16.result.max_fitting_batch_size > 1.2 * fp32.result.max_fitting_batch_size
    assert sizes.seen[0] == bf16.result.batch_size and trainer.global_step == 2
    assert cap.peak_bytes <= LIMIT_BYTES


def test_lightning_precision_spellings_map_to_the_vocabulary() -> None:
    expected = {"32-true": "fp32", "bf16-mixed": "bf16-mixed", "bf16-true": "bf16-true",
                "16-mixed": "fp16-mixed", "bf16": "bf16-mixed", "32": "fp32"}
    for given, name in expected.items():
        if given == "16-mixed":  # not on a CPU Trainer: the string as a GPU Trainer reports it
            assert tl.precision_from_lightning(given).name == name
            continue
        trainer = L.Trainer(accelerator="cpu", precision=given, logger=False)
        assert tl.precision_of_trainer(trainer).name == name, given
    # Lightning's pure fp16 (fp16 weights, no scaler) is tilefit's fp16-true
    assert tl.precision_from_lightning("16-true").name == "fp16-true"
    for unsupported in ("64-true", "transformer-engine", "bf16"):
        with pytest.raises(TilefitError, match="cannot tune a Trainer"):
            tl.precision_from_lightning(unsupported)  # raw "bf16" is never reported


def test_batch_is_capped_at_the_dataset_length() -> None:
    module = ModuleData(rows=24)
    _, tuner, _, sizes = fit(module, limit_bytes=50 * LIMIT_BYTES, measure_throughput=True)
    result = tuner.result
    assert result.samples_per_epoch == 24 and result.max_fitting_batch_size == 24
    assert result.samples_per_s is not None and result.batch_size <= 24
    assert max(t.batch_size for t in result.trials) <= 24
    assert sizes.seen[0] == result.batch_size


@pytest.mark.parametrize("module, fit_kwargs, match", [
    (FixedBatch(batch_size=None), {}, "no 'batch_size' attribute"),
    (FixedBatch(), {}, "does not use self.batch_size"),
    (Net(batch_size=None), {"train_dataloaders": DataLoader(Stream(batched=True),
                                                             batch_size=None)},
     "makes its own batches"),
])
def test_what_cannot_be_applied_fails(module: Net, fit_kwargs: dict[str, Any],
                                      match: str) -> None:
    with pytest.raises(TilefitError, match=match):
        fit(module, fit_kwargs=fit_kwargs)
    assert module.steps_run == 0  # before any trial


def test_iterable_dataset_without_length_is_not_capped() -> None:
    module = StreamData()
    _, tuner, _, sizes = fit(module)
    result = tuner.result
    assert result.samples_per_epoch is None
    assert result.max_fitting_batch_size > 64  # found by memory alone
    assert sizes.seen[0] == result.batch_size


def test_manual_optimization_is_refused_before_any_trial() -> None:
    module = ModuleData()
    module.automatic_optimization = False
    with pytest.raises(TilefitError, match="automatic optimization"):
        fit(module)
    assert module.steps_run == 0


def test_rebatched_loader_keeps_everything_but_the_batch_size() -> None:
    loader = DataLoader(dataset(10), batch_size=2, shuffle=True, drop_last=True)
    again = tl.rebatch_loader(loader, 4)
    assert (again.batch_size, again.drop_last, again.sampler) == (4, True, loader.sampler)
    assert tl.samples_per_epoch(again) == 10 and len(again) == 2
    assert tl.samples_per_epoch(DataLoader(Stream(), batch_size=2)) is None


class RecordingFinder(cb.TilefitBatchSizeFinder):  # type: ignore[misc, name-defined]
    """A subclass: the finder's own hook, then what the module's batch size became."""

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        super().on_fit_start(trainer, pl_module)
        self.applied = pl_module.batch_size


def test_callbacks_are_classes_that_pickle_and_subclass() -> None:
    finder = tl.tilefit_batch_size_finder(global_batch=64, memory_limit_bytes=LIMIT_BYTES)
    assert type(finder) is cb.TilefitBatchSizeFinder and isinstance(finder, L.Callback)
    again = pickle.loads(pickle.dumps(finder))
    assert type(again) is cb.TilefitBatchSizeFinder and again.result is None
    assert again.options == finder.options == FinderOptions(
        global_batch=64, memory_limit_bytes=LIMIT_BYTES)
    cap = pickle.loads(pickle.dumps(tl.simulated_memory_limit(LIMIT_BYTES)))
    assert type(cap) is cb.SimulatedMemoryLimit and cap.limit_bytes == LIMIT_BYTES
    monitor = pickle.loads(pickle.dumps(tl.noise_scale_monitor(at_steps=(5, 0, 5),
                                                               batch_sizes=(2, 8))))
    assert (monitor.at_steps, monitor.batch_sizes, monitor.results) == ([0, 5], (2, 8), [])
    with pytest.raises(TilefitError, match="at_steps"):
        cb.NoiseScaleMonitor(at_steps=())

    module = ModuleData()
    sub = RecordingFinder(FinderOptions(memory_limit_bytes=LIMIT_BYTES, measure_throughput=False))
    trainer = L.Trainer(accelerator="cpu", max_steps=1, enable_progress_bar=False, logger=False,
                        enable_checkpointing=False, enable_model_summary=False, callbacks=[sub])
    trainer.fit(module)
    assert sub.result is not None and sub.applied == sub.result.batch_size == module.batch_size
    assert sub.result.batch_size > 4  # tuned up from the module's 4
    done = pickle.loads(pickle.dumps(sub))  # with its result, after the fit
    assert done.result == sub.result and done.applied == sub.applied



@pytest.mark.parametrize(("clip", "algorithm", "expected"), [
    (0.5, None, 0.5), (0.5, "norm", 0.5), (0.5, "value", None), (None, None, None)])
def test_the_trials_clip_as_the_trainer_clips(clip: float | None, algorithm: str | None,
                                              expected: float | None) -> None:
    # the adapter's recipe is the loop each trial runs (tilefit.loop): clip_grad_norm_ at
    # gradient_clip_val where Lightning clips the norm; by value it is not expressible
    from tilefit.tuning.integrations.lightning import LightningAdapter

    trainer = L.Trainer(accelerator="cpu", gradient_clip_val=clip,
                        gradient_clip_algorithm=algorithm, logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    recipe = LightningAdapter(trainer, ModuleData(), None).recipe
    assert recipe.max_grad_norm == expected and recipe.precision == "fp32"
