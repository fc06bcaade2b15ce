"""Snapshot and restore of everything a training step changes, bit for bit.

Parameters, buffers, gradients, requires_grad flags, train/eval mode of every module, the
optimizer's per-parameter state (step counts included) and hyperparameters, and the RNG states
(torch CPU, every CUDA device, numpy, Python ``random``). Copies are kept on the CPU so that
the snapshot does not take device memory away from the trials it protects.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class _Saved:
    """A CPU copy of a tensor and where it lived."""

    data: torch.Tensor
    device: torch.device
    dtype: torch.dtype


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _Saved(value.detach().to("cpu", copy=True), value.device, value.dtype)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _from_cpu(value: Any) -> Any:
    if isinstance(value, _Saved):
        return value.data.to(device=value.device, dtype=value.dtype, copy=True)
    if isinstance(value, dict):
        return {k: _from_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_from_cpu(v) for v in value)
    return value


@dataclass
class Snapshot:
    params: list[tuple[nn.Parameter, torch.Tensor, bool, torch.Tensor | None]]
    buffers: list[tuple[nn.Module, str, torch.Tensor | None, Any]]
    modes: list[tuple[nn.Module, bool]]
    optimizer: torch.optim.Optimizer | None
    optimizer_state: dict[Any, Any]
    optimizer_groups: list[dict[str, Any]]
    rng: dict[str, Any]


def capture_rng() -> dict[str, Any]:
    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        rng["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy ships with torch's usual installs
        pass
    return rng


def restore_rng(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "cuda" in rng:
        torch.cuda.set_rng_state_all(rng["cuda"])
    if "numpy" in rng:
        import numpy as np

        np.random.set_state(rng["numpy"])


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Snapshot:
    params = [
        (p, p.detach().to("cpu", copy=True), p.requires_grad,
         None if p.grad is None else p.grad.detach().to("cpu", copy=True))
        for p in _unique_params(model, optimizer)
    ]
    buffers: list[tuple[nn.Module, str, torch.Tensor | None, Any]] = []
    for module in model.modules():
        for name, buf in module._buffers.items():
            buffers.append((module, name, buf, None if buf is None else _to_cpu(buf)))
    modes = [(m, m.training) for m in model.modules()]
    state: dict[Any, Any] = {}
    groups: list[dict[str, Any]] = []
    if optimizer is not None:
        state = {p: _to_cpu(dict(s)) for p, s in optimizer.state.items()}
        groups = [
            {k: (None if k == "params" else _to_cpu(v)) for k, v in g.items()}
            for g in optimizer.param_groups
        ]
    return Snapshot(params, buffers, modes, optimizer, state, groups, capture_rng())


def _unique_params(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {id(p): p for p in model.parameters()}
    if optimizer is not None:
        for g in optimizer.param_groups:
            for p in g["params"]:
                seen.setdefault(id(p), p)
    return list(seen.values())


def restore_weights(snap: Snapshot) -> None:
    """Parameters, gradients, flags, buffers, modes and optimizer state; not the RNG."""
    with torch.no_grad():
        for p, data, requires_grad, grad in snap.params:
            p.copy_(data)
            p.requires_grad_(requires_grad)
            p.grad = None if grad is None else grad.to(device=p.device, dtype=p.dtype, copy=True)
        for module, name, original, saved in snap.buffers:
            if original is None:
                module._buffers[name] = None
                continue
            module._buffers[name] = original  # the same tensor object the model had
            original.copy_(_from_cpu(saved))
    for module, training in snap.modes:
        module.training = training
    if snap.optimizer is not None:
        opt = snap.optimizer
        opt.state.clear()
        for p, s in snap.optimizer_state.items():
            opt.state[p] = _from_cpu(s)
        for group, saved in zip(opt.param_groups, snap.optimizer_groups, strict=True):
            params = group["params"]  # the live Parameter objects, not copies
            group.clear()
            for key, value in saved.items():
                group[key] = params if key == "params" else _from_cpu(value)


def restore(snap: Snapshot) -> None:
    """Everything, RNG included: the state tune found, bit for bit."""
    restore_weights(snap)
    restore_rng(snap.rng)
