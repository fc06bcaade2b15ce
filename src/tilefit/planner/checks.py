"""plan()'s checks of what it is asked, before anything is traced."""

from __future__ import annotations

from tilefit.errors import TilefitError
from tilefit.hardware import Device


def check_fraction(memory_fraction: float) -> None:
    if isinstance(memory_fraction, bool) or not isinstance(memory_fraction, int | float) \
            or not 0 < memory_fraction <= 1:
        raise TilefitError("the memory fraction must be in (0, 1]",
                           expected="the share of GPU memory a plan may use, e.g. 0.9",
                           given=repr(memory_fraction),
                           fix="pass PlanSearch(memory_fraction=0.9) (10% headroom) or "
                           "leave it out (all of it)")


def check_gpu(device: Device) -> None:
    """A plan is for a GPU: the CPU (or another device kind) is an error."""
    if device.kind != "cuda":
        raise TilefitError("plan needs a GPU to plan for",
                           expected="a GPU from the catalog (`tilefit gpus`)",
                           given=device.name,
                           fix="pass plan(..., gpu='a100-80gb') (or your GPU)")
