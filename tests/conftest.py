"""Shared helpers: run the CLI in a fresh interpreter, as a user would; and an empty profile
cache for every test."""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tilefit.hardware.profiles import CACHE_ENV, NO_PROFILE_ENV, clear_profile_cache

_WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ... under pytest-xdist
if _WORKER:
    # Workers share the cores: one thread each (and in the processes a test starts), not one
    # per core each; and each its own rendezvous port, so that two tests launching torchrun
    # at once on two workers do not both take its default 29500 (torchrun reads --master-port
    # from PET_MASTER_PORT). The workers already take every core: an audit's or plan's
    # background traces (tracing.background) would only oversubscribe them;
    # tests/test_background.py turns them on where it checks them.
    import torch

    os.environ["TILEFIT_JOBS"] = "1"
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    os.environ["PET_MASTER_PORT"] = str(29500 + 11 * (1 + int(_WORKER.removeprefix("gw"))))


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


def invoke_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`tilefit ARGS` in this process (typer's CliRunner), answered as run_cli answers: the
    exit code, stdout, and stderr with the traceback Python would print for an exception
    that escaped the command. For what a command says and its exit code; a fresh process
    (run_cli, ~8 s of imports each) where the test is about one: imports, the libraries'
    import-time log lines, the real entry point."""
    from typer.testing import CliRunner

    from tilefit.cli.app import app

    r = CliRunner().invoke(app, list(args))
    err = r.stderr
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        err += "".join(traceback.format_exception(r.exception))
    return subprocess.CompletedProcess(["tilefit", *args], r.exit_code, r.stdout, err)


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def clip_calls(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The max_norm of every torch.nn.utils.clip_grad_norm_ call while the test runs (the
    clipping still happens): which loop a live trial ran."""
    import torch

    calls: list[float] = []
    clip = torch.nn.utils.clip_grad_norm_

    def spy(params: Any, max_norm: float, *args: Any, **kwargs: Any) -> Any:
        calls.append(max_norm)
        return clip(params, max_norm, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    return calls
