"""The private PyTorch APIs tilefit uses, wrapped in one place.

Tested on torch 2.4-2.13 APIs: FakeTensorMode and its exceptions, the flop formula registry
of torch.utils.flop_counter, and ModuleTracker (public since 2.4 in torch.utils).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.utils.flop_counter import flop_registry
from torch.utils.module_tracker import ModuleTracker

__all__ = [
    "FAKE_ERRORS",
    "FakeTensor",
    "FakeTensorMode",
    "ModuleTracker",
    "flop_formula",
    "new_fake_mode",
]

# Exceptions a fake-tensor run raises for code that needs real values or real kernels.
FAKE_ERRORS: tuple[type[BaseException], ...] = (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
)


def new_fake_mode() -> FakeTensorMode:
    # allow_non_fake_inputs lets module-level constants (real CPU tensors a model keeps as
    # plain attributes) mix with fake tensors, as they would on a device.
    return FakeTensorMode(allow_non_fake_inputs=True)


def flop_formula(func: Any) -> Callable[..., int] | None:
    """torch.utils.flop_counter's formula for an aten overload, or None."""
    packet = getattr(func, "overloadpacket", func)
    return flop_registry.get(packet)
