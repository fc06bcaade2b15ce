"""The training loop a traced step emulates: each micro-batch's forward and backward, and
once per step GradScaler's unscale, gradient clipping, the optimizer step and the scale
update."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tilefit.compat.amp import unscale_grads_, update_scale_
from tilefit.errors import TilefitError
from tilefit.tracing.optimizers import optimizer_state_tensors
from tilefit.tracing.recorder import Recorder

if TYPE_CHECKING:
    from tilefit.tracing.fakes import Prepared
    from tilefit.tracing.options import TraceOptions

__all__ = ["SCALER_BACKOFF", "SCALER_GROWTH", "SCALER_INIT", "SCALER_INTERVAL",
           "check_default_loss_batch", "check_scalar_loss", "default_loss", "micro_step",
           "optimizer_step"]

# torch.amp.GradScaler's defaults (torch/amp/grad_scaler.py): init_scale 2**16,
# growth_factor 2.0, backoff_factor 0.5, growth_interval 2000.
SCALER_INIT, SCALER_GROWTH, SCALER_BACKOFF, SCALER_INTERVAL = 2.0**16, 2.0, 0.5, 2000


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


def micro_step(prep: Prepared, options: TraceOptions, recorder: Recorder,
                autocast: Any) -> None:
    recorder.enter_phase("forward")
    if prep.compiled is not None:  # its casts are in the graph: no autocast around it
        autocast = None
    if autocast is not None:
        autocast.begin_forward()
    loss = check_scalar_loss(prep.compiled.loss() if prep.compiled is not None
                             else options.loss_fn(prep.model, prep.batch))
    if options.accumulation_steps > 1:
        loss = loss / options.accumulation_steps
    if prep.scaler_state is not None:
        loss = loss * prep.scaler_state[0]
    if autocast is not None:
        autocast.end_forward()
    recorder.enter_phase("backward")
    loss.backward()
    if autocast is not None:
        autocast.end_backward()
    if options.loss_sync:
        _check_loss(loss.detach(), recorder)
    del loss


def _check_loss(loss: torch.Tensor, recorder: Recorder) -> None:
    """What the HF Trainer does after each micro-batch's backward with its default
    logging_nan_inf_filter=True: ``torch.isnan(loss) or torch.isinf(loss)`` (each a read on
    the host, so the host waits for the GPU), then adds the loss to its running total."""
    recorder.enter_phase("loss_check")
    if torch.isnan(loss) or torch.isinf(loss):
        return
    loss.add(0.0)  # the running total's add (tr_loss += tr_loss_step), out of place here


def optimizer_step(prep: Prepared, options: TraceOptions, recorder: Recorder) -> None:
    """What a training loop does once per optimizer step: GradScaler's unscale (fp16),
    gradient clipping, the optimizer step (skipped by GradScaler only after reading
    found_inf on the host: a sync), the scale update."""
    grads = [p.grad for p in prep.params if p.grad is not None]
    if prep.scaler_state is not None:
        recorder.enter_phase("scaler")
        scale, _, found_inf = prep.scaler_state
        unscale_grads_(grads, found_inf, scale.double().reciprocal().float())
    if options.max_grad_norm is not None:
        recorder.enter_phase("clip_grad")
        torch.nn.utils.clip_grad_norm_(prep.params, options.max_grad_norm,
                                       foreach=options.foreach)
    if prep.scaler_state is not None:
        recorder.enter_phase("scaler")
        prep.scaler_state[2].item()  # GradScaler.step: found_inf read on the host
    recorder.enter_phase("optimizer")
    prep.optimizer.step()
    recorder.label(optimizer_state_tensors(prep.optimizer), "optimizer_state")
    if prep.scaler_state is not None:
        recorder.enter_phase("scaler")
        scale, growth, found_inf = prep.scaler_state
        update_scale_(scale, growth, found_inf, SCALER_GROWTH, SCALER_BACKOFF, SCALER_INTERVAL)
