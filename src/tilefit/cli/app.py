"""The typer application. Each command lives in its own module with a ``register(app)``."""

from __future__ import annotations

import importlib

import typer

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
    "tilefit.cli.plan",
    "tilefit.cli.tune",
    "tilefit.cli.noise",
    "tilefit.cli.bench",
    "tilefit.cli.calibrate",
    "tilefit.cli.gpus",
    "tilefit.cli.models",
    "tilefit.cli.gemm",
    "tilefit.cli.linear",
)

for _name in COMMAND_MODULES:
    importlib.import_module(_name).register(app)


def main() -> None:
    app()
