"""What an aten op reads, writes and walks: its tensors (a DTensor's shard, a float8
tensor's fp8 data), those it writes in place without returning them, the tensor lists a
multi-tensor kernel walks, and the bytes it moves."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from tilefit.compat.distributed import local_tensor
from tilefit.compat.fake import sparse_parts, written_args
from tilefit.compat.torchao import float8_payload

__all__ = ["multi_tensor", "op_tensors", "traffic", "written_in_place"]


def op_tensors(tree: Any) -> Iterator[torch.Tensor]:
    """The tensors in nested tuples/lists/dicts (aten arguments are no deeper than that)."""
    if isinstance(tree, torch.Tensor) and tree.layout == torch.sparse_coo:
        # a sparse COO tensor has no storage of its own: its indices' and values' are it
        yield from sparse_parts(tree)
    elif isinstance(tree, torch.Tensor):
        # a DTensor's shard: what this rank holds; a torchao float8 tensor's fp8 data
        yield float8_payload(local_tensor(tree))
    elif isinstance(tree, tuple | list):
        for x in tree:
            yield from op_tensors(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from op_tensors(x)


# torch's multi-tensor ops (foreach, fused optimizers, GradScaler's unscale): in place over
# tensor lists, returning nothing
_MULTI_TENSOR_PREFIXES = ("aten._foreach_", "aten._fused_", "aten._amp_")
_NATIVE_PREFIXES = ("aten.", "prims.")  # ops whose in-place forms return what they write


def written_in_place(name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                      ) -> list[torch.Tensor]:
    """The tensors an op writes in place and does not return: torch's multi-tensor ops, and
    every custom op (tilefit's fused loss, FSDP2's ``fsdp.split_with_sizes_copy`` and
    ``fsdp.chunk_cat`` into their ``out`` lists, a user's ``mutates_args`` op: a custom op
    may not return an input). ATen's other in-place ops return what they write. torch's fused
    optimizers mark the gradients mutable but write them back only when they unscale them (a
    ``grad_scale`` is given)."""
    if name.startswith(_NATIVE_PREFIXES) and not name.startswith(_MULTI_TENSOR_PREFIXES):
        return []
    written = written_args(func, args, kwargs)
    if name.startswith("aten._fused_") and kwargs.get("grad_scale") is None and \
            len(written) > 1:
        written = [written[0], *written[2:]]
    return list(op_tensors(written))


def multi_tensor(name: str, args: tuple[Any, ...], out: Any
                  ) -> tuple[int, tuple[int, ...]] | None:
    """(depth, numels of the first list) of a foreach or fused multi-tensor op: the lists
    its kernel walks together are those of the first list's length and element counts (a
    list of 0-dim step counters or an empty amsgrad list is not walked), and the result
    list of an out-of-place op."""
    if not name.startswith(_MULTI_TENSOR_PREFIXES):
        return None
    first = args[0] if args and isinstance(args[0], list | tuple) else None  # a tensor list
    if not first or not all(isinstance(t, torch.Tensor) for t in first):
        return None
    numels = tuple(t.numel() for t in first)
    lists = [a for a in args if isinstance(a, list | tuple)]
    if isinstance(out, list | tuple) and out:
        lists.append(out)
    depth = sum(1 for lst in lists if len(lst) == len(numels) and all(
        isinstance(t, torch.Tensor) and t.numel() == n for t, n in zip(lst, numels,
                                                                       strict=True)))
    return depth, numels


def traffic(inputs: list[torch.Tensor], outputs: list[torch.Tensor],
             written: Sequence[torch.Tensor] = (),
             write_only: Sequence[torch.Tensor] = ()) -> int:
    """Bytes a kernel reads and writes: each distinct input read once (no more than its
    storage holds, for broadcast views) except the ``out`` arguments it only writes, each
    output written once, and each input written in place that the op does not return
    (``_foreach_mul_``, ``_fused_adamw_``, a custom op's mutated or ``out`` arguments)."""
    seen: set[int] = {id(t) for t in write_only}
    total = 0
    returned = {id(t) for t in outputs}
    total += sum(t.numel() * t.element_size() for t in written if id(t) not in returned)
    for t in inputs:
        key = id(t)
        if key in seen:
            continue
        seen.add(key)
        n = t.numel() * t.element_size()
        if 0 in t.stride():  # a broadcast view reads no more than its storage holds
            n = min(n, t.untyped_storage().nbytes())
        total += n
    for t in outputs:
        total += t.numel() * t.element_size()
    return total
