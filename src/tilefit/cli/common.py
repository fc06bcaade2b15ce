"""What every command shares: JSON output, error handling (exit 2), the console."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from tilefit.errors import TilefitError


class TableConsole(Console):
    """A Console that prints a table as Rich lays it out only where it fits a terminal;
    piped, or on a terminal too narrow for it, as plain text that keeps every header and
    number (tilefit.report.layout)."""

    def print(self, *objects: Any, **kwargs: Any) -> None:
        if not any(isinstance(o, Table) for o in objects):
            super().print(*objects, **kwargs)
            return
        from tilefit.report.layout import fits, plain_table, stacked_table

        for o in objects:
            if not isinstance(o, Table) or (self.is_terminal and fits(self, o)):
                super().print(o, **kwargs)
            elif self.is_terminal:  # too narrow: the terminal wraps each cell's line
                super().print(Text(stacked_table(o)), **kwargs)
            else:  # piped: one line per row, however long
                super().print(Text(plain_table(o)), **{**kwargs, "soft_wrap": True})


console = TableConsole()  # stdout: tables and reports
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


# --verbose (tilefit --verbose COMMAND): the libraries' own log lines, warnings and the
# traceback behind an error are kept; without it tilefit's message stands for them
VERBOSE = {"on": False}


@contextmanager
def quiet_libraries() -> Iterator[None]:
    """While a command runs without --verbose: no log record and no warning from the
    libraries tilefit drives (PyTorch logs the traceback of a failed fake-tensor op before
    re-raising it, torchao a "Failed to load" line per kernel library on import); tilefit
    says what went wrong in its own words. tilefit itself neither logs nor warns from the
    CLI. The logging switch and the warning filters are restored afterwards."""
    import logging
    import warnings

    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


def say(text: str) -> str:
    """A library text (an error, a note, a warning, a finding) in the running command's
    words: each Python call it names that the command has flags for, as those flags
    (cli.words)."""
    from tilefit.cli.words import cli_words, current_command

    return cli_words(text, current_command())


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn TilefitError into a clear message on stderr and exit code 2 (with --verbose,
    after the traceback of the error behind it)."""
    try:
        yield
    except TilefitError as exc:
        cause = exc.__cause__ or exc.__context__
        if VERBOSE["on"] and cause is not None:
            import traceback

            sys.stderr.write("".join(traceback.format_exception(cause)))
        words = say(exc.message)
        # escaped: the message is text, not markup (a spec file's "[memory]", a fix's
        # pip install 'tilefit[peft]' stay as written)
        err_console.print(f"[bold red]error:[/] {escape(words)}", highlight=False,
                          soft_wrap=True)
        raise typer.Exit(code=2) from None
