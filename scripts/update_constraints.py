"""Regenerate the tested versions: constraints.txt (newest) or constraints-lowest.txt (lowest).

A maintainer command (README: 'Keeping the tested versions'). It builds a scratch virtual
environment, installs tilefit with every extra into it, runs the whole suite there and then:

- green: rewrites the constraints file from ``pip freeze`` (tilefit itself left out) and the
  matching table in ``src/tilefit/compat/probes.py`` (TESTED or LOWEST), which
  ``tilefit --version`` and the trace's version notes read;
- red: prints each failed test and each version that moved against the committed file, and
  leaves both files alone (exit status 1).

Newest (the default): the newest release the registry offers of every dependency, torch kept
at the README's pin (a torch bump is a change of its own: ``--torch``). Lowest (``--lowest``):
every library whose internals tilefit reads (probes.TESTED's names) at the lower bound that
pyproject.toml declares for it, the rest resolved by pip; torch's lower bound comes from PyPI
as a CUDA build (several GB; it runs on the CPU).

Usage, from the repository root:  python3 scripts/update_constraints.py [--lowest]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PROBES = ROOT / "src" / "tilefit" / "compat" / "probes.py"
EXTRAS = "test,bench,peft,fp8,quant"
HEADER = {
    "constraints.txt": (
        "# The exact versions tilefit's suite last passed with (Python 3.11, Linux x86-64):\n"
        "# pip install -c constraints.txt ... installs them. Regenerate with\n"
        "# scripts/update_constraints.py (README: 'Keeping the tested versions').\n"),
    "constraints-lowest.txt": (
        "# The lowest versions tilefit's suite passed with (Python 3.11, Linux x86-64): the\n"
        "# lower bounds pyproject.toml declares for the libraries whose internals tilefit\n"
        "# reads. Regenerate with scripts/update_constraints.py --lowest (README: 'Keeping the\n"
        "# tested versions').\n"),
}
TABLE = {"constraints.txt": "TESTED", "constraints-lowest.txt": "LOWEST"}
_PIN = re.compile(r"^([A-Za-z0-9_.-]+)==([^\s;]+)", re.M)


def read_pins(text: str) -> dict[str, str]:
    """``name==version`` lines (a constraints file, ``pip freeze``) as {name: version}, names
    in their canonical form (lower case, '-' for '_' and '.')."""
    return {canonical(name): version for name, version in _PIN.findall(text)}


def canonical(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def moved(old: dict[str, str], new: dict[str, str]) -> list[tuple[str, str | None, str | None]]:
    """Each distribution whose version differs between two pin sets, by name: (name, old,
    new), None where a side lacks it."""
    return [(name, old.get(name), new.get(name)) for name in sorted(old.keys() | new.keys())
            if old.get(name) != new.get(name)]


def failed_tests(pytest_output: str) -> list[str]:
    """The node ids pytest's short summary names as FAILED or ERROR."""
    return re.findall(r"^(?:FAILED|ERROR) (\S+)", pytest_output, re.M)


def lower_bounds(requirements: list[str], names: list[str]) -> dict[str, str]:
    """The version each named distribution's ``>=`` bound gives, the highest where several
    requirements name it; a named distribution with no lower bound is an error."""
    bounds: dict[str, str] = {}
    for text in requirements:
        req = Requirement(text)
        name = canonical(req.name)
        for spec in req.specifier:
            if spec.operator == ">=" and name in names and (
                    name not in bounds or Version(spec.version) > Version(bounds[name])):
                bounds[name] = spec.version
    missing = [n for n in names if n not in bounds]
    if missing:
        raise SystemExit(f"pyproject.toml declares no lower bound (>=) for {', '.join(missing)}:"
                         " add one, then run --lowest again")
    return bounds


def pyproject_requirements(pyproject: Path) -> list[str]:
    """Every requirement pyproject.toml declares: the dependencies and each extra's."""
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    extras = project.get("optional-dependencies", {})
    return list(project["dependencies"]) + [r for reqs in extras.values() for r in reqs]


def render(pins: dict[str, str], header: str) -> str:
    """A constraints file: the header, then one ``name==version`` line a distribution."""
    return header + "".join(f"{name}=={pins[name]}\n" for name in sorted(pins))


def with_table(source: str, table: str, pins: dict[str, str]) -> str:
    """probes.py's source with each entry of its ``table`` dict set to the pinned version."""
    start = source.index(f"{table}: dict[str, str] = {{")
    end = source.index("}", start)

    def entry(m: re.Match[str]) -> str:
        version = pins.get(canonical(m.group(1)), m.group(2))
        return f'"{m.group(1)}": "{version}"'

    block = re.sub(r'"([A-Za-z0-9_.-]+)": "([^"]+)"', entry, source[start:end])
    return source[:start] + block + source[end:]


def tested_names(probes_source: str) -> list[str]:
    """The distributions of probes.py's TESTED table, in order."""
    start = probes_source.index("TESTED: dict[str, str] = {")
    block = probes_source[start:probes_source.index("}", start)]
    return [canonical(n) for n in re.findall(r'"([A-Za-z0-9_.-]+)": "', block)]


def _run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, text=True, **kwargs)  # type: ignore[call-overload, no-any-return]


def _install(venv: Path, torch: str, pins: dict[str, str]) -> None:
    _run([sys.executable, "-m", "venv", str(venv)], check=True)
    wanted = [f"torch=={torch}", *(f"{n}=={v}" for n, v in pins.items() if n != "torch")]
    _run([str(venv / "bin" / "pip"), "install", "-q", "--upgrade", *wanted,
          "-e", f"{ROOT}[{EXTRAS}]"], check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lowest", action="store_true",
                        help="pin the read libraries at pyproject's lower bounds")
    parser.add_argument("--torch", help="torch version for the newest set "
                        "(default: the one constraints.txt pins)")
    parser.add_argument("--venv", type=Path, help="build the environment here and keep it")
    args = parser.parse_args(argv)
    target = "constraints-lowest.txt" if args.lowest else "constraints.txt"
    committed = read_pins((ROOT / "constraints.txt").read_text(encoding="utf-8"))
    probes_source = PROBES.read_text(encoding="utf-8")
    if args.lowest:
        pins = lower_bounds(pyproject_requirements(ROOT / "pyproject.toml"),
                            tested_names(probes_source))
        torch = pins["torch"]
    else:
        pins, torch = {}, args.torch or committed["torch"]
    with tempfile.TemporaryDirectory(prefix="tilefit-constraints-") as scratch:
        venv = args.venv or Path(scratch) / "venv"
        _install(venv, torch, pins)
        freeze = _run([str(venv / "bin" / "pip"), "freeze", "--exclude-editable"],
                      capture_output=True, check=True).stdout
        suite = _run([str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p",
                      "no:cacheprovider"], cwd=ROOT, capture_output=True)
    new = {n: v.split("+", 1)[0] for n, v in read_pins(freeze).items() if n != "tilefit"}
    old_path = ROOT / target
    old = read_pins(old_path.read_text(encoding="utf-8")) if old_path.exists() else {}
    changes = [f"  {n}: {a or '-'} -> {b or '-'}" for n, a, b in moved(old, new)]
    if suite.returncode != 0:
        print(suite.stdout[-4000:])
        print(f"the suite failed with these versions; {target} is left as it was.\n"
              "failed:\n  " + "\n  ".join(failed_tests(suite.stdout) or ["(see above)"]))
        print("versions that moved:\n" + ("\n".join(changes) or "  none"))
        return 1
    old_path.write_text(render(new, HEADER[target]), encoding="utf-8")
    PROBES.write_text(with_table(probes_source, TABLE[target], new), encoding="utf-8")
    print(f"the suite passed; wrote {target} and probes.{TABLE[target]}; moved:\n"
          + ("\n".join(changes) or "  none"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
