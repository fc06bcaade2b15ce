"""GradScaler's private ops (torch/amp/grad_scaler.py calls them as below), and a watch on
the torch.autocast contexts a traced step enters."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tilefit.compat import probes

__all__ = ["unscale_grads_", "update_scale_", "watching_autocast"]


@contextlib.contextmanager
def watching_autocast(entered: Callable[[Any, bool], object],
                      left: Callable[[Any], object]) -> Iterator[None]:
    """While active, ``entered(ctx, enabled)`` runs when code enters a ``torch.autocast``
    context ``ctx`` (``enabled``: its private ``_enabled`` flag, what it sets) and
    ``left(ctx)`` when it leaves it. torch.autocast has no hook of its own: its class's
    ``__enter__`` / ``__exit__`` are wrapped, and restored on exit."""
    cls = torch.amp.autocast_mode.autocast
    enter, leave = cls.__enter__, cls.__exit__

    def watched_enter(ctx: Any) -> Any:
        out = enter(ctx)
        if not hasattr(ctx, "_enabled"):
            probes.went_blind("torch", "whether a torch.autocast context the step enters "
                              "is enabled (its _enabled flag): each is taken as enabled")
        entered(ctx, bool(getattr(ctx, "_enabled", True)))
        return out

    def watched_exit(ctx: Any, *exc: Any) -> Any:
        left(ctx)
        return leave(ctx, *exc)

    cls.__enter__, cls.__exit__ = watched_enter, watched_exit  # type: ignore[method-assign]
    try:
        yield
    finally:
        cls.__enter__, cls.__exit__ = enter, leave  # type: ignore[method-assign]


def unscale_grads_(grads: list[torch.Tensor], found_inf: torch.Tensor,
                   inv_scale: torch.Tensor) -> None:
    """GradScaler.unscale_: multiply each gradient by ``inv_scale`` in place and set
    ``found_inf`` to 1 if any is not finite (torch._amp_foreach_non_finite_check_and_unscale_)."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def update_scale_(scale: torch.Tensor, growth_tracker: torch.Tensor, found_inf: torch.Tensor,
                  growth_factor: float, backoff_factor: float, growth_interval: int) -> None:
    """GradScaler.update: back the scale off after a non-finite step, grow it after
    ``growth_interval`` finite ones, in place (torch._amp_update_scale_)."""
    torch._amp_update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor,
                             growth_interval)
