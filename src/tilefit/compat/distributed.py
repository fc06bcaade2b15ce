"""torch.distributed: the fake process group, DTensor, storage resizes, DDP's bucket rebuild
on fake tensors, and PyTorch's MemTracker."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tilefit.compat.fake import TorchDispatchMode, unset_fake_temporarily


def distributed_available() -> bool:
    """Whether this torch build has torch.distributed (macOS and Windows wheels may not)."""
    import torch.distributed as dist

    return bool(dist.is_available())


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """The default process group as PyTorch's fake backend at ``world_size``, as rank 0: the
    collectives are dispatched (so they are recorded) but move no data
    (torch.testing._internal.distributed.fake_pg, private; checked on torch 2.13)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def reduce_scatter_single_name() -> str:
    """The name in ``torch.distributed`` of the one-tensor reduce-scatter FSDP2 calls:
    ``reduce_scatter_single`` from torch 2.13 (``reduce_scatter_tensor`` kept as its
    deprecated alias); torch 2.11 has only ``reduce_scatter_tensor``, which its FSDP2 calls
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py of each release)."""
    import torch.distributed as dist

    return "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") \
        else "reduce_scatter_tensor"


def process_group_initialized() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized())


_DTENSOR: list[type] = []  # DTensor's class, once a multi-GPU trace has asked for it


def enable_dtensor() -> None:
    """Let ``local_tensor`` unwrap DTensors (imported only for multi-GPU traces)."""
    if not _DTENSOR:
        from torch.distributed.tensor import DTensor

        _DTENSOR.append(DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The shard a rank holds of a DTensor (its private ``_local_tensor``: ``to_local()``
    would dispatch a view), or ``t`` itself."""
    if _DTENSOR and isinstance(t, _DTENSOR[0]):
        return t._local_tensor  # type: ignore[attr-defined, no-any-return]
    return t


def process_group_size(arg: Any) -> int | None:
    """The size of the process group a c10d op receives (a ProcessGroup boxed in a script
    object, unboxed by the private ``ProcessGroup.unbox``), None for other arguments."""
    import torch.distributed as dist

    group = arg
    if isinstance(arg, torch.ScriptObject):
        try:
            group = dist.ProcessGroup.unbox(arg)
        except (RuntimeError, TypeError, AttributeError):  # a ReduceOp or a Work
            return None
    if not isinstance(group, dist.ProcessGroup):
        return None
    return int(group.size())


@contextlib.contextmanager
def storage_resizes(callback: Callable[[Any, int], None]) -> Iterator[None]:
    """Call ``callback(storage, new_nbytes)`` after every ``UntypedStorage.resize_``: FSDP2
    allocates and frees its unsharded parameters that way, outside the dispatcher (PyTorch's
    MemTracker patches the same method)."""
    original = torch.UntypedStorage.resize_

    def resize_(st: Any, size: int) -> Any:
        out = original(st, size)
        callback(st, int(size))
        return out

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]


_INTEGER_DTYPES = (torch.int32, torch.int64)


class _RealIntegerAllocations(TorchDispatchMode):
    """Integer tensors created from nothing (no tensor arguments) are real CPU tensors: the
    host-side bookkeeping C++ code reads back (DDP's bucket indices), not model data."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        leaves = [*args, *kwargs.values()]
        if kwargs.get("dtype") in _INTEGER_DTYPES and not any(
                isinstance(a, torch.Tensor) for a in leaves):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


class _BucketRebuild:
    """DDP's C++ reducer, whose one bucket rebuild runs with real integer bookkeeping."""

    def __init__(self, reducer: Any, around: Callable[[], Any]) -> None:
        self._reducer = reducer
        self._around = around

    def _rebuild_buckets(self) -> bool:
        with self._around(), _RealIntegerAllocations():
            return bool(self._reducer._rebuild_buckets())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)


def rebuild_ddp_buckets_on_fake_tensors(ddp: Any, around: Callable[[], Any]) -> None:
    """DDP (torch >= 2.12) starts with all gradients in one bucket and rebuilds its buckets
    once, in the forward after the first backward, in the order the gradients became ready
    (the first at most 1 MiB, the others 25 MiB). The rebuild broadcasts the bucket indices
    in an integer tensor and reads them back, which a fake tensor cannot: those integer
    tensors are made real (the fake process group moves nothing, so rank 0 reads its own
    indices, as it would). ``around()``: a context the rebuild runs in (the recorder's
    category for the new buckets). Wraps DDP's private ``reducer``; call after
    ``register_comm_hook``, which needs the C++ object."""
    ddp.reducer = _BucketRebuild(ddp.reducer, around)


def new_mem_tracker() -> Any:
    """PyTorch's MemTracker (torch.distributed._tools.mem_tracker, private): live tensor
    bytes by module and category, by its own accounting.

    MemTracker registers a gradient hook on every parameter of a module it enters, which a
    frozen parameter refuses ("cannot register a hook on a tensor that doesn't require
    gradient", torch 2.13): a LoRA or QLoRA base. Its hook table is given a no-op entry for
    each frozen parameter first, so it counts the parameter and hooks only the trainable."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from tilefit.compat.modules import acyclic_mod_tracker

    class FrozenAwareMemTracker(MemTracker):  # type: ignore[misc]
        # MemTracker hooks every parameter's gradient, which torch refuses for a frozen one
        # (a LoRA base): a frozen parameter gets a placeholder handle instead of a hook, so
        # it is still counted as a parameter
        def _track_module_params_and_buffers(self, module: torch.nn.Module,
                                             install_grad_hooks: bool = True) -> Any:
            for p in module.parameters():
                if not p.requires_grad:
                    self._param_to_grad_hook_handles.setdefault(p, (_NO_HOOK, _NO_HOOK))
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

    tracker = FrozenAwareMemTracker()
    # its ModTracker's input hooks form the reference cycle compat.modules describes: a
    # graph the backward never runs would live until the cycle collector ran
    tracker._mod_tracker = acyclic_mod_tracker()
    return tracker


class _NoHook:
    """A removable handle with nothing to remove (MemTracker removes its hooks on exit)."""

    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()
