"""Values a model reads from its own tensors while it is built, answered on fake tensors.

Some constructors read a value to choose a branch that does not change any shape: torch's
``orthogonal()`` parametrization asks whether the initial weight is orthogonal already
(``torch.allclose``), a custom init may scale by a norm it reads. Fake and meta tensors have
no values, so such a model cannot be built without weights. While it is built, each read
is answered: a check (a bool) True, the branch a weight that needs no repair takes; a
number 1.0. An integer is not answered: it could size a layer, and a wrong shape would be a
silent wrong number; the error says how to build it instead.
"""

from __future__ import annotations

from typing import Any

import torch

from tilefit.compat.fake import DataDependentOutputException, TorchDispatchMode
from tilefit.errors import TilefitError

# a schema's scalar return (.item()'s _local_scalar_dense), as torch spells its type
_SCALAR = ("Scalar", "number")
# what torch says when a value is read from a meta tensor
_META_READ = "cannot be called on meta tensors"


def reads_a_value(exc: BaseException) -> bool:
    """Whether a meta build failed because the model read a value."""
    return _META_READ in str(exc)


class BuildValues(TorchDispatchMode):
    """Answers each value the model reads while it is built (above the fake mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.answered: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        try:
            return func(*args, **(kwargs or {}))
        except DataDependentOutputException:
            returns = str(func._schema.returns[0].type) if func._schema.returns else ""
            t = args[0] if args and isinstance(args[0], torch.Tensor) else None
            scalar = returns in _SCALAR and t is not None
            if returns == "bool" or (scalar and t.dtype == torch.bool):
                return self._answer("check", True)
            if returns == "float" or (scalar and t.is_floating_point()):
                return self._answer("number", 1.0)
            if returns != "int" and not scalar:
                raise
            raise self._integer(t) from None

    def _answer(self, kind: str, value: object) -> object:
        self.answered[kind] = self.answered.get(kind, 0) + 1
        return value

    @staticmethod
    def _integer(t: torch.Tensor | None) -> TilefitError:
        dtype = "an integer" if t is None else f"a {str(t.dtype).removeprefix('torch.')}"
        return (
            TilefitError(
                "the model reads an integer from a tensor while it is built",
                expected="a model whose construction reads no integer from its tensors (one "
                "could size a layer, which fake tensors cannot know)",
                given=f"{dtype} value read in __init__",
                fix="build the model once for real and pass the instance (tilefit.estimate("
                "model, batch, ...)), or compute the integer from Python numbers"))

    def notes(self) -> tuple[str, ...]:
        if not self.answered:
            return ()
        read = ", ".join(f"{n} {kind}(s)" for kind, n in sorted(self.answered.items()))
        return (f"the model read {read} from its tensors while it was built (torch's "
                "orthogonal() parametrization checks its weight so); with no values on fake "
                "tensors, a check was answered True and a number 1.0: no shape depends on "
                "them, the initial weights' values do",)
