"""Lightning: a callback in the spirit of BatchSizeFinder, with throughput and alignment.

    from tilefit.tuning.integrations.lightning import tilefit_batch_size_finder

    finder = tilefit_batch_size_finder(global_batch=256)
    trainer = L.Trainer(precision="bf16-mixed", callbacks=[finder])
    trainer.fit(module, datamodule=dm)      # or fit(module) or fit(module, train_dataloaders=dl)
    finder.result.batch_size, finder.result.precision

At fit start it tunes the batch size in the Trainer's own precision, on the dataloader the
Trainer will use, capped at the samples of one epoch, then applies it: ``batch_size`` on the
module / datamodule / their hparams (as Lightning's ``lightning_setattr`` does) when the
dataloader comes from ``train_dataloader()``, or a rebuilt DataLoader when it was passed to
``fit(train_dataloaders=...)``; with ``global_batch`` also ``trainer.accumulate_grad_batches``.
What it needs (the attribute, a loader that uses it, a supported precision, automatic
optimization, one device) is checked before any trial: in ``setup``, or from the first loader
built.

How the trials run. Lightning's BatchSizeFinder runs each trial as a shortened real fit loop
(``fit_loop.run()`` with ``max_steps`` lowered), after saving a checkpoint to disk and
swapping out callbacks, loggers and the loop's state dict, which it then restores: that needs
the loop's private state and gives one bit per trial (OOM or not). tilefit's search needs the
per-phase peaks of each trial (to extrapolate), OOM recovery and a bit-exact restore of
weights, optimizer and RNG, which its executor provides; so the trials run in the executor,
and each step is made of the pieces Lightning's automatic optimization uses:

- batch: the dataloader's dataset and ``collate_fn``, then the precision plugin's
  ``convert_input``, ``on_before_batch_transfer`` and ``Strategy.batch_to_device`` (the
  module's transfer hooks);
- loss: ``Strategy.training_step`` (inside the precision plugin's ``train_step_context``:
  autocast for "bf16-mixed", the default dtype for "bf16-true"), its loss;
- optimizer: the one Lightning built from ``configure_optimizers`` (``trainer.optimizers``),
  its state restored after every trial;
- ``self.log`` / ``self.log_dict`` are no-ops while tuning (patched on the instance and put
  back): the trials are not training steps, so their values must not reach the epoch's
  aggregates or the loggers, and Lightning refuses ``self.log`` from ``on_fit_start``
  (setting the module's hook name instead would write into the fit loop's results).
  Loggers are swapped for a DummyLogger, as BatchSizeFinder does.

Not run in a trial: gradient clipping and overrides of the hooks around backward and the
optimizer step. Modules train in the modes they are in, as Lightning 2 does (it does not
call ``train()``). Lightning is imported only when a callback is made; it is not a tilefit
dependency.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from tilefit.errors import TilefitError
from tilefit.tuning.tuner import DEFAULT_MARGIN, TuneResult, tune
from tilefit.vocab import PRECISIONS, Precision, parse_precision

DATALOADER_IDX = 0  # the one train dataloader tuned


def import_lightning() -> Any:
    """``lightning.pytorch`` (or the older ``pytorch_lightning``), or a clear error."""
    try:
        import lightning.pytorch as pl
    except ImportError:
        try:
            import pytorch_lightning as pl
        except ImportError:
            raise TilefitError(
                "the Lightning callback needs Lightning, which is not installed",
                expected="the lightning package",
                given="no module named lightning or pytorch_lightning",
                fix="pip install lightning (tilefit does not depend on it)",
            ) from None
    return pl


@dataclasses.dataclass(frozen=True)
class LightningTuneResult(TuneResult):
    """tune's result, with what the callback read off the Trainer."""

    precision: str = "fp32"  # the tilefit precision the trials ran in (Trainer's precision)
    samples_per_epoch: int | None = None  # the cap from the dataset's length; None: no len


@dataclasses.dataclass(frozen=True)
class FinderOptions:
    batch_arg_name: str = "batch_size"
    global_batch: int | None = None
    memory_limit_bytes: int | None = None
    margin: float = DEFAULT_MARGIN
    max_batch: int | None = None
    measure_throughput: bool = True
    objective: str = "samples-per-s"  # or "time-to-loss" (tune's objective)
    noise_scale: Any = None  # B_noise or a NoiseScale; None: measured on the train data


# ---- pure helpers -----------------------------------------------------------------------

def loss_from_step_output(output: Any) -> Any:
    """The loss tensor of a training_step's return value: a tensor or a dict with "loss"."""
    import torch

    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    raise TilefitError(
        "training_step must return the loss for tune to run it",
        expected="a loss tensor or a dict with a 'loss' tensor",
        given=type(output).__name__,
        fix="return the loss from training_step (automatic optimization)",
    )


def first_optimizer(conf: Any) -> Any:
    """The optimizer from what configure_optimizers returns: an optimizer, a list or tuple of
    them (or ([optimizers], [schedulers])), or a dict with "optimizer"."""
    import torch

    if isinstance(conf, torch.optim.Optimizer):
        return conf
    if isinstance(conf, Mapping) and "optimizer" in conf:
        return first_optimizer(conf["optimizer"])
    if isinstance(conf, list | tuple) and conf:
        return first_optimizer(conf[0])
    raise TilefitError(
        "configure_optimizers returned no optimizer tune can use",
        expected="an optimizer, a list of them, or {'optimizer': ...}",
        given=type(conf).__name__,
        fix="return a single optimizer from configure_optimizers",
    )


def precision_from_lightning(spelling: str) -> Precision:
    """The tilefit Precision of Lightning's normalised precision string (``trainer.precision``:
    "32-true", "16-mixed", "bf16-mixed", "bf16-true"). Only spellings whose Lightning meaning
    is the Precision's own are accepted: Lightning's legacy "bf16" is bf16-mixed (Lightning
    normalises it before the Trainer reports it), as tilefit reads a bare "bf16"."""
    try:
        precision: Precision | None = parse_precision(spelling)
    except TilefitError:
        precision = None
    if precision is None or precision.lightning != spelling:
        spellings = sorted({p.lightning for p in PRECISIONS})
        raise TilefitError(
            f"tilefit cannot tune a Trainer with precision={spelling!r}",
            expected="Trainer(precision=...) one of " + ", ".join(spellings),
            given=repr(spelling),
            fix="tune with one of those precisions (bf16-mixed on Ampere and later GPUs)",
        )
    return precision


def precision_of_trainer(trainer: Any) -> Precision:
    """The precision the Trainer trains in; fp32 on a GPU with TF32 matmuls allowed
    (torch.set_float32_matmul_precision("high" or "medium")) is tf32."""
    import torch

    precision = precision_from_lightning(str(trainer.precision))
    on_gpu = trainer.strategy.root_device.type == "cuda"
    if precision.name == "fp32" and on_gpu and torch.backends.cuda.matmul.allow_tf32:
        return parse_precision("tf32")
    return precision


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


# ---- the Trainer's data -------------------------------------------------------------------

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

    def make_batch(b: int) -> Any:
        batch = trainer.precision_plugin.convert_input(collate(take(b)))
        # the module's or datamodule's hook, whichever the Trainer would call (private:
        # Lightning's own loop calls it so; the public hook alone skips the datamodule's)
        batch = pl_module._on_before_batch_transfer(batch, dataloader_idx=DATALOADER_IDX)
        return trainer.strategy.batch_to_device(batch, dataloader_idx=DATALOADER_IDX)

    return make_batch


# ---- checks, tuning and applying -----------------------------------------------------------

def check_trainer(trainer: Any, pl_module: Any, batch_arg_name: str) -> None:
    """Everything the callback needs, checked before any trial runs."""
    from lightning.pytorch.utilities.parsing import lightning_hasattr
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

    precision_of_trainer(trainer)
    if not pl_module.automatic_optimization or is_param_in_hook_signature(
            pl_module.training_step, "dataloader_iter", explicit=True):
        raise TilefitError(
            "tilefit runs training_step(batch, batch_idx) with automatic optimization",
            expected="automatic_optimization = True and training_step(self, batch, batch_idx)",
            given="manual optimization or training_step(self, dataloader_iter)",
            fix="tune such a module with tilefit.tune and your own loss_fn")
    if trainer.world_size > 1:
        raise TilefitError("tilefit tunes single-device training",
                           expected="Trainer(devices=1)", given=f"{trainer.world_size} processes",
                           fix="tune on one device, then scale out")
    if data_source(trainer).is_module() and not lightning_hasattr(pl_module, batch_arg_name):
        raise TilefitError(
            f"no {batch_arg_name!r} attribute to set on the LightningModule or DataModule",
            expected=f"self.{batch_arg_name} (or hparams.{batch_arg_name}) on the module or "
            "its datamodule, used by train_dataloader()",
            given=f"neither has {batch_arg_name!r}",
            fix=f"store the batch size as self.{batch_arg_name} and build the DataLoader "
            "with it (or pass batch_arg_name=...)")


@contextlib.contextmanager
def quiet_logging(trainer: Any, pl_module: Any) -> Iterator[None]:
    """self.log / self.log_dict as no-ops and a DummyLogger, put back afterwards."""
    from lightning.pytorch.loggers.logger import DummyLogger

    def no_log(*args: Any, **kwargs: Any) -> None:
        return None

    names = ("log", "log_dict")
    own = {name: vars(pl_module)[name] for name in names if name in vars(pl_module)}
    loggers = trainer.loggers
    patched: list[str] = []
    try:
        for name in names:
            setattr(pl_module, name, no_log)
            patched.append(name)
        trainer.loggers = [DummyLogger()] if loggers else []
        yield
    finally:
        trainer.loggers = loggers
        for name in patched:
            delattr(pl_module, name)
            if name in own:
                setattr(pl_module, name, own[name])


def _smallest(*caps: int | None) -> int | None:
    known = [c for c in caps if c is not None]
    return min(known) if known else None


def tune_lightning(trainer: Any, pl_module: Any, options: FinderOptions) -> LightningTuneResult:
    """tune on the Trainer's module, optimizer, precision and train data (see the module doc);
    nothing is applied. Call it with the Trainer set up (as at on_fit_start)."""
    from lightning.pytorch.utilities.parsing import lightning_getattr

    precision = precision_of_trainer(trainer)
    loader = train_dataloader_of(trainer)
    if data_source(trainer).is_module():  # a loader ignoring the attribute: know it now
        name = options.batch_arg_name
        check_loader_follows(loader, name, lightning_getattr(pl_module, name))
    per_epoch = samples_per_epoch(loader)

    def loss_fn(model: Any, batch: Any) -> Any:
        return loss_from_step_output(trainer.strategy.training_step(batch, 0))

    noise = options.noise_scale
    if options.objective == "time-to-loss" and noise is None:
        noise = noise_scale_lightning(trainer, pl_module)  # random samples: the real noise
    with quiet_logging(trainer, pl_module):
        result = tune(
            pl_module, lightning_batch_maker(trainer, pl_module, loader), loss_fn=loss_fn,
            optimizer=first_optimizer(trainer.optimizers), precision=precision.name,
            device=trainer.strategy.root_device, global_batch=options.global_batch,
            max_batch=_smallest(options.max_batch, per_epoch),
            memory_limit_bytes=options.memory_limit_bytes, margin=options.margin,
            measure_throughput=options.measure_throughput, objective=options.objective,
            noise_scale=noise,
            keep_modes=True)  # Lightning 2.6 trains the modules in the modes they are in
    fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
    return LightningTuneResult(**{**fields, "precision": precision.name,
                                  "samples_per_epoch": per_epoch})


def apply_batch_size(trainer: Any, pl_module: Any, batch_arg_name: str,
                     batch_size: int) -> None:
    """Make the Trainer's next train dataloader batch ``batch_size`` samples: the attribute
    (everywhere lightning_setattr finds it) for train_dataloader(), a rebuilt DataLoader for
    one given to fit(); checked by building the loader again."""
    from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr

    source = data_source(trainer)
    if lightning_hasattr(pl_module, batch_arg_name):
        lightning_setattr(pl_module, batch_arg_name, batch_size)
    if not source.is_module():
        source.instance = rebatch_loader(source.instance, batch_size)
    if getattr(trainer.fit_loop, "_combined_loader", None) is not None:
        trainer.fit_loop._combined_loader = None  # a loader built already is rebuilt
    check_loader_follows(train_dataloader_of(trainer), batch_arg_name, batch_size)


def check_loader_follows(loader: Any, batch_arg_name: str, batch_size: int) -> None:
    """An error unless the loader batches ``batch_size`` samples, the attribute's value."""
    if loader.batch_size != batch_size:
        raise TilefitError(
            f"train_dataloader() does not use self.{batch_arg_name}",
            expected=f"a DataLoader with batch_size={batch_size}, the attribute's value",
            given=f"batch_size={loader.batch_size}",
            fix=f"build the DataLoader with batch_size=self.{batch_arg_name}")


# ---- the callbacks -------------------------------------------------------------------------

def tilefit_batch_size_finder(
    *,
    batch_arg_name: str = "batch_size",
    global_batch: int | None = None,
    memory_limit_bytes: int | None = None,
    margin: float | None = None,
    max_batch: int | None = None,
    measure_throughput: bool = True,
    objective: str = "samples-per-s",
    noise_scale: Any = None,
) -> Any:
    """A Lightning Callback that tunes the batch size at fit start (see the module doc). Its
    ``result`` is a LightningTuneResult once the fit has started. objective="time-to-loss"
    chooses the batch soonest to a given loss from the gradient noise scale (``noise_scale``,
    else measured on random samples of the train data; see ``tilefit.tune``)."""
    pl = import_lightning()
    options = FinderOptions(batch_arg_name, global_batch, memory_limit_bytes,
                            DEFAULT_MARGIN if margin is None else margin, max_batch,
                            measure_throughput, objective, noise_scale)

    class TilefitBatchSizeFinder(pl.Callback):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.options = options
            self.result: LightningTuneResult | None = None

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            if stage == "fit":
                check_trainer(trainer, pl_module, options.batch_arg_name)

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            self.result = tune_lightning(trainer, pl_module, options)
            apply_batch_size(trainer, pl_module, options.batch_arg_name,
                             self.result.batch_size)
            if options.global_batch is not None:
                trainer.accumulate_grad_batches = self.result.accumulation_steps

    return TilefitBatchSizeFinder()


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


def simulated_memory_limit(limit_bytes: int) -> Any:
    """A Lightning Callback that trains on tilefit's simulated device of ``limit_bytes``
    (tilefit.tuning.simulate): from on_train_start to the end of training, live tensor
    storage is counted and an allocation past the limit raises torch.OutOfMemoryError. With
    the finder's ``memory_limit_bytes`` it checks on the CPU that the tuned batch trains.
    ``peak_bytes`` is the highest total seen."""
    pl = import_lightning()

    class SimulatedMemoryLimit(pl.Callback):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.limit_bytes = limit_bytes
            self.peak_bytes: int | None = None
            self._mode: Any = None

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            from tilefit.tuning.simulate import MemoryLimitMode

            self._mode = MemoryLimitMode(limit_bytes,
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

    return SimulatedMemoryLimit()


# ---- the gradient noise scale ----------------------------------------------------------------

def random_lightning_batches(trainer: Any, pl_module: Any, loader: Any,
                             seed: int = 0) -> Callable[[int], Any]:
    """make_batch(b): b samples drawn at random (with replacement, from a private generator)
    from the loader's map-style dataset, prepared as the fit loop prepares a batch (collate,
    precision conversion, on_before_batch_transfer, batch_to_device)."""
    import random

    n = _length(loader.dataset)
    from torch.utils.data import IterableDataset

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
        batch = trainer.precision_plugin.convert_input(batch)
        batch = pl_module._on_before_batch_transfer(batch, dataloader_idx=DATALOADER_IDX)
        return trainer.strategy.batch_to_device(batch, dataloader_idx=DATALOADER_IDX)

    return make_batch


def noise_scale_lightning(trainer: Any, pl_module: Any, *,
                          batch_sizes: tuple[int, int] | None = None,
                          measurements: int | None = None, checkpoint: str | None = None,
                          seed: int = 0) -> Any:
    """tilefit.noise_scale on the Trainer's module, train data (random samples), precision
    and training_step's loss, in the modules' own modes (as Lightning trains); the
    optimizer's state and everything else restored. checkpoint: a .ckpt of this module to
    measure at (the module keeps its weights). Call it with the Trainer set up (from a
    callback hook), as ``noise_scale_monitor`` does."""
    from tilefit.tuning.noise_measure import DEFAULT_MEASUREMENTS, noise_scale

    loader = train_dataloader_of(trainer)
    optimizers = list(getattr(trainer, "optimizers", None) or [])

    def loss_fn(model: Any, batch: Any) -> Any:
        return loss_from_step_output(trainer.strategy.training_step(batch, 0))

    with quiet_logging(trainer, pl_module):
        return noise_scale(
            pl_module, random_lightning_batches(trainer, pl_module, loader, seed),
            loss_fn=loss_fn, optimizer=optimizers[0] if optimizers else None,
            device=trainer.strategy.root_device, batch_sizes=batch_sizes,
            measurements=measurements or DEFAULT_MEASUREMENTS,
            precision=precision_of_trainer(trainer).name, checkpoint=checkpoint,
            keep_modes=True)


def noise_scale_monitor(*, at_steps: Iterable[int], batch_sizes: tuple[int, int] | None = None,
                        measurements: int | None = None) -> Any:
    """A Lightning Callback measuring the gradient noise scale during training, after the
    optimizer steps in ``at_steps`` (trainer.global_step; e.g. after warm-up and then every
    few thousand steps: the noise scale grows as the loss falls). ``results`` holds
    (global_step, NoiseScale) pairs; the training run itself is not changed."""
    pl = import_lightning()
    steps = sorted(set(at_steps))
    if not steps or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in steps):
        raise TilefitError("at_steps must be optimizer steps (whole numbers >= 0)",
                           expected="e.g. at_steps=(200, 2000)", given=repr(at_steps),
                           fix="pass the global steps after which to measure")

    class NoiseScaleMonitor(pl.Callback):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.at_steps = steps
            self.results: list[tuple[int, Any]] = []

        def _measure(self, trainer: Any, pl_module: Any) -> None:
            step = trainer.global_step
            if step in self.at_steps and all(s != step for s, _ in self.results):
                self.results.append((step, noise_scale_lightning(
                    trainer, pl_module, batch_sizes=batch_sizes, measurements=measurements)))

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self._measure(trainer, pl_module)  # at_steps may include 0

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            self._measure(trainer, pl_module)

    return NoiseScaleMonitor()
