"""docs/architecture.md names only what exists (issue 44, item 7): every file, folder,
module, class, function or constant it writes in backticks is in the repository, so the map
cannot drift from the code unnoticed; and it stays a map a newcomer can hold."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "tilefit"
DOC = ROOT / "docs" / "architecture.md"
MAX_WORDS = 1500
# names of other libraries and of Python the map mentions (torch's nn.Module, ...)
FOREIGN = ("torch", "nn", "transformers", "peft", "typer", "BitsAndBytesConfig",
           "TYPE_CHECKING")


def _spans() -> list[str]:
    text = re.sub(r"```.*?```", "", DOC.read_text(encoding="utf-8"), flags=re.S)
    return re.findall(r"`([^`]+)`", text)


def _defined() -> set[str]:
    """Every name a module, class, function or module-level assignment defines under src/."""
    names = {"tilefit"}
    for path in SRC.rglob("*.py"):
        names.update((path.stem, path.parent.name))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
    return names


def _file_exists(span: str) -> bool:
    span = span.rstrip("/")
    if span.startswith(("src/", "tests/", "docs/", "benchmarks/")):
        return bool(list(ROOT.glob(span)))
    return bool(list(SRC.glob(span)) or list(SRC.glob(f"**/{span}")))


def test_every_name_in_the_architecture_exists() -> None:
    defined = _defined()
    missing = []
    for span in _spans():
        if span.endswith((".py", "/")) or "/" in span:
            if not _file_exists(span):
                missing.append(span)
            continue
        name = span.removesuffix("()")
        if not re.fullmatch(r"[A-Za-z_][\w.]*", name):
            continue  # a command, a flag, a value
        parts = name.split(".")
        if parts[0] in FOREIGN:
            continue
        if not all(p in defined for p in parts):
            missing.append(span)
    assert not missing, f"docs/architecture.md names what does not exist: {missing}"


def test_the_architecture_is_a_map_a_newcomer_can_hold() -> None:
    words = len(DOC.read_text(encoding="utf-8").split())
    assert words <= MAX_WORDS, f"docs/architecture.md has {words} words (at most {MAX_WORDS})"
