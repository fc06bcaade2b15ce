"""accelerate's process-wide state, kept apart from a simulated run.

accelerate keeps one state per process (``PartialState``, ``AcceleratorState``,
``GradientState``: class-level ``SharedDict``s, private): the first ``Accelerator`` fixes the
device and mixed precision for every later one, and a second one asking for another precision
raises "AcceleratorState has already been initialized and cannot be changed". A script run
under the simulated GPU starts from a fresh state, as in its own process, and the caller's
state (a notebook's Accelerator on the CPU) is put back after, untouched.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from typing import Any

from tilefit.compat import probes

_STATES = ("PartialState", "AcceleratorState", "GradientState")


@contextlib.contextmanager
def fresh_accelerate_state() -> Iterator[None]:
    """accelerate's shared states emptied for the block, restored after."""
    if importlib.util.find_spec("accelerate") is None:
        yield
        return
    from accelerate import state

    shared: list[Any] = []
    for name in _STATES:
        store = getattr(getattr(state, name, None), "_shared_state", None)
        if store is None or not hasattr(store, "clear"):
            probes.went_blind("accelerate", f"its process state ({name}._shared_state): a "
                              "script's Accelerator may find the caller's")
            continue
        shared.append(store)
    saved = [dict(store) for store in shared]
    for store in shared:
        store.clear()
    try:
        yield
    finally:
        for store, values in zip(shared, saved, strict=True):
            store.clear()
            store.update(values)
