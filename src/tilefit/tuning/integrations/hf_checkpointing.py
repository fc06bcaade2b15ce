"""Activation checkpointing on a Hugging Face model as ``Trainer.train()`` turns it on, for
tune's trials, and every attribute and hook it added put back afterwards."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from tilefit.errors import TilefitError
from tilefit.tuning.integrations.adapter import first_line

_ABSENT = object()
# Instance attributes model.activation_checkpointing_enable() sets (transformers
# modeling_utils: _set_gradient_checkpointing, enable_input_require_grads).
_CHECKPOINTING_ATTRS = ("gradient_checkpointing", "_gradient_checkpointing_func",
                        "_require_grads_hooks", "_require_grads_hook")


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
        raise _cannot_checkpoint(model, first_line(exc)) from None


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
