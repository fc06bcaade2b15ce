"""`tilefit bench gemm` and `tilefit calibrate`: --json shapes and bad input (exit 2)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tilefit.cli.app import app

runner = CliRunner()

ROW_KEYS = {"label", "x", "m", "n", "k", "dtype", "measured_time_s", "measured_tflops",
            "predicted_time_s", "predicted_tflops", "error"}


def test_bench_n_sweep_json_and_plot(tmp_path) -> None:
    png = tmp_path / "n.png"
    r = runner.invoke(app, ["bench", "gemm", "--sweep", "n", "--m", "16", "--in", "24",
                            "--quick", "--json", "--plot", str(png)])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    # --quick spans 16 around the centre 24: N = 16..32, 17 shapes with M=16, K=24
    assert [row["n"] for row in data["rows"]] == list(range(16, 33))
    assert all(row["m"] == 16 and row["k"] == 24 for row in data["rows"])
    assert set(data["rows"][0]) == ROW_KEYS
    row = data["rows"][0]
    # measured TFLOP/s is 2*M*N*K / time: 2*16*16*24 = 12288 FLOPs
    assert row["measured_tflops"] == pytest.approx(12288 / row["measured_time_s"] / 1e12)
    assert row["error"] == pytest.approx(
        (row["predicted_time_s"] - row["measured_time_s"]) / row["measured_time_s"])
    assert data["plot"] == str(png) and png.read_bytes()[:4] == b"\x89PNG"


def test_bench_batch_sweep_has_three_gemms_per_batch() -> None:
    r = runner.invoke(app, ["bench", "gemm", "--sweep", "batch", "--in", "24", "--out", "40",
                            "--quick", "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["rows"]
    t = rows[0]["x"]
    first = {row["label"]: (row["m"], row["n"], row["k"]) for row in rows[:3]}
    # forward M=T,N=out,K=in; activation grad M=T,N=in,K=out; weight grad M=out,N=in,K=T
    assert first == {"forward": (t, 40, 24), "activation-grad": (t, 24, 40),
                     "weight-grad": (40, 24, t)}


@pytest.mark.parametrize("args, needle", [
    (["bench", "gemm", "--sweep", "kk"], "unknown sweep"),
    (["bench", "gemm", "--device", "tpu"], "unknown --device"),
    (["bench", "gemm", "--dtype", "fp8", "--sweep", "k", "--m", "8", "--n", "8", "--in", "16"],
     "no fp8"),
    (["bench", "gemm", "--in", "0"], "--in must be a positive"),
    (["calibrate", "--device", "tpu"], "unknown --device"),
])
def test_bad_input_exits_2(args, needle) -> None:
    r = runner.invoke(app, args)
    assert r.exit_code == 2
    assert needle in r.stderr


def test_cuda_without_gpu_exits_2() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    for args in (["bench", "gemm", "--device", "cuda"], ["calibrate", "--device", "cuda"]):
        r = runner.invoke(app, args)
        assert r.exit_code == 2 and "needs a CUDA GPU" in r.stderr


TINY_GRID = ((16, 16, 16), (16, 64, 32), (64, 16, 48), (48, 48, 64), (64, 64, 64),
             (17, 33, 64), (32, 17, 16), (80, 24, 40))


@pytest.fixture
def tiny_calibration(monkeypatch):
    """A tiny grid so a calibration takes a second: 8 shapes, a 64^3 probe, a 16 MiB copy;
    two options (3 rounds, or 6 of the shapes once) for a budget to choose from."""
    import tilefit.calibrate.measure as measure
    import tilefit.calibrate.run as run
    from tilefit.calibrate.grid import GridOption

    ladder = (GridOption(TINY_GRID, 3), GridOption(TINY_GRID[:6], 1))
    monkeypatch.setattr(run, "grid_options", lambda kind, quick: ladder)
    monkeypatch.setattr(run, "PROBE_SHAPES", {"cpu": (64, 64, 64)})
    monkeypatch.setattr(measure, "COPY_BYTES", 16 * 1024**2)
    return run


def test_calibrate_json_saves_profile(tilefit_cache, tiny_calibration, monkeypatch) -> None:
    monkeypatch.setattr(tiny_calibration, "CPU_DTYPES", ("fp32",))
    r = runner.invoke(app, ["calibrate", "--device", "cpu", "--quick", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["path"] == str(tilefit_cache / "profiles" / "cpu.json")
    assert json.loads((tilefit_cache / "profiles" / "cpu.json").read_text())["device"] == "cpu"
    assert data["kind"] == "cpu" and data["quick"] is True
    assert [g["dtype"] for g in data["gemm"]] == ["fp32"] and data["gemm"][0]["shapes"] >= 6
    assert data["bandwidth_bytes_per_s"] > 0 and data["peak_flops_per_s"]["fp32"] > 0
    cal = data["calibration"]
    assert cal["time_budget_s"] == 150.0 and cal["reference_dtype"] == "fp32"
    (fp32,) = cal["dtypes"]
    assert fp32["relative_rate"] == 1.0 and fp32["probe_shape"] == [64, 64, 64]
    # a second or two of work in a 150 s budget: the whole grid, nothing skipped
    assert fp32["grid"] == {"shapes": 8, "max_dim": 80, "rounds": 3}
    assert fp32["rounds_done"] == 3 and fp32["skipped"] == "" and cal["within_budget"]


def test_calibrate_progress_is_plain_lines_when_piped(tiny_calibration) -> None:
    # CliRunner's stderr is not a terminal: one line per step with the elapsed time, the
    # expected total from the plan on, and no per-shape ticks.
    r = runner.invoke(app, ["calibrate", "--device", "cpu", "--quick"])
    assert r.exit_code == 0, r.output
    lines = r.stderr.splitlines()
    plan = next(line for line in lines if "plan: fp32" in line)
    assert "expected" in plan and "of a 150 s budget" in plan
    assert any(" of ~" in line and "fp32: round 3/3, 8/8 shapes" in line for line in lines)
    assert not any("1/8 shapes" in line for line in lines)
    assert all(line.startswith("[") for line in lines)
    assert "bf16 GEMMs run at " in r.stdout and "% of fp32 here" in r.stdout


def test_calibrate_shrinks_to_its_time_budget(tiny_calibration) -> None:
    # A budget spent before the grids start: fp32 (the reference) still gets the smallest
    # grid, bf16 is skipped, and both are said.
    r = runner.invoke(app, ["calibrate", "--device", "cpu", "--quick", "--time-budget",
                            "0.001", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    fp32, bf16 = data["calibration"]["dtypes"]
    assert fp32["grid"] == {"shapes": 6, "max_dim": 64, "rounds": 1}
    assert fp32["skipped"] == "2 of 3 rounds; dims up to 64 instead of 80; 6 shapes instead of 8"
    assert bf16["fitted"] is False and bf16["grid"] is None
    assert bf16["skipped"] == "all of it: 8 shapes up to 80 x 3 rounds"
    assert [g["dtype"] for g in data["gemm"]] == ["fp32"]
    assert data["calibration"]["within_budget"] is False


def test_calibrate_rejects_a_non_positive_budget() -> None:
    r = runner.invoke(app, ["calibrate", "--quick", "--time-budget", "0"])
    assert r.exit_code == 2 and "--time-budget must be a positive" in r.stderr


def test_gemm_command_accepts_the_cpu() -> None:
    r = runner.invoke(app, ["gemm", "64", "64", "64", "--gpu", "cpu", "--dtype", "fp32",
                            "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["gpu"] == "cpu" and data["waves"] == 1
    assert data["flops"] == 2 * 64**3  # 524288


def test_bench_gemm_model_measures_the_steps_own_gemms() -> None:
    # GPT-2 with one layer, batch 1 x 16 tokens, fp32 on the CPU. Its plain GEMMs per step:
    # forward c_attn 16x2304x768, c_proj 16x768x768, c_fc 16x3072x768, mlp c_proj
    # 16x768x3072, lm_head 16x50257x768; backward two per weight (dgrad, wgrad) -- shapes
    # repeat, so the rows are the distinct ones, each with its count per step.
    r = runner.invoke(app, ["bench", "gemm", "--model", "gpt2", "--layers", "1", "--seq", "16",
                            "--quick", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["sweep"] == "model" and data["dtype"] == "fp32"
    shapes = {(row["m"], row["n"], row["k"]) for row in data["rows"]}
    assert (16, 2304, 768) in shapes  # c_attn forward (Conv1D: addmm of x and W)
    assert (768, 2304, 16) in shapes  # its weight gradient: K = tokens
    assert (16, 50257, 768) in shapes  # lm_head forward
    counts = {(row["m"], row["n"], row["k"]): row["x"] for row in data["rows"]}
    assert counts[(16, 768, 768)] == 2  # attn.c_proj forward and its dgrad share the shape
    assert all(set(row) >= ROW_KEYS for row in data["rows"])


def test_bench_step_measures_a_real_step_beside_the_estimate() -> None:
    # A real CPU step of a one-layer GPT-2: its peak (MemTracker on the real tensors) is what
    # the fake-tensor trace predicted, to the byte; the time is measured (median of steps).
    r = runner.invoke(app, ["bench", "step", "gpt2", "--layers", "1", "--batch", "1", "--seq",
                            "16", "--steps", "1", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["measured_peak_memory_bytes"] == data["predicted_peak_memory_bytes"]
    assert data["measured_step_time_s"] > 0 and data["predicted_step_time_s"] > 0
    assert data["recipe"]["precision"] == "fp32"


def test_bench_step_runs_the_recipes_loop_as_the_estimate_traces_it() -> None:
    # issue 44 item 4: the measured step is the predicted one, the loop's settings included.
    # zero_grad(set_to_none=False) holds the gradients through the next forward, which the
    # real step's peak (MemTracker) shows as the trace predicts; the Trainer's loop (clipping
    # at 1.0, the loss read) runs in both
    from tilefit.bench.step import measure_step
    from tilefit.estimator.workload_estimate import estimate_workload
    from tilefit.hardware import get_device
    from tilefit.models import load_workload
    from tilefit.recipe import Recipe

    work = load_workload("gpt2", seq_len=16).with_config(num_hidden_layers=1)
    dev = get_device("cpu")
    peaks = {}
    for to_none in (True, False):
        recipe = Recipe.for_model(work, batch_size=1, precision="fp32", optimizer="sgd",
                                  zero_grad_to_none=to_none).on(dev)
        assert recipe.max_grad_norm == 1.0 and recipe.loss_sync
        measured = measure_step(work, recipe, "cpu", steps=1, warmup=1)
        assert measured.peak_memory_bytes == estimate_workload(work, recipe, dev).peak_memory_bytes
        peaks[to_none] = measured.peak_memory_bytes
    assert peaks[False] > peaks[True]  # the held gradients
