"""The training step, written once: what a PyTorch training loop does for each micro-batch
(forward, loss, backward, the loss read) and once per optimizer step (GradScaler's unscale,
clipping, the optimizer step, the scale update, zero_grad), as a ``Recipe`` says.

Everything that needs a step runs these functions: the tracer on fake tensors as the target
GPU runs them (tilefit.tracing.step, each phase recorded), ``bench step`` on the live device
(tilefit.bench.step), calibration's host measurement, the tuner's trials and the noise
scale's micro-batches. So ``bench step`` measures the step ``estimate`` predicts, clipping and
loss read included. What differs between them is what they watch (``Hooks``: the phases,
the autocast around the forward, the optimizer once stepped) and the scaler: torch.amp's
GradScaler on a live device, its stand-in on fake tensors (tilefit.tracing.scaler)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from tilefit.dtypes import torch_dtype
from tilefit.errors import TilefitError
from tilefit.recipe import Recipe
from tilefit.vocab import Precision

__all__ = ["NO_HOOKS", "Hooks", "LossFn", "Scaler", "autocast_for", "check_default_loss_batch",
           "check_scalar_loss", "clear_gradients", "default_loss", "describe_batch",
           "micro_batch", "optimizer_update", "training_step"]

LossFn = Callable[[nn.Module, Any], torch.Tensor]


class Scaler(Protocol):
    """torch.amp.GradScaler's part of the loop (its ``scale``, ``unscale_``, ``step`` and
    ``update``)."""

    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None: ...

    def step(self, optimizer: torch.optim.Optimizer) -> Any: ...

    def update(self) -> None: ...


def _ignore(_: Any) -> None:
    return None


def _no_context() -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


@dataclass(frozen=True)
class Hooks:
    """What a caller watches of the step, each a no-op by default: ``phase(name)`` as each
    phase begins (a vocab phase: forward, backward, loss_check, scaler, clip_grad,
    optimizer, zero_grad), ``forward()`` the context the loss is computed in (autocast),
    ``backward()`` the one the backward runs in, ``stepped(optimizer)`` after the optimizer
    step."""

    phase: Callable[[str], None] = _ignore
    forward: Callable[[], contextlib.AbstractContextManager[Any]] = _no_context
    backward: Callable[[], contextlib.AbstractContextManager[Any]] = _no_context
    stepped: Callable[[torch.optim.Optimizer], None] = _ignore


NO_HOOKS = Hooks()


def autocast_for(device_type: str, precision: Precision) -> contextlib.AbstractContextManager[Any]:
    """The forward's context on a live ``device_type`` in ``precision``: torch.autocast to
    its autocast dtype, nothing without one (``Hooks.forward`` of a live step)."""
    low = precision.autocast_dtype
    if low is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch_dtype(low))


def describe_batch(batch: Any) -> str:
    """The batch as its user knows it: "a Tensor of shape (2, 4)", "a tuple of 2: Tensor
    (2, 4), Tensor (2,)" (a fake tensor is the Tensor the user gave)."""
    if isinstance(batch, torch.Tensor):
        return f"a Tensor of shape {tuple(batch.shape)}"
    if isinstance(batch, tuple | list) and batch:
        items = ", ".join(f"Tensor {tuple(b.shape)}" if isinstance(b, torch.Tensor)
                          else type(b).__name__ for b in batch[:4])
        more = ", ..." if len(batch) > 4 else ""
        return f"a {type(batch).__name__} of {len(batch)}: {items}{more}"
    return f"a {type(batch).__name__}"


def check_default_loss_batch(batch: Any) -> None:
    """An error unless default_loss can take ``batch`` (a dict, which a Hugging Face model
    takes with its labels): checked on the user's batch before tracing, and again inside."""
    if isinstance(batch, Mapping):
        return
    example = ("criterion(model(batch[0]), batch[1])" if isinstance(batch, tuple | list)
               else "criterion(model(batch), target), or model(batch).mean()")
    raise TilefitError(
        "no loss_fn given, and without one tilefit takes the loss from a dict batch "
        "(model(**batch).loss, as Hugging Face models compute it)",
        expected="a dict batch for a model that returns .loss (Hugging Face), or loss_fn",
        given=f"{describe_batch(batch)} as the batch, and no loss_fn",
        fix=f"pass loss_fn=lambda model, batch: ... (your loss, e.g. {example})")


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """model(**batch).loss for dict batches (Hugging Face models with labels in the batch):
    the loss of a step when no loss_fn is given, for trace, estimate and tune alike."""
    check_default_loss_batch(batch)
    out = model(**batch)
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if loss is None:
        raise TilefitError(
            "the model's output has no .loss",
            expected="labels in the batch so the model computes its loss, or a loss_fn",
            given=f"output of type {type(out).__name__} without loss",
            fix="add labels to the batch, or pass loss_fn=lambda model, batch: ...")
    return loss


def check_scalar_loss(loss: Any) -> torch.Tensor:
    """The loss, or an error when loss_fn did not return a one-element tensor."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TilefitError("loss_fn must return a scalar tensor",
                           expected="a tensor with one element",
                           given=type(loss).__name__ if not isinstance(loss, torch.Tensor)
                           else f"a tensor of shape {tuple(loss.shape)}",
                           fix="reduce the loss, e.g. loss.mean()")
    return loss


def micro_batch(loss_of: Callable[[], torch.Tensor], recipe: Recipe, *,
                scaler: Scaler | None = None, hooks: Hooks = NO_HOOKS) -> torch.Tensor:
    """One micro-batch: the loss (``loss_of()``, in ``hooks.forward()``), divided over the
    recipe's accumulation steps and scaled by the scaler (each rebinding ``loss``, as the
    HF Trainer's ``loss = loss / steps`` does, so the undivided loss is freed then), its
    backward, and the loss read the recipe's loop makes (``loss_sync``). Returns the loss
    the backward ran from (without accumulation or scaler: the loss as computed)."""
    hooks.phase("forward")
    with hooks.forward():
        loss = check_scalar_loss(loss_of())
        if recipe.accumulation_steps > 1:
            loss = loss / recipe.accumulation_steps
        if scaler is not None:
            loss = scaler.scale(loss)
    hooks.phase("backward")
    with hooks.backward():
        loss.backward()
    if recipe.loss_sync:
        _read_loss(loss.detach(), hooks)
    return loss


def _read_loss(loss: torch.Tensor, hooks: Hooks) -> None:
    """What the HF Trainer does after each micro-batch's backward with its default
    logging_nan_inf_filter=True: ``torch.isnan(loss) or torch.isinf(loss)`` (each a read on
    the host, so the host waits for the GPU), then adds the loss to its running total."""
    hooks.phase("loss_check")
    if torch.isnan(loss) or torch.isinf(loss):
        return
    loss.add(0.0)  # the running total's add (tr_loss += tr_loss_step), out of place here


def optimizer_update(optimizer: torch.optim.Optimizer, params: Iterable[nn.Parameter],
                     recipe: Recipe, *, scaler: Scaler | None = None,
                     clip_foreach: bool | None = None, hooks: Hooks = NO_HOOKS) -> None:
    """What a loop does once per optimizer step before zero_grad: GradScaler's unscale,
    gradient clipping (``recipe.max_grad_norm``, as the user's loop and the HF Trainer call
    clip_grad_norm_, by default with its foreach kernels on the CPU and on CUDA alike;
    ``clip_foreach=True`` says so where torch cannot tell, on fake tensors), the optimizer
    step (through the scaler, which skips it after reading found_inf on the host: a sync),
    the scale update."""
    if scaler is not None:
        hooks.phase("scaler")
        scaler.unscale_(optimizer)
    if recipe.max_grad_norm is not None:
        hooks.phase("clip_grad")
        torch.nn.utils.clip_grad_norm_(list(params), recipe.max_grad_norm,
                                       foreach=clip_foreach)
    if scaler is not None:
        hooks.phase("scaler")
        scaler.step(optimizer)
    else:
        hooks.phase("optimizer")
        optimizer.step()
    hooks.stepped(optimizer)
    if scaler is not None:
        hooks.phase("scaler")
        scaler.update()


def clear_gradients(optimizer: torch.optim.Optimizer, recipe: Recipe,
                    hooks: Hooks = NO_HOOKS) -> None:
    """zero_grad as the recipe's loop calls it (``set_to_none=recipe.zero_grad_to_none``)."""
    hooks.phase("zero_grad")
    optimizer.zero_grad(set_to_none=recipe.zero_grad_to_none)


def training_step(loss_of: Callable[[], torch.Tensor], optimizer: torch.optim.Optimizer,
                  params: Iterable[nn.Parameter], recipe: Recipe, *,
                  scaler: Scaler | None = None, hooks: Hooks = NO_HOOKS) -> None:
    """One optimizer step of ``recipe``: ``recipe.accumulation_steps`` micro-batches, each
    ``loss_of()``'s forward and backward, then the optimizer update and zero_grad. Each
    loss is let go once its micro-batch is done, as the tracer records it (a loop that
    keeps ``loss`` referenced holds one more scalar through the next forward)."""
    params = list(params)
    for _ in range(recipe.accumulation_steps):
        micro_batch(loss_of, recipe, scaler=scaler, hooks=hooks)
    optimizer_update(optimizer, params, recipe, scaler=scaler, hooks=hooks)
    clear_gradients(optimizer, recipe, hooks)
