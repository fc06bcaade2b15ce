"""What every command shares: JSON output, error handling (exit 2), the console."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import typer
from rich.console import Console

from tilefit.errors import TilefitError

console = Console()  # stdout: tables and reports
err_console = Console(stderr=True)  # diagnostics; with --json, everything but the JSON

JSON_OPTION = typer.Option(False, "--json", help="Print only JSON on stdout.")
GPU_HELP = "Catalog name or alias (see `tilefit gpus`), a TOML spec file, or auto."


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=_default) + "\n")


def _default(obj: Any) -> Any:
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if isinstance(obj, tuple | set | frozenset):
        return list(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn TilefitError into a clear message on stderr and exit code 2."""
    try:
        yield
    except TilefitError as exc:
        err_console.print(f"[bold red]error:[/] {exc.message}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=2) from None
