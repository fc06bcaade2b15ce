"""Values a fake tensor does not have, read by the script on the host.

``.item()``, ``float(loss)``, ``bool(t)``, ``if torch.isnan(loss)`` and ``.tolist()`` reach
aten's ``_local_scalar_dense``, which a fake tensor cannot answer. The simulation answers
with a placeholder that takes the ordinary branch of a training loop, and records the read:
on a GPU each is a host synchronization (the host waits for the device), which the step's
timeline costs (tilefit.estimator.steptime's SYNC_OPS).

- a bool: False (``if torch.isnan(loss)``, ``if torch.isinf(...)``: the loss is finite);
- GradScaler's found-inf flag (read in its ``step``): 0.0, no inf found, so the optimizer
  steps (1 would skip every step);
- any other float: 1.0 (a loss, a norm, a step count: 0 would divide by zero in
  single-tensor AdamW's bias correction, which reads its step count);
- an integer: 1.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tilefit.compat.fake import DynamicOutputShapeException
from tilefit.tracing.recorder import Recorder
from tilefit.tracing.shapes import packet_name

_TILEFIT = Path(__file__).resolve().parents[1]
_TORCH = Path(torch.__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class HostRead:
    """A value the script read from a tensor on the host: where, and what stood in."""

    site: str  # "train.py:42" (the script's own line), or the library's where it read
    placeholder: float | bool
    count: int  # in the whole run


def placeholder(t: torch.Tensor, phase: str) -> float | int | bool:
    """The stand-in for a read of ``t`` in ``phase`` (the module's rules)."""
    if t.dtype == torch.bool:
        return False
    if phase == "scaler":
        return 0.0
    return 1.0 if t.is_floating_point() else 1


def read_site(frame: Any = None) -> str:
    """The innermost caller outside torch and tilefit: the script's line, or the library's
    (the HF Trainer's, Lightning's) that read the value."""
    frame = frame or sys._getframe(1)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if not (_is_under(path, _TORCH) or _is_under(path, _TILEFIT)) and \
                not frame.f_code.co_filename.startswith("<"):
            return f"{path.name}:{frame.f_lineno}"
        frame = frame.f_back
    return "(torch)"


def _is_under(path: Path, root: Path) -> bool:
    try:
        return path.resolve().is_relative_to(root)
    except OSError:
        return False


def _selected_shape(args: tuple[Any, ...]) -> tuple[int, ...] | None:
    """``x[mask]``'s shape with every element of the boolean mask selected (aten.index with
    a bool index at position p covering k dimensions: x.shape[:p] + (mask.numel(),) +
    x.shape[p + k:]); None where no index is a mask."""
    x, indices = args[0], list(args[1])
    for p, ix in enumerate(indices):
        if isinstance(ix, torch.Tensor) and ix.dtype == torch.bool:
            return (*x.shape[:p], ix.numel(), *x.shape[p + ix.dim():])
    return None


def upper_bound(func: Any, args: tuple[Any, ...]) -> torch.Tensor | None:
    """The output of an op whose shape depends on values, with every element selected:
    the largest it can be. None for an op without a stated bound."""
    name = packet_name(func)
    x = args[0]
    if name == "aten.nonzero":
        return torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)
    if name == "aten.masked_select":
        numel = torch.broadcast_shapes(x.shape, args[1].shape).numel()
        return torch.empty((numel,), dtype=x.dtype, device=x.device)
    if name == "aten.index":
        shape = _selected_shape(args)
        return None if shape is None else torch.empty(shape, dtype=x.dtype, device=x.device)
    if name == "aten.index_put_":  # the backward of x[mask]: written in place
        return x
    return None


# what the report says of each op given its upper bound
BOUND_NOTE = ("{ops}: shapes that depend on values, taken at their upper bound (every "
              "element selected, as if the mask were all True): memory and time are the most "
              "they can be")


class SimulationRecorder(Recorder):
    """The tracer's Recorder, answering every host read of a value (the module's rules) and
    counting those of GPU tensors (a read of a tensor in host memory syncs nothing)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reads: collections.Counter[tuple[str, float | bool]] = collections.Counter()
        self.bounded: dict[str, None] = {}  # ops taken at their upper bound
        self.engine_depth = 0  # inside an engine's own code (DDP's buckets): all on the GPU

    @contextlib.contextmanager
    def engine_buffers(self) -> Iterator[None]:
        """What a data-parallel engine allocates inside (DDP's buckets, made without a
        device from the parameters' own): on the GPU, as "communication"."""
        self.engine_depth += 1
        try:
            with self.allocations_as("communication"):
                yield
        finally:
            self.engine_depth -= 1

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        except DynamicOutputShapeException:
            out = upper_bound(func, args)
            if out is None:
                raise
        self.raised_in = None
        self.bounded.setdefault(packet_name(func))
        self._record(func, args, kwargs or {}, out, self.module, self.effective_phase)
        return out

    def _stand_in_scalar(self, func: Any, args: tuple[Any, ...]) -> Any:
        if packet_name(func) != "aten._local_scalar_dense":
            raise
        value = placeholder(args[0], self.phase)
        if not self.is_host(args[0]):  # a read of a CPU tensor makes the GPU wait for nothing
            self.reads[(read_site(), value)] += 1
        return value

    def copy_to_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (in host memory) copied to the GPU: a new GPU tensor, and an op the GPU
        runs (the clone is recorded as a host op, its input being in host memory)."""
        out = t.clone()
        if self.ops:
            self.ops[-1] = dataclasses.replace(self.ops[-1], on_host=False)
        self.unmark_host(out)
        return out

    def made_on_host(self, tensors: Any, since: int) -> None:
        """These tensors, made by the ops recorded from event ``since`` on (a factory called
        without a device: ``torch.randint`` in a Dataset), live in host memory, and those ops
        ran on the host."""
        if self.engine_depth:
            return
        self.mark_host(tensors)
        for i in range(since, len(self.ops)):
            self.ops[i] = dataclasses.replace(self.ops[i], on_host=True)

    def host_reads(self) -> tuple[HostRead, ...]:
        return tuple(HostRead(site, value, n) for (site, value), n in self.reads.items())
