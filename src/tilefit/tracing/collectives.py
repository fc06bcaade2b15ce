"""The c10d collectives as the dispatcher shows them, and what each communicates.

Eager engines (DDP, FSDP2) call ProcessGroup methods, dispatched as the in-place ``c10d.*``
ops (``c10d.allreduce_``, ``c10d._allgather_base_``, ``c10d._reduce_scatter_base_``, ...);
traced and DTensor code uses the functional ``_c10d_functional.*`` ops. FSDP2's copy-in and
copy-out kernels (``fsdp.all_gather_copy_in``, ``fsdp.split_with_sizes_copy``,
``fsdp.chunk_cat``) are plain copies: memory-bound ops, not collectives.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from tilefit.compat.distributed import local_tensor, process_group_size
from tilefit.tracing.records import Collective

# packet -> (collective, which argument holds the payload: an index, or "out")
_PAYLOAD: dict[str, tuple[str, int | str]] = {
    "c10d.allreduce_": ("all_reduce", 0),
    "c10d.allreduce_coalesced_": ("all_reduce", 0),
    "c10d._allgather_base_": ("all_gather", 0),
    "c10d.allgather_": ("all_gather", 0),
    "c10d.allgather_into_tensor_coalesced_": ("all_gather", 0),
    "c10d._reduce_scatter_base_": ("reduce_scatter", 1),
    "c10d.reduce_scatter_": ("reduce_scatter", 1),
    "c10d.reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "c10d.broadcast_": ("broadcast", 0),
    "c10d.alltoall_base_": ("all_to_all", 1),
    "c10d.barrier": ("barrier", 0),
    "_c10d_functional.all_reduce": ("all_reduce", 0),
    "_c10d_functional.all_reduce_": ("all_reduce", 0),
    "_c10d_functional.all_reduce_coalesced": ("all_reduce", 0),
    "_c10d_functional.all_gather_into_tensor": ("all_gather", "out"),
    "_c10d_functional.all_gather_into_tensor_coalesced": ("all_gather", "out"),
    "_c10d_functional.reduce_scatter_tensor": ("reduce_scatter", 0),
    "_c10d_functional.reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "_c10d_functional.broadcast": ("broadcast", 0),
    "_c10d_functional.all_to_all_single": ("all_to_all", 0),
}
# a functional collective's result is ready after this op; it launches nothing itself
WAIT_OPS = frozenset({"_c10d_functional.wait_tensor"})
COLLECTIVE_NAMESPACES = ("c10d.", "_c10d_functional.")
ENGINE_COPY_NAMESPACE = "fsdp."


def is_collective(packet: str) -> bool:
    return packet.startswith(COLLECTIVE_NAMESPACES) and packet not in WAIT_OPS


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield local_tensor(tree)
    elif isinstance(tree, tuple | list):
        for x in tree:
            yield from _tensors(x)


def _group_size(packet: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    for a in (*args, *kwargs.values()):
        size = process_group_size(a)
        if size is not None:
            return size
    given = kwargs.get("group_size")
    if isinstance(given, int):
        return given
    ints = [a for a in args[1:] if isinstance(a, int) and not isinstance(a, bool)]
    if ints and packet.startswith("_c10d_functional."):
        return ints[0]  # all-gather / reduce-scatter: (input, [reduce_op,] group_size, name)
    import torch.distributed as dist

    return int(dist.get_world_size()) if dist.is_initialized() else 1


def collective_of(packet: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
                  ) -> Collective:
    """What a collective op communicates: its name, payload bytes (NCCL's size of the
    operation) and group size."""
    name, where = _PAYLOAD.get(packet, (packet.split(".", 1)[1].rstrip("_"), 0))
    if where == "out":
        payload: Any = out
    else:
        payload = args[where] if isinstance(where, int) and where < len(args) else ()
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(payload))
    return Collective(name, int(nbytes), _group_size(packet, args, kwargs))
