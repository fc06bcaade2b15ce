"""Shared helpers: run the CLI in a fresh interpreter, as a user would; and an empty profile
cache for every test."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tilefit.hardware.profiles import CACHE_ENV, NO_PROFILE_ENV, clear_profile_cache


@pytest.fixture(autouse=True)
def tilefit_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Each test's own, empty TILEFIT_CACHE_DIR (a subprocess CLI inherits it): no test sees
    the developer's calibration profiles or TILEFIT_NO_PROFILE, nor what another test stored
    or what this process's profile cache remembers. Tests that store a profile find it here."""
    cache = tmp_path / "tilefit-cache"
    monkeypatch.setenv(CACHE_ENV, str(cache))
    monkeypatch.delenv(NO_PROFILE_ENV, raising=False)
    clear_profile_cache()
    yield cache
    clear_profile_cache()


def run_cli(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """`python -m tilefit ARGS` in a subprocess (the test environment's interpreter)."""
    return subprocess.run(
        [sys.executable, "-m", "tilefit", *args],
        capture_output=True, text=True, timeout=timeout_s, check=False,
    )


@pytest.fixture
def cli():
    return run_cli
