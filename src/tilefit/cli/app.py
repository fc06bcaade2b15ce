"""The typer application. Each command lives in its own module with a ``register(app)``."""

from __future__ import annotations

import importlib

import typer

from tilefit.cli import common
from tilefit.quiet_imports import library_output_shown

app = typer.Typer(
    name="tilefit",
    help="Predict and fix what makes single-GPU training slow or run out of memory.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# One line per command module; each module defines register(app). Modules are imported here,
# so a command module must not import torch at import time (gemm / linear / gpus stay fast).
COMMAND_MODULES: tuple[str, ...] = (  # in the order `tilefit --help` lists them
    "tilefit.cli.audit",
    "tilefit.cli.estimate",
    "tilefit.cli.run",
    "tilefit.cli.plan",
    "tilefit.cli.tune",
    "tilefit.cli.noise",
    "tilefit.cli.bench",
    "tilefit.cli.calibrate",
    "tilefit.cli.snapshot",
    "tilefit.cli.gpus",
    "tilefit.cli.models",
    "tilefit.cli.gemm",
    "tilefit.cli.linear",
)


def _version(value: bool) -> None:
    """tilefit's version (the installed distribution's: the package is a tier above), then
    one line per library of the tested set, what an issue report needs."""
    if value:
        from importlib.metadata import version

        from tilefit.compat.probes import library_versions, tested_text

        lines = [f"tilefit {version('tilefit')}"]
        for lib in library_versions():
            if lib.version is None:
                lines.append(f"{lib.name} not installed")
                continue
            build = f" ({lib.build})" if lib.build else ""
            mark = (f"  (not tested: tilefit was tested with {tested_text(lib.name)})"
                    if lib.untested else "")
            lines.append(f"{lib.name} {lib.version}{build}{mark}")
        typer.echo("\n".join(lines))
        raise typer.Exit()


@app.callback()
def _global_options(
    ctx: typer.Context,
    verbose: bool = typer.Option(
        False, "--verbose", "-v", help="Keep the libraries' own log lines, warnings, progress "
        "bars and tracebacks (PyTorch, transformers, peft, bitsandbytes, torchao), which "
        "tilefit otherwise silences, saying what matters in its own notes. Before the "
        "command: tilefit --verbose estimate ..."),
    version: bool = typer.Option(
        False, "--version", is_eager=True, callback=_version,
        help="Print tilefit's version and those of torch (CPU or CUDA build), transformers, "
        "peft, bitsandbytes, torchao, accelerate and lightning, marking any outside the "
        "tested set, and exit."),
) -> None:
    """Predict and fix what makes single-GPU training slow or run out of memory."""
    common.VERBOSE["on"] = verbose
    ctx.with_resource(library_output_shown() if verbose else common.quiet_libraries())


for _name in COMMAND_MODULES:
    importlib.import_module(_name).register(app)


def main() -> None:
    app()
