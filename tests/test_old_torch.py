"""The corpus benchmarks trace a record with the tensors its PyTorch held that the installed
one frees (benchmarks/old_torch.py): foreach Adam's second parameter-sized list before July
2023 (``adam_foreach_before_july_2023``: the same update, plus the list that version made,
``denom = torch._foreach_add(exp_avg_sq_sqrt, eps)``, held until the function returned;
pytorch/pytorch issue #97712), and softmax's input before 1.11 (``softmax_saving_input``:
the same values and gradients, the input alive until the softmax's backward has run;
pytorch PR #65242). A record's PyTorch is the stated one, else the release current at its
date."""

from __future__ import annotations

import functools
import gc
import sys
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from packaging.version import Version
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from old_torch import (
    adam_foreach_before_july_2023,
    softmax_saves_input,
    softmax_saving_input,
    torch_of,
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


def test_a_records_torch_is_the_stated_one_else_the_release_of_its_day() -> None:
    dated = {"software": {"torch": None}, "source": {"date": "2022-01-11"}}
    assert torch_of(dated) == Version("1.10.0")  # 1.10.0: 2021-10-21, 1.11.0: 2022-03-10
    assert torch_of({**dated, "source": {"date": "2022-03-10"}}) == Version("1.11.0")
    assert torch_of({**dated, "source": {"date": "2023-07-20"}}) == Version("2.0.0")
    assert torch_of({**dated, "software": {"torch": "2.1.0.dev20230623+cu118"}}) \
        == Version("2.1.0.dev20230623+cu118")
    assert torch_of({"software": {"torch": None}, "source": {}}) is None
    assert torch_of({**dated, "source": {"date": "2019-05-01"}}) is None  # before 1.6.0
    assert softmax_saves_input(dated)
    assert not softmax_saves_input({**dated, "source": {"date": "2022-06-01"}})
    assert not softmax_saves_input({**dated, "software": {"torch": "2.1.0.dev20230623"}})
    # an Adam record without a stated version, dated before 2.1.0's release
    assert two_adam_intermediates({**dated, "optimizer": "adam",
                                   "source": {"date": "2023-07-20"}})


def _softmax_of_a_temporary(x: torch.Tensor) -> tuple[torch.Tensor, Any, bool]:
    """softmax(x * 2): the result, a weak reference to the temporary x * 2, and whether the
    temporary was still alive once the forward dropped it."""
    scores = x * 2.0
    alive = weakref.ref(scores)
    probs = F.softmax(scores, dim=-1)
    del scores
    gc.collect()
    return probs, alive, alive() is not None


def _softmax_step(old: bool, out: list[Any]) -> torch.Tensor:
    """A softmax over an intermediate; ``out`` gets whether the intermediate was alive after
    the forward and after the backward."""
    torch.manual_seed(0)
    x = torch.randn(3, 5, requires_grad=True)
    ctx = softmax_saving_input() if old else torch.enable_grad()
    with ctx:
        probs, alive, held = _softmax_of_a_temporary(x)
        out.append(held)
        (probs * torch.arange(5.0)).sum().backward()
        del probs
        gc.collect()
        out.append(alive() is not None)
    assert x.grad is not None
    return x.grad


def test_old_softmax_holds_its_input_until_its_backward_and_changes_nothing_else() -> None:
    new_life: list[Any] = []
    old_life: list[Any] = []
    new_grad = _softmax_step(False, new_life)
    old_grad = _softmax_step(True, old_life)
    assert torch.equal(new_grad, old_grad)
    assert new_life == [False, False]  # 2.13: SoftmaxBackward0 saves the result only
    assert old_life == [True, False]   # before 1.11: the input too, released by the backward


def test_old_cross_entropy_is_atens_and_holds_the_logits() -> None:
    torch.manual_seed(0)
    w = torch.randn(4, 3, requires_grad=True)
    target = torch.tensor([0, 2, 1, 2, 0])
    x = torch.randn(5, 4)
    want = F.cross_entropy(x @ w, target, ignore_index=1)
    want.backward()
    want_grad, w.grad = w.grad, None
    with softmax_saving_input():
        logits = x @ w
        alive = weakref.ref(logits)
        got = F.cross_entropy(logits, target, ignore_index=1)
        del logits
        gc.collect()
        held = alive() is not None
        got.backward()
    assert held and torch.allclose(got, want) and torch.allclose(w.grad, want_grad)


def test_old_softmax_holds_nothing_inside_a_checkpointed_forward() -> None:
    life: list[bool] = []

    def block(x: torch.Tensor) -> torch.Tensor:
        probs, _, held = _softmax_of_a_temporary(x)
        life.append(held)
        return probs

    x = torch.randn(3, 5, requires_grad=True)
    with softmax_saving_input():
        y = checkpoint(block, x, use_reentrant=False)
        assert life == [False]  # the checkpoint's pack hook drops what autograd saves
        y.sum().backward()


def test_a_traced_bert_holds_one_score_tensor_per_layer_more() -> None:
    """BERT with eager attention, fp32: the old softmax's held inputs are the masked scores,
    batch x heads x seq x seq fp32 per layer, all alive at the allocated peak (the start of
    the backward): 2 layers x 4 x 4 x 512 x 512 x 4 bytes = 32 MiB more, by hand."""
    from tilefit.estimator import estimate_recipe
    from tilefit.hardware import get_device
    from tilefit.models import load_workload
    from tilefit.recipe import Recipe

    device = get_device("v100-16gb")
    work = load_workload("bert-large-uncased", task="seq-cls", seq_len=512).with_config(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=256)
    recipe = Recipe(batch_size=4, precision="fp32", attention="eager",
                    optimizer=functools.partial(torch.optim.AdamW, foreach=False)).on(device)
    new = estimate_recipe(work, None, recipe, device)
    with softmax_saving_input():
        old = estimate_recipe(work, None, recipe, device)
    assert old.peak_memory_bytes - new.peak_memory_bytes == 2 * 4 * 4 * 512 * 512 * 4
