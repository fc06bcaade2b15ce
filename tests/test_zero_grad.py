"""Recipe(zero_grad_to_none=False): a loop that zeroes its gradients in place
(optimizer.zero_grad(set_to_none=False), PyTorch 1.x's default and the Hugging Face Trainer's
of that time) holds them through the next forward."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tilefit.errors import TilefitError
from tilefit.recipe import Recipe
from tilefit.tracing import trace

WIDTH, BATCH = 256, 4


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))


def loss_fn(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).square().mean()


def real_peak(set_to_none: bool) -> int:
    """Two real CPU steps measured by PyTorch's MemTracker (a second method)."""
    from tilefit.bench.step import real_step_peak_bytes

    model, batch = build(), torch.randn(BATCH, WIDTH)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)

    return real_step_peak_bytes(model, opt, batch, loss_fn, set_to_none=set_to_none)


def predicted(zero_grad_to_none: bool) -> Any:
    return trace(build(), torch.randn(BATCH, WIDTH), gpu="cpu", loss_fn=loss_fn,
                 recipe=Recipe(batch_size=BATCH, precision="fp32", optimizer="sgd",
                               zero_grad_to_none=zero_grad_to_none))


@pytest.mark.parametrize("to_none", [True, False])
def test_the_peak_matches_a_real_step_either_way(to_none: bool) -> None:
    assert predicted(to_none).peak(rounded=False)[0] == real_peak(to_none)


def test_kept_gradients_are_live_when_the_forward_ends() -> None:
    # weights 2 x (256 x 256 + 256) fp32 = 526,336 bytes; their gradients are as large,
    # held through the steady step's forward only when zeroed in place
    grads = 2 * (WIDTH * WIDTH + WIDTH) * 4
    kept, freed = predicted(False), predicted(True)
    live = {}
    for name, tr in (("kept", kept), ("freed", freed)):
        forward_end = max(i for i, op in enumerate(tr.ops) if op.step == 1
                          and op.phase == "forward")
        live[name] = sum(s.nbytes for s in tr.storages if s.category == "gradients"
                         and s.alloc_at <= forward_end
                         and (s.free_at is None or s.free_at > forward_end))
    assert live == {"kept": grads, "freed": 0}


def test_a_bad_value_is_refused() -> None:
    with pytest.raises(TilefitError, match="zero_grad"):
        Recipe(zero_grad_to_none="no")  # type: ignore[arg-type]
