"""fp16 autocast without a GradScaler, by name (issue 44, items 2 and 3): a user's loop that
never scales its loss is 'fp16-mixed-unscaled', traced without the scaler's ops; a custom
Precision object is refused instead of being reduced to its name (which put a scaler back)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import tilefit
from tilefit import Recipe
from tilefit.errors import TilefitError
from tilefit.vocab import parse_precision

GPU = "v100"  # fp16 Tensor Cores, no bf16


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).square().mean()


def test_an_unscaled_fp16_loop_is_the_estimate_of_its_name() -> None:
    with tilefit.simulate(gpu=GPU, steps=3) as sim:  # the user's loop: autocast, no scaler
        torch.manual_seed(0)
        model = _mlp().cuda()
        opt = torch.optim.AdamW(model.parameters())
        for _ in range(3):
            x = torch.randn(64, 256, device="cuda")
            with torch.autocast("cuda", dtype=torch.float16):
                loss = _loss(model, x)
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert sim.found.precision == "fp16-mixed-unscaled" and not sim.found.grad_scaler
    batch = torch.randn(64, 256)
    unscaled, scaled = (tilefit.estimate(_mlp, batch, loss_fn=_loss, gpu=GPU, recipe=Recipe(
        precision=p, optimizer="adamw")) for p in ("fp16-mixed-unscaled", "fp16-mixed"))
    phases = {c.record.phase for c in unscaled.ops}
    assert "scaler" not in phases and "scaler" in {c.record.phase for c in scaled.ops}
    run = sim.result
    assert "scaler" not in {c.record.phase for c in run.ops}
    assert run.flops == unscaled.flops
    # the same kernels but the script's own: its batch drawn on the GPU (aten.randn)
    ours = sum(c.time_s * c.repeats for c in run.ops if c.record.op != "aten.randn.default")
    assert ours == pytest.approx(unscaled.device_time_s, rel=1e-3)
    assert unscaled.step_time_s < scaled.step_time_s  # the scaler's unscale and reads


def test_a_custom_precision_object_is_refused_not_renamed() -> None:
    custom = dataclasses.replace(parse_precision("fp16-mixed"), grad_scaler=False)
    with pytest.raises(TilefitError, match="vocabulary") as err:
        Recipe(precision=custom)  # type: ignore[arg-type]
    assert "fp16-mixed-unscaled" in (err.value.fix or "")
    assert Recipe(precision=parse_precision("bf16-mixed")).precision == "bf16-mixed"
    assert parse_precision("fp16-autocast").name == "fp16-mixed-unscaled"
    assert parse_precision("16-mixed").grad_scaler  # Lightning's and HF's fp16 still scale
