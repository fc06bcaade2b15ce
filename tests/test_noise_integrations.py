"""The noise scale through the real Hugging Face Trainer and Lightning Trainer (CPU)."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tilefit.tuning.noise import NoiseScale

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
L = pytest.importorskip("lightning.pytorch")


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    logger = logging.getLogger("transformers")
    level, threads = logger.level, torch.get_num_threads()
    logger.setLevel(logging.ERROR)
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    torch.set_num_threads(threads)
    logger.setLevel(level)


def _trainer(tmp_path: Path, **args: Any) -> Any:
    from tests.test_integration_hf import TokenData, gpt2, make_trainer

    return make_trainer(gpt2(), TokenData(n=64), tmp_path, per_device_train_batch_size=8,
                        **args)


def test_hf_noise_scale_from_the_trainers_data_and_a_checkpoint(tmp_path: Path) -> None:
    from tilefit.tuning.integrations.hf import noise_scale_trainer

    trainer = _trainer(tmp_path)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    r = noise_scale_trainer(trainer, batch_sizes=(2, 8), measurements=3)
    assert isinstance(r, NoiseScale) and r.samples == 24 and r.b_simple > 0
    assert all(torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())
    # a checkpoint folder as Trainer.save_model writes it: other weights, measured there
    other = _trainer(tmp_path / "other").model
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.5)
    other.save_pretrained(tmp_path / "checkpoint-9")
    at_ckpt = noise_scale_trainer(trainer, batch_sizes=(2, 8), measurements=3,
                                  checkpoint=str(tmp_path / "checkpoint-9"))
    assert at_ckpt.b_simple != r.b_simple
    assert all(torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())


def test_hf_tune_trainer_time_to_loss_keeps_the_effective_batch(tmp_path: Path) -> None:
    from tilefit.tuning.integrations.hf import tune_trainer

    trainer = _trainer(tmp_path)
    r = tune_trainer(trainer, max_batch=8, measure_throughput=False,
                     objective="time-to-loss", noise_scale=2.0)
    assert r.batch_size * r.accumulation_steps == 8
    assert r.b_noise == 2.0 and r.learning_rate is not None and r.learning_rate.rule == "adam"
    assert r.warnings and "4.0x the gradient noise scale" in r.warnings[0]


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 8
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> Any:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(256, 6, generator=gen)
        data = torch.utils.data.TensorDataset(x, x[:, :3].argmax(1))
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size, shuffle=True)


def _fit(callbacks: list[Any]) -> Any:
    torch.manual_seed(0)
    module = Net()
    trainer = L.Trainer(max_steps=6, accelerator="cpu", logger=False, callbacks=callbacks,
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    trainer.fit(module)
    return module


def test_lightning_monitor_measures_during_training_and_changes_nothing() -> None:
    from tilefit.tuning.integrations.lightning import noise_scale_monitor

    monitor = noise_scale_monitor(at_steps=(0, 3), batch_sizes=(2, 8), measurements=3)
    measured = _fit([monitor])
    plain = _fit([])
    assert [s for s, _ in monitor.results] == [0, 3]
    assert all(isinstance(r, NoiseScale) and r.optimizer == "SGD" for _, r in monitor.results)
    for a, b in zip(measured.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)  # the run is bit for bit the one without the monitor


def test_lightning_finder_time_to_loss_measures_on_random_samples() -> None:
    from tilefit.tuning.integrations.lightning import tilefit_batch_size_finder

    finder = tilefit_batch_size_finder(max_batch=16, objective="time-to-loss")
    _fit([finder])
    r = finder.result
    assert r.objective == "time-to-loss" and isinstance(r.noise_measurement, NoiseScale)
    assert r.batch_size in {row.batch_size for row in r.time_to_loss}
    assert r.learning_rate is not None and r.learning_rate.rule == "sgd"
