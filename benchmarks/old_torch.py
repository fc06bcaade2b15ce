"""The PyTorch a published run used, where it held memory the installed one does not.

A published memory reading is the memory of the software that ran; tilefit traces the
installed PyTorch. Where an older version is known to have held a tensor the installed one
frees, the benchmarks trace the record with that tensor held as the old version held it:
the installed functions run unchanged (same ops, same results), and the extra reference is
all that is added. Each rule names the change that ended it (docs/references.md, sections 43
and 44). Nothing here is fitted: a rule applies to every record whose PyTorch predates it.

- ``torch_of``: the record's stated PyTorch, or, where the source does not state it, the
  release that was current at the record's date (the most likely one a run of that day
  installed; PyTorch's release dates, docs/references.md, section 44).
- ``adam_foreach_before_july_2023``: foreach Adam's second parameter-sized list (pytorch
  issue #97712, section 43).
- ``softmax_saving_input``: before PyTorch 1.11, softmax and log_softmax kept their input
  for the backward as well as their output (pytorch PR #65242, section 44).
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from packaging.version import Version
from torch.overrides import TorchFunctionMode

from tilefit.compat.fake import saved_tensors_hooks_active

# PyTorch's feature releases and their dates (GitHub releases of pytorch/pytorch;
# docs/references.md, section 44): the release current at a date is the last one before it
RELEASES: tuple[tuple[str, datetime.date], ...] = (
    ("1.6.0", datetime.date(2020, 7, 28)), ("1.7.0", datetime.date(2020, 10, 27)),
    ("1.8.0", datetime.date(2021, 3, 4)), ("1.9.0", datetime.date(2021, 6, 15)),
    ("1.10.0", datetime.date(2021, 10, 21)), ("1.11.0", datetime.date(2022, 3, 10)),
    ("1.12.0", datetime.date(2022, 6, 28)), ("1.13.0", datetime.date(2022, 10, 28)),
    ("2.0.0", datetime.date(2023, 3, 15)), ("2.1.0", datetime.date(2023, 10, 4)),
    ("2.2.0", datetime.date(2024, 1, 30)), ("2.3.0", datetime.date(2024, 4, 24)),
    ("2.4.0", datetime.date(2024, 7, 24)), ("2.5.0", datetime.date(2024, 10, 17)),
)
# the first nightly after the Adam family's intermediates were minimized began (AdamW:
# pytorch/pytorch PR #104898, merged 2023-07-10; the last of the stack by 2023-07-31, issue
# #97712): a torch below it ran foreach Adam with two intermediates
FOREACH_ADAM_ONE_INTERMEDIATE = Version("2.1.0.dev20230710")
# softmax and log_softmax stopped saving their input in 1.11 (pytorch PR #65242; the
# _softmax_backward_data signature took the input's dtype instead of the input)
SOFTMAX_SAVES_OUTPUT_ONLY = Version("1.11.0")


def torch_of(rec: dict[str, Any]) -> Version | None:
    """The record's PyTorch: stated, else the release current at its date (None before the
    first listed release or without a date)."""
    stated = rec.get("software", {}).get("torch")
    if stated:
        return Version(stated)
    date = rec.get("source", {}).get("date")
    if not date:
        return None
    day = datetime.date.fromisoformat(date)
    current = [v for v, released in RELEASES if released <= day]
    return Version(current[-1]) if current else None


def two_adam_intermediates(rec: dict[str, Any]) -> bool:
    """Whether the record's torch.optim.Adam (foreach) held two intermediates at once."""
    version = torch_of(rec)
    return rec["optimizer"] == "adam" and not rec.get("optimizer_kwargs") \
        and version is not None and version < FOREACH_ADAM_ONE_INTERMEDIATE


def softmax_saves_input(rec: dict[str, Any]) -> bool:
    """Whether the record's PyTorch kept softmax's input for the backward."""
    version = torch_of(rec)
    return version is not None and version < SOFTMAX_SAVES_OUTPUT_ONLY


def old_torch(rec: dict[str, Any]) -> contextlib.AbstractContextManager[None]:
    """Every rule that applies to the record, entered together."""
    stack = contextlib.ExitStack()
    if two_adam_intermediates(rec):
        stack.enter_context(adam_foreach_before_july_2023())
    if softmax_saves_input(rec):
        stack.enter_context(softmax_saving_input())
    return stack


@contextlib.contextmanager
def adam_foreach_before_july_2023() -> Iterator[None]:
    """torch.optim's foreach Adam as before July 2023: where the installed
    ``_multi_tensor_adam`` adds eps in place (``torch._foreach_add_(exp_avg_sq_sqrt, eps)``),
    that version made a new list (``denom = torch._foreach_add(exp_avg_sq_sqrt, eps)``) and
    both lived until the function returned. The installed function runs; at that call a list
    of the same tensors is made as the old one made it and held until it returns."""
    import torch.optim.adam as adam

    installed, add_ = adam._multi_tensor_adam, torch._foreach_add_

    def multi_tensor_adam(*args: Any, **kwargs: Any) -> Any:
        held: list[Any] = []

        def add_eps(tensors: Any, other: Any, *more: Any, **named: Any) -> Any:
            if isinstance(other, float) and not more and not named:  # the eps, not steps + 1
                held.append(torch._foreach_add(tensors, other))
            return add_(tensors, other, *more, **named)

        torch._foreach_add_ = add_eps
        try:
            return installed(*args, **kwargs)
        finally:
            torch._foreach_add_ = add_
            held.clear()

    adam._multi_tensor_adam = multi_tensor_adam
    try:
        yield
    finally:
        adam._multi_tensor_adam = installed


_SOFTMAXES: frozenset[Callable[..., Any]] = frozenset({
    F.softmax, F.log_softmax, torch.softmax, torch.log_softmax,
    torch.Tensor.softmax, torch.Tensor.log_softmax})


class _SoftmaxSavingInput(TorchFunctionMode):
    """Each softmax or log_softmax that autograd records keeps a reference to its input
    until its backward node has run, as ``SoftmaxBackward`` / ``LogSoftmaxBackward`` saved
    ``self`` before 1.11 (released with the node's saved variables, after it runs). A plain
    ``cross_entropy`` is run as ATen runs it (``nll_loss(log_softmax(input, 1))``) so that
    its log_softmax does the same. Entered before the trace, this mode sits below tilefit's
    own (its autocast policy), so it sees the input the softmax kernel received."""

    def __torch_function__(self, func: Callable[..., Any], types: Any,
                           args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
                           ) -> Any:
        kwargs = kwargs or {}
        if func is F.cross_entropy:
            plain = _plain_cross_entropy(args, kwargs)
            if plain is not None:
                return plain
        out = func(*args, **kwargs)
        if func in _SOFTMAXES:
            _hold(args[0] if args else kwargs.get("input"), out)
        return out


def _hold(x: Any, out: Any) -> None:
    """Keep ``x`` alive until the backward node that made ``out`` has run. Not inside a
    checkpointed forward: there what autograd saves goes to the checkpoint's pack hook,
    which drops it until the block is recomputed (where the input is held only until that
    block's backward, one block at a time; not modelled)."""
    node = getattr(out, "grad_fn", None)
    if isinstance(x, torch.Tensor) and node is not None and not saved_tensors_hooks_active():
        held = [x]
        node.register_hook(lambda *_: held.clear())


def _plain_cross_entropy(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``nll_loss(log_softmax(input, class dim), target, ...)`` for class-index targets
    without label smoothing (ATen's cross_entropy_loss), else None."""
    bound = inspect.signature(F.cross_entropy).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    x, target = a["input"], a["target"]
    if (a["label_smoothing"] != 0.0 or a["size_average"] is not None
            or a["reduce"] is not None or not isinstance(target, torch.Tensor)
            or target.is_floating_point()):
        return None
    logp = F.log_softmax(x, dim=1 if x.dim() > 1 else 0)  # the mode is off in here
    _hold(x, logp)
    return F.nll_loss(logp, target, weight=a["weight"], ignore_index=a["ignore_index"],
                      reduction=a["reduction"])


@contextlib.contextmanager
def softmax_saving_input() -> Iterator[None]:
    """Softmax and log_softmax as before PyTorch 1.11: the input kept for the backward."""
    with _SoftmaxSavingInput():
        yield
