"""The gradient noise scale: the estimator against hand arithmetic and closed forms, the
measuring loop against per-sample gradients computed by hand, bad input, and the bit-exact
restore of everything a measurement touches."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import tilefit
from tilefit.errors import TilefitError
from tilefit.tuning import NoiseMeasure
from tilefit.tuning.noise import (
    Measurement,
    choose_time_to_loss,
    estimates,
    far_above_noise_scale,
    fit_steps_curve,
    learning_rate_advice,
    lr_fraction,
    lr_rule_of,
    lr_scale,
    time_to_loss,
)
from tilefit.tuning.noise_measure import noise_scale

# ---- the estimator: hand arithmetic ----------------------------------------------------------


def test_appendix_a_estimators_by_hand() -> None:
    # B_small 2, B_big 8, |G_2|^2 = 5, |G_8|^2 = 2:
    # |G|^2 = (8*2 - 2*5) / (8 - 2) = 1; tr(Sigma) = (5 - 2) / (1/2 - 1/8) = 8
    g2, trace = estimates([Measurement(5.0, 2.0)], 2, 8)
    assert g2 == pytest.approx(1.0)
    assert trace == pytest.approx(8.0)


def test_estimators_invert_the_expectation_exactly() -> None:
    # E|G_B|^2 = |G|^2 + tr(Sigma)/B: fed the expectations, the estimators return the truth
    g2, trace = 0.7, 31.0
    m = Measurement(g2 + trace / 4, g2 + trace / 32)
    assert estimates([m, m], 4, 32) == pytest.approx((g2, trace))


def test_ratio_of_means_and_interval_contains_it() -> None:
    ms = [Measurement(5.0, 2.0), Measurement(6.0, 2.2), Measurement(4.5, 1.9)]
    from tilefit.tuning.noise import from_measurements

    r = from_measurements(ms, 2, 8, time_s=0.0)
    g2s = [(8 * m.big_sq - 2 * m.small_sq) / 6 for m in ms]
    trs = [(m.small_sq - m.big_sq) / (1 / 2 - 1 / 8) for m in ms]
    assert r.b_simple == pytest.approx(sum(trs) / sum(g2s))
    assert r.b_simple_low <= r.b_simple <= r.b_simple_high
    assert r.samples == 24 and r.measurements == 3


def test_fit_steps_curve_recovers_the_model() -> None:
    bs = [4, 8, 16, 32, 64, 128]
    steps = [100 * (1 + 50 / b) for b in bs]
    fit = fit_steps_curve(bs, steps)
    assert fit.s_min == pytest.approx(100)
    assert fit.b_crit == pytest.approx(50)
    assert fit.max_relative_error < 1e-9


def test_time_to_loss_by_hand() -> None:
    # B_noise 32; rates 100 samples/s at 8, 160 at 32, 170 at 64:
    # time ~ (B + 32)/rate: 40/100 = 0.4, 64/160 = 0.4, 96/170 = 0.565
    rows = time_to_loss({8: 100.0, 32: 160.0, 64: 170.0}, 32)
    assert [r.batch_size for r in rows] == [8, 32, 64]
    assert [r.time_factor for r in rows] == pytest.approx([1.0, 1.0, 0.96 / 0.68])
    assert rows[0].steps_factor == pytest.approx(5.0)
    assert choose_time_to_loss(rows, noise=0.0).batch_size == 8  # the smaller of the tie


def test_learning_rate_rules() -> None:
    assert lr_fraction(32, 32, "sgd") == pytest.approx(0.5)  # eq. 2.7 at B = B_noise
    assert lr_fraction(32, 32, "adam") == pytest.approx(math.sqrt(0.5))
    # from 8 to 32 at B_noise 8: (1 + 8/8) / (1 + 8/32) = 2 / 1.25
    assert lr_scale(8, 32, 8, "sgd") == pytest.approx(1.6)
    assert lr_rule_of("AdamW") == "adam" and lr_rule_of("SGD") == "sgd"
    advice = learning_rate_advice(32, 8, "sgd", from_batch=8)
    assert advice.scale == pytest.approx(1.6) and "eq. 2.7" in advice.text


def test_far_above_warning() -> None:
    assert far_above_noise_scale(100, 60) is None
    text = far_above_noise_scale(400, 100)
    assert text is not None and "5.0x the fewest samples" in text  # 1 + 400/100


# ---- the loop: per-sample gradients by hand ---------------------------------------------------

D = 5


def _linear(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(D, 1, bias=False)


def _half_mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return 0.5 * ((model(x).squeeze(1) - y) ** 2).mean()


def test_measurements_match_per_sample_gradients_by_hand() -> None:
    rng = np.random.default_rng(3)
    xs, ys = rng.normal(size=(32, D)), rng.normal(size=32)
    pos = [0]

    def make_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = pos[0]
        pos[0] += b
        return torch.tensor(xs[i:i + b], dtype=torch.float32), \
            torch.tensor(ys[i:i + b], dtype=torch.float32)

    model = _linear()
    w = model.weight.detach().double().numpy()[0]
    r = noise_scale(model, make_batch, loss_fn=_half_mse, device="cpu",
                    measure=NoiseMeasure(batch_sizes=(4, 16), measurements=2))
    per_sample = xs * (xs @ w - ys)[:, None]  # gradient of 0.5 (w.x - y)^2
    for j, m in enumerate(r.per_measurement):
        block = per_sample[16 * j:16 * (j + 1)]
        small = np.mean([np.sum(block[4 * i:4 * i + 4].mean(0) ** 2) for i in range(4)])
        assert m.small_sq == pytest.approx(small, rel=1e-5)
        assert m.big_sq == pytest.approx(np.sum(block.mean(0) ** 2), rel=1e-5)


def test_least_squares_closed_form() -> None:
    """x ~ N(0, C) (C diagonal), y = w*.x + e, e ~ N(0, s^2), loss 0.5 (w.x - y)^2, d = w - w*:
    G = C d, Sigma = C (d'Cd + s^2) + C d d' C (Isserlis), so |G|^2 = |Cd|^2 and
    tr(Sigma) = tr(C)(d'Cd + s^2) + |Cd|^2. Seeded: the estimate is the same every run."""
    torch.manual_seed(0)
    scales = torch.linspace(0.5, 1.5, D)
    w_star, s = torch.randn(D), 0.5
    model = nn.Linear(D, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_((w_star + 0.5 * torch.randn(D))[None])
    gen = torch.Generator().manual_seed(1)

    def make_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(b, D, generator=gen) * scales
        return x, x @ w_star + s * torch.randn(b, generator=gen)

    delta, c = model.weight.detach()[0] - w_star, scales**2
    g2 = float(((c * delta) ** 2).sum())
    trace = float(c.sum()) * (float((c * delta * delta).sum()) + s**2) + g2
    r = noise_scale(model, make_batch, loss_fn=_half_mse, device="cpu",
                    measure=NoiseMeasure(batch_sizes=(4, 64), measurements=100))
    assert r.b_simple == pytest.approx(trace / g2, rel=0.15)  # 7% off with these seeds


# ---- state restored bit for bit ---------------------------------------------------------------


MODES_SEEN: list[bool] = []


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(),
                                  nn.Dropout(0.3), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        MODES_SEEN.append(self.training)  # outside the module: its own lists are restored
        return self.body(x)


def _net_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(b, 6)
    return x, x[:, :3].argmax(1)  # labels the model can learn: a clear gradient at init


def _ce(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def test_state_is_restored_bit_for_bit_and_eval_mode_measured_in_train_mode() -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _ce(model, _net_batch(8)).backward()
    opt.step()
    _ce(model, _net_batch(8)).backward()  # gradients left in place
    model.eval()
    MODES_SEEN.clear()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters()]
    opt_before = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    r = noise_scale(model, _net_batch, loss_fn=_ce, optimizer=opt, device="cpu",
                    measure=NoiseMeasure(batch_sizes=(4, 16), measurements=3))
    assert r.optimizer == "AdamW" and r.learning_rate == pytest.approx(1e-3)
    assert MODES_SEEN and all(MODES_SEEN)  # measured in train mode
    assert not any(m.training for m in model.modules())  # and eval mode is back
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    for k, v in opt.state_dict()["state"][0].items():
        assert torch.equal(v, opt_before[k])
    assert torch.equal(torch.get_rng_state(), rng[0])
    assert random.getstate() == rng[1]
    assert np.array_equal(np.random.get_state()[1], rng[2])


def test_checkpoint_is_measured_and_the_model_kept(tmp_path: Path) -> None:
    trained = _linear(seed=1)
    path = tmp_path / "step-100.pt"
    torch.save({"state_dict": trained.state_dict(), "epoch": 3}, path)
    model = _linear(seed=0)
    weight = model.weight.detach().clone()

    def run(m: nn.Module, **kw: Any) -> float:
        return noise_scale(m, _seeded_batches(), loss_fn=_half_mse, device="cpu",
                           measure=NoiseMeasure(batch_sizes=(2, 8), measurements=3,
                                                **kw)).b_simple

    assert run(model, checkpoint=path) == run(trained)
    assert torch.equal(model.weight, weight)
    with pytest.raises(TilefitError, match="does not match"):
        run(Net(), checkpoint=path)


# ---- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes", [(1, 8), (8, 8), (8, 12), (8, 4)])
def test_batch_sizes_that_cannot_measure(sizes: tuple[int, int]) -> None:
    with pytest.raises(TilefitError) as err:
        noise_scale(_linear(), _net_batch, loss_fn=_half_mse, device="cpu",
                    measure=NoiseMeasure(batch_sizes=sizes))
    assert "batch_sizes=(8, 64)" in err.value.message


def test_zero_and_non_finite_gradients_are_named() -> None:
    def batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(b, D), torch.randn(b)

    with pytest.raises(TilefitError, match="exactly zero"):
        noise_scale(_linear(), batch, loss_fn=lambda m, b: 0 * m(b[0]).sum(), device="cpu")
    with pytest.raises(TilefitError, match=r"not finite.*\n.*\n.*weight"):
        noise_scale(_linear(), batch, loss_fn=lambda m, b: (0 * m(b[0])).sqrt().mean(),
                    device="cpu")
    with pytest.raises(TilefitError, match="loss is nan"):
        noise_scale(_linear(), batch, loss_fn=lambda m, b: m(b[0]).mean() * math.nan,
                    device="cpu")


def test_the_same_batch_every_call_has_no_noise() -> None:
    fixed = (torch.ones(8, D), torch.zeros(8))
    with pytest.raises(TilefitError, match="no gradient noise") as err:
        noise_scale(_linear(), lambda b: (fixed[0][:b], fixed[1][:b]), loss_fn=_half_mse,
                    device="cpu", measure=NoiseMeasure(batch_sizes=(2, 8), measurements=2))
    assert "at random" in err.value.message


def test_measurements_and_confidence_are_checked_when_the_options_are_made() -> None:
    with pytest.raises(TilefitError, match="one measurement gives no interval"):
        NoiseMeasure(measurements=1)
    with pytest.raises(TilefitError, match="measurements must be a whole number"):
        NoiseMeasure(measurements=2.5)  # type: ignore[arg-type]
    with pytest.raises(TilefitError, match=r"confidence must be a fraction in \(0, 1\)"):
        NoiseMeasure(confidence=1.0)


def _seeded_batches() -> Any:
    gen = torch.Generator().manual_seed(5)

    def make_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(b, D, generator=gen), torch.randn(b, generator=gen)

    return make_batch


def test_public_names() -> None:
    assert tilefit.noise_scale is noise_scale
    assert tilefit.NoiseScale.__name__ == "NoiseScale"
    assert tilefit.NoiseMeasure is NoiseMeasure


def test_expanded_percentile_tails() -> None:
    from statistics import NormalDist

    from tilefit.tuning.noise import expanded_tail, student_t_quantile

    assert student_t_quantile(0.95, 9) == pytest.approx(1.8331, abs=1e-3)  # t tables
    assert student_t_quantile(0.975, 19) == pytest.approx(2.0930, abs=2e-3)
    # n = 10 at 90%: Phi(-sqrt(10/9) * 1.8331) = Phi(-1.9322)
    assert expanded_tail(0.9, 10) == pytest.approx(NormalDist().cdf(-1.9322), abs=2e-4)
    assert expanded_tail(0.9, 10_000) == pytest.approx(0.05, abs=1e-3)
