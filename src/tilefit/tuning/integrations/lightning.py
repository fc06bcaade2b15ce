"""Lightning: a callback in the spirit of BatchSizeFinder, with throughput and alignment.

    from tilefit.tuning.integrations.lightning import tilefit_batch_size_finder

    trainer = L.Trainer(callbacks=[tilefit_batch_size_finder(global_batch=256)])
    trainer.fit(module, datamodule=dm)

At fit start it runs ``tilefit.tuning`` with the module's own ``training_step`` as the loss and
``configure_optimizers`` as the optimizer factory, on samples from the train dataloader's
dataset, then sets the module's (or datamodule's) ``batch_size`` attribute and, with
``global_batch``, ``trainer.accumulate_grad_batches``. Lightning is imported only here and only
when the callback is made; it is not a tilefit dependency.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tilefit.errors import TilefitError


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


def batch_size_owner(module: Any, datamodule: Any, attr: str) -> Any:
    """Which object holds the batch size attribute: the datamodule first, as Lightning's
    lightning_setattr looks it up, then the module (or its hparams)."""
    for owner in (datamodule, module):
        if owner is None:
            continue
        if hasattr(owner, attr):
            return owner
        hparams = getattr(owner, "hparams", None)
        if hparams is not None and attr in hparams:
            return hparams
    raise TilefitError(
        f"no {attr!r} attribute to set on the LightningModule or LightningDataModule",
        expected=f"self.{attr} used by train_dataloader()",
        given="neither object has it",
        fix=f"store the batch size as self.{attr} and build the dataloader with it",
    )


def set_batch_size(owner: Any, attr: str, value: int) -> None:
    if isinstance(owner, Mapping) or hasattr(owner, "__setitem__"):
        owner[attr] = value
    else:
        setattr(owner, attr, value)


def tilefit_batch_size_finder(
    *,
    batch_arg_name: str = "batch_size",
    global_batch: int | None = None,
    memory_limit_bytes: int | None = None,
    margin: float | None = None,
    max_batch: int | None = None,
) -> Any:
    """A Lightning Callback that tunes the batch size at fit start (see the module doc)."""
    pl = import_lightning()

    class TilefitBatchSizeFinder(pl.Callback):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.result: Any = None

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            from tilefit.tuning.tuner import DEFAULT_MARGIN, tune

            datamodule = getattr(trainer, "datamodule", None)
            source = datamodule if datamodule is not None else pl_module
            loader = source.train_dataloader()
            dataset, collate = loader.dataset, loader.collate_fn
            n = len(dataset)

            def make_batch(b: int) -> Any:
                return collate([dataset[i % n] for i in range(b)])

            def loss_fn(model: Any, batch: Any) -> Any:
                return loss_from_step_output(model.training_step(batch, 0))

            def optimizer(params: Any) -> Any:
                return first_optimizer(pl_module.configure_optimizers())

            self.result = tune(
                pl_module, make_batch, loss_fn=loss_fn, optimizer=optimizer,
                device=pl_module.device, global_batch=global_batch, max_batch=max_batch,
                memory_limit_bytes=memory_limit_bytes,
                margin=DEFAULT_MARGIN if margin is None else margin,
            )
            owner = batch_size_owner(pl_module, datamodule, batch_arg_name)
            set_batch_size(owner, batch_arg_name, self.result.batch_size)
            if global_batch is not None:
                trainer.accumulate_grad_batches = self.result.accumulation_steps

    return TilefitBatchSizeFinder()
