"""What a CPU build of torch must answer for a script to see a CUDA device that is not there.

tilefit's simulated GPU keeps every tensor a fake tensor on the CPU and presents "cuda" to
the script (docs/references.md, section 47: a CPU build has no CUDA device guard, and a
backward through fake *cuda* tensors aborts the process). The parts of that which reach into torch's
internals are here:

- ``presented_device``: ``FakeTensor.device`` is a Python property that a TorchFunctionMode
  does not see; it answers ``cuda:0`` for the tensors ``on_gpu`` selects, outside the fake
  mode's own kernels (which read it as meta) and outside the ops tilefit runs;
- ``fake_parameter_swaps``: ``nn.Module._apply`` (``.to``, ``.cuda``, ``.half``) always swaps
  a fake parameter with ``torch.utils.swap_tensors``, which refuses one with a weak
  reference (every fake tensor has one): the new data is set on the parameter instead;
- ``patched``: module attributes (``torch.cuda``'s functions, ``torch.accelerator``'s)
  replaced for a block and restored after, whether or not the attribute is private.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tilefit.compat import probes
from tilefit.compat.fake import FakeTensor

__all__ = ["called_from_torch_distributed", "fake_parameter_swaps",
           "foreach_for_fake_parameters", "inside_torch", "patched", "presented_device"]

_STATE = threading.local()


@contextlib.contextmanager
def inside_torch() -> Iterator[None]:
    """A block of torch's own work (an op tilefit runs for the script): tensors report the
    device they really have inside it."""
    was = getattr(_STATE, "inside", False)
    _STATE.inside = True
    try:
        yield
    finally:
        _STATE.inside = was


@contextlib.contextmanager
def presented_device(on_gpu: Callable[[Any], bool], device: torch.device) -> Iterator[None]:
    """While active, ``t.device`` of a fake tensor that ``on_gpu(t)`` selects is ``device``
    (outside ``inside_torch`` and the fake mode's kernels)."""
    prop = FakeTensor.__dict__.get("device")
    if not isinstance(prop, property) or prop.fget is None:
        probes.went_blind("torch", "FakeTensor.device (a property in the tested torch): the "
                          "script's tensors report the CPU as their device")
        yield
        return
    real = prop.fget

    def answered(t: Any) -> torch.device:
        dev = real(t)
        if dev.type == "cpu" and not getattr(_STATE, "inside", False) and on_gpu(t) \
                and not called_from_torch_distributed(2):  # the property's caller
            return device
        return dev  # type: ignore[no-any-return]

    FakeTensor.device = property(answered, prop.fset)  # type: ignore[assignment]
    try:
        yield
    finally:
        FakeTensor.device = prop  # type: ignore[assignment]


# torch.distributed's tensor code (DTensor, FSDP2) builds wrappers whose C++ device is the
# device their Python code reads: it is answered the tensors' real one, as torch's kernels
# see them, so a DTensor's gradient and its parameter agree (the script still sees "cuda")
_DISTRIBUTED = "torch.distributed."


def called_from_torch_distributed(depth: int = 2) -> bool:
    """Whether the code ``depth`` frames up is torch.distributed's (DTensor, FSDP2): their
    buffers live on the GPU whatever device they name (the mesh's, the CPU here)."""
    caller = sys._getframe(depth).f_globals.get("__name__", "")
    return isinstance(caller, str) and caller.startswith(_DISTRIBUTED)


@contextlib.contextmanager
def fake_parameter_swaps() -> Iterator[None]:
    """``torch.utils.swap_tensors(a, b)`` of fake tensors sets ``a``'s data to ``b``'s (the
    module keeps its parameter object, now of ``b``'s dtype and storage)."""
    swap = torch.utils.swap_tensors

    def swapped(t1: torch.Tensor, t2: torch.Tensor) -> None:
        if isinstance(t1, FakeTensor) or isinstance(t2, FakeTensor):
            t1.data = t2.detach()
            return
        swap(t1, t2)

    torch.utils.swap_tensors = swapped
    try:
        yield
    finally:
        torch.utils.swap_tensors = swap


@contextlib.contextmanager
def patched(owner: Any, answers: dict[str, Any]) -> Iterator[None]:
    """``owner``'s attributes set to ``answers`` for the block (missing ones created), the
    old values (or their absence) restored after."""
    missing = object()
    saved = {name: owner.__dict__.get(name, missing) if isinstance(owner, type)
             else getattr(owner, name, missing) for name in answers}
    for name, value in answers.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


@contextlib.contextmanager
def foreach_for_fake_parameters() -> Iterator[None]:
    """torch.optim's optimizers and torch.nn.utils' gradient clipping take their foreach
    (multi-tensor) path by default when every tensor is a plain Tensor (or Parameter) on a
    device with foreach kernels (CUDA): a fake tensor is neither class, so the simulated
    GPU's optimizers and clipping took the per-tensor path a CUDA run does not take.
    FakeTensor is added to both lists of accepted classes for the block, and the CPU to the
    optimizers' foreach devices (every tensor of the block is the simulated GPU's)."""
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    lists = [getattr(m, "_foreach_supported_types", None) for m in (optimizer, _foreach_utils)]
    if not all(isinstance(accepted, list) for accepted in lists):
        probes.went_blind("torch", "torch.optim's and clip_grad_norm_'s default to their "
                          "foreach path (_foreach_supported_types): they take their "
                          "per-tensor path")
        yield
        return
    for accepted in lists:
        accepted.append(FakeTensor)
    # a DTensor (FSDP2's sharded parameter) reports its real device, the CPU, to torch:
    # the devices with foreach kernels include it while every tensor is the GPU's
    devices = optimizer._get_foreach_kernels_supported_devices
    try:
        with patched(optimizer, {"_get_foreach_kernels_supported_devices":
                                 lambda: [*devices(), "cpu"]}):
            yield
    finally:
        for accepted in lists:
            accepted.remove(FakeTensor)
