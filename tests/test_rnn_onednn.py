"""nn.LSTM on the CPU target is oneDNN's LSTM layer, aten::mkldnn_rnn_layer (issue 46): its
workspace, which the layer keeps for its backward, has the size the real op gives it, and a
training step's predicted peak is the real step's (PyTorch's MemTracker, a second method).
The real CPU op is the reference throughout (tracing.cpu_kernels)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from tilefit import Recipe, estimate, simulate
from tilefit.bench.step import real_step_peak_bytes
from tilefit.compat.fake import TorchDispatchMode, new_fake_mode
from tilefit.tracing.cpu_kernels import cpu_target_kernels, lstm_workspace_bytes, onednn_version

LAYER = torch.ops.aten.mkldnn_rnn_layer.default
pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="torch built without oneDNN")


def _real_workspace(seq: int, batch: int, inp: int, hidden: int, dtype: torch.dtype) -> int:
    """The real op's workspace bytes for one layer (time-major input, LSTM, training)."""
    x = torch.randn(seq, batch, inp, dtype=dtype)
    w_ih, w_hh = torch.randn(4 * hidden, inp, dtype=dtype), torch.randn(4 * hidden, hidden,
                                                                        dtype=dtype)
    b_ih, b_hh = torch.randn(4 * hidden, dtype=dtype), torch.randn(4 * hidden, dtype=dtype)
    h0, c0 = torch.zeros(batch, hidden, dtype=dtype), torch.zeros(batch, hidden, dtype=dtype)
    out = LAYER(x, w_ih, w_hh, b_ih, b_hh, h0, c0, False, [], 2, hidden, 1, True, False, False,
                True)
    assert out[3].dtype == torch.uint8
    return int(out[3].numel())


def _bf16_runs() -> bool:
    try:
        _real_workspace(2, 2, 2, 2, torch.bfloat16)
    except RuntimeError:
        return False
    return True


_rng = random.Random(46)
SHAPES = [(5, 3, 16, 32), (64, 8, 128, 256), (1, 1, 1, 1), (2, 7, 33, 255), (9, 2, 512, 64),
          (11, 13, 17, 19)] + [(_rng.randint(1, 40), _rng.randint(1, 20), _rng.randint(1, 600),
                                _rng.randint(1, 600)) for _ in range(12)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_workspace_formula_is_the_real_ops(dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and not _bf16_runs():
        pytest.skip("this CPU's oneDNN runs no bf16 LSTM")
    size = torch.finfo(dtype).bits // 8
    for seq, batch, inp, hidden in SHAPES:
        assert lstm_workspace_bytes(seq, batch, inp, hidden, state_bytes=size, cell_bytes=size,
                                    onednn=onednn_version()) == \
            _real_workspace(seq, batch, inp, hidden, dtype), (seq, batch, inp, hidden)


def test_the_workspace_by_hand() -> None:
    # LSTM(128, 256), 64 steps of 8, fp32, oneDNN 3.12: gates 64*8 x ld(1024 -> 1040, a
    # multiple of 256 gets one more cache line) x 4 B = 520 pages; ht 64*8 x 272 x 4 = 136;
    # layer states 2*65*8 x 272 x 4 = 276.25 -> 277; cell states 2*65*8 x 256 x 4 = 260; the
    # gradients of the layer and iteration states 277 each, of the cell states 260
    assert lstm_workspace_bytes(64, 8, 128, 256, state_bytes=4, cell_bytes=4) == \
        (520 + 136 + 277 + 260 + 277 + 277 + 260) * 4096
    # before oneDNN 3.9 the iteration states took two more regions as large as the layer's:
    # 5 x 3, LSTM(16, 32): 2 + 1 + 2 + 2 + 2 + 2 + 2 = 13 pages, then 2 + 2 more
    assert lstm_workspace_bytes(5, 3, 16, 32, state_bytes=4, cell_bytes=4) == 13 * 4096
    assert lstm_workspace_bytes(5, 3, 16, 32, state_bytes=4, cell_bytes=4,
                                onednn=(3, 7)) == 17 * 4096


class _Workspaces(TorchDispatchMode):
    """Each mkldnn_rnn_layer's workspace bytes (0 for none), as the op returns them."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is LAYER:
            self.nbytes.append(0 if out[3] is None else out[3].numel())
        return out


def _workspaces(build: Callable[[], nn.Module], shape: tuple[int, ...], *, fake: bool,
                autocast: bool = False, grad: bool = True) -> list[int]:
    torch.manual_seed(0)
    model, spy = build(), _Workspaces()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
            torch.set_grad_enabled(grad):
        if not fake:
            with spy:
                model(torch.randn(*shape))
            return spy.nbytes
        with cpu_target_kernels(), new_fake_mode() as mode:
            fake_model = build()
            x = mode.from_tensor(torch.randn(*shape))
            with spy:
                fake_model(x)
    return spy.nbytes


MODULES = {
    "2 layers": (lambda: nn.LSTM(16, 40, num_layers=2), (7, 3, 16)),
    "bidirectional": (lambda: nn.LSTM(24, 20, num_layers=2, bidirectional=True), (5, 4, 24)),
    "batch_first": (lambda: nn.LSTM(16, 36, batch_first=True), (6, 11, 16)),  # 6 x 11 steps
    "no bias": (lambda: nn.LSTM(10, 30, bias=False), (9, 2, 10)),
}


@pytest.mark.parametrize("name", list(MODULES))
def test_the_traced_layers_workspaces_are_the_real_ones(name: str) -> None:
    build, shape = MODULES[name]
    real = _workspaces(build, shape, fake=False)
    assert len(real) == {"2 layers": 2, "bidirectional": 4}.get(name, 1)
    assert _workspaces(build, shape, fake=True) == real


def test_under_autocast_bf16_and_without_grad_too() -> None:
    build, shape = MODULES["bidirectional"]
    if _bf16_runs():
        real = _workspaces(build, shape, fake=False, autocast=True)
        assert _workspaces(build, shape, fake=True, autocast=True) == real
        assert real != _workspaces(build, shape, fake=False)  # bf16 states: smaller
    # no grad, no workspace; the fake-tensor cache must not answer one mode with the other
    assert _workspaces(build, shape, fake=False, grad=False) == [0] * 4
    assert _workspaces(build, shape, fake=True, grad=False) == [0] * 4
    assert _workspaces(build, shape, fake=True) == _workspaces(build, shape, fake=False)


def test_outside_the_block_torchs_meta_kernel_is_back() -> None:
    build, shape = MODULES["2 layers"]
    assert _workspaces(build, shape, fake=True)[0] > 0
    with new_fake_mode() as mode:
        spy, model = _Workspaces(), build()
        with spy:
            model(mode.from_tensor(torch.randn(*shape)))
    assert spy.nbytes == [0, 0]  # torch's own: an empty workspace


class _Net(nn.Module):
    def __init__(self, bidirectional: bool) -> None:
        super().__init__()
        self.lstm = nn.LSTM(128, 256, num_layers=2, bidirectional=bidirectional)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0]  # type: ignore[no-any-return]


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


@pytest.mark.parametrize("bidirectional", [False, True], ids=["lstm", "bidirectional"])
def test_the_predicted_peak_is_the_real_steps(bidirectional: bool) -> None:
    # 2-layer LSTM(128, 256), 64 steps of batch 8, fp32, SGD with momentum; before the
    # workspace the prediction was 12,693,512 B against 28,360,712 (-55%), and 31,404,040
    # against 67,018,760 bidirectional (-53%)
    torch.manual_seed(0)
    x = torch.randn(64, 8, 128)
    est = estimate(_Net(bidirectional), x, gpu="cpu", loss_fn=_loss,
                   recipe=Recipe(batch_size=8, precision="fp32", optimizer="sgd"))
    model = _Net(bidirectional)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    assert est.peak_memory_bytes == real_step_peak_bytes(model, opt, x, _loss)


def test_a_simulated_cpu_loop_has_the_real_peak() -> None:
    def run() -> None:
        torch.manual_seed(0)
        model = nn.LSTM(32, 64, num_layers=2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
        for _ in range(3):
            loss = model(torch.randn(20, 4, 32))[0].square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()

    with simulate(gpu="cpu", steps=2) as sim:
        run()
    torch.manual_seed(0)
    model = nn.LSTM(32, 64, num_layers=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    real = real_step_peak_bytes(model, opt, torch.randn(20, 4, 32),
                                lambda m, x: m(x)[0].square().mean())
    assert sim.result.peak_memory_bytes == real
