"""torch's dispatcher from Python: kernels registered for aten ops while a step is traced,
and removed after.

A kernel registered for a dispatch key runs wherever an op reaches that key, whatever Python
function called the op: torch.nn.functional's composites (``multi_head_attention_forward``),
the user's own functions, autograd's engine (a checkpointed recompute). That is how ATen's
own autocast and kernel choices work, and what a torch-function mode cannot do: a mode is
not active while its own handler runs the function it was handed
(docs/references.md, section 46).

Private: ``torch.library.Library._destroy`` (removing the registrations, after which the
previous kernels are back), ``torch._C._ExcludeDispatchKeyGuard`` and ``DispatchKeySet``
(running the op below a key, as ATen's autocast kernels do),
``torch._C._dispatch_has_kernel_for_dispatch_key`` and ``_dispatch_get_all_op_names``
(which ops have a kernel for a key), ``OpOverload._schema``.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["Registrations", "excluding", "kept_registration", "op_overload", "ops_with_kernel",
           "python_meta_kernel", "registered", "schema_names"]


class Registrations:
    """aten kernels registered for a block (``registered``)."""

    def __init__(self) -> None:
        self._lib = torch.library.Library("aten", "IMPL")

    def impl(self, op: str, kernel: Callable[..., Any], key: str) -> None:
        """``kernel`` for the aten overload ``op`` ("mm", "pow.Tensor_Scalar") at ``key``."""
        self._lib.impl(op, kernel, key)

    def fallthrough(self, op: str, key: str) -> None:
        """``op`` passes through ``key`` untouched (as for an op without a kernel there)."""
        self._lib.impl(op, torch.library.fallthrough_kernel, key)

    def close(self) -> None:
        self._lib._destroy()


@contextlib.contextmanager
def registered() -> Iterator[Registrations]:
    """Kernels registered on the yielded object hold for the block; the kernels they
    replaced are back after it."""
    regs = Registrations()
    try:
        with warnings.catch_warnings():
            # "Overriding a previously registered kernel": that is the point
            warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered",
                                    category=UserWarning)
            yield regs
    finally:
        regs.close()


def kept_registration(op: str, kernel: Callable[..., Any], key: str) -> None:
    """``kernel`` for the aten overload ``op`` at ``key`` for the rest of the process (a kernel
    that switches itself on and off). For the Meta key a kernel registered for a block does
    not hold: on torch 2.13, after a Library's Meta kernel for mkldnn_rnn_layer was removed,
    meta tensors ran torch's own kernel again but fake tensors kept running the removed one."""
    regs = Registrations()  # never closed
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered",
                                category=UserWarning)
        regs.impl(op, kernel, key)
    _KEPT.append(regs)


_KEPT: list[Registrations] = []


def python_meta_kernel(op: torch._ops.OpOverload) -> Callable[..., Any] | None:
    """torch's own Python meta kernel for ``op`` (``register_meta`` in
    torch/_meta_registrations.py puts it in ``OpOverload.py_kernels``); None where it has
    none."""
    return op.py_kernels.get(torch._C.DispatchKey.Meta)  # type: ignore[return-value]


def excluding(key: str) -> Any:
    """A guard under which ops skip the dispatch key ``key`` (an autocast kernel runs its
    op below itself so)."""
    return torch._C._ExcludeDispatchKeyGuard(
        torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key)))


@functools.cache
def ops_with_kernel(key: str) -> frozenset[str]:
    """The aten overloads with a kernel of their own at ``key`` ("mm", "conv1d.padding")."""
    names = torch._C._dispatch_get_all_op_names()
    return frozenset(n.removeprefix("aten::") for n in names if n.startswith("aten::")
                     and torch._C._dispatch_has_kernel_for_dispatch_key(n, key))


def op_overload(op: str) -> torch._ops.OpOverload | None:
    """The aten OpOverload named ``op`` ("mm", "pow.Tensor_Scalar"); None where this torch
    has no such overload."""
    name, _, overload = op.partition(".")
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return None
    return getattr(packet, overload or "default", None)


def schema_names(op: torch._ops.OpOverload) -> tuple[list[str], list[str]]:
    """An overload's positional and keyword-only argument names, in order."""
    positional = [a.name for a in op._schema.arguments if not a.kwarg_only]
    keyword = [a.name for a in op._schema.arguments if a.kwarg_only]
    return positional, keyword
