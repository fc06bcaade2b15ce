"""tune(objective="time-to-loss"): the choice follows S(B) = S_min (1 + B_noise/B) times the
measured time per step (McCandlish et al. eq. 2.11), checked against the result's own
measured rates by hand; the samples/s choice is kept beside it; the state comes back."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tilefit.errors import TilefitError
from tilefit.tuning import TuneSearch, tune
from tilefit.tuning.noise import NoiseScale


def _batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(b, 8)
    return x, x[:, :4].argmax(1)


def _ce(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_time_to_loss_choice_by_hand() -> None:
    model, opt = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    r = tune(model, _batch, loss_fn=_ce, optimizer=opt, device="cpu",
             search=TuneSearch(max_batch=16, predict=False, objective="time-to-loss",
                               noise_scale=16.0))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert r.objective == "time-to-loss" and r.b_noise == 16.0
    rates = {row.batch_size: row.samples_per_s for row in r.time_to_loss}
    seconds = {b: (b + 16.0) / rate for b, rate in rates.items()}  # S_min (B + B_noise)/rate
    best = min(seconds.values())
    for row in r.time_to_loss:
        assert row.steps_factor == pytest.approx(1 + 16.0 / row.batch_size)
        assert row.time_factor == pytest.approx(seconds[row.batch_size] / best)
    # the smallest batch within the throughput noise of the best time
    assert r.batch_size == min(b for b in seconds if seconds[b] <= best * (1 + r.noise))
    assert r.samples_per_s_batch in rates
    assert r.time_to_loss_slowdown == pytest.approx(
        seconds[r.samples_per_s_batch] / seconds[r.batch_size])
    assert r.learning_rate is not None and r.learning_rate.rule == "sgd"
    assert r.learning_rate.fraction_of_max == pytest.approx(1 / (1 + 16.0 / r.batch_size))
    d = r.to_dict()
    assert d["time_to_loss"][0]["batch_size"] == r.time_to_loss[0].batch_size


def test_global_batch_far_above_the_noise_scale_warns() -> None:
    model, _ = _model()
    r = tune(model, _batch, loss_fn=_ce, optimizer=lambda p: torch.optim.AdamW(p), device="cpu",
             search=TuneSearch(max_batch=16, global_batch=64, predict=False,
                               objective="time-to-loss", noise_scale=8.0))
    assert r.batch_size == r.samples_per_s_batch  # the same steps whatever the micro-batch
    assert r.time_to_loss_slowdown == 1.0
    assert r.learning_rate is not None and r.learning_rate.rule == "adam"
    assert r.learning_rate.to_batch == 64
    assert len(r.warnings) == 1 and "8.0x the gradient noise scale" in r.warnings[0]


def test_tune_measures_the_noise_scale_when_not_given() -> None:
    model, opt = _model()
    r = tune(model, _batch, loss_fn=_ce, optimizer=opt, device="cpu",
             search=TuneSearch(max_batch=16, predict=False, objective="time-to-loss"))
    assert isinstance(r.noise_measurement, NoiseScale)
    assert (r.noise_measurement.batch_small, r.noise_measurement.batch_big) == (8, 64)
    assert r.b_noise == r.noise_measurement.b_simple


def test_bad_objective_and_noise_scale() -> None:
    # checked when the search is made, before any trial
    with pytest.raises(TilefitError, match="unknown objective"):
        TuneSearch(max_batch=4, objective="fastest")
    with pytest.raises(TilefitError, match="noise_scale must be a positive number"):
        TuneSearch(max_batch=4, objective="time-to-loss", noise_scale=-3)
