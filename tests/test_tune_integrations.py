"""Lightning helpers and the `tilefit tune` command (the Hugging Face Trainer is tested against
the real transformers.Trainer in test_integration_hf.py)."""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from tilefit.cli.app import app
from tilefit.cli.model_options import parse_shape
from tilefit.cli.tune import parse_bytes
from tilefit.errors import TilefitError
from tilefit.tuning.integrations import lightning as tl


def test_lightning_is_imported_only_when_used() -> None:
    if importlib.util.find_spec("lightning"):
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
    # progress without a terminal: plain lines on stderr, the outlook first, one per trial
    lines = [line for line in out.stderr.splitlines() if line.startswith("tune [")]
    outlook = next(i for i, line in enumerate(lines) if "trials (" in line)
    trial_lines = [line for line in lines if "trial " in line and " at batch " in line]
    assert len(trial_lines) == len(data["trials"]) and lines.index(trial_lines[0]) > outlook
    expected = int(lines[outlook].split("about ")[1].split(" trials")[0])
    assert expected == len(data["trials"])  # 1 fit trial (the cap) + 5 timed candidates
    assert f"trial 1 of ~{expected}: fit at batch 16: fits" in trial_lines[0]


def test_cli_tune_shows_what_tune_skipped() -> None:
    # the CPU without --memory-limit has no memory budget: no prediction to start from, and
    # the table says so
    out = CliRunner().invoke(app, ["tune", "tests.fixtures.tiny_models:mlp", "--input-shape",
                                   "32", "--gpu", "cpu", "--max-batch", "4"])
    assert out.exit_code == 0, out.output
    assert ("note: the estimator's prediction of the largest batch was skipped: there is no "
            "memory budget to predict against (the CPU without a memory limit); the search "
            "began at batch 2 instead") in " ".join(out.stdout.split())  # rich wraps lines


def test_cli_tune_errors_exit_2() -> None:
    runner = CliRunner()
    out = runner.invoke(app, ["tune", "tests.fixtures.tiny_models:mlp", "--input-shape", "32",
                              "--memory-limit", "lots"])
    assert out.exit_code == 2 and "memory size not understood" in out.output
    out = runner.invoke(app, ["tune", "tests.fixtures.tiny_models:mlp", "--input-shape", "32",
                              "--gpu", "cpu"])
    assert out.exit_code == 2 and "memory limit or a largest batch" in out.output
