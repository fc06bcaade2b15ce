"""The Python examples of the README and docs/ call tilefit's current API: every keyword they
pass to a public name is one of its parameters (0.1.0's keywords are refused, so an example
in them would fail for whoever copies it). Running them needs a GPU for tune; this checks
each call against the signature instead."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

import tilefit

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [(page.name, i, block) for page in PAGES for i, block in enumerate(
    re.findall(r"```python\n(.*?)```", page.read_text(), re.S))]


def _public_calls(tree: ast.AST) -> list[tuple[str, ast.Call]]:
    """Each call of a tilefit public name: ``tilefit.X(...)``, or ``X(...)`` after ``from
    tilefit import X``."""
    imported = {a.asname or a.name for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module == "tilefit"
                for a in node.names}
    calls = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) \
                and f.value.id == "tilefit":
            calls.append((f.attr, node))
        elif isinstance(f, ast.Name) and f.id in imported:
            calls.append((f.id, node))
    return calls


def test_the_pages_have_examples_that_call_tilefit() -> None:
    names = {name for _, _, block in BLOCKS for name, _ in _public_calls(ast.parse(block))}
    assert {"estimate", "trace", "tune", "noise_scale", "TuneSearch", "Recipe"} <= names


@pytest.mark.parametrize(("page", "index", "block"), BLOCKS,
                         ids=[f"{p}-{i}" for p, i, _ in BLOCKS])
def test_each_example_passes_only_current_keywords(page: str, index: int, block: str) -> None:
    for name, call in _public_calls(ast.parse(block)):
        params = inspect.signature(getattr(tilefit, name)).parameters
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            continue
        unknown = [k.arg for k in call.keywords if k.arg is not None and k.arg not in params]
        assert not unknown, f"{page}, example {index + 1}: {name}() takes no {unknown}"
