"""The code cites only files that ship with the repository.

Sources are cited by the repository's references page (docs/) and a section number; a path
outside the repository (a shared notes folder, a design document that is not checked in) is a
dead reference for every reader but its author.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("src", "tests", "benchmarks")
REFERENCES = ROOT / "docs" / "references.md"
# Built by concatenation so that this file does not match itself.
FORBIDDEN = ("shared" + "/reference", ".." + "/shared", "DESIGN" + ".md")
CITE = "docs/" + "references.md"
# e.g. "<CITE>, section 7" or "<CITE>, sections 1-4"
CITATION = re.compile(re.escape(CITE) + r",\s+sections?\s+(\d+)(?:\s*-\s*(\d+))?")
HEADING = re.compile(r"^## (\d+)\. \S", re.MULTILINE)


def _files() -> list[Path]:
    out = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*")):
            generated = "__pycache__" in path.parts or any(
                part.endswith(".egg-info") for part in path.parts)  # pip's copy of the README
            if path.is_file() and not generated and path.suffix != ".pyc":
                out.append(path)
    return out


def _lines(path: Path) -> list[str]:
    return path.read_bytes().decode("utf-8", errors="replace").splitlines()


def _where(path: Path, lineno: int) -> str:
    return f"{path.relative_to(ROOT)}:{lineno}"


def test_no_reference_to_files_outside_the_repository() -> None:
    hits = [
        f"{_where(path, i)}: {needle!r}"
        for path in _files()
        for i, line in enumerate(_lines(path), 1)
        for needle in FORBIDDEN
        if needle in line
    ]
    assert not hits, f"cite {CITE}, section N instead:\n" + "\n".join(hits)


def test_every_cited_section_exists() -> None:
    sections = {int(n) for n in HEADING.findall(REFERENCES.read_text(encoding="utf-8"))}
    assert sections, f"no '## N. Title' headings in {REFERENCES}"
    missing, bare = [], []
    for path in _files():
        for i, line in enumerate(_lines(path), 1):
            if CITE not in line:
                continue
            cited = CITATION.findall(line)
            if not cited:
                bare.append(_where(path, i))
            for first, last in cited:
                for n in range(int(first), int(last or first) + 1):
                    if n not in sections:
                        missing.append(f"{_where(path, i)}: section {n}")
    assert not missing, f"sections not in {CITE}:\n" + "\n".join(missing)
    assert not bare, f"cite {CITE} with ', section N' on the same line:\n" + "\n".join(bare)


def test_the_code_cites_the_references() -> None:
    # Guards the two tests above against scanning nothing.
    assert any(CITE in line for path in _files() for line in _lines(path))


# ---- one vocabulary, short functions (issue: codebase a newcomer can read) ----------------
MAX_FUNCTION_LINES = 60  # issue 24: no function over 60 lines
PRECISION_HOMES = 3  # the vocabulary, and at most two files that document or parse input


def test_precision_spellings_live_in_the_vocabulary() -> None:
    import tilefit.vocab as vocab

    spelled = "bf16" + "-mixed"
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "src").rglob("*.py")
                   if spelled in p.read_text(encoding="utf-8"))
    assert str(Path(vocab.__file__).resolve().relative_to(ROOT)) in files
    assert len(files) <= PRECISION_HOMES, f"{spelled!r} spelled in: {files}"


def test_no_function_is_longer_than_the_limit() -> None:
    import ast

    long_ones = []
    for path in sorted((ROOT / "src").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long_ones.append(f"{_where(path, node.lineno)} {node.name}: {lines} lines")
    assert not long_ones, "split these into named steps:\n" + "\n".join(long_ones)


MAX_FILE_LINES = 450  # issue 24: a module holds one idea; past this it holds several


def test_no_module_is_longer_than_the_limit() -> None:
    long_files = [f"{p.relative_to(ROOT)}: {n} lines" for p in sorted((ROOT / "src").rglob("*.py"))
                  if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_FILE_LINES]
    assert not long_files, "split these by concern:\n" + "\n".join(long_files)


def test_the_architecture_names_every_module() -> None:
    # docs/architecture.md is where a newcomer finds where things are: every module has a line
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    unnamed = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "src").rglob("*.py"))
               if p.name not in ("__init__.py", "__main__.py")
               and p.name not in doc and f"`{p.stem}`" not in doc]
    assert not unnamed, f"docs/architecture.md does not name: {unnamed}"
