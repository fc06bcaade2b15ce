"""`tilefit noise-scale` and `tilefit tune --objective time-to-loss` on a module:function
model with a data factory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tests.fixtures.tiny_models import mlp
from typer.testing import CliRunner

from tilefit.cli.app import app

MODEL = "tests.fixtures.tiny_models:mlp"
DATA = ["--data", "tests.fixtures.tiny_models:make_mlp_data",
        "--loss", "tests.fixtures.tiny_models:mlp_loss"]


def test_noise_scale_json_and_table(tmp_path: Path) -> None:
    runner = CliRunner()
    out = runner.invoke(app, ["noise-scale", MODEL, *DATA, "--gpu", "cpu", "--batch-sizes",
                              "4,16", "--measurements", "4", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert (data["batch_small"], data["batch_big"], data["samples"]) == (4, 16, 64)
    assert data["b_simple_low"] <= data["b_simple"] <= data["b_simple_high"]
    # from a checkpoint: other weights, another noise scale; the table names the flag
    trained = mlp()
    with torch.no_grad():
        for p in trained.parameters():
            p.mul_(3)
    path = tmp_path / "ckpt.pt"
    torch.save(trained.state_dict(), path)
    out = runner.invoke(app, ["noise-scale", MODEL, *DATA, "--gpu", "cpu", "--batch-sizes",
                              "4,16", "--measurements", "4", "--checkpoint", str(path)])
    assert out.exit_code == 0, out.output
    assert "gradient noise scale B_simple" in out.stdout and "--checkpoint" in out.stdout


def test_noise_scale_errors_exit_2() -> None:
    runner = CliRunner()
    out = runner.invoke(app, ["noise-scale", MODEL, "--gpu", "cpu"])
    assert out.exit_code == 2 and "needs your training data" in out.output
    out = runner.invoke(app, ["noise-scale", MODEL, *DATA, "--gpu", "cpu", "--batch-sizes", "1,8"])
    assert out.exit_code == 2 and "B_small >= 2" in out.output
    out = runner.invoke(app, ["noise-scale", MODEL, *DATA, "--gpu", "cpu", "--batch-sizes", "8"])
    assert out.exit_code == 2 and "two whole numbers" in out.output


def test_tune_time_to_loss_cli() -> None:
    runner = CliRunner()
    out = runner.invoke(app, ["tune", MODEL, "--input-shape", "32", "--gpu", "cpu",
                              "--max-batch", "8", "--objective", "time-to-loss",
                              "--noise-scale", "4", *DATA])
    assert out.exit_code == 0, out.output
    assert "soonest to a given loss: batch" in out.stdout
    assert "learning rate:" in out.stdout
    out = runner.invoke(app, ["tune", MODEL, "--input-shape", "32", "--gpu", "cpu",
                              "--max-batch", "8", "--objective", "time-to-loss"])
    assert out.exit_code == 2 and "--noise-scale" in out.output


def test_plan_warns_far_above_a_given_noise_scale(tmp_path: Path, monkeypatch: Any) -> None:
    import tilefit.planner

    class Planned:  # plan itself is tested elsewhere; this checks the warning only
        def to_dict(self) -> dict[str, Any]:
            return {"rows": []}

    monkeypatch.setattr(tilefit.planner, "plan", lambda *a, **k: Planned())
    ns = tmp_path / "ns.json"
    ns.write_text(json.dumps({"b_simple": 16.0}))
    runner = CliRunner()
    for given in ("16", str(ns)):
        out = runner.invoke(app, ["plan", MODEL, "--input-shape", "32", "--global-batch", "64",
                                  "--noise-scale", given, "--json"])
        assert out.exit_code == 0, out.output
        # 64 = 4 x 16: 1 + 64/16 = 5x the fewest samples (eq. 2.11)
        assert "5.0x the fewest samples" in json.loads(out.stdout)["warnings"][0]
    out = runner.invoke(app, ["plan", MODEL, "--input-shape", "32", "--global-batch", "16",
                              "--noise-scale", "16", "--json"])
    assert json.loads(out.stdout)["warnings"] == []
    out = runner.invoke(app, ["plan", MODEL, "--input-shape", "32", "--global-batch", "16",
                              "--noise-scale", "many"])
    assert out.exit_code == 2 and "--noise-scale must be a positive number" in out.output


def test_tune_cli_trials_clip_as_the_flag_says(clip_calls: list[float]) -> None:
    # --max-grad-norm reaches every trial (tune(recipe=...): tilefit.loop's step); a
    # module:function model's loop (plain PyTorch's, as estimate reads it) clips nothing
    clips = clip_calls
    runner = CliRunner()
    base = ["tune", MODEL, "--input-shape", "32", "--gpu", "cpu", "--max-batch", "4", *DATA]
    out = runner.invoke(app, [*base, "--max-grad-norm", "0.25"])
    assert out.exit_code == 0, out.output
    assert clips and set(clips) == {0.25}
    clips.clear()
    out = runner.invoke(app, base)
    assert out.exit_code == 0, out.output
    assert not clips
