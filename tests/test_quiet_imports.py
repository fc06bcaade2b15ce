"""tilefit.quiet_imports: torchao's import-time warnings (pulled in by transformers whenever
torchao is installed) do not reach the user's stderr, and the user's logger levels survive."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from tilefit.quiet_imports import IMPORT_TIME_LOGGERS, quiet_imports

SRC = Path(__file__).resolve().parents[1] / "src"


def test_the_loggers_are_quiet_inside_and_restored_after() -> None:
    logs = [logging.getLogger(n) for n in IMPORT_TIME_LOGGERS]
    logs[0].setLevel(logging.DEBUG)  # a user's own setting
    try:
        with quiet_imports():
            assert all(not log.isEnabledFor(logging.WARNING) for log in logs)
        assert logs[0].level == logging.DEBUG and logs[1].level == logging.NOTSET
    finally:
        logs[0].setLevel(logging.NOTSET)


def test_building_a_hugging_face_model_prints_nothing_of_torchao() -> None:
    # a fresh process, so that transformers (and through it torchao) is imported for the first
    # time inside tilefit's model build, as in the CLI
    pytest.importorskip("torchao")
    code = ("import torch\nfrom tilefit.models.hf import build_model\n"
            "cfg = {'model_type': 'gpt2', 'n_layer': 1, 'n_embd': 32, 'n_head': 2, "
            "'vocab_size': 64, 'n_positions': 16}\n"
            "with torch.device('meta'):\n    build_model(cfg, 'causal-lm', 'sdpa')\n"
            "import torchao\nprint('built')\n")
    out = _fresh_python(code)
    assert "built" in out.stdout
    assert "Failed to load" not in out.stderr and "Enum subclass" not in out.stderr, out.stderr


def test_an_estimate_from_python_prints_nothing_of_torchao() -> None:
    # tilefit.estimate in a fresh process: the trace builds the fake model, which imports
    # transformers' modeling code (and torchao through its quantizers) for the first time
    pytest.importorskip("torchao")
    code = ("import tilefit\nfrom tilefit.models import load_workload\n"
            "w = load_workload('gpt2', seq_len=16).with_config(n_layer=1, n_embd=32, "
            "n_head=2)\ne = tilefit.estimate(w)\n"
            "import torchao\nprint('estimated', e.peak_memory_bytes > 0)\n")
    out = _fresh_python(code)
    assert "estimated True" in out.stdout
    assert out.stderr == "", out.stderr


def _fresh_python(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter (its first imports are the ones under test)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": str(SRC), "PATH": ""}, timeout=300)
    assert out.returncode == 0, out.stderr
    return out
