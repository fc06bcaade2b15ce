"""Python's cyclic garbage collector paused while a step is traced.

A trace builds hundreds of thousands of objects that live until it ends (fake tensors, their
storages, op records; with compile=True AOTAutograd's joint graph, its partitioned graphs and
their metadata). Python's generational collector runs a full collection each time the
long-lived objects grow by a quarter, and each walks every object of the process (torch's,
transformers'): about a quarter of a compiled trace's CPU time for GPT-2, a fifth of an
eager one's. The collector resumes when the trace ends; what it frees then is the same.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No automatic collection inside; the collector's previous state after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
