"""GradScaler's private ops (torch/amp/grad_scaler.py calls them as below)."""

from __future__ import annotations

import torch

__all__ = ["unscale_grads_", "update_scale_"]


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
