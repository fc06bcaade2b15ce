"""hardware/ sits below calibrate/: no module under src/tilefit/hardware imports
tilefit.calibrate (calibrate imports hardware to save what it fitted, never the reverse)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import tilefit.hardware

HARDWARE_DIR = Path(tilefit.hardware.__file__).parent
FORBIDDEN = "tilefit.calibrate"


def _forbidden(module: str) -> bool:
    return module == FORBIDDEN or module.startswith(FORBIDDEN + ".")


def upward_imports(source: str, package: str = "tilefit.hardware") -> list[str]:
    """The modules under tilefit.calibrate that ``source`` (a module of ``package``) imports:
    import statements anywhere (module level or inside functions), relative ones resolved,
    and importlib.import_module / __import__ calls with a literal name."""
    found = []
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
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            arg = node.args[0]
            if fname in ("import_module", "__import__") and isinstance(arg, ast.Constant) \
                    and isinstance(arg.value, str):
                names = [arg.value]
        found += [n for n in names if _forbidden(n)]
    return found


def test_the_checker_sees_every_form_of_import() -> None:
    assert upward_imports("import tilefit.calibrate.store") == ["tilefit.calibrate.store"]
    assert upward_imports("def f():\n    from tilefit.calibrate.fit import x\n")
    assert upward_imports("from tilefit import calibrate") == ["tilefit.calibrate"]
    assert upward_imports("from ..calibrate import run") == ["tilefit.calibrate",
                                                             "tilefit.calibrate.run"]
    assert upward_imports("import importlib\nimportlib.import_module('tilefit.calibrate')")
    assert upward_imports("import tilefit.calibrated_thing, tilefit.hardware.profiles") == []
    assert upward_imports("from . import profiles\nfrom .profiles import save_profile") == []


def test_no_hardware_module_imports_calibrate() -> None:
    files = sorted(HARDWARE_DIR.glob("**/*.py"))
    names = {f.name for f in files}
    assert {"__init__.py", "lookup.py", "cpu.py", "profiles.py"} <= names, names
    offenders = {}
    for f in files:
        parts = f.relative_to(HARDWARE_DIR).with_suffix("").parts
        package = ".".join(["tilefit", "hardware", *parts[:-1]])
        bad = upward_imports(f.read_text(), package)
        if bad:
            offenders[str(f.relative_to(HARDWARE_DIR))] = bad
    assert not offenders, f"hardware/ imports calibrate/: {offenders}"


def test_a_device_lookup_loads_nothing_from_calibrate() -> None:
    code = ("import sys; from tilefit.hardware import get_device; get_device('h200'); "
            "print(sorted(m for m in sys.modules if m.startswith('tilefit.calibrate')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]"
