"""The tested versions are what pyproject.toml declares (issue 43, items 2 and 3): each library
whose internals tilefit reads is bounded below by the lowest tested release and above by the
next series not tested, and scripts/update_constraints.py's pieces do what its README says."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tilefit.compat import probes

ROOT = Path(__file__).resolve().parents[1]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("update_constraints",
                                                  ROOT / "scripts" / "update_constraints.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


uc = _script()


def _pins(name: str) -> dict[str, str]:
    return dict(re.findall(r"^([A-Za-z0-9_.-]+)==([^\s;]+)", (ROOT / name).read_text(), re.M))


def _specifiers() -> dict[str, list[Requirement]]:
    reqs: dict[str, list[Requirement]] = {}
    for text in uc.pyproject_requirements(ROOT / "pyproject.toml"):
        req = Requirement(text)
        reqs.setdefault(uc.canonical(req.name), []).append(req)
    return reqs


def test_each_read_library_is_bounded_by_the_tested_releases() -> None:
    for lib in probes.TESTED:
        declared = _specifiers()[lib]  # every library of the set is declared somewhere
        newest, lowest = Version(probes.TESTED[lib]), Version(probes.LOWEST[lib])
        # the next series: 5.25.0 -> 5.26.0, 0.21.2 -> 0.22.0
        untried = Version(f"{newest.major}.{newest.minor + 1}.0")
        below = Version(f"{lowest.base_version}.dev0")  # anything before the lowest release
        for req in declared:
            assert req.specifier.contains(newest) and req.specifier.contains(lowest), (lib, req)
            assert not req.specifier.contains(untried), f"{req}: no upper bound below {untried}"
            assert not req.specifier.contains(below, prereleases=True), (
                f"{req}: admits releases before {lowest}, which were not tested")


def test_the_lowest_set_is_the_lowest_constraints_file_and_pyprojects_bounds() -> None:
    pinned = _pins("constraints-lowest.txt")
    assert {lib: pinned.get(lib) for lib in probes.LOWEST} == probes.LOWEST
    bounds = uc.lower_bounds(uc.pyproject_requirements(ROOT / "pyproject.toml"),
                             list(probes.TESTED))
    assert {lib: Version(v) for lib, v in bounds.items()} == {
        lib: Version(v) for lib, v in probes.LOWEST.items()}


def test_pins_moves_and_failures_are_read_as_written() -> None:
    freeze = "# a comment\nTorch==2.13.0+cpu\npeft==0.21.2\nzope.interface==7.1\n-e /x\n"
    pins = uc.read_pins(freeze)
    assert pins == {"torch": "2.13.0+cpu", "peft": "0.21.2", "zope-interface": "7.1"}
    assert uc.moved({"peft": "0.21.2", "old": "1"}, {"peft": "0.22.0", "new": "2"}) == [
        ("new", None, "2"), ("old", "1", None), ("peft", "0.21.2", "0.22.0")]
    out = ("....F\nFAILED tests/test_a.py::test_x - AssertionError: no\n"
           "ERROR tests/test_b.py::test_y - ImportError\n1 failed, 1 error\n")
    assert uc.failed_tests(out) == ["tests/test_a.py::test_x", "tests/test_b.py::test_y"]
    text = uc.render({"b": "2", "a": "1"}, "# head\n")
    assert text == "# head\na==1\nb==2\n" and uc.read_pins(text) == {"a": "1", "b": "2"}


def test_lower_bounds_take_the_highest_and_refuse_a_missing_one() -> None:
    reqs = ["peft>=0.13", "peft>=0.21,<0.22", "torch>=2.11,<2.14", "rich>=13"]
    assert uc.lower_bounds(reqs, ["peft", "torch"]) == {"peft": "0.21", "torch": "2.11"}
    with pytest.raises(SystemExit, match=r"no lower bound .* for transformers"):
        uc.lower_bounds(["transformers<5.26"], ["transformers"])


def test_the_probe_tables_are_rewritten_in_place() -> None:
    source = (ROOT / "src" / "tilefit" / "compat" / "probes.py").read_text()
    assert uc.tested_names(source) == list(probes.TESTED)
    rewritten = uc.with_table(source, "LOWEST", {"torch": "2.12.0", "peft": "0.21.1"})
    namespace: dict[str, object] = {}
    exec(compile(rewritten, "probes.py", "exec"), namespace)
    assert namespace["LOWEST"] == {**probes.LOWEST, "torch": "2.12.0", "peft": "0.21.1"}
    assert namespace["TESTED"] == probes.TESTED
