"""A simulated device of a given size: live tensor storage is counted, and an allocation that
takes the total past the limit raises ``torch.OutOfMemoryError`` from inside the op, exactly
where a real device would fail. This is how the whole search runs on the CPU in tests and
benchmarks.

What is counted is what the device would hold: the ``preexisting`` tensors (the model's
persistent state: parameters, buffers, gradients, optimizer state) and every storage an op
allocates while the mode is on. An op's output that aliases one of its inputs (a view, an
in-place result) allocates nothing: it is counted only if that input's storage already is.
So a slice of the user's dataset (``data[:b]``, a view of a host tensor that may hold
millions of rows) is never charged the whole dataset; ``device_copy`` charges the batch as
the device would receive it, a copy of its own elements.

Counting: every new storage is registered once (keyed by the StorageImpl pointer, so views
and in-place results are not double counted) with a weakref finalizer that subtracts its
bytes when the storage is freed. PyTorch preserves the Python object of a live storage, so
the finalizer fires when the storage itself dies, not when a wrapper is collected.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch

from tilefit.compat.fake import TorchDispatchMode, storage_key, tree_flatten, tree_unflatten

# torch.OutOfMemoryError is the top-level name from torch 2.5; torch.cuda.OutOfMemoryError
# (the same class) is older.
OOM_ERROR: type[Exception] = getattr(torch, "OutOfMemoryError", None) or \
    torch.cuda.OutOfMemoryError


def _storage(t: Any) -> torch.UntypedStorage | None:
    """The storage of a real tensor; None for anything else (meta, sparse, not a tensor)."""
    if not isinstance(t, torch.Tensor) or t.is_meta:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, ...)
        return None


class MemoryLimitMode(TorchDispatchMode):
    """Track live storage bytes; raise OutOfMemoryError past ``limit_bytes`` (None: no limit).

    ``preexisting`` tensors (weights, buffers, gradients, optimizer state) are counted from the
    start. ``peak_bytes`` is the highest live total seen.
    """

    def __init__(self, limit_bytes: int | None, preexisting: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.limit_bytes = limit_bytes
        self._live: dict[int, int] = {}  # StorageImpl pointer -> bytes
        self.live_bytes = 0
        self.peak_bytes = 0
        self.window_peak_bytes = 0  # highest live total since the last reset_window()
        self._finalizers: list[weakref.finalize] = []
        for t in preexisting:
            self._track(t)
        self.baseline_bytes = self.live_bytes

    def _track(self, t: torch.Tensor) -> None:
        storage = _storage(t)
        if storage is None:
            return
        key = storage_key(storage)
        if key in self._live:
            return
        nbytes = int(storage.nbytes())
        self._live[key] = nbytes
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.window_peak_bytes = max(self.window_peak_bytes, self.live_bytes)
        self._finalizers.append(weakref.finalize(storage, self._free, key))

    def reset_window(self) -> None:
        """Start a new window for ``window_peak_bytes`` (e.g. one forward+backward)."""
        self.window_peak_bytes = self.live_bytes

    def _free(self, key: int) -> None:
        nbytes = self._live.pop(key, 0)
        self.live_bytes -= nbytes

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage is counted (on the simulated device)."""
        storage = _storage(t)
        return storage is not None and storage_key(storage) in self._live

    def device_copy(self, tree: Any) -> Any:
        """``tree`` with every tensor the device does not hold replaced by a copy of its own
        elements, counted: what ``batch.to("cuda")`` gives for a batch on the host (a view
        such as ``data[:b]`` is copied as its b rows, not its dataset). Call inside the mode."""
        leaves, spec = tree_flatten(tree)
        if not any(isinstance(t, torch.Tensor) and not self.holds(t) for t in leaves):
            return tree
        copied = [t.clone() if isinstance(t, torch.Tensor) and _storage(t) is not None
                  and not self.holds(t) else t for t in leaves]
        return tree_unflatten(copied, spec)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # storages the inputs already had: an output on one of them is a view or an in-place
        # result, not an allocation (and if that input is not counted, neither is the view)
        inputs = {storage_key(s) for s in map(_storage, tree_flatten((args, kwargs))[0])
                  if s is not None}
        for t in tree_flatten(out)[0]:
            storage = _storage(t)
            if storage is not None and storage_key(storage) not in inputs:
                self._track(t)
        if self.limit_bytes is not None and self.live_bytes > self.limit_bytes:
            over = self.live_bytes
            del out  # the failed allocation is not kept, as on a real device
            raise OOM_ERROR(
                f"simulated device out of memory: {over} bytes live > limit "
                f"{self.limit_bytes} bytes (tilefit memory_limit_bytes)"
            )
        return out

    def __exit__(self, *exc: Any) -> Any:
        result = super().__exit__(*exc)
        for f in self._finalizers:  # stop counting: storages outliving the trial are not ours
            f.detach()
        self._finalizers.clear()
        return result
