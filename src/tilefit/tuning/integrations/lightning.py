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

Gradient clipping by norm (``gradient_clip_val``) runs in each trial as Lightning runs it
(the adapter's ``recipe``); clipping by value and overrides of the hooks around backward and
the optimizer step do not. Modules train in the modes they are in, as Lightning 2 does (it does not
call ``train()``). Lightning is imported only when a callback is made; it is not a tilefit
dependency. The callbacks are classes of ``lightning_callbacks.py`` (subclass them there);
the framework reaches tune through ``LightningAdapter`` (``adapter.py``), as the Hugging Face
Trainer does; its data through ``lightning_data.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from tilefit.errors import TilefitError
from tilefit.recipe import Recipe
from tilefit.tuning.executor import LossFn, OptimizerArg
from tilefit.tuning.integrations.adapter import noise_scale_with, tune_with
from tilefit.tuning.integrations.lightning_data import (
    data_source,
    lightning_batch_maker,
    random_lightning_batches,
    rebatch_loader,
    samples_per_epoch,
    train_dataloader_of,
)
from tilefit.tuning.tuner import DEFAULT_MARGIN, TuneResult
from tilefit.vocab import PRECISIONS, Precision, parse_precision


def import_lightning() -> Any:
    """``lightning.pytorch``, or a clear error (tilefit supports the ``lightning`` package)."""
    try:
        import lightning.pytorch as pl
    except ImportError:
        raise TilefitError(
            "the Lightning callback needs Lightning, which is not installed",
            expected="the lightning package",
            given="no module named lightning",
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
    """What the batch-size finder tunes with (``tilefit_batch_size_finder``'s arguments)."""

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
    precision = precision_from_lightning(str(trainer.precision))
    on_gpu = trainer.strategy.root_device.type == "cuda"
    if precision.name == "fp32" and on_gpu and torch.backends.cuda.matmul.allow_tf32:
        return parse_precision("tf32")
    return precision


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


class LightningAdapter:
    """A Lightning Trainer set up for fit as a ``TrainingAdapter``: its module (in the modes
    it is in), ``Strategy.training_step``'s loss, the optimizer built from
    configure_optimizers, the Trainer's precision, the train dataloader's samples prepared as
    the fit loop prepares them, and self.log silenced around the trials."""

    keep_modes = True  # Lightning 2.6 trains the modules in the modes they are in

    def __init__(self, trainer: Any, pl_module: Any, loader: Any) -> None:
        self.trainer = trainer
        self.pl_module = pl_module
        self.loader = loader

    @property
    def model(self) -> nn.Module:
        return self.pl_module

    @property
    def device(self) -> torch.device:
        return self.trainer.strategy.root_device

    @property
    def precision(self) -> str:
        return precision_of_trainer(self.trainer).name

    @property
    def recipe(self) -> Recipe:
        """The Trainer's loop: its precision, and gradient_clip_val where it clips the
        norm (gradient_clip_algorithm="norm", Lightning's default)."""
        clip = self.trainer.gradient_clip_val
        by_norm = (self.trainer.gradient_clip_algorithm or "norm") == "norm"
        return Recipe(precision=self.precision,
                      max_grad_norm=float(clip) if clip and by_norm else None)

    def loss_fn(self) -> LossFn:
        trainer = self.trainer

        def loss_fn(model: Any, batch: Any) -> Any:
            return loss_from_step_output(trainer.strategy.training_step(batch, 0))

        return loss_fn

    def optimizer(self) -> OptimizerArg:
        return first_optimizer(self.trainer.optimizers)

    def held_optimizer(self) -> torch.optim.Optimizer | None:
        optimizers = list(getattr(self.trainer, "optimizers", None) or [])
        return optimizers[0] if optimizers else None

    def trial_batches(self) -> Callable[[int], Any]:
        return lightning_batch_maker(self.trainer, self.pl_module, self.loader)

    def random_batches(self, seed: int) -> Callable[[int], Any]:
        return random_lightning_batches(self.trainer, self.pl_module, self.loader, seed)

    def around_trials(self) -> contextlib.AbstractContextManager[None]:
        return quiet_logging(self.trainer, self.pl_module)


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
    result = tune_with(
        LightningAdapter(trainer, pl_module, loader), global_batch=options.global_batch,
        max_batch=_smallest(options.max_batch, per_epoch),
        memory_limit_bytes=options.memory_limit_bytes, margin=options.margin,
        measure_throughput=options.measure_throughput, objective=options.objective,
        noise_scale=options.noise_scale)  # time-to-loss: measured on random samples
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


def noise_scale_lightning(trainer: Any, pl_module: Any, *,
                          batch_sizes: tuple[int, int] | None = None,
                          measurements: int | None = None, checkpoint: str | None = None,
                          seed: int = 0) -> Any:
    """tilefit.noise_scale on the Trainer's module, train data (random samples), precision
    and training_step's loss, in the modules' own modes (as Lightning trains); the
    optimizer's state and everything else restored. checkpoint: a .ckpt of this module to
    measure at (the module keeps its weights). Call it with the Trainer set up (from a
    callback hook), as ``noise_scale_monitor`` does."""
    adapter = LightningAdapter(trainer, pl_module, train_dataloader_of(trainer))
    return noise_scale_with(adapter, batch_sizes=batch_sizes, measurements=measurements,
                            checkpoint=checkpoint, seed=seed)


# ---- the callbacks (classes in lightning_callbacks.py) ----------------------------------------

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
    """A Lightning Callback (``TilefitBatchSizeFinder``) that tunes the batch size at fit
    start (see the module doc). Its ``result`` is a LightningTuneResult once the fit has
    started. objective="time-to-loss" chooses the batch soonest to a given loss from the
    gradient noise scale (``noise_scale``, else measured on random samples of the train data;
    see ``tilefit.tune``)."""
    from tilefit.tuning.integrations.lightning_callbacks import TilefitBatchSizeFinder

    return TilefitBatchSizeFinder(FinderOptions(
        batch_arg_name, global_batch, memory_limit_bytes,
        DEFAULT_MARGIN if margin is None else margin, max_batch, measure_throughput,
        objective, noise_scale))


def simulated_memory_limit(limit_bytes: int) -> Any:
    """A Lightning Callback (``SimulatedMemoryLimit``) that trains on tilefit's simulated
    device of ``limit_bytes`` (tilefit.tuning.simulate): from on_train_start to the end of
    training, live tensor storage is counted and an allocation past the limit raises
    torch.OutOfMemoryError. With the finder's ``memory_limit_bytes`` it checks on the CPU that
    the tuned batch trains. ``peak_bytes`` is the highest total seen."""
    from tilefit.tuning.integrations.lightning_callbacks import SimulatedMemoryLimit

    return SimulatedMemoryLimit(limit_bytes)


def noise_scale_monitor(*, at_steps: Iterable[int], batch_sizes: tuple[int, int] | None = None,
                        measurements: int | None = None) -> Any:
    """A Lightning Callback (``NoiseScaleMonitor``) measuring the gradient noise scale during
    training, after the optimizer steps in ``at_steps`` (trainer.global_step; e.g. after
    warm-up and then every few thousand steps: the noise scale grows as the loss falls).
    ``results`` holds (global_step, NoiseScale) pairs; the training run itself is not
    changed."""
    from tilefit.tuning.integrations.lightning_callbacks import NoiseScaleMonitor

    return NoiseScaleMonitor(at_steps, batch_sizes, measurements)
