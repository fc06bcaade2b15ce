"""The CUDA caching allocator's private history API (torch.cuda.memory's underscored
functions): turn the recording of every request on and off, read the recorded device trace
back, write a snapshot file for PyTorch's memory visualizer. Used by the GPU checks
(benchmarks/gpu_memory_check.py); each needs a CUDA device."""

from __future__ import annotations

from typing import Any

import torch


def record_allocator_history(enabled: bool, *, max_entries: int = 2_000_000) -> None:
    """Start (every alloc and free, without Python stacks: cheap) or stop recording."""
    if enabled:
        torch.cuda.memory._record_memory_history(enabled="all", context=None,
                                                 max_entries=max_entries)
    else:
        torch.cuda.memory._record_memory_history(enabled=None)


def allocator_history(device: int = 0) -> list[dict[str, Any]]:
    """The recorded trace of ``device``: dicts with ``action``, ``addr``, ``size``,
    ``stream`` (tilefit.estimator.allocator_history reads them)."""
    traces = torch.cuda.memory._snapshot()["device_traces"]
    return list(traces[device]) if device < len(traces) else []


def dump_allocator_snapshot(path: str) -> None:
    """The allocator's segments and recorded trace, as a pickle for
    https://pytorch.org/memory_viz."""
    torch.cuda.memory._dump_snapshot(path)
