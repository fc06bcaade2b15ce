"""The layering of docs/architecture.md, checked over the import graph of src/tilefit.

Every import of a tilefit module is an edge from the importer's layer to the imported module's:
module-level imports, imports inside functions (lazy imports are dependencies all the same),
imports under TYPE_CHECKING, relative imports, and importlib.import_module / __import__ with a
literal name. A layer may import its own modules and the layers of lower tiers, nothing else:
no estimator -> planner, no models -> tracing, no library module -> report/ or cli/, no
hardware/ -> calibrate/. docs/architecture.md's "Layering" section draws the same table, and
the last tests keep the two in step."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "tilefit"
ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"

# Lowest first. A layer imports its own modules and the layers of the tiers below it; layers
# of one tier never import each other.
TIERS: tuple[tuple[str, ...], ...] = (
    ("leaves",),  # errors, dtypes, batches, quiet_imports, html_repr
    # every private or version-dependent API of torch, transformers and torchao
    ("compat",),
    ("hardware",),
    # vocab sits above hardware, not beside the leaves: check_precision names the catalog's
    # GPUs that support a precision (hardware never imports vocab)
    ("vocab", "gemm"),
    # the one description of a training step (recipe.py), 0.1.0's keywords refused with
    # their new spellings (old_keywords.py) and the one training step that runs it (loop.py)
    ("recipe",),
    ("models",),
    ("tracing",),
    ("estimator",),
    ("planner", "tuning", "bench", "simulation"),
    # calibrate times its grid with bench's timer and stores profiles through hardware; the
    # audit's way forward, when the step does not fit, is the planner's answer
    ("advise", "calibrate"),
    ("report",),
    ("cli",),
    ("tilefit",),  # the package itself: __init__ (lazy public names) and __main__
)
# the modules at the top of src/tilefit, by layer (a package is its own layer)
TOP_LEVEL = {"errors": "leaves", "dtypes": "leaves", "batches": "leaves",
             "quiet_imports": "leaves", "html_repr": "leaves", "units": "leaves",
             "vocab": "vocab", "gemm": "gemm",
             "gemm_cpu": "gemm",
             "linear": "gemm", "recipe": "recipe", "recipe_parts": "recipe",
             "old_keywords": "recipe", "alloc_conf": "recipe", "loop": "recipe",
             "__main__": "tilefit"}
TIER_OF = {layer: i for i, tier in enumerate(TIERS) for layer in tier}


def layer_of(module: str) -> str:
    """The layer of a tilefit module: its package under tilefit, or TOP_LEVEL's name for a
    module at the top; KeyError for a top-level module without one."""
    parts = module.split(".")
    if len(parts) == 1:
        return "tilefit"
    if (SRC / parts[1]).is_dir():
        return parts[1]
    return TOP_LEVEL[parts[1]]


def allowed(importer: str, imported: str) -> bool:
    a, b = layer_of(importer), layer_of(imported)
    return a == b or TIER_OF[b] < TIER_OF[a]


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(name: str, modules: set[str]) -> str:
    """The module ``name`` names: itself, or its longest prefix that is a module (``from
    tilefit.estimator import Estimate`` imports tilefit.estimator)."""
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def imports_of(source: str, module: str, is_package: bool = False
               ) -> list[tuple[str, int]]:
    """(dotted name, line) of every tilefit import in ``source``, the code of ``module``:
    import statements anywhere, relative ones resolved, and importlib.import_module /
    __import__ calls with a literal name. ``from X import a`` yields X.a (a module or a name
    in X: ``resolve`` tells)."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = parts[: len(parts) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            names = [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            arg = node.args[0]
            if fname in ("import_module", "__import__") and isinstance(arg, ast.Constant) \
                    and isinstance(arg.value, str):
                names = [arg.value]
        found += [(n, node.lineno) for n in names
                  if n == "tilefit" or n.startswith("tilefit.")]
    return found


def source_files() -> dict[str, Path]:
    return {module_name(f): f for f in sorted(SRC.rglob("*.py"))}


def violations(files: dict[str, Path], modules: set[str] | None = None) -> list[str]:
    """``importer -> imported (file:line)`` for every edge the tiers do not allow; ``modules``:
    every module there is (those of ``files`` by default)."""
    modules = set(files) if modules is None else modules
    out = []
    for module, path in files.items():
        for name, line in imports_of(path.read_text(encoding="utf-8"), module,
                                     path.name == "__init__.py"):
            imported = resolve(name, modules)
            if not allowed(module, imported):
                where = path.relative_to(SRC.parents[1]) if path.is_relative_to(
                    SRC.parents[1]) else path
                out.append(f"{module} -> {imported} ({where}:{line})")
    return list(dict.fromkeys(out))  # ``from X import a, b``: one edge


def test_the_checker_sees_every_form_of_import() -> None:
    mod = "tilefit.hardware.lookup"
    assert imports_of("import tilefit.calibrate.store", mod) == [("tilefit.calibrate.store", 1)]
    assert imports_of("def f():\n    from tilefit.calibrate.fit import x\n", mod) == [
        ("tilefit.calibrate.fit.x", 2)]
    assert imports_of("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from tilefit.report import plots\n", mod) == [
        ("tilefit.report.plots", 3)]
    assert imports_of("from tilefit import calibrate", mod) == [("tilefit.calibrate", 1)]
    assert imports_of("from ..calibrate import run", mod) == [("tilefit.calibrate.run", 1)]
    assert imports_of("from . import profiles", "tilefit.hardware", is_package=True) == [
        ("tilefit.hardware.profiles", 1)]
    assert imports_of("import importlib\nimportlib.import_module('tilefit.cli')", mod) == [
        ("tilefit.cli", 2)]
    assert imports_of("import tilefitx, torch\nfrom collections import abc", mod) == []


def test_the_checker_flags_an_upward_edge_and_passes_a_downward_one() -> None:
    modules = set(source_files())
    assert resolve("tilefit.estimator.Estimate", modules) == "tilefit.estimator"
    assert resolve("tilefit.estimate", modules) == "tilefit"  # a lazy name of the package
    assert layer_of("tilefit.gemm_cpu") == "gemm" and layer_of("tilefit.errors") == "leaves"
    assert layer_of("tilefit.tracing.step") == "tracing" and layer_of("tilefit") == "tilefit"
    assert not allowed("tilefit.estimator.workload_estimate", "tilefit.planner.run")
    assert not allowed("tilefit.models.sources", "tilefit.tracing.step")
    assert not allowed("tilefit.bench.sweeps", "tilefit.report.plots")
    assert not allowed("tilefit.hardware.lookup", "tilefit.calibrate.run")
    assert not allowed("tilefit.planner.run", "tilefit.tuning.tuner")  # one tier: siblings
    assert not allowed("tilefit.advise.audit", "tilefit")  # the package's names: from above
    assert allowed("tilefit.planner.search", "tilefit.estimator.offload")
    assert allowed("tilefit.cli.tune", "tilefit.report.plots")
    assert allowed("tilefit.gemm", "tilefit.gemm_cpu")


def test_a_violation_names_both_ends_and_the_line(tmp_path: Path) -> None:
    fake = tmp_path / "fake.py"
    fake.write_text("from tilefit.estimator.offload import OffloadLink\n\n\n"
                    "def f():\n    from tilefit.planner.run import plan\n")
    modules = set(source_files()) | {"tilefit.estimator.fake"}
    assert violations({"tilefit.estimator.fake": fake}, modules) == [
        f"tilefit.estimator.fake -> tilefit.planner.run ({fake}:5)"]


def test_every_module_has_a_layer() -> None:
    files = source_files()
    assert {"tilefit", "tilefit.hardware.lookup", "tilefit.planner.run"} <= set(files)
    missing = [m for m in files if layer_of(m) not in TIER_OF]
    assert not missing, f"modules without a layer (add them to TOP_LEVEL or TIERS): {missing}"


def test_the_import_graph_follows_the_layers() -> None:
    bad = violations(source_files())
    assert not bad, "imports against the layering (docs/architecture.md, Layering):\n" + \
        "\n".join(bad)


def _documented_tiers() -> list[tuple[str, ...]]:
    """The tiers drawn in docs/architecture.md's Layering section, lowest first: its first
    code block, one tier a line (highest first), each layer's name before any parenthesis."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    section = text.split("## Layering", 1)[1]
    block = section.split("```", 2)[1]
    tiers = [tuple(re.findall(r"[a-z_]+", re.sub(r"\(.*?\)", "", line)))
             for line in block.strip().splitlines()]
    return tiers[::-1]


def test_the_architecture_document_draws_the_same_tiers() -> None:
    assert _documented_tiers() == list(TIERS)


def test_a_device_lookup_loads_nothing_from_calibrate() -> None:
    """hardware/ sits below calibrate/ at run time too (calibrate writes profiles through
    hardware.profiles, never the reverse)."""
    code = ("import sys; from tilefit.hardware import get_device; get_device('h200'); "
            "print(sorted(m for m in sys.modules if m.startswith('tilefit.calibrate')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]"
