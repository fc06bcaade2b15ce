"""Shared helpers: run the CLI in a fresh interpreter, as a user would."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run_cli(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """`python -m tilefit ARGS` in a subprocess (the test environment's interpreter)."""
    return subprocess.run(
        [sys.executable, "-m", "tilefit", *args],
        capture_output=True, text=True, timeout=timeout_s, check=False,
    )


@pytest.fixture
def cli():
    return run_cli
