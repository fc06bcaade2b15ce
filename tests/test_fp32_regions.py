"""What the user's own code keeps in fp32 under a mixed-precision recipe is a finding: the
module, its share of the step, and the step re-costed with it in the autocast dtype, for
information (issue 46, item 6)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tilefit import Recipe, audit, estimate
from tilefit.advise.rules_fp32_regions import RULE


class _Head(nn.Module):
    def __init__(self, keep_fp32: bool) -> None:
        super().__init__()
        self.keep_fp32 = keep_fp32
        self.body = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))
        self.head = nn.Linear(512, 2048)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        if not self.keep_fp32:
            return self.head(y)  # type: ignore[no-any-return]
        with torch.autocast(y.device.type, enabled=False):
            return self.head(y.float())  # type: ignore[no-any-return]


X = torch.randn(16, 128, 512)
RECIPE = Recipe(precision="bf16-mixed", batch_size=16)


def _loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x).float().mean()


def test_an_fp32_region_is_named_with_its_cost() -> None:
    result = audit(_Head(True), X, gpu="a100-80gb", recipe=RECIPE, loss_fn=_loss)
    (f,) = [f for f in result.findings if f.rule == RULE]
    assert f.modules == ("head",) and not f.recommended  # said, not called wrong
    est = result.estimate
    head_fp32 = sum(c.time_s * c.repeats for c in est.ops if c.record.module == "head"
                    and c.record.kind == "gemm" and c.record.gemms[0].dtype == "fp32")
    assert f"{head_fp32 / est.step_time_s:.1%} of the step" in f.title
    # the step with the head under autocast, estimated from the model changed by hand: the
    # rewrite leaves out only the head weight's cast and keeps the .float() copy
    without = estimate(_Head(False), X, gpu="a100-80gb", recipe=RECIPE, loss_fn=_loss)
    assert f.step_time_after_s == pytest.approx(without.step_time_s, rel=0.1)
    assert f.step_time_after_s < f.step_time_before_s


def test_no_region_no_finding() -> None:
    result = audit(_Head(False), X, gpu="a100-80gb", recipe=RECIPE, loss_fn=_loss)
    assert not [f for f in result.findings if f.rule == RULE]
