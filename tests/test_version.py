"""`tilefit --version`: tilefit's version, then one line per library whose internals it reads
(torch with its build, transformers, peft, bitsandbytes, torchao, accelerate, lightning) as
installed, any outside the tested set marked: what an issue report needs (issue 43, item 5)."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest
import torch
from tests.conftest import invoke_cli, run_cli

from tilefit.compat import probes

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "torchao")


def _tested(name: str = "constraints.txt") -> dict[str, str]:
    """A tested set as the repository's constraints file pins it (not tilefit's table)."""
    return dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", (ROOT / name).read_text(), re.M))


def _lines(stdout: str) -> dict[str, str]:
    """Each line of the report by its first word (the distribution's name)."""
    return {line.split()[0]: line for line in stdout.splitlines() if line.strip()}


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def test_version_names_each_library_as_installed() -> None:
    out = run_cli("--version")  # the real entry point, in a fresh process
    assert out.returncode == 0 and out.stderr == "", out.stderr
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert version is not None
    assert out.stdout.splitlines()[0] == f"tilefit {version.group(1)}"
    lines, tested, lowest = _lines(out.stdout), _tested(), _tested("constraints-lowest.txt")
    for lib in LIBRARIES:
        have = _installed(lib)
        if have is None:
            assert lines[lib] == f"{lib} not installed"
            continue
        assert lines[lib].startswith(f"{lib} {have}"), lines[lib]
        outside = have.split("+", 1)[0] not in (tested[lib], lowest[lib])
        assert ("not tested" in lines[lib]) == outside, lines[lib]
    if torch.version.hip:
        build = f"(ROCm {torch.version.hip} build)"
    else:
        build = f"(CUDA {torch.version.cuda} build)" if torch.version.cuda else "(CPU build)"
    # the distribution's version (a PyPI CUDA wheel says 2.11.0 where torch.__version__ says
    # 2.11.0+cu130)
    assert lines["torch"].startswith(f"torch {_installed('torch')} {build}"), lines["torch"]


def test_a_library_outside_the_tested_set_is_marked(monkeypatch: pytest.MonkeyPatch) -> None:
    have = _installed("transformers")
    assert have is not None  # a dependency of tilefit
    monkeypatch.setitem(probes.TESTED, "transformers", "0.0.1")
    monkeypatch.setitem(probes.LOWEST, "transformers", "0.0.1")
    real = probes.installed
    monkeypatch.setattr(probes, "installed", lambda d: None if d == "peft" else real(d))
    out = invoke_cli("--version")
    assert out.returncode == 0, out.stderr
    lines = _lines(out.stdout)
    assert lines["transformers"] == (
        f"transformers {have}  (not tested: tilefit was tested with 0.0.1)")
    assert lines["peft"] == "peft not installed"
    for lib in ("torch", "bitsandbytes", "torchao", "accelerate"):  # the tested ones unmarked
        if lib in lines and probes.untested(lib) is None:
            assert "not tested" not in lines[lib], lines[lib]
