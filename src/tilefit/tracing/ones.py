"""Which traced storages are known to hold only ones: the masks a model makes itself.

A decoder given no attention mask (BART, mBART, Pegasus, Marian) makes one with
``torch.ones``, and transformers reads its values to decide whether SDPA may run causal with
no mask at all (``masking_utils._ignore_causal_mask_sdpa``: all ones and a square query, skip
the mask). A fake tensor has no values, so without this the trace built a B x T x T mask in
every decoder layer that the real run never makes. Only what is certain counts: a storage
made by ``ones``/``full(1)`` and the copies of it that cannot change a value (dtype and
device copies, clones, gathers by index: any element of a tensor of ones is one); views share
their base's storage and so its answer; any write in place (an argument its schema marks
written, ``compat.fake.written_args``) forgets the storage.
(docs/references.md, section 32)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tilefit.compat.fake import written_args
from tilefit.tracing.traffic import op_tensors

MAKERS = ("aten.ones.", "aten.new_ones.", "aten.ones_like.")
# (op prefix, position of the fill value among the op's arguments)
FILLS = (("aten.full.", 1), ("aten.new_full.", 2), ("aten.full_like.", 1))
KEEPERS = ("aten._to_copy.", "aten.clone.", "aten.index.Tensor", "aten.index_select.",
           "aten.repeat.", "aten.expand_copy.", "aten.lift_fresh_copy.")


def _filled_with_one(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    for prefix, at in FILLS:
        if name.startswith(prefix):
            value = args[at] if len(args) > at else kwargs.get("fill_value")
            return isinstance(value, int | float | bool) and value == 1
    return False


class KnownOnes:
    """The storages (by the recorder's uid) that hold only ones; called with a tensor, says
    whether its storage is one of them."""

    def __init__(self, uid: Callable[[torch.Tensor], int | None]) -> None:
        self._uid = uid
        self._ones: set[int] = set()

    def observe(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        """Update the known storages after one op (its tensors already have uids)."""
        written = list(op_tensors(written_args(func, args, kwargs)))
        if written:
            self._ones.difference_update(self._uid(t) for t in written)
            return
        name = str(func)
        made = name.startswith(MAKERS) or _filled_with_one(name, args, kwargs)
        kept = name.startswith(KEEPERS) and bool(inputs) and self(inputs[0])
        if made or kept:
            self._ones.update(u for u in map(self._uid, outputs) if u is not None)

    def __call__(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and self._uid(t) in self._ones
