"""The versions tilefit was tested with, and what a trace could not check of a library's
internals: said in the estimate's notes instead of predicting as if nothing were there.

tilefit reads library internals (transformers' kernel wrappers and mask rule, peft's LoRA
target rule, bitsandbytes' kernel choice, torch's private tracing APIs): a new release can
change them without an error. Each compat probe calls ``read`` when it reads a library, and
``went_blind`` when it finds nothing where the tested version has something. A trace run
inside ``collecting`` turns what was reported into notes, one line each: the probe that
went blind (the library, its version, what could not be checked and what the trace did
instead), and each library read whose installed version is not the tested one.

``TESTED`` is the tested set's entry for each library whose internals tilefit reads: the
exact versions in the repository's ``constraints.txt``; ``LOWEST`` the lowest set the suite
also passed with, ``constraints-lowest.txt`` (pyproject.toml's lower bounds). Both are
rewritten by ``scripts/update_constraints.py`` (``tests/test_probes.py`` checks that each
table and its file agree).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Iterator
from importlib import metadata

# distribution -> the version the suite passed with (constraints.txt)
TESTED: dict[str, str] = {
    "torch": "2.13.0",
    "transformers": "5.25.0",
    "peft": "0.21.2",
    "bitsandbytes": "0.50.2",
    "torchao": "0.18.0",
    "accelerate": "1.16.0",
    "lightning": "2.6.6",
}

# distribution -> the lowest version the suite passed with (constraints-lowest.txt)
LOWEST: dict[str, str] = {
    "torch": "2.11.0",
    "transformers": "5.25.0",
    "peft": "0.21.0",
    "bitsandbytes": "0.50.0",
    "torchao": "0.18.0",
    "accelerate": "1.16.0",
    "lightning": "2.6.0",
}


@functools.cache
def installed(distribution: str) -> str | None:
    """The installed version of a distribution, or None where it is not installed."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def release(version: str) -> str:
    """A version without its local part: torch's "2.13.0+cpu" and "2.13.0+cu128" are one
    release."""
    return version.split("+", 1)[0]


def is_tested(distribution: str, version: str) -> bool:
    """Whether the suite passed with this release of the distribution: the newest or the
    lowest tested set's."""
    return release(version) in (TESTED.get(distribution), LOWEST.get(distribution))


def tested_text(distribution: str) -> str:
    """The tested releases of a distribution as a note says them: "2.13.0 and 2.11.0"."""
    newest, lowest = TESTED.get(distribution, "?"), LOWEST.get(distribution)
    return newest if lowest in (None, newest) else f"{newest} and {lowest}"


def untested(distribution: str) -> str | None:
    """The installed version where it is not a tested one; None where it is, or where the
    distribution is not installed or has no tested version."""
    have = installed(distribution)
    if have is None or distribution not in TESTED or is_tested(distribution, have):
        return None
    return have


@dataclasses.dataclass(frozen=True)
class LibraryVersion:
    """One library of the tested set as installed here (``tilefit --version``)."""

    name: str  # the distribution
    version: str | None  # the installed version; None where it is not installed
    tested: str  # the version tilefit was tested with
    build: str | None = None  # torch's: "CPU build", "CUDA 12.8 build", "ROCm 6.3 build"

    @property
    def untested(self) -> bool:
        """Installed at a release other than the tested ones."""
        return self.version is not None and not is_tested(self.name, self.version)


def library_versions() -> list[LibraryVersion]:
    """Each library of the tested set, in TESTED's order: its installed version (torch's
    with its build) beside the tested one."""
    return [LibraryVersion(name, installed(name), tested,
                           torch_build() if name == "torch" and installed(name) else None)
            for name, tested in TESTED.items()]


def torch_build() -> str | None:
    """What the installed torch was built for, read from ``torch.version`` (its ``cuda`` and
    ``hip`` fields): from the file itself where torch is not imported yet (importing it takes
    seconds), else from the module; None where neither can be read."""
    import sys

    fields = _torch_version_fields() if "torch" not in sys.modules else None
    if fields is None:
        try:
            import torch.version
        except ImportError:
            return None
        fields = vars(torch.version)
    if fields.get("hip"):
        return f"ROCm {fields['hip']} build"
    return f"CUDA {fields['cuda']} build" if fields.get("cuda") else "CPU build"


def _torch_version_fields() -> dict[str, object] | None:
    """The literal module-level assignments of torch/version.py, which torch's build writes;
    None where the file cannot be read or has no ``cuda`` field."""
    import ast
    import importlib.util
    from pathlib import Path

    try:
        spec = importlib.util.find_spec("torch")
        roots = list(spec.submodule_search_locations or ()) if spec is not None else []
        tree = ast.parse(Path(roots[0], "version.py").read_text(encoding="utf-8"))
    except (ImportError, IndexError, OSError, SyntaxError, ValueError):
        return None
    fields: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name):
            with contextlib.suppress(ValueError, TypeError, SyntaxError, RecursionError):
                fields[target.id] = ast.literal_eval(value)
    return fields if "cuda" in fields else None  # another layout: ask the module


@dataclasses.dataclass(frozen=True)
class Blind:
    """A probe that found nothing where the tested version of its library has something."""

    library: str  # the distribution whose internals were read (transformers, peft, ...)
    what: str  # what could not be checked, and what the trace did instead

    @property
    def note(self) -> str:
        have = installed(self.library) or "(not installed)"
        against = (f"; tilefit was tested with {tested_text(self.library)}"
                   if self.library in TESTED else "")
        return (f"{self.library} {have}: tilefit could not check {self.what}{against} "
                "(run `tilefit --version` to see the tested set)")


@dataclasses.dataclass
class _Reports:
    blind: dict[Blind, None] = dataclasses.field(default_factory=dict)
    read: dict[str, None] = dataclasses.field(default_factory=dict)

    def notes(self) -> list[str]:
        lines = [b.note for b in self.blind]
        for lib in self.read:
            have = untested(lib)
            if have is not None:
                lines.append(
                    f"{lib} {have} is not a version tilefit was tested with "
                    f"({tested_text(lib)}): what tilefit reads of its internals is unchecked "
                    f"there (pip install {lib}=={TESTED[lib]} for the tested one)")
        return lines


_REPORTS: contextvars.ContextVar[_Reports | None] = contextvars.ContextVar(
    "tilefit_probe_reports", default=None)


def read(library: str) -> None:
    """A probe read this library's internals (its version is then checked)."""
    reports = _REPORTS.get()
    if reports is not None:
        reports.read.setdefault(library)


def read_model(model: object) -> None:
    """The libraries whose classes make up a traced model (transformers' layers, peft's
    adapters, bitsandbytes' and torchao's linears): tilefit reads their internals."""
    modules = getattr(model, "modules", None)
    if not callable(modules):
        return
    for m in modules():
        top = type(m).__module__.split(".", 1)[0]
        if top in TESTED:
            read(top)


def went_blind(library: str, what: str) -> None:
    """A probe found nothing where the tested version has something: said once per trace."""
    reports = _REPORTS.get()
    if reports is not None:
        reports.read.setdefault(library)
        reports.blind.setdefault(Blind(library, what))


@contextlib.contextmanager
def collecting() -> Iterator[list[str]]:
    """Collect the probes' reports while the block runs; on exit the yielded list holds
    their notes (a nested block, a trace inside a traced step, collects its own)."""
    reports = _Reports()
    token = _REPORTS.set(reports)
    notes: list[str] = []
    try:
        yield notes
    finally:
        _REPORTS.reset(token)
        notes.extend(reports.notes())
