"""What a trace is asked to do, validated: the target, the options, the traced step's
settings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tilefit.dtypes import torch_dtype
from tilefit.errors import TilefitError
from tilefit.hardware import Device, get_device
from tilefit.tracing.distributed import Parallel
from tilefit.tracing.optimizers import OptimizerSpec
from tilefit.tracing.target import Target
from tilefit.vocab import (
    BALANCED,
    ExpertRouting,
    Precision,
    check_precision_supported,
    gpus_supporting,
)

__all__ = ["LossFn", "ModelSpec", "TraceOptions", "check_device_options", "resolve_target"]

LossFn = Callable[[nn.Module, Any], torch.Tensor]
ModelSpec = nn.Module | Callable[[], nn.Module]


def resolve_target(device: str | Device) -> tuple[Target, Device | None]:
    """The target semantics for ``device``; "cpu" needs no Device to trace."""
    if isinstance(device, str) and device.strip().lower() == "cpu":
        return Target("cpu", None, 1, foreach=False), None
    dev = get_device(device)
    return Target.from_device(dev), dev


def check_device_options(spec: Precision, device: Device | None) -> None:
    """The precision against the target (the recipe checked the rest when it was made)."""
    if device is not None:
        check_precision_supported(spec, device)
    elif spec.requires == "fp8":
        raise TilefitError(
            f"precision {spec.name} runs fp8 GEMMs on a GPU's Tensor Cores, not on the CPU",
            expected="a GPU with fp8 Tensor Cores: " + ", ".join(gpus_supporting("fp8")),
            given="estimate(..., gpu='cpu')",
            fix="pass estimate(..., gpu='h100') (or another GPU above)")


@dataclass(frozen=True)
class TraceOptions:
    """What the traced step does besides the model and the batch (validated)."""

    loss_fn: LossFn
    optimizer: OptimizerSpec
    precision: Precision
    grad_checkpointing: bool
    accumulation_steps: int
    attention: str
    replay_steady_step: bool
    replay_micro_step: bool = False  # a second micro-batch replayed from the first
    max_grad_norm: float | None = None  # clip_grad_norm_ before the optimizer step
    foreach: bool | None = None  # the target's foreach default (CUDA: True)
    cuda: bool = False  # the target is a CUDA GPU (host memory and device memory differ)
    loss_sync: bool = False  # the loop reads the loss on the host after each micro-batch
    zero_grad_to_none: bool = True  # zero_grad(set_to_none=...): False keeps the gradients
    compile: bool = False  # forward and backward as torch.compile (Inductor) runs them
    compile_mode: str = "default"  # with compile: a vocab.CompileMode
    graph_breaks: bool = False  # with compile: run Dynamo over the step to list its breaks
    parallel: Parallel | None = None  # data-parallel engine and world size; None: one device
    routing: ExpertRouting = BALANCED  # a MoE layer's tokens per expert (tracing.moe)

    @property
    def low_dtype(self) -> torch.dtype | None:
        """Autocast's dtype, None without autocast."""
        low = self.precision.autocast_dtype
        return torch_dtype(low) if low else None

    @property
    def pure_half(self) -> torch.dtype | None:
        """The 16-bit dtype the weights are held in (pure bf16 or fp16 training), None when
        they are fp32."""
        held = self.precision.param_dtype
        return None if held == "fp32" else torch_dtype(held)
