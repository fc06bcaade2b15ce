"""A user's own model that reads values while it is built, takes a sparse batch, or reads
values in its forward: traced where it can be, else an error that names the real cause and
where it is (issue 46, item 8)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.utils.parametrizations import orthogonal

from tilefit import Recipe, estimate, trace
from tilefit.errors import TilefitError
from tilefit.tracing.errors import raised_at


def _loss(m: nn.Module, batch: object) -> torch.Tensor:
    return m(batch).float().mean()


def _orthogonal() -> nn.Module:
    m = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    orthogonal(m[0])  # checks whether the weight is orthogonal already: a value read
    return m


def test_a_factory_that_reads_a_value_while_built_traces_and_says_so() -> None:
    x = torch.randn(8, 16)
    from_factory = trace(_orthogonal, x, loss_fn=_loss, recipe=Recipe(optimizer="sgd"))
    torch.manual_seed(0)
    instance = trace(_orthogonal(), x, loss_fn=_loss, recipe=Recipe(optimizer="sgd"))
    assert [n for n in from_factory.warnings if "while it was built" in n]
    # the same step: the factory's answer changed no shape
    assert [(o.op, o.input_shapes) for o in from_factory.ops] == \
        [(o.op, o.input_shapes) for o in instance.ops]


def test_an_integer_read_while_built_is_a_clear_error() -> None:
    class Sized(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            n = int(torch.tensor([3, 5]).max().item())  # a layer sized by a value
            self.lin = nn.Linear(n, n)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

    with pytest.raises(TilefitError) as err:
        trace(Sized, torch.randn(2, 5), loss_fn=_loss)
    assert "reads an integer from a tensor while it is built" in str(err.value)
    assert "pass the instance" in err.value.fix


class _GCN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 4)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        adj, x = batch
        return self.lin(torch.sparse.mm(adj, x))


def test_a_sparse_batch_traces_and_its_storages_are_counted() -> None:
    nnz, n = 5, 8
    adj = torch.sparse_coo_tensor(torch.tensor([[0, 1, 2, 3, 4], [1, 2, 0, 4, 3]]),
                                  torch.ones(nnz), (n, n))
    tr = trace(_GCN, (adj, torch.randn(n, 16)), loss_fn=_loss, gpu="cpu",
               recipe=Recipe(optimizer="sgd"))
    inputs = sum(s.nbytes for s in tr.storages if s.category == "inputs")
    # indices 2 x nnz int64, values nnz fp32, features n x 16 fp32
    assert inputs == 2 * nnz * 8 + nnz * 4 + n * 16 * 4


class _Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.out = nn.Linear(16, 1), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = (self.gate(x).squeeze(-1) > 0).nonzero()  # in the parent's own forward
        return self.out(x[keep[:, 0]])


def test_a_value_read_in_the_parents_forward_is_attributed_to_the_parent() -> None:
    with pytest.raises(TilefitError) as err:
        estimate(_Gated(), torch.randn(8, 16), loss_fn=_loss)
    assert "aten.nonzero.default in the forward of the model itself (_Gated)" in str(err.value)
    assert "'gate'" not in str(err.value)


def test_raised_at_skips_only_tilefits_own_folder(tmp_path: Path) -> None:
    # the user's code in a folder named "tilefit" (a clone into git's default folder name)
    path = tmp_path / "tilefit" / "user_model.py"
    code = compile("def boom():\n    raise ValueError('x')\n", str(path), "exec")
    scope: dict[str, object] = {}
    exec(code, scope)
    with pytest.raises(ValueError) as err:
        scope["boom"]()  # type: ignore[operator]
    assert raised_at(err.value) == "tilefit/user_model.py:2"


def test_layers_made_with_deepcopy_are_the_real_steps_memory() -> None:
    # as nn.TransformerEncoder builds its layers: deep copies of one layer; each copy's
    # weight.t() in the forward is a view, no new tensor (the copy keeps the fake mode)
    import copy

    from tilefit.bench.step import real_step_peak_bytes

    def build() -> nn.Module:
        layer = nn.Linear(256, 256)
        return nn.Sequential(*[copy.deepcopy(layer) for _ in range(8)])

    def make_opt(ps: object) -> torch.optim.Optimizer:
        return torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False)  # type: ignore[arg-type]

    x = torch.randn(16, 256)
    tr = trace(build, x, loss_fn=_loss, gpu="cpu", recipe=Recipe(optimizer=make_opt))
    assert not [o for o in tr.ops if o.op == "aten.t.default" and o.alloc_bytes]
    torch.manual_seed(0)
    model = build()
    real = real_step_peak_bytes(model, make_opt(model.parameters()), x, _loss)
    assert tr.peak(rounded=False)[0] == pytest.approx(real, rel=0.01)
