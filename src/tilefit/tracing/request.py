"""What one trace is asked to run: the user's Recipe as given (resolved on its GPU), the
target's semantics, the loss, and how much of the step the tracer may replay rather than
run (tracing mechanics, not part of the step's description)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tilefit.dtypes import torch_dtype
from tilefit.loop import LossFn
from tilefit.recipe import Recipe
from tilefit.tracing.distributed import Parallel
from tilefit.tracing.target import Target

__all__ = ["ModelSpec", "TraceRequest"]

ModelSpec = nn.Module | Callable[[], nn.Module]


@dataclass(frozen=True)
class TraceRequest:
    """One trace: ``recipe`` (its precision resolved on the target's GPU), ``target``,
    ``loss_fn``, ``parallel`` (the recipe's data-parallel engine and world size as the
    tracer builds it; None on one device), and whether the steady step and a second
    micro-batch are replayed from the first (tracing.replay)."""

    recipe: Recipe
    target: Target
    loss_fn: LossFn
    parallel: Parallel | None = None
    replay_steady_step: bool = True
    replay_micro_step: bool = False

    @property
    def cuda(self) -> bool:
        """The target is a CUDA GPU (host memory and device memory differ)."""
        return self.target.kind == "cuda"

    @property
    def compiled(self) -> bool:
        return self.recipe.compile is not None

    @property
    def low_dtype(self) -> torch.dtype | None:
        """Autocast's dtype, None without autocast."""
        low = self.recipe.spec.autocast_dtype
        return torch_dtype(low) if low else None

    @property
    def pure_half(self) -> torch.dtype | None:
        """The 16-bit dtype the weights are held in (pure bf16 or fp16 training), None when
        they are fp32."""
        held = self.recipe.spec.param_dtype
        return None if held == "fp32" else torch_dtype(held)
