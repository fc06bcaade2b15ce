"""What the CLI prints, for people and for logs: tables that keep every header and number at
any width and when piped, the libraries' log lines and tracebacks replaced by tilefit's message
(kept under --verbose), --version, sizes in GiB/MiB, suggestions one per device, the reason a
finding is not recommended."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.table import Table
from tests.conftest import invoke_cli
from typer.testing import CliRunner

import tilefit
from tilefit.advise import Finding
from tilefit.cli.app import app
from tilefit.cli.common import TableConsole
from tilefit.errors import TilefitError
from tilefit.hardware import get_device

ROOT = Path(__file__).resolve().parents[1]
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64}


def _run(*args: str, env: dict[str, str] | None = None,
         path: Path | None = None) -> subprocess.CompletedProcess[str]:
    extra = {} if path is None else {
        "PYTHONPATH": os.pathsep.join([str(path), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "tilefit", *args], capture_output=True,
                          text=True, timeout=120, check=False,
                          env={**os.environ, **(env or {}), **extra})


def test_piped_table_keeps_every_header_and_number_at_60_columns() -> None:
    proc = _run("gpus", env={"COLUMNS": "60"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "…" not in proc.stdout  # nothing cut short
    header = next(line for line in lines if line.startswith("name"))
    for col in ("SMs", "GiB", "TB/s", "fp32", "bf16", "fp8", "align B", "eff"):
        assert col in header.split("  ") or f" {col}" in header
    data = json.loads(_run("gpus", "--json").stdout)
    for d in data:  # each device on one line: its name and its memory in whole GiB
        row = next(line for line in lines if line.split()[:1] == [d["name"]])
        assert f" {round(d['memory_bytes'] / 2**30)} " in row


def _table() -> Table:
    t = Table(title="time by module")
    t.add_column("module")
    t.add_column("time / step", justify="right")
    t.add_column("share", justify="right")
    t.add_row("model.layers.*.self_attn.k_proj", "64.70 us", "0.6%")
    t.add_row("model.layers.*.post_attention_layernorm", "168.40 us", "1.6%")
    return t


def test_narrow_terminal_stacks_rows_wide_terminal_keeps_rich() -> None:
    narrow = TableConsole(file=io.StringIO(), force_terminal=True, width=50, color_system=None)
    narrow.print(_table())
    text = narrow.file.getvalue()  # type: ignore[attr-defined]
    assert "module: model.layers.*.self_attn.k_proj" in text
    assert "time / step: 168.40 us" in text and "share: 1.6%" in text
    wide = TableConsole(file=io.StringIO(), force_terminal=True, width=120, color_system=None)
    wide.print(_table())
    assert "─" in wide.file.getvalue()  # type: ignore[attr-defined]  # Rich's own rules
    piped = TableConsole(file=io.StringIO(), width=30)
    piped.print(_table())
    lines = piped.file.getvalue().splitlines()  # type: ignore[attr-defined]
    assert lines[1].split() == ["module", "time", "/", "step", "share"]
    assert lines[3].split() == ["model.layers.*.self_attn.k_proj", "64.70", "us", "0.6%"]


def test_estimate_table_keeps_module_names_and_names_what_is_outside(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA))
    result = CliRunner().invoke(app, ["estimate", str(config), "--gpu", "h100", "--batch", "2",
                                      "--seq", "32"])
    assert result.exit_code == 0, result.output
    for name in ("model.layers.*.self_attn.k_proj", "(GPU waiting for the host)",
                 "time / step", "share"):
        assert name in result.output
    assert "…" not in result.output and "(outside modules)" not in result.output


BAD_MODEL = '''
import torch
from torch import nn

try:  # a user's model that imports torchao (its kernel libraries fail to load on a CPU)
    import torchao  # noqa: F401
except ImportError:
    pass


def build():
    return nn.Sequential(nn.Linear(32, 64), nn.Linear(32, 10))  # 64 in, 32 expected
'''


def test_a_model_error_is_tilefits_message_the_traceback_under_verbose(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "badmodel.py").write_text(BAD_MODEL)
    args = ("estimate", "badmodel:build", "--input-shape", "32", "--gpu", "h100")
    quiet = _run(*args, path=tmp_path)  # a fresh process: torchao's import lines included
    assert quiet.returncode == 2
    assert quiet.stderr.startswith("error: one training step of the model failed in module '1'")
    for noise in ("Traceback", "fake_tensor", "Failed to load", "_pytree"):
        assert noise not in quiet.stderr
    # --verbose keeps the traceback behind the message: in this process (no import lines
    # to check), where the same app writes the same stderr
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "badmodel", raising=False)
    verbose = invoke_cli("--verbose", *args)
    assert verbose.returncode == 2
    assert "Traceback" in verbose.stderr and "must have same reduction dim" in verbose.stderr
    assert verbose.stderr.rstrip().splitlines()[-4].startswith("error: one training step")


def test_version() -> None:  # the libraries' lines: tests/test_version.py
    result = CliRunner().invoke(app, ["--version"])
    pyproject = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'^version = "([^"]+)"', pyproject, re.MULTILINE)
    assert match is not None
    version = match.group(1)
    assert result.exit_code == 0 and result.output.splitlines()[0] == f"tilefit {version}"
    assert tilefit.__version__ == version


def test_gpu_suggestions_name_each_device_once() -> None:
    result = CliRunner().invoke(app, ["gemm", "64", "64", "64", "--gpu", "h100-sxm7"])
    assert result.exit_code == 2
    match = re.search(r"did you mean ([^?]+)\?", " ".join(result.output.split()))
    assert match is not None
    names = [n.strip() for n in match.group(1).split(",")]
    devices = [get_device(n).name for n in names]
    assert names == devices and len(set(devices)) == len(devices)  # catalog names, one each
    assert "h100-sxm" in names


def test_an_optimizer_close_to_a_name_is_suggested(tmp_path: Path) -> None:
    from tilefit.cli.tune import optimizer_factory

    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA))
    result = CliRunner().invoke(app, ["estimate", str(config), "--optimizer", "adam8bit"])
    assert result.exit_code == 2 and "did you mean adamw-8bit" in result.output
    with pytest.raises(TilefitError, match="did you mean adamw-8bit"):
        optimizer_factory("adam8bit")


def test_tune_table_sizes_in_gib(capsys: pytest.CaptureFixture[str]) -> None:
    from tilefit.cli.tune import _render

    trial = SimpleNamespace(kind="fit", batch_size=8, fits=True, peak_memory_bytes=3 * 2**29,
                            samples_per_s=None, time_s=1.0)
    result = SimpleNamespace(trials=[trial], max_fitting_batch_size=8, budget_bytes=2**33,
                             samples_per_s=None, world_size=1, batch_size=8,
                             accumulation_steps=1, noise=0.02, notes=(), objective="throughput",
                             global_batch_size=8)
    _render(result, None)
    out = capsys.readouterr().out
    assert "1.50 GiB" in out and "(budget 8.00 GiB)" in out
    assert f"{3 * 2**29:,}" not in out


def _finding(after_s: float, peak_after: int = 2**30, saved: int = 0,
             method: str = "retrace") -> Finding:
    return Finding(rule="r", severity="info", title="t", modules=(), dimension=None,
                   current=1, suggested=2, fix="f", reason="why", step_time_before_s=1.0,
                   step_time_after_s=after_s, peak_memory_before_bytes=peak_after + saved,
                   peak_memory_after_bytes=peak_after, method=method, recommended=False)


def test_a_finding_not_recommended_says_why() -> None:
    from tilefit.report.audit_terminal import not_recommended_because, print_findings

    device = get_device("h100")
    audit = SimpleNamespace(estimate=SimpleNamespace(overhead_bytes=2**29, device=device),
                            findings=[_finding(1 / 0.98)], combined=None)
    assert not_recommended_because(_finding(1 / 0.98), audit) == "slower: 0.980x"
    assert not_recommended_because(_finding(1 / 1.002), audit).startswith(
        "gain too small to count: 1.002x")
    big = device.memory_bytes
    assert not_recommended_because(_finding(0.5, peak_after=big), audit).startswith(
        "does not fit after the fix")
    assert not_recommended_because(_finding(1 / 0.9, saved=2**30), audit) == \
        "trade-off: saves 1.00 GiB, 0.900x the speed"
    assert not_recommended_because(_finding(1.0, method="none"), audit).startswith(
        "for information")
    console = TableConsole(file=io.StringIO(), width=200)
    print_findings(console, audit)  # type: ignore[arg-type]
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "[slower: 0.980x]" in text and "not recommended" not in text


def test_the_fixes_together_and_those_left_out() -> None:
    """2 ms for 4 samples before, 2.5 ms for 8 after: 0.5 against 0.3125 ms a sample, 1.60x."""
    from tilefit.advise.combined import CombinedFix
    from tilefit.advise.findings import Change
    from tilefit.report.audit_terminal import print_findings

    combined = CombinedFix(fixes=("a: x 1 -> 2", "b: batch_size 4 -> 8"),
                           left_out=("c: batch_size 4 -> 16",), change=Change(),
                           step_time_before_s=2e-3, step_time_after_s=2.5e-3, samples_before=4,
                           samples_after=8, peak_memory_before_bytes=1, peak_memory_after_bytes=2,
                           fits=False)
    audit = SimpleNamespace(findings=[], combined=combined)
    console = TableConsole(file=io.StringIO(), width=200)
    print_findings(console, audit)  # type: ignore[arg-type]
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "all 2 fixes together: 2.00 ms -> 2.50 ms per step (1.60x per sample), does NOT " \
        "fit: a: x 1 -> 2; b: batch_size 4 -> 8" in text
    assert "left out (each conflicts with a fix of larger gain): c: batch_size 4 -> 16" in text
