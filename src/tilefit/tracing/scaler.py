"""GradScaler on fake tensors: the part of torch.amp.GradScaler the loop calls (tilefit.loop),
over the scale, growth tracker and found-inf tensors the tracer makes up front, issuing the
ops GradScaler issues. The real GradScaler cannot run here: it makes its state lazily on the
first ``scale`` (a tensor the step-0 forward would leave behind) and is disabled on a CPU
build for a "cuda" target."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tilefit.compat.amp import unscale_grads_, update_scale_

__all__ = ["SCALER_BACKOFF", "SCALER_GROWTH", "SCALER_INIT", "SCALER_INTERVAL",
           "TracedScaler", "scaler_state"]

# torch.amp.GradScaler's defaults (torch/amp/grad_scaler.py): init_scale 2**16,
# growth_factor 2.0, backoff_factor 0.5, growth_interval 2000.
SCALER_INIT, SCALER_GROWTH, SCALER_BACKOFF, SCALER_INTERVAL = 2.0**16, 2.0, 0.5, 2000

ScalerState = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def scaler_state() -> ScalerState:
    """GradScaler's scale, growth tracker and found-inf tensors, at their initial values
    (made under the caller's fake mode)."""
    return (torch.full((1,), SCALER_INIT), torch.zeros(1, dtype=torch.int32), torch.zeros(1))


class TracedScaler:
    """GradScaler's scale, unscale_, step and update over ``state``; ``phase`` is told when
    its step hands over to the optimizer."""

    def __init__(self, state: ScalerState, phase: Callable[[str], None]) -> None:
        self.state = state
        self.phase = phase

    def scale(self, outputs: torch.Tensor) -> torch.Tensor:
        return outputs * self.state[0]

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """The gradients divided by the scale, found_inf set where one is not finite."""
        scale, _, found_inf = self.state
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]
                 if p.grad is not None]
        unscale_grads_(grads, found_inf, scale.double().reciprocal().float())

    def step(self, optimizer: torch.optim.Optimizer) -> Any:
        """GradScaler.step: found_inf read on the host (a sync), then the optimizer step."""
        self.state[2].item()
        self.phase("optimizer")
        return optimizer.step()

    def update(self) -> None:
        scale, growth, found_inf = self.state
        update_scale_(scale, growth, found_inf, SCALER_GROWTH, SCALER_BACKOFF, SCALER_INTERVAL)
