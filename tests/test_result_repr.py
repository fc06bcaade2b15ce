"""print() of a result is one short line (issue 44, item 6: an Estimate printed 30,000
characters: its Device's every field and each op's cost); the detail stays in the fields."""

from __future__ import annotations

import torch
from torch import nn

import tilefit


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))


def _loss(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
    return m(b).pow(2).mean()


def test_an_estimate_and_an_audit_print_in_one_line() -> None:
    est = tilefit.estimate(_mlp, torch.randn(64, 256), gpu="a100-80gb", loss_fn=_loss,
                           recipe=tilefit.Recipe(precision="fp32", optimizer="adamw"))
    text = repr(est)
    assert str(est) == text and "\n" not in text and len(text) < 160
    # the step's own figures: the GPU, the recipe, the verdict
    assert text.startswith("Estimate(gpu='a100-80gb', recipe='fp32, adamw', step_time=")
    assert text.endswith("fits=True)")
    # (256*1024 + 1024) + (1024*256 + 256) = 525,568 fp32 weights: 2.0 MiB of weights
    # alone, under a GiB, so the peak prints in MiB
    assert " MiB, fits" in text
    audit = tilefit.audit(_mlp, torch.randn(64, 256), gpu="a100-80gb", loss_fn=_loss,
                          recipe=tilefit.Recipe(precision="fp32", optimizer="adamw"))
    assert repr(audit).startswith("Audit(model='_mlp', gpu='a100-80gb', step_time=")
    assert "\n" not in repr(audit) and f"findings={len(audit.findings)}" in repr(audit)


def test_a_simulation_prints_its_estimate() -> None:
    with tilefit.simulate(gpu="h100", steps=2) as sim:
        model = _mlp().cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            _loss(model, torch.randn(8, 256, device="cuda")).backward()
            opt.step()
    assert repr(sim).startswith("Simulation(gpu='h100-sxm', steps_run=2, result=Estimate(")
    assert len(repr(sim)) < 250
