"""Optimizers by name, built the way the target device would run them."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from tilefit.errors import TilefitError
from tilefit.vocab import OPTIMIZER_NAMES

__all__ = [
    "OPTIMIZER_NAMES",
    "AdamW8bitModel",
    "OptimizerSpec",
    "host_step_counters",
    "make_optimizer",
    "optimizer_state_tensors",
]

OptimizerSpec = str | Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]

# bitsandbytes' 8-bit optimizers quantise each state blockwise with one fp32 absmax per block
# of 256 values (bitsandbytes functional.optimizer_update_8bit_blockwise, blocksize 256), and
# keep tensors smaller than min_8bit_size = 4096 elements in 32-bit state.
BNB_BLOCK = 256
BNB_MIN_8BIT_SIZE = 4096


class AdamW8bitModel(torch.optim.Optimizer):
    """What bitsandbytes' AdamW8bit allocates and moves, without bitsandbytes.

    State per parameter: two uint8 moments plus one fp32 absmax per 256 values (fp32 moments
    for tensors under 4096 elements). Its step is one fused kernel per tensor that reads the
    parameter, the gradient and both states and writes the parameter and both states; the
    in-place ops below move the same bytes and allocate nothing, as the fused kernel does.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 1e-3) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    if p.numel() < BNB_MIN_8BIT_SIZE:
                        state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                        state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                    else:
                        blocks = -(-p.numel() // BNB_BLOCK)
                        state["exp_avg"] = torch.zeros_like(p, dtype=torch.uint8)
                        state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.uint8)
                        state["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
                        state["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
                state["exp_avg"].add_(1)
                state["exp_avg_sq"].add_(1)
                p.add_(p.grad, alpha=-group["lr"])


def make_optimizer(spec: OptimizerSpec, params: list[torch.nn.Parameter], *,
                   foreach: bool | None) -> torch.optim.Optimizer:
    """The optimizer a name stands for, with tilefit's default hyper-parameters (they do not
    change what the step allocates or moves), or the factory's product."""
    if callable(spec) and not isinstance(spec, str):
        return spec(params)
    name = str(spec).lower()
    lr = 1e-4
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=foreach)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, foreach=foreach)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, foreach=foreach)
    if name == "adamw-fused":  # one multi-tensor kernel for the whole update
        return torch.optim.AdamW(params, lr=lr, fused=True)
    if name == "adafactor":
        if not hasattr(torch.optim, "Adafactor"):
            raise TilefitError(
                "optimizer 'adafactor' needs torch.optim.Adafactor (PyTorch 2.5 or later)",
                expected="torch >= 2.5", given=f"torch {torch.__version__}",
                fix="upgrade PyTorch, or pass a factory: optimizer=lambda ps: MyAdafactor(ps)")
        return torch.optim.Adafactor(params, lr=1e-2, foreach=foreach)
    if name == "adamw-8bit":
        return AdamW8bitModel(params, lr=lr)
    raise TilefitError(
        f"unknown optimizer {spec!r}",
        expected="one of " + ", ".join(OPTIMIZER_NAMES) + ", or a factory params -> Optimizer",
        given=repr(spec),
        fix="pass one of the names above",
    )


def optimizer_state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                out.append(v)
    return out


def host_step_counters(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The step counters a CUDA run of ``opt`` keeps in host memory: torch.optim keeps each
    parameter's ``step`` as a CPU scalar unless the group is fused or capturable (its
    ``_init_group``), so incrementing and reading it launches no kernel and never waits
    for the GPU."""
    out: list[torch.Tensor] = []
    for group in opt.param_groups:
        if group.get("fused") or group.get("capturable"):
            continue
        for p in group["params"]:
            step = opt.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor) and step.dim() == 0:
                out.append(step)
    return out
