"""tilefit.tracing.gc_pause: the collector is off while a step is traced, as it was after."""

from __future__ import annotations

import gc

import torch
from torch import nn

from tilefit.recipe import Recipe
from tilefit.tracing import trace
from tilefit.tracing.gc_pause import gc_paused


def test_the_collector_is_paused_during_a_trace_and_restored_after() -> None:
    seen: list[bool] = []

    def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        seen.append(gc.isenabled())
        return model(x).sum()

    assert gc.isenabled()
    trace(lambda: nn.Linear(4, 2), torch.randn(3, 4), loss_fn=loss,
          recipe=Recipe(precision="fp32", optimizer="sgd"), gpu="cpu")
    assert seen and not any(seen)
    assert gc.isenabled()


def test_a_disabled_collector_stays_disabled() -> None:
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
