"""Tables at any width. Rich lays a table out to the console's width: where the columns do
not fit it cuts cells short (``model.layers.*.self_attn.…``) and breaks words, and when
stdout is not a terminal it takes 80 columns (or $COLUMNS). So a table goes through Rich only
on a terminal that holds it; piped (logs, grep, a file) it is plain text, one line per row,
columns aligned, nothing cut; on a terminal too narrow for it, one block per row, each cell on
its own ``header: value`` line. Every header and number is kept either way. Pure text, no I/O:
cli/ prints what these return."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

__all__ = ["cells", "fits", "plain_table", "stacked_table"]


def _plain(cell: Any) -> str:
    """A cell's text without its markup or styles."""
    if isinstance(cell, Text):
        return cell.plain
    if isinstance(cell, str):
        return Text.from_markup(cell).plain
    return str(cell)


def cells(table: Table) -> tuple[str, list[str], list[list[str]]]:
    """(title, headers, rows) of ``table`` as plain text; headers empty when it shows none."""
    title = _plain(table.title) if table.title is not None else ""
    headers = [_plain(c.header) for c in table.columns] if table.show_header else []
    columns = [[_plain(cell) for cell in c.cells] for c in table.columns]
    rows = [list(row) for row in zip(*columns, strict=True)] if columns else []
    return title, headers, rows


def fits(console: Console, table: Table) -> bool:
    """Whether Rich lays ``table`` out on ``console`` with no cell cut short or wrapped."""
    unbounded = console.options.update_width(1 << 20)  # its natural width, not the console's
    return Measurement.get(console, unbounded, table).maximum <= console.width


def plain_table(table: Table) -> str:
    """The table as aligned plain text: its title, its headers, one line per row; columns as
    wide as their widest cell (right-justified where the table says so)."""
    title, headers, rows = cells(table)
    lines = [r for r in ([headers] if headers else []) + rows]
    if not lines:
        return title
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    right = [c.justify == "right" for c in table.columns]

    def render(line: list[str]) -> str:
        parts = [v.rjust(w) if r else v.ljust(w)
                 for v, w, r in zip(line, widths, right, strict=True)]
        return "  ".join(parts).rstrip()

    out = [title] if title else []
    if headers:
        out += [render(headers), "  ".join("-" * w for w in widths).rstrip()]
    out += [render(r) for r in rows]
    return "\n".join(out)


def stacked_table(table: Table) -> str:
    """One block per row, a ``header: value`` line per cell (a table without headers: its
    first cell, then the rest), for a terminal too narrow for the columns."""
    title, headers, rows = cells(table)
    out = [title] if title else []
    for row in rows:
        if headers:
            out += [f"  {h}: {v}" if h else f"  {v}" for h, v in zip(headers, row, strict=True)
                    if v]
        else:
            out.append(f"  {row[0]}: " + "  ".join(v for v in row[1:] if v))
        if headers:
            out.append("")
    return "\n".join(out).rstrip("\n")
