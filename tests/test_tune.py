"""tune on the CPU with a simulated memory limit: exact max, OOM safety, bit-exact restore."""

from __future__ import annotations

import copy
import dataclasses
import json
import random
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from tilefit.errors import TilefitError
from tilefit.tuning import TuneResult, TuneSearch, tune
from tilefit.tuning.executor import is_oom
from tilefit.tuning.simulate import OOM_ERROR, MemoryLimitMode
from tilefit.tuning.state import restore, snapshot

LIMIT_BYTES = 400_000


class Net(nn.Module):
    """An MLP with BatchNorm (buffers incl. num_batches_tracked), Dropout (RNG), a frozen
    layer (requires_grad False) and a submodule left in eval mode (the trials run it in train
    mode, and its mode must come back). The batch norm sees 48 channels of 2 values per
    sample, so that it trains at batch 1 too (one value per channel cannot)."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.body = nn.Sequential(nn.Linear(16, 96), nn.Unflatten(1, (48, 2)),
                                  nn.BatchNorm1d(48), nn.ReLU(), nn.Dropout(0.2), nn.Flatten(),
                                  nn.Linear(96, 4))
        self.body[2].eval()  # a mode that must survive

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.frozen(x))


def make_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, 16), torch.randint(0, 4, (b,))


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def fresh() -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    # one real step so the optimizer has state (exp_avg, step counts) and params have grads
    loss_fn(model, make_batch(8)).backward()
    opt.step()
    loss_fn(model, make_batch(8)).backward()  # leave gradients in place
    return model, opt


def state_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "grads": {n: None if p.grad is None else p.grad.clone()
                  for n, p in model.named_parameters()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "modes": {n: m.training for n, m in model.named_modules()},
        "opt": copy.deepcopy(opt.state_dict()),
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": np.random.get_state(),
        "python_rng": random.getstate(),
    }


def assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    for key in ("params", "buffers"):
        assert before[key].keys() == after[key].keys()
        for name in before[key]:
            assert torch.equal(before[key][name], after[key][name]), (key, name)
    for name, g in before["grads"].items():
        h = after["grads"][name]
        assert (g is None and h is None) or torch.equal(g, h), name
    assert before["requires_grad"] == after["requires_grad"]
    assert before["modes"] == after["modes"]
    o1, o2 = before["opt"], after["opt"]
    assert o1["param_groups"] == o2["param_groups"]
    assert o1["state"].keys() == o2["state"].keys()
    for pid, s in o1["state"].items():
        assert s.keys() == o2["state"][pid].keys()
        for k, v in s.items():
            assert torch.equal(v, o2["state"][pid][k]), (pid, k)
    assert torch.equal(before["torch_rng"], after["torch_rng"])
    n1, n2 = before["numpy_rng"], after["numpy_rng"]
    assert n1[0] == n2[0] and np.array_equal(n1[1], n2[1]) and n1[2:] == n2[2:]
    assert before["python_rng"] == after["python_rng"]


def fits_directly(b: int, limit_bytes: int, budget_bytes: int) -> bool:
    """A second way to answer "does b fit?": two plain steps on a deep copy, in our own loop."""
    model, opt = fresh()  # seeded: the same weights, gradients and optimizer state
    model.train()  # as tune's trials run it
    live = [*model.parameters(), *model.buffers(),
            *(p.grad for p in model.parameters() if p.grad is not None),
            *(v for s in opt.state.values() for v in s.values())]
    mode = MemoryLimitMode(limit_bytes, live)
    try:
        with mode:
            for _ in range(2):
                batch = make_batch(b)  # held through backward, as a training loop holds it
                loss_fn(model, batch).backward()
                del batch
                opt.step()
                opt.zero_grad(set_to_none=True)
    except OOM_ERROR:
        return False
    return mode.peak_bytes <= budget_bytes


def test_memory_limit_mode_counts_storages_once() -> None:
    with MemoryLimitMode(None) as mode:
        a = torch.empty(1000)  # 1000 * 4 B = 4000 B
        view = a[10:]  # same storage: not counted again
        b = a.add_(1)  # in place: same storage
        assert mode.live_bytes == 4000
        c = torch.empty(250, dtype=torch.float64)  # 250 * 8 = 2000 B
        assert mode.live_bytes == 6000
        del a, view, b
        assert mode.live_bytes == 2000  # freed when the last reference went
        del c
    assert mode.peak_bytes == 6000 and mode.live_bytes == 0


def test_memory_limit_mode_raises_a_real_oom() -> None:
    with pytest.raises(OOM_ERROR) as info, MemoryLimitMode(10_000):
        keep = [torch.empty(1000) for _ in range(3)]  # 4000 B each: the 3rd makes 12000
        del keep
    assert is_oom(info.value)
    assert is_oom(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_oom(RuntimeError("shape mismatch"))


def test_tune_finds_exact_max_and_restores_state() -> None:
    model, opt = fresh()
    before = state_of(model, opt)
    result = tune(model, make_batch, loss_fn=loss_fn, optimizer=opt,
                  search=TuneSearch(memory_limit_bytes=LIMIT_BYTES, margin=0.1,
                                    measure_throughput=False))
    assert isinstance(result, TuneResult)
    assert_same(before, state_of(model, opt))
    budget = int(LIMIT_BYTES * 0.9)  # 360000
    assert result.budget_bytes == budget
    best = result.max_fitting_batch_size
    assert best > 8
    # checked by a second method: our own two-step loop under the same simulated device
    assert fits_directly(best, LIMIT_BYTES, budget)
    assert not fits_directly(best + 1, LIMIT_BYTES, budget)
    fit_trials = [t for t in result.trials if t.kind == "fit"]
    lightning_bound = 2 * best.bit_length()  # doubling to 2^k > best, bisecting 2^(k-1)
    assert len(fit_trials) < lightning_bound
    assert result.batch_size == result.candidates[-1] == best  # untimed: the largest
    assert result.accumulation_steps == 1 and result.samples_per_s is None
    assert result.fit_trials == len(fit_trials)
    d = result.to_dict()
    assert d["batch_size"] == result.batch_size and isinstance(d["trials"], list)
    # --json: each trial under the keys it always had, with the typed trial's values
    assert [set(t) for t in d["trials"]] == [
        {"kind", "batch_size", "fits", "samples_per_s", "peak_memory_bytes", "time_s"}
    ] * len(result.trials)
    assert [(t["kind"], t["batch_size"], t["fits"], t["peak_memory_bytes"])
            for t in d["trials"]] == [(t.kind, t.batch_size, t.fits, t.peak_memory_bytes)
                                      for t in result.trials]
    json.dumps(d)  # plain JSON, nothing typed left in it


def test_the_throughput_plot_draws_the_typed_trials(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tilefit.report.plots import plot_throughput
    from tilefit.tuning.executor import Trial
    from tilefit.tuning.tuner import TuneResult

    trials = (Trial("fit", 16, True, None, 1000, 0.1),
              Trial("throughput", 4, True, 40.0, None, 0.2),
              Trial("throughput", 8, True, 64.0, None, 0.2))
    result = TuneResult(batch_size=8, max_fitting_batch_size=16, accumulation_steps=1,
                        samples_per_s=64.0, trials=trials)
    assert result.fit_trials == 1
    out = plot_throughput(result, tmp_path / "tune.png")
    assert out == tmp_path / "tune.png" and out.read_bytes()[:4] == b"\x89PNG"


def test_global_batch_is_kept_exact_and_prediction_is_first_probe() -> None:
    model, opt = fresh()
    before = state_of(model, opt)
    result = tune(model, make_batch, loss_fn=loss_fn, optimizer=opt,
                  search=TuneSearch(memory_limit_bytes=LIMIT_BYTES, global_batch=32,
                                    max_batch=20, predicted_max_batch=20))
    assert_same(before, state_of(model, opt))  # timing steps restored too
    assert result.trials[0].batch_size == 20 and result.trials[0].kind == "fit"
    assert result.max_fitting_batch_size == 20  # capped: 20 fits far below the limit
    # divisors of 32 up to 20: 1 2 4 8 16, all powers of two
    assert result.candidates == (1, 2, 4, 8, 16)
    timed = [t for t in result.trials if t.kind == "throughput"]
    assert [t.batch_size for t in timed] == [1, 2, 4, 8, 16]
    assert all(t.samples_per_s is not None and t.samples_per_s > 0 for t in timed)
    assert result.samples_per_s == max(  # the chosen size's score is its fastest repeat
        t.samples_per_s for t in timed if t.batch_size == result.batch_size)
    assert 32 % result.batch_size == 0
    assert result.batch_size * result.accumulation_steps == 32


class Interrupt(Exception):
    pass


@pytest.mark.parametrize("error", [KeyboardInterrupt, Interrupt])
def test_interrupted_mid_trial_restores_everything(error: type[BaseException]) -> None:
    model, opt = fresh()
    before = state_of(model, opt)
    calls = {"n": 0}

    def interrupting_batch(b: int) -> Any:
        calls["n"] += 1
        if calls["n"] == 4:  # second trial, second step: weights and state already changed
            raise error()
        return make_batch(b)

    with pytest.raises(error):
        tune(model, interrupting_batch, loss_fn=loss_fn, optimizer=opt,
             search=TuneSearch(memory_limit_bytes=LIMIT_BYTES))
    assert calls["n"] == 4
    assert_same(before, state_of(model, opt))


def test_optimizer_factory_and_dict_batches_with_default_loss() -> None:
    class HFLike(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> Any:
            return {"loss": nn.functional.cross_entropy(self.lin(x), labels)}

    model = HFLike()
    result = tune(model, lambda b: {"x": torch.randn(b, 8), "labels": torch.zeros(b).long()},
                  optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                  search=TuneSearch(max_batch=24, measure_throughput=False))
    # no memory limit on the CPU: the cap 24 is the answer; 2, 4, 8, 16, 24
    assert result.max_fitting_batch_size == 24
    assert [t.batch_size for t in result.trials] == [2, 4, 8, 16, 24]


def test_clear_errors() -> None:
    model, opt = fresh()
    with pytest.raises(TilefitError, match="loss_fn"):
        tune(model, make_batch, optimizer=opt, search=TuneSearch(memory_limit_bytes=LIMIT_BYTES))
    with pytest.raises(TilefitError, match="memory limit or a largest batch"):
        tune(model, make_batch, loss_fn=loss_fn, optimizer=opt)
    with pytest.raises(TilefitError, match="persistent state alone"):
        tune(model, make_batch, loss_fn=loss_fn, optimizer=opt,
             search=TuneSearch(memory_limit_bytes=20_000))
    with pytest.raises(TilefitError, match="positive whole number"):
        TuneSearch(max_batch=0)
    with pytest.raises(TilefitError, match=r"margin must be a fraction in \[0, 1\)"):
        TuneSearch(margin=1.0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_memory_is_given_back() -> None:
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    result = tune(model, lambda b: (torch.randn(b, 256, device="cuda"),
                                    torch.randint(0, 10, (b,), device="cuda")),
                  loss_fn=loss_fn, optimizer=opt, device="cuda",
                  search=TuneSearch(max_batch=4096))
    assert result.max_fitting_batch_size == 4096
    assert torch.cuda.memory_allocated() <= before


def test_tilefit_tune_stays_the_function_after_the_package_is_imported() -> None:
    import tilefit
    import tilefit.tuning.search  # the package is tilefit.tuning: tilefit.tune stays the function

    model = nn.Linear(4, 2)
    result = tilefit.tune(model, lambda b: (torch.randn(b, 4), torch.zeros(b).long()),
                          loss_fn=loss_fn_linear, optimizer=torch.optim.SGD(model.parameters()),
                          search=tilefit.TuneSearch(max_batch=3, measure_throughput=False))
    assert result.max_fitting_batch_size == 3  # 2 fits, 4 > cap -> 3 (the cap) fits
    assert [t.batch_size for t in result.trials] == [2, 3]


def loss_fn_linear(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def test_the_estimators_prediction_starts_the_search_next_to_the_exact_maximum() -> None:
    # The simulated device counts live tensor bytes, as the tracer does: the prediction from
    # fake-tensor traces lands within 1% of the exact maximum, and the search confirms it in
    # fewer real trials than a search started from batch 2.
    from tests.fixtures.tiny_models import mlp

    def loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return model(batch).mean()

    model = mlp()
    search = TuneSearch(memory_limit_bytes=4_000_000, measure_throughput=False)
    with_pred = tune(model, lambda b: torch.randn(b, 32), loss_fn=loss,
                     optimizer=torch.optim.AdamW(model.parameters()), search=search)
    without = tune(model, lambda b: torch.randn(b, 32), loss_fn=loss,
                   optimizer=torch.optim.AdamW(model.parameters()),
                   search=dataclasses.replace(search, predict=False))
    exact = without.max_fitting_batch_size
    assert with_pred.max_fitting_batch_size == exact
    assert abs(with_pred.predicted_max_batch - exact) <= 0.01 * exact
    assert with_pred.fit_trials < without.fit_trials


class HostRead(nn.Module):
    """A step that reads a value back to the host (``float(tensor)``): it runs on real
    tensors, but a fake tensor has no value, so the estimator cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y / float(y.detach().abs().max() + 1)


def test_a_prediction_that_cannot_run_is_said_in_the_notes() -> None:
    torch.manual_seed(0)
    model = HostRead()

    def run(**kwargs: Any) -> TuneResult:
        return tune(model, lambda b: torch.randn(b, 32), loss_fn=lambda m, x: m(x).mean(),
                    optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                    search=TuneSearch(measure_throughput=False, **kwargs))

    untraceable = run(memory_limit_bytes=200_000)
    (note,) = untraceable.notes
    assert note.startswith("the estimator's prediction of the largest batch was skipped: the "
                           "step could not be traced on fake tensors: ")
    assert "aten._local_scalar_dense" in note  # the op float() runs, named by the tracer
    assert note.endswith("; the search began at batch 2 instead")
    assert untraceable.predicted_max_batch is None and untraceable.trials[0].batch_size == 2
    assert untraceable.to_dict()["notes"] == [note]
    # without a prediction asked for, nothing was skipped: no note, and the same search
    asked = run(memory_limit_bytes=200_000, predict=False)
    def probes(result: TuneResult) -> list[tuple[int, bool]]:
        return [(t.batch_size, t.fits) for t in result.trials]

    assert asked.notes == () and probes(asked) == probes(untraceable)
    # on the CPU without a memory limit there is no budget to predict against
    (unbounded,) = run(max_batch=8).notes
    assert unbounded == ("the estimator's prediction of the largest batch was skipped: there "
                         "is no memory budget to predict against (the CPU without a memory "
                         "limit); the search began at batch 2 instead")


class Scale(nn.Module):
    """loss = sum(x * w) for x of shape (b, 64): memory small enough to count by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.w).sum()


def test_the_users_dataset_at_rest_is_not_charged_to_the_device() -> None:
    # By hand, fp32, 64 features (256 B a row), SGD without momentum (no optimizer state).
    # The backward's peak holds w (256 B), its gradient being reduced (256 B), the batch x
    # (256 b B, the device's copy of data[:b]), grad * x (256 b B, before the sum over the
    # batch), the loss and the ones it starts from (4 B each): 520 + 512 b bytes. The forward
    # holds x, x * w and the previous loss, less. Under 6764 B the largest b is 12 (6664 B;
    # 13 needs 7176 B), whatever the size of the dataset the batch is sliced from: the
    # dataset (64 KiB to 16 MiB here, each over the limit) stays on the host.
    limit_bytes = 6764
    expected_peak_bytes = 520 + 512 * 12
    answers = []
    for rows in (256, 4096, 65536):
        data = torch.randn(rows, 64)
        model = Scale()
        result = tune(model, lambda b, data=data: data[:b], loss_fn=lambda m, x: m(x),
                      optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                      search=TuneSearch(memory_limit_bytes=limit_bytes, margin=0,
                                        measure_throughput=False))
        fit = {t.batch_size: t for t in result.trials if t.kind == "fit"}
        assert fit[12].fits and fit[12].peak_memory_bytes == expected_peak_bytes
        answers.append(result.max_fitting_batch_size)
    # a second method: batches made fresh on the "device" (no dataset at all)
    fresh_result = tune(Scale(), lambda b: torch.randn(b, 64), loss_fn=lambda m, x: m(x),
                        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                        search=TuneSearch(memory_limit_bytes=limit_bytes, margin=0,
                                          measure_throughput=False))
    assert answers == [12, 12, 12] == [fresh_result.max_fitting_batch_size] * 3


def test_views_of_memory_the_device_does_not_hold_are_not_counted() -> None:
    host = torch.zeros(1000)  # 4000 B made before the mode: the user's data at rest
    with MemoryLimitMode(None) as mode:
        view = host[:10]  # a view of the host tensor: nothing allocated
        host.add_(1)  # in place on the host tensor: nothing allocated
        assert mode.live_bytes == 0
        copy = mode.device_copy({"x": view, "n": 3})  # the device's copy: 10 * 4 = 40 B
        assert mode.live_bytes == 40 and copy["n"] == 3 and torch.equal(copy["x"], view)
        assert mode.device_copy(copy)["x"] is copy["x"]  # already on the device: kept
        del copy
        assert mode.live_bytes == 0


class Pretrained(nn.Module):
    """Two dropouts between linear layers; put in eval mode as from_pretrained leaves it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5), nn.ReLU(),
                                 nn.Linear(64, 64), nn.Dropout(0.5), nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def pretrained() -> Pretrained:
    torch.manual_seed(0)
    return Pretrained().eval()


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def own_loop_fits(b: int, train: bool, limit_bytes: int) -> bool:
    """A second method: two steps in our own loop, in the mode given, under the same cap."""
    model = pretrained().train(train)
    opt = sgd(model.parameters())
    mode = MemoryLimitMode(limit_bytes, [*model.parameters(), *model.buffers()])
    try:
        with mode:
            for _ in range(2):
                batch = make_batch_64(b)
                loss_fn(model, batch).backward()
                del batch
                opt.step()
                opt.zero_grad(set_to_none=True)
    except OOM_ERROR:
        return False
    return True


def make_batch_64(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, 64), torch.randint(0, 4, (b,))


def largest(fits: Any) -> int:
    """The largest b with fits(b), for a monotone fits: doubling, then bisection."""
    lo, hi = 0, 1
    while fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:  # lo fits, hi does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def test_trials_run_in_train_mode_and_the_modes_come_back() -> None:
    limit_bytes = 90_000
    model = pretrained()
    seen: list[bool] = []  # the mode each dropout ran in, whoever called it
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.register_forward_pre_hook(lambda mod, args: seen.append(mod.training))
    result = tune(model, make_batch_64, loss_fn=loss_fn, optimizer=sgd,
                  search=TuneSearch(memory_limit_bytes=limit_bytes, margin=0,
                                    measure_throughput=False))
    assert seen and all(seen)  # dropout on in every trial
    assert not any(m.training for m in model.modules())  # eval again, every module
    in_train = largest(lambda b: own_loop_fits(b, True, limit_bytes))
    in_eval = largest(lambda b: own_loop_fits(b, False, limit_bytes))
    # dropout's outputs and masks cost memory only in training: measuring in eval mode would
    # choose a batch that runs out of memory once training starts
    assert in_train < in_eval
    assert result.max_fitting_batch_size == in_train
    assert own_loop_fits(result.batch_size, True, limit_bytes)


class Metered(nn.Module):
    """A classifier whose forward updates a torchmetrics Metric and plain Python state: a
    counter, a list it appends to, a dict, a tensor attribute changed in place, and an
    attribute it adds on its first call."""

    def __init__(self) -> None:
        super().__init__()
        import torchmetrics

        self.lin = nn.Linear(16, 4)
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=4)
        self.calls = 0
        self.seen: list[int] = []
        self.stats: dict[str, Any] = {"batches": 0}
        self.total = torch.zeros(())

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.lin(x)
        self.accuracy.update(logits.detach(), y)
        self.calls += 1
        self.seen.append(x.shape[0])
        self.stats["batches"] += 1
        self.total += x.shape[0]
        if not hasattr(self, "first_batch"):
            self.first_batch = x.shape[0]
        return nn.functional.cross_entropy(logits, y)


def same_value(a: Any, b: Any) -> bool:
    """Equal as data: tensors by value, containers item by item, modules by their own
    attributes; callables and other objects are not compared here (deepcopy copies them)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, nn.Module):
        return type(a) is type(b)  # compared module by module by the caller
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            same_value(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(
            same_value(x, y) for x, y in zip(a, b, strict=True))
    if a is None or isinstance(a, bool | int | float | str | torch.device | torch.dtype):
        return a == b
    return True


def test_every_modules_own_state_is_restored_as_deepcopy_sees_it() -> None:
    torch.manual_seed(0)
    model = Metered()
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    model(x, y)  # the user's own step before tuning: the metric holds one update
    accuracy_before = model.accuracy.compute()  # caches _computed, which must come back too
    before = copy.deepcopy(model)
    counts = []

    def loss(m: Metered, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        out = m(**batch)
        counts.append(m.accuracy._update_count)  # during the trial
        return out

    tune(model, lambda b: {"x": torch.randn(b, 16), "y": torch.randint(0, 4, (b,))},
         loss_fn=loss, optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
         search=TuneSearch(memory_limit_bytes=200_000, max_batch=64, predicted_max_batch=64))
    # the trials did update the metric (two steps per fit trial, timed steps after), and
    # none of it is left
    assert max(counts) > 1
    assert model.accuracy._update_count == before.accuracy._update_count == 1
    assert torch.equal(model.accuracy.compute(), accuracy_before)
    assert (model.calls, model.seen, model.stats) == (1, [8], {"batches": 1})
    assert model.total.item() == 8 and model.first_batch == 8
    for (name, m), (_, ref) in zip(model.named_modules(), before.named_modules(), strict=True):
        assert vars(m).keys() == vars(ref).keys(), name
        for key, value in vars(m).items():
            assert same_value(value, vars(ref)[key]), (name, key)


def test_attributes_outside_the_containers_followed_are_kept_by_reference() -> None:
    class Holder:
        def __init__(self) -> None:
            self.hits = 0

    model = nn.Linear(4, 2)
    holder = Holder()
    model.holder = holder  # an arbitrary object: bound back by reference, not rolled back
    model.nested = [[{"t": torch.ones(2)}]]
    snap = snapshot(model, None)
    holder.hits += 1
    model.nested[0][0]["t"].add_(1)
    model.nested[0].append("new")
    model.holder = None
    restore(snap)
    assert model.holder is holder and holder.hits == 1  # out of scope, as documented
    assert model.nested == [[{"t": model.nested[0][0]["t"]}]]
    assert torch.equal(model.nested[0][0]["t"], torch.ones(2))


# nn.Linear(256, 256) trained with AdamW, by hand: 256 * 256 + 256 = 65,792 fp32 parameters,
# 263,168 B; gradients the same; AdamW keeps exp_avg and exp_avg_sq (2 x 263,168 B) and a
# 4-byte fp32 step count per parameter tensor (2): 526,344 B. Together 1,052,680 B.
LINEAR_PARAMS_BYTES = (256 * 256 + 256) * 4
LINEAR_ADAMW_BYTES = 2 * LINEAR_PARAMS_BYTES + 2 * 4
LINEAR_STATE_BYTES = 2 * LINEAR_PARAMS_BYTES + LINEAR_ADAMW_BYTES
assert (LINEAR_PARAMS_BYTES, LINEAR_ADAMW_BYTES, LINEAR_STATE_BYTES) == (
    263_168, 526_344, 1_052_680)


def linear_sum(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).sum()


@pytest.mark.parametrize("user_optimizer", [False, True])
def test_a_cap_below_the_persistent_state_says_so_in_gib(user_optimizer: bool) -> None:
    torch.manual_seed(0)
    model = nn.Linear(256, 256)
    optimizer: Any = lambda params: torch.optim.AdamW(params)  # noqa: E731
    source = "traced"  # a factory's optimizer has no state before the first step
    if user_optimizer:
        optimizer = torch.optim.AdamW(model.parameters())
        linear_sum(model, torch.randn(2, 256)).backward()
        optimizer.step()  # the state exists: it is measured
        source = "measured"
    with pytest.raises(TilefitError) as info:
        tune(model, lambda b: torch.randn(b, 256), loss_fn=linear_sum, optimizer=optimizer,
             search=TuneSearch(memory_limit_bytes=1_000_000, margin=0,
                               measure_throughput=False))
    err = info.value
    assert err.problem == ("the model's persistent state alone, 0.00098 GiB (1,052,680 B), "
                           "exceeds the memory budget of 0.00093 GiB (1,000,000 B): no batch "
                           "can fit")
    assert pytest.approx(0.00098, abs=5e-6) == LINEAR_STATE_BYTES / 2**30
    p, a, total = LINEAR_PARAMS_BYTES, LINEAR_ADAMW_BYTES, LINEAR_STATE_BYTES
    assert err.given == (
        f"parameters and buffers 0.00025 GiB ({p:,} B) + gradients 0.00025 GiB ({p:,} B) "
        f"+ optimizer state 0.00049 GiB ({a:,} B) ({source}) = 0.00098 GiB ({total:,} B)")
    assert "batch size 1 ran out of memory" not in str(err)
    assert "tilefit plan MODEL --gpu GPU" in err.fix


def test_a_cap_above_the_state_but_below_batch_1_says_what_is_left() -> None:
    # 100,000 B left over the state: AdamW's step alone needs more (its denominator
    # sqrt(exp_avg_sq) is a temporary the size of the weight, 256 * 256 * 4 = 262,144 B)
    limit_bytes = LINEAR_STATE_BYTES + 100_000
    with pytest.raises(TilefitError) as info:
        tune(nn.Linear(256, 256), lambda b: torch.randn(b, 256), loss_fn=linear_sum,
             optimizer=lambda params: torch.optim.AdamW(params),
             search=TuneSearch(memory_limit_bytes=limit_bytes, margin=0,
                               measure_throughput=False))
    err = info.value
    assert err.problem == "not even a batch of 1 fits in the memory budget"
    assert "= 0.00098 GiB (1,052,680 B), leaving 9.3e-05 GiB (100,000 B)" in err.given


def test_the_plan_command_the_errors_name_parses() -> None:
    import typer

    from tilefit.cli.app import app
    from tilefit.tuning.tuner import PLAN_COMMAND

    words = PLAN_COMMAND.split()
    assert words[:2] == ["tilefit", "plan"]
    args = [{"MODEL": "gpt2", "GPU": "a100-80gb", "N": "32"}.get(w, w) for w in words[2:]]
    plan = typer.main.get_command(app).commands["plan"]
    ctx = plan.make_context("plan", args)  # raises on a missing or unknown option
    assert ctx.params["model"] == "gpt2" and ctx.params["global_batch"] == 32
    assert ctx.params["allow_peft"] and ctx.params["allow_optimizer_change"]


def test_the_first_probe_on_a_gpu_counts_what_the_allocator_reserves() -> None:
    """On a GPU the first probe is the batch whose reserved memory meets the budget: the
    traced step plus the caching allocator's excess. A step whose every tensor is under
    1 MiB lives in the allocator's small pool, in one 2 MiB segment (CUDACachingAllocator:
    kSmallSize 1 MiB, kSmallBuffer 2 MiB), so the excess is 2 MiB less the step's peak in
    512-byte blocks."""
    from tilefit.estimator import estimate_trace
    from tilefit.hardware import get_device
    from tilefit.recipe import Recipe
    from tilefit.tracing import trace
    from tilefit.tuning.predict import fragmentation_bytes

    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    tr = trace(model, torch.randn(4, 16), recipe=Recipe(precision="fp32", optimizer="adam"),
               gpu="a100-80gb", loss_fn=lambda m, b: m(b).square().mean())
    peak = estimate_trace(tr, get_device("a100-80gb")).peak_memory_bytes
    assert peak % 512 == 0 and 0 < peak < 2**20
    assert fragmentation_bytes(tr) == 2 * 2**20 - peak


def test_each_trial_runs_the_recipes_loop(monkeypatch: pytest.MonkeyPatch,
                                         clip_calls: list[float]) -> None:
    """tune(recipe=...): every trial is tilefit.loop's step of that Recipe (issue 44 items
    1 and 4): clipping at max_grad_norm and zero_grad(set_to_none=False) where it says so;
    precision= alone is plain PyTorch's loop, which clips nothing."""
    from tilefit.recipe import Recipe

    clips = clip_calls
    cleared: list[bool] = []
    zero_grad = torch.optim.Optimizer.zero_grad

    def spy_zero(self: Any, set_to_none: bool = True) -> None:
        cleared.append(set_to_none)
        zero_grad(self, set_to_none)

    monkeypatch.setattr(torch.optim.Optimizer, "zero_grad", spy_zero)
    search = TuneSearch(max_batch=4, measure_throughput=False, predict=False)

    def run(**kw: Any) -> TuneResult:
        return tune(Scale(), lambda b: torch.randn(b, 64), loss_fn=lambda m, x: m(x),
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1), search=search, **kw)

    run(recipe=Recipe(precision="fp32", max_grad_norm=0.5, zero_grad_to_none=False))
    assert clips and set(clips) == {0.5} and False in cleared
    clips.clear()
    cleared.clear()
    run(precision="fp32")
    assert not clips and cleared and all(cleared)


@pytest.mark.parametrize(("kw", "words"), [
    ({"recipe": "ckpt"}, "gradient_checkpointing_enable()"),
    ({"recipe": "both"}, "precision="),
    ({"recipe": "auto"}, "precision='auto'"),
    ({"recipe": "sgd"}, "optimizer=..."),
])
def test_tune_refuses_what_the_recipe_cannot_change_on_a_built_model(kw: dict[str, str],
                                                                       words: str) -> None:
    from tilefit.recipe import Recipe

    given = {"ckpt": {"recipe": Recipe(precision="fp32", grad_checkpointing=True)},
             "both": {"recipe": Recipe(precision="fp32"), "precision": "fp32"},
             "auto": {"recipe": Recipe()},
             "sgd": {"recipe": Recipe(precision="fp32", optimizer="sgd")}}[kw["recipe"]]
    with pytest.raises(TilefitError) as err:
        tune(Scale(), lambda b: torch.randn(b, 64), loss_fn=lambda m, x: m(x),
             optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
             search=TuneSearch(max_batch=4), **given)
    assert words in str(err.value)
