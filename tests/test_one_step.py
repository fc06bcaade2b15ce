"""Issue 44 item 4: one training step. tilefit.loop's step run on real CPU tensors issues
the ops the tracer records for the same recipe, op for op, and holds the memory it
predicts (PyTorch's MemTracker on the real tensors: a second method); bench step runs that
step, so it measures what the estimate predicts, clipping, loss read and accumulation
included."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from torch import nn

from tilefit import Recipe, trace
from tilefit.bench.step import memtracker_peak_bytes
from tilefit.compat.fake import TorchDispatchMode
from tilefit.loop import Hooks, training_step
from tilefit.tracing.optimizers import make_optimizer


class _CountOps(TorchDispatchMode):
    """Every aten op the real step dispatches, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _mlp() -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    return model, (torch.randn(16, 64), torch.randint(0, 10, (16,)))


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


RECIPES = [
    Recipe(precision="fp32", optimizer="adamw", max_grad_norm=0.5, accumulation_steps=2,
           loss_sync=True),
    Recipe(precision="fp32", optimizer="sgd", zero_grad_to_none=False, accumulation_steps=3),
    Recipe(precision="fp32", optimizer="adamw", max_grad_norm=1.0),
]


@pytest.mark.parametrize("recipe", RECIPES, ids=["clip-read-acc2", "sgd-keep-acc3", "clip"])
def test_the_real_step_runs_the_ops_the_trace_records(recipe: Recipe) -> None:
    model, batch = _mlp()
    traced = trace(model, batch, recipe=recipe, gpu="cpu", loss_fn=_loss)
    # the steady step as the estimate costs it: each traced op times its repeats
    predicted: collections.Counter[str] = collections.Counter()
    for op in traced.ops_of_step(1):
        predicted[op.op] += traced.repeats_per_step(op)
    params = list(model.parameters())
    opt = make_optimizer(recipe.optimizer, params, foreach=False)  # the CPU's default
    training_step(lambda: _loss(model, batch), opt, params, recipe)  # lazy state
    counted = _CountOps()
    with counted:
        training_step(lambda: _loss(model, batch), opt, params, recipe)
    real = collections.Counter({op: n for op, n in counted.ops.items()
                                if not op.startswith("profiler.")})  # no kernels
    assert real == predicted


def test_clipping_on_the_cpu_holds_what_the_real_step_holds() -> None:
    # clip_grad_norm_ takes its foreach kernels on real CPU tensors; the CPU target traced
    # the per-tensor path before (predicted 261,976 B against a real 223,540 B)
    model, batch = _mlp()
    recipe = Recipe(precision="fp32", optimizer="adamw", max_grad_norm=0.5, loss_sync=True)
    predicted = trace(model, batch, recipe=recipe, gpu="cpu", loss_fn=_loss)
    params = list(model.parameters())
    opt = make_optimizer("adamw", params, foreach=False)
    real = memtracker_peak_bytes(model, opt, batch, lambda phase: training_step(
        lambda: _loss(model, batch), opt, params, recipe, hooks=Hooks(phase=phase)))
    assert predicted.peak(rounded=False)[0] == real


def test_bench_step_measures_accumulation_as_the_estimate_predicts() -> None:
    # bench step refused accumulation before; its step is now the estimate's, so a real CPU
    # step of two micro-batches holds the predicted peak to the byte
    from tilefit.bench.step import measure_step
    from tilefit.estimator.workload_estimate import estimate_workload
    from tilefit.hardware import get_device
    from tilefit.models import load_workload

    work = load_workload("gpt2", seq_len=8).with_config(num_hidden_layers=1, n_embd=64,
                                                         n_head=2, vocab_size=256)
    dev = get_device("cpu")
    recipe = Recipe.for_model(work, batch_size=2, precision="fp32", optimizer="sgd",
                              accumulation_steps=2).on(dev)
    measured = measure_step(work, recipe, "cpu", steps=1, warmup=1)
    assert measured.peak_memory_bytes == estimate_workload(work, recipe, dev).peak_memory_bytes


def test_calibration_times_each_phase_of_the_one_step() -> None:
    # calibration's host measurement runs tilefit.loop's step and reads its phases off the
    # phase hook: a forward that sleeps 40 ms and an optimizer step that sleeps 30 ms are
    # booked to the forward and optimizer issuers (no bound on the backward: the machine's
    # load stretches it)
    import time

    from tilefit.calibrate.host import _PhaseClock

    class SlowSGD(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            time.sleep(0.03)
            return super().step(closure)

    model, batch = _mlp()
    params = list(model.parameters())
    opt = SlowSGD(params, lr=0.1)

    def loss_of() -> torch.Tensor:
        time.sleep(0.04)
        return _loss(model, batch)

    clock = _PhaseClock("cpu")
    training_step(loss_of, opt, params, Recipe(precision="fp32"), hooks=Hooks(phase=clock.phase))
    spent = clock.spent_s()
    assert spent["forward"] >= 0.04 and spent["optimizer"] >= 0.03
    assert spent["backward"] > 0


def test_estimate_names_an_op_without_a_fake_kernel_as_the_simulation_does() -> None:
    # one error for both roads: the op, the module whose forward called it, the fix
    from tests.fixtures.extension_op import WithExtension

    import tilefit
    from tilefit.errors import TilefitError

    model = nn.Sequential(nn.Linear(16, 16), WithExtension())
    with pytest.raises(TilefitError) as err:
        tilefit.estimate(model, torch.randn(2, 16), loss_fn=lambda m, x: m(x).sum(),
                         gpu="a100-80gb", recipe=Recipe(precision="bf16-mixed"))
    assert "tilefit_tests::scaled_gelu in module '1'" in err.value.problem
    assert "register_fake('tilefit_tests::scaled_gelu')" in (err.value.fix or "")
