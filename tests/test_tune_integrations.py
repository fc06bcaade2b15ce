"""Hugging Face and Lightning helpers, and the `tilefit tune` command."""

from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from tilefit.cli.app import app
from tilefit.cli.model_options import parse_shape
from tilefit.cli.tune import parse_bytes
from tilefit.errors import TilefitError
from tilefit.tuning.integrations import lightning as tl
from tilefit.tuning.integrations.hf import precision_of, split_effective_batch, tune_trainer


def test_split_effective_batch_keeps_the_product() -> None:
    assert split_effective_batch(32, 8) == (8, 4)  # 8 * 4 = 32
    assert split_effective_batch(96, 24) == (24, 4)  # 24 * 4 = 96
    with pytest.raises(TilefitError, match="does not divide"):
        split_effective_batch(32, 12)


def test_precision_from_training_arguments() -> None:
    assert precision_of(SimpleNamespace(bf16=True, fp16=False)) == "bf16-mixed"
    assert precision_of(SimpleNamespace(bf16=False, fp16=True)) == "fp16-mixed"
    assert precision_of(SimpleNamespace(bf16=False, fp16=False, tf32=False)) == "fp32"


class FakeTrainer:
    """The attributes tune_trainer reads from transformers.Trainer (which needs accelerate,
    not installed here): model, args, train_dataset, data_collator, the optimizer classmethod."""

    def __init__(self, model: torch.nn.Module, dataset: list[dict[str, Any]]) -> None:
        self.model = model
        self.train_dataset = dataset
        self.args = SimpleNamespace(per_device_train_batch_size=4, gradient_accumulation_steps=8,
                                    remove_unused_columns=True, bf16=False, fp16=False,
                                    tf32=False, learning_rate=1e-3)
        self._train_batch_size = 4
        self.label_names = ["labels"]

    @staticmethod
    def get_optimizer_cls_and_kwargs(args: Any, model: Any = None) -> tuple[Any, dict[str, Any]]:
        return torch.optim.AdamW, {"lr": args.learning_rate}

    @staticmethod
    def data_collator(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def test_tune_trainer_on_a_tiny_gpt2() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                       n_positions=16))
    ids = torch.arange(16) % 64
    dataset = [{"input_ids": ids, "labels": ids, "text": "unused column"} for _ in range(4)]
    trainer = FakeTrainer(model, dataset)
    trainer.args.train_batch_size = property(lambda s: s.per_device_train_batch_size)
    before = [p.detach().clone() for p in model.parameters()]
    result = tune_trainer(trainer, memory_limit_bytes=3_000_000, measure_throughput=False)
    args = trainer.args
    assert args.per_device_train_batch_size == result.batch_size
    # the effective batch 4 * 8 = 32 is unchanged
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 32
    assert 32 % args.per_device_train_batch_size == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    # untimed, the largest divisor of 32 that fits is chosen
    assert result.batch_size == max(d for d in (1, 2, 4, 8, 16, 32)
                                    if d <= result.max_fitting_batch_size)


def test_lightning_is_imported_only_when_used() -> None:
    if importlib.util.find_spec("lightning") or importlib.util.find_spec("pytorch_lightning"):
        pytest.skip("Lightning is installed here")
    with pytest.raises(TilefitError, match="pip install lightning"):
        tl.tilefit_batch_size_finder()


def test_lightning_pure_parts() -> None:
    loss = torch.tensor(1.5)
    assert tl.loss_from_step_output(loss) is loss
    assert tl.loss_from_step_output({"loss": loss, "log": 1}) is loss
    with pytest.raises(TilefitError, match="return the loss"):
        tl.loss_from_step_output(None)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert tl.first_optimizer(opt) is opt
    assert tl.first_optimizer(([opt], ["scheduler"])) is opt
    assert tl.first_optimizer({"optimizer": opt, "lr_scheduler": None}) is opt


def test_parse_bytes_and_shape() -> None:
    assert parse_bytes("2GiB") == 2147483648  # 2 * 1024^3
    assert parse_bytes("500MB") == 500_000_000  # 500 * 1000^2
    assert parse_bytes("1.5KiB") == 1536  # 1.5 * 1024
    assert parse_bytes("123456") == 123456
    for bad in ("2 GiBs", "-5MB", "lots", "0"):
        with pytest.raises(TilefitError):
            parse_bytes(bad)
    assert parse_shape("3,224,224") == (3, 224, 224)
    assert parse_shape("3x32x32") == (3, 32, 32)
    with pytest.raises(TilefitError):
        parse_shape("3,-1")


def test_cli_tune_json_and_plot(tmp_path: Any) -> None:
    plot = tmp_path / "tune.png"
    runner = CliRunner()
    out = runner.invoke(app, ["tune", "tests.fixtures.tiny_models:mlp", "--input-shape", "32",
                              "--memory-limit", "400KB", "--global-batch", "16",
                              "--max-batch", "16", "--json",
                              "--plot", str(plot)])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["budget_bytes"] == 360_000  # 400 KB * (1 - 0.10)
    assert data["batch_size"] * data["accumulation_steps"] == 16
    assert data["max_fitting_batch_size"] == 16  # capped by --max-batch
    assert data["candidates"] == [1, 2, 4, 8, 16]  # divisors of 16, all friendly
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:4] == b"\x89PNG"


def test_cli_tune_errors_exit_2() -> None:
    runner = CliRunner()
    out = runner.invoke(app, ["tune", "tests.fixtures.tiny_models:mlp", "--input-shape", "32",
                              "--memory-limit", "lots"])
    assert out.exit_code == 2 and "memory size not understood" in out.output
    out = runner.invoke(app, ["tune", "tests.fixtures.tiny_models:mlp", "--input-shape", "32",
                              "--gpu", "cpu"])
    assert out.exit_code == 2 and "memory limit or a largest batch" in out.output
