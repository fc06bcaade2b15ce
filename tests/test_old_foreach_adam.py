"""The reserved-memory corpus traces records whose stated PyTorch predates July 2023 with
that version's foreach Adam (benchmarks/bench_reserved_corpus.py,
``adam_foreach_before_july_2023``): the same update, plus the second parameter-sized list
that version made (``denom = torch._foreach_add(exp_avg_sq_sqrt, eps)``) and held until the
function returned (pytorch/pytorch issue #97712)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from bench_reserved_corpus import (
    adam_foreach_before_july_2023,
    two_adam_intermediates,
)


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        out = func(*args, **(kwargs or {}))
        if isinstance(out, (list, tuple)):
            self.calls.append((str(func), sum(t.numel() for t in out
                                               if isinstance(t, torch.Tensor))))
        return out


def _stepped(old: bool) -> tuple[list[torch.Tensor], list[tuple[str, int]]]:
    torch.manual_seed(0)
    params = [torch.randn(3, 5, requires_grad=True), torch.randn(7, requires_grad=True)]
    opt = torch.optim.Adam(params, lr=0.1, foreach=True)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # the state exists; the second step is the steady one
    ops = _Ops()
    ctx = adam_foreach_before_july_2023() if old else torch.no_grad()
    with ctx, ops:
        opt.step()
    return [p.detach().clone() for p in params], ops.calls


def test_the_old_adam_makes_one_more_parameter_sized_list_and_the_same_update() -> None:
    new_params, new_calls = _stepped(old=False)
    old_params, old_calls = _stepped(old=True)
    for a, b in zip(new_params, old_params, strict=True):
        assert torch.equal(a, b)
    # the out-of-place add of eps: 15 + 7 elements, the parameters' count, in the old step only
    made = [n for name, n in old_calls if name.startswith("aten._foreach_add.Scalar")]
    assert made == [22]
    assert not any(name.startswith("aten._foreach_add.Scalar") for name, _ in new_calls)
    # and the patch is gone afterwards
    assert torch._foreach_add_.__name__ == "_foreach_add_"


def test_which_records_ran_it() -> None:
    rec = {"optimizer": "adam", "software": {"torch": "2.1.0.dev20230623+cu118"}}
    assert two_adam_intermediates(rec)
    assert not two_adam_intermediates({**rec, "software": {"torch": "2.1.0"}})
    assert not two_adam_intermediates({**rec, "software": {"torch": None}})
    assert not two_adam_intermediates({**rec, "optimizer": "sgd"})
    # a record naming its own arguments (the 2022 Trainer's foreach=False) is left alone
    assert not two_adam_intermediates({**rec, "optimizer_kwargs": {"foreach": False}})
