"""The commands as a user runs them: exit codes, messages, JSON, startup imports, the plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tilefit.cli.app import app
from tilefit.hardware import list_devices

GEMM_KEYS = {"m", "n", "k", "flops", "bytes", "arithmetic_intensity", "ops_per_byte", "bound",
             "alignment", "tile_efficiency", "wave_efficiency", "predicted_time_s",
             "predicted_tflops"}


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize(
    ("args", "messages"),
    [
        (["gemm", "0", "64", "64"], ["M must be a positive whole number", "'0'"]),
        (["gemm", "--", "64", "-3", "64"], ["N must be a positive whole number"]),
        (["gemm", "64", "64", "4.5"], ["K must be a positive whole number", "'4.5'"]),
        (["gemm", "64", "64", "64", "--dtype", "fp64"], ["unknown dtype 'fp64'", "bf16"]),
        (["gemm", "64", "64", "64", "--gpu", "h1000"], ["unknown GPU 'h1000'", "did you mean",
                                                        "h100"]),
        (["gemm", "64", "64", "64", "--gpu", "a100"], ["ambiguous", "a100-40gb", "a100-80gb",
                                                       "a100-pcie-80gb"]),
        (["gemm", "64", "64", "64", "--gpu", "v100", "--dtype", "bf16"], ["no bf16 math",
                                                                          "--dtype fp16"]),
        (["gemm", "64", "64", "64", "--gpu", "t4", "--dtype", "bf16"], ["no bf16 math"]),
        (["gemm", "64", "64", "64", "--gpu", "a100-80gb", "--dtype", "fp8"], ["no fp8 math"]),
        (["linear", "--in", "0", "--out", "64", "--batch", "8"], ["--in must be a positive"]),
        (["linear", "--in", "64", "--out", "x", "--batch", "8"], ["--out must be a positive"]),
        (["linear", "--in", "64", "--out", "64", "--batch", "8,0"], ["--batch", "'0'"]),
        (["linear", "--in", "64", "--out", "64", "--batch", "8;16"], ["--batch", "8,64,256"]),
        (["linear", "--in", "64", "--out", "64", "--batch", "8", "--seq", "-1"], ["--seq"]),
        (["linear", "--in", "64", "--out", "64", "--batch", "8", "--dtype", "half8"],
         ["unknown dtype"]),
        (["linear", "--in", "64", "--out", "64", "--batch", "8", "--gpu", "rtx-3090",
          "--dtype", "fp8"], ["no fp8 math"]),
        (["linear", "--in", "64", "--out", "64", "--batch", "8", "--gpu", "v100",
          "--dtype", "bf16"], ["no bf16 math"]),
        (["linear", "--in", "64", "--out", "64", "--batch", "8", "--gpu", "b250"],
         ["unknown GPU", "did you mean"]),
        (["linear", "--in", "64", "--out", "64", "--batch", "8", "--gpu", "b300"],
         ["not in tilefit's catalog", 'base = "b200"']),
        (["linear", "--in", "64", "--out", "64", "--batch", "8", "--plot", "out.svg"],
         ["PNG", ".png"]),
        (["linear", "--in", "64", "--out", "64", "--batch", "8", "--plot", "/no/such/dir/a.png"],
         ["does not exist", "/no/such/dir"]),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(cli, args: list[str], messages: list[str]
                                                ) -> None:
    proc = cli(*args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    err = _flat(proc.stderr)
    assert err.startswith("error:"), err
    for m in messages:
        assert m in err, (m, err)
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stdout == ""


def test_negative_positional_is_a_usage_error(cli) -> None:
    # click reads "-3" as an option; still exit 2 with a usage message, no traceback
    proc = cli("gemm", "64", "-3", "64")
    assert proc.returncode == 2
    assert "No such option: -3" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_input_in_process_with_cli_runner() -> None:
    result = CliRunner().invoke(app, ["linear", "--in", "4096", "--out", "-1", "--batch", "8"])
    assert result.exit_code == 2
    assert "--out must be a positive whole number" in _flat(result.output)
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_gemm_json_is_only_json(cli) -> None:
    proc = cli("gemm", "128", "4096", "4096", "--gpu", "a100-40gb", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert set(data) >= GEMM_KEYS
    assert data["arithmetic_intensity"] == pytest.approx(120.47, abs=0.005)  # see test_gemm
    assert data["bound"] == "memory"
    assert set(data["alignment"]) == {"m", "n", "k"}
    assert data["alignment"]["k"] == {"multiple": 64, "aligned": True, "suggested": 4096,
                                      "factor": 1.0}


def test_linear_json_is_only_json(cli) -> None:
    proc = cli("linear", "--in", "4096", "--out", "4096", "--batch", "8,64,128,256,512",
               "--gpu", "a100-40gb", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["gpu"] == "a100-40gb" and data["dtype"] == "fp16"
    assert data["in_features"] == 4096 and data["out_features"] == 4096
    assert len(data["rows"]) == 15  # 5 batches x 3 GEMMs
    assert {r["phase"] for r in data["rows"]} == {"forward", "activation_grad", "weight_grad"}
    for row in data["rows"]:
        assert {"batch", "tokens", "phase", "gemm_batch"} | GEMM_KEYS <= set(row)
        assert row["gemm_batch"] == 1  # one GEMM per call: no bmm in a linear layer
    # each row carries the batch size asked for (the GEMM's count of batched GEMMs, 1, used
    # to overwrite it), three GEMMs per batch, and its tokens are batch x seq (seq 1)
    assert [r["batch"] for r in data["rows"]] == [b for b in (8, 64, 128, 256, 512)
                                                   for _ in range(3)]
    assert all(r["tokens"] == r["batch"] for r in data["rows"])
    forward = [r for r in data["rows"] if r["phase"] == "forward"]
    assert [r["m"] for r in forward] == [8, 64, 128, 256, 512]  # forward's M is T
    assert [t["batch"] for t in data["totals"]] == [8, 64, 128, 256, 512]
    for t in data["totals"]:
        assert {"flops", "predicted_time_s", "predicted_tflops"} <= set(t)
    assert data["recommendations"]["min_math_bound_batch"] == 223  # see test_linear
    assert data["recommendations"]["aligned_batches"] == [64, 128, 256, 512]


def test_linear_default_gpu_is_a100_80gb(cli) -> None:
    proc = cli("linear", "--in", "1024", "--out", "1024", "--batch", "64", "--json")
    assert json.loads(proc.stdout)["gpu"] == "a100-80gb"


def test_gpus_json(cli) -> None:
    proc = cli("gpus", "--json")
    assert proc.returncode == 0
    data = json.loads(proc.stdout)
    assert [d["name"] for d in data] == [d.name for d in list_devices()]
    for d in data:
        assert {"name", "memory_bytes", "sms", "bandwidth_bytes_per_s", "peak_flops_per_s",
                "alignment_bytes", "source"} <= set(d)
        assert d["source"]


def test_human_output_mentions_the_recommendation(cli) -> None:
    proc = cli("linear", "--in", "4096", "--out", "4096", "--batch", "8,64,128,256,512",
               "--gpu", "a100-40gb")
    assert proc.returncode == 0, proc.stderr
    out = _flat(proc.stdout)
    assert "math-bound from batch 223" in out
    assert "aligned choice is 256" in out
    assert "8->64" in out


@pytest.mark.parametrize(
    "args",
    [["gemm", "64", "64", "64", "--json"],
     ["linear", "--in", "64", "--out", "64", "--batch", "8,16", "--json"],
     ["gpus", "--json"]],
)
def test_fast_commands_do_not_import_torch(cli, args: list[str]) -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "tilefit", *args],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    imported = [line for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert len(imported) > 50  # the import log is really there
    assert not [line for line in imported if "torch" in line]
    assert not [line for line in imported if "matplotlib" in line]


def test_plot_writes_a_png(cli, tmp_path: Path) -> None:
    out = tmp_path / "fc.png"
    proc = cli("linear", "--in", "4096", "--out", "1024", "--batch", "64,256", "--gpu",
               "a100-80gb", "--plot", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    json.loads(proc.stdout)  # the plot notice went to stderr, stdout is still only JSON
    assert "plot written" in proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 10_000
