"""GradScaler's private ops (torch/amp/grad_scaler.py calls them as below), and a watch on
the torch.autocast contexts a traced step enters."""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tilefit.compat import probes

__all__ = ["autocast_runs_rms_norm_in_fp32", "has_named_dim_overloads", "requested",
           "unscale_grads_", "update_scale_", "watching_autocast"]


def requested(ctx: Any) -> tuple[bool, torch.dtype | None]:
    """What a ``torch.autocast`` context was asked for (enabled, dtype), before torch
    disabled it for a device it does not have ("cuda" on a CPU build), where
    ``watching_autocast`` saw it made; else what it holds."""
    asked = getattr(ctx, "_tilefit_requested", None)
    if asked is not None:
        return asked  # type: ignore[no-any-return]
    return bool(getattr(ctx, "_enabled", True)), getattr(ctx, "fast_dtype", None)


@contextlib.contextmanager
def watching_autocast(entered: Callable[[Any, bool], object],
                      left: Callable[[Any], object]) -> Iterator[None]:
    """While active, ``entered(ctx, enabled)`` runs when code enters a ``torch.autocast``
    context ``ctx`` (``enabled``: its private ``_enabled`` flag, what it sets) and
    ``left(ctx)`` when it leaves it; a context made meanwhile keeps what it was asked for
    (``requested``), and one naming "cuda" warns nothing of CUDA's absence. torch.autocast
    has no hook of its own: its class's ``__init__``, ``__enter__`` and ``__exit__`` are
    wrapped, and restored on exit."""
    cls = torch.amp.autocast_mode.autocast
    init, enter, leave = cls.__init__, cls.__enter__, cls.__exit__
    asked = inspect.signature(init)

    def watched_init(ctx: Any, *args: Any, **kwargs: Any) -> None:
        bound = asked.bind(ctx, *args, **kwargs)
        bound.apply_defaults()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*CUDA is not available",
                                    category=UserWarning)
            init(ctx, *args, **kwargs)
        ctx._tilefit_requested = (bool(bound.arguments["enabled"]),
                                  bound.arguments["dtype"] or ctx.fast_dtype)

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

    cls.__init__ = watched_init  # type: ignore[method-assign]
    cls.__enter__, cls.__exit__ = watched_enter, watched_exit  # type: ignore[method-assign]
    try:
        yield
    finally:
        cls.__init__ = init  # type: ignore[method-assign]
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


def autocast_runs_rms_norm_in_fp32() -> bool:
    """Whether CUDA autocast lists ``rms_norm`` in its fp32 policy (ATen/autocast_mode.h,
    AT_FORALL_FP32): from torch 2.12 (pytorch/pytorch#174824, fixing #167308; torch 2.13's
    header lists it); torch 2.11's header does not, so there rms_norm runs uncast."""
    from tilefit.compat.compile import torch_version

    return torch_version() >= (2, 12)


def has_named_dim_overloads() -> bool:
    """Whether aten still has the named-dimension (Dimname) overloads (``softmax.Dimname``,
    ``sum.dim_DimnameList``, ``norm.names_ScalarOpt_dim``, ...), which CUDA autocast lists
    beside their positional siblings: torch 2.11 has them and its autocast_mode.h lists
    them; torch 2.13 has neither (pytorch/pytorch#173895 removed named tensors). Asked of
    the installed aten rather than of a version."""
    return "Dimname" in torch.ops.aten.softmax.overloads()
