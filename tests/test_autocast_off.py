"""CUDA autocast emulated on fake (CPU) tensors: code that turns autocast off for its own
computation names its tensors' device ("cpu" for a fake tensor), and on the GPU that context
turns CUDA autocast off: the emulation follows it (tracing.autocast, compat.amp)."""

from __future__ import annotations

import torch
from torch import nn

import tilefit


class RopeLike(nn.Module):
    """A matmul under autocast, then one inside torch.autocast(enabled=False) as
    transformers' rotary embeddings compute their angles (in fp32)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        with torch.autocast(device_type=x.device.type, enabled=False):
            z = y.float() @ y.float().t()
        return (y.float().sum() + z.sum()) * 1.0


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch)


def test_an_autocast_off_context_runs_its_matmul_in_fp32_on_a_gpu_target() -> None:
    tr = tilefit.trace(RopeLike, torch.empty(8, 16, device="meta"), loss_fn=_loss,
                       gpu="a100-80gb", recipe=tilefit.Recipe(precision="bf16-mixed"))
    forward = [o for o in tr.ops_of_step(1) if o.phase == "forward"]
    addmm = [o.dtype for o in forward if o.op.startswith("aten.addmm")]
    mm = [o.dtype for o in forward if o.op == "aten.mm.default"]
    assert addmm == ["bfloat16"]  # nn.Linear under autocast
    assert mm == ["float32"]  # the product inside autocast(enabled=False)
    # the watch on torch.autocast is gone once the trace is done
    assert torch.amp.autocast_mode.autocast.__enter__.__name__ == "__enter__"
