"""Snapshot and restore of everything a training step changes, bit for bit.

Parameters, buffers, gradients, requires_grad flags, train/eval mode of every module, the
optimizer's per-parameter state (step counts included) and hyperparameters, and the RNG states
(torch CPU, every CUDA device, numpy, Python ``random``). Copies are kept on the CPU so that
the snapshot does not take device memory away from the trials it protects.

Beyond parameters and buffers, every module's own attributes (its ``__dict__``, as
``copy.deepcopy`` would see it) are restored: a torchmetrics ``Metric``'s states and
``_update_count``, counters, lists a forward appends to, tensors kept as plain attributes
(their values, in place), attributes a step adds (removed again) or rebinds (bound back).
Tensors, lists, tuples, dicts and sets are restored by value, recursively; any other object
an attribute refers to is bound back by reference, and what that object holds inside (a
Lightning ``Trainer`` a ``LightningModule`` points to, a tokenizer, a config object) is out of
scope: a step that mutates such an object's own attributes is not rolled back.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tilefit.compat.modules import buffer_slots


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


# ---- module attributes ---------------------------------------------------------------------
# The registries nn.Module keeps in its __dict__: restored by reference (the same Parameter,
# buffer and submodule objects under the same names; their values are restored on their own).
_REGISTRIES = ("_parameters", "_buffers", "_modules")
_MODE = "training"  # restored with the modes, not with the attributes
MAX_DEPTH = 16  # nesting of containers followed; deeper values are bound back by reference


@dataclass(frozen=True)
class _Kept:
    """A value bound back by reference."""

    value: Any


@dataclass(frozen=True)
class _TensorValue:
    """A tensor attribute: the same object, its values restored in place."""

    tensor: torch.Tensor
    saved: _Saved


@dataclass(frozen=True)
class _ContainerValue:
    """A list, tuple, dict or set: the same object, its items restored (recursively)."""

    container: Any
    items: Any  # list of frozen items, dict of frozen values, or a set's items


def _freeze(value: Any, skip: set[int], depth: int = 0) -> Any:
    """What restores ``value`` later. ``skip``: ids of tensors restored elsewhere
    (parameters, buffers), bound back by reference here."""
    if isinstance(value, torch.Tensor):
        if id(value) in skip or value.is_meta:
            return _Kept(value)
        return _TensorValue(value, _to_cpu(value))
    if depth >= MAX_DEPTH:
        return _Kept(value)
    if isinstance(value, dict):
        return _ContainerValue(value, {k: _freeze(v, skip, depth + 1) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return _ContainerValue(value, [_freeze(v, skip, depth + 1) for v in value])
    if isinstance(value, set):
        return _ContainerValue(value, set(value))
    return _Kept(value)


def _thaw(frozen: Any) -> Any:
    """Restore what ``_freeze`` saw and return the object to bind."""
    if isinstance(frozen, _Kept):
        return frozen.value
    if isinstance(frozen, _TensorValue):
        tensor, saved = frozen.tensor, _from_cpu(frozen.saved)
        with torch.no_grad():
            if tensor.shape == saved.shape and tensor.dtype == saved.dtype:
                tensor.copy_(saved)
            else:  # resized in place: give it back its old size and values
                tensor.data = saved
        return tensor
    obj, items = frozen.container, frozen.items
    if isinstance(obj, dict):
        values = {k: _thaw(v) for k, v in items.items()}
        obj.clear()
        obj.update(values)
    elif isinstance(obj, list):
        obj[:] = [_thaw(v) for v in items]
    elif isinstance(obj, set):
        obj.clear()
        obj.update(items)
    else:  # a tuple: immutable, its items restored in place
        for v in items:
            _thaw(v)
    return obj


def _snapshot_attributes(model: nn.Module, skip: set[int]
                         ) -> list[tuple[nn.Module, dict[str, Any]]]:
    out = []
    for module in model.modules():
        saved: dict[str, Any] = {}
        for key, value in vars(module).items():
            if key in _REGISTRIES:
                saved[key] = _ContainerValue(value, {k: _Kept(v) for k, v in value.items()})
            elif key != _MODE:
                saved[key] = _freeze(value, skip)
        out.append((module, saved))
    return out


def _restore_attributes(attributes: list[tuple[nn.Module, dict[str, Any]]]) -> None:
    for module, saved in attributes:
        own = vars(module)
        for key in [k for k in own if k not in saved and k != _MODE]:
            del own[key]  # added by the trial
        for key, frozen in saved.items():
            own[key] = _thaw(frozen)


@dataclass
class Snapshot:
    params: list[tuple[nn.Parameter, torch.Tensor, bool, torch.Tensor | None]]
    buffers: list[tuple[nn.Module, str, torch.Tensor | None, Any]]
    modes: list[tuple[nn.Module, bool]]
    optimizer: torch.optim.Optimizer | None
    optimizer_state: dict[Any, Any]
    optimizer_groups: list[dict[str, Any]]
    rng: dict[str, Any]
    attributes: list[tuple[nn.Module, dict[str, Any]]]  # every module's own __dict__


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
        for name, buf in buffer_slots(module).items():
            buffers.append((module, name, buf, None if buf is None else _to_cpu(buf)))
    modes = [(m, m.training) for m in model.modules()]
    restored_elsewhere = {id(t) for t in (*model.parameters(), *model.buffers())}
    attributes = _snapshot_attributes(model, restored_elsewhere)
    state: dict[Any, Any] = {}
    groups: list[dict[str, Any]] = []
    if optimizer is not None:
        state = {p: _to_cpu(dict(s)) for p, s in optimizer.state.items()}
        groups = [
            {k: (None if k == "params" else _to_cpu(v)) for k, v in g.items()}
            for g in optimizer.param_groups
        ]
    return Snapshot(params, buffers, modes, optimizer, state, groups, capture_rng(), attributes)


def _unique_params(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {id(p): p for p in model.parameters()}
    if optimizer is not None:
        for g in optimizer.param_groups:
            for p in g["params"]:
                seen.setdefault(id(p), p)
    return list(seen.values())


def restore_weights(snap: Snapshot) -> None:
    """Everything a step changes: module attributes, parameters, gradients, flags, buffers
    and optimizer state. Not the modes (the trials run in train mode, see ``train_mode``)
    nor the RNG: ``restore`` puts those back too."""
    _restore_attributes(snap.attributes)
    with torch.no_grad():
        for p, data, requires_grad, grad in snap.params:
            p.copy_(data)
            p.requires_grad_(requires_grad)
            p.grad = None if grad is None else grad.to(device=p.device, dtype=p.dtype, copy=True)
        for module, name, original, saved in snap.buffers:
            if original is None:
                buffer_slots(module)[name] = None
                continue
            buffer_slots(module)[name] = original  # the same tensor object the model had
            original.copy_(_from_cpu(saved))
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


def train_mode(model: nn.Module) -> None:
    """Put every module in train mode, as a training loop does (``model.train()``; Hugging
    Face's Trainer calls it): dropout on, batch norm on batch statistics. A model from
    ``from_pretrained`` is in eval mode, where dropout allocates nothing and a batch that
    fits may not fit in training."""
    model.train()


def restore_modes(snap: Snapshot) -> None:
    for module, training in snap.modes:
        module.training = training


def restore(snap: Snapshot) -> None:
    """Everything, modes and RNG included: the state tune found, bit for bit."""
    restore_weights(snap)
    restore_modes(snap)
    restore_rng(snap.rng)
