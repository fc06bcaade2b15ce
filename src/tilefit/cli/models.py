"""`tilefit models`: the catalog of published model configs."""

from __future__ import annotations

import typer

from tilefit.cli.common import JSON_OPTION, console, print_json, user_errors


def register(app: typer.Typer) -> None:
    app.command("models")(models)


def models(json_out: bool = JSON_OPTION) -> None:
    """List the model catalog: task, parameters (computed from each config), shapes, source."""
    from tilefit.models.params import catalog_models

    with user_errors():
        rows = catalog_models()
    if json_out:
        print_json([r.to_dict() for r in rows])
        return
    from rich import box
    from rich.table import Table

    table = Table(title="tilefit model catalog (published Hugging Face configs)",
                  box=box.SIMPLE_HEAD, pad_edge=False,
                  show_edge=False, collapse_padding=True)
    table.add_column("name", no_wrap=True)
    table.add_column("task", no_wrap=True)
    for col in ("params", "layers", "hidden", "vocab", "max seq", "seq"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in sorted(rows, key=lambda r: (r.model_type, r.parameters)):
        table.add_row(
            r.name, r.task, _params(r.parameters), str(r.layers), str(r.hidden_size),
            "-" if r.vocab_size is None else str(r.vocab_size),
            "-" if r.max_seq_len is None else str(r.max_seq_len),
            "-" if r.default_seq_len is None else str(r.default_seq_len),
        )
    console.print(table)
    console.print("max seq: the position limit; seq: the default tokens per sample (--seq).")
    console.print("Parameters are counted from each model built on the meta device; configs are "
                  "the hub's config.json (`--json` has each source). Also accepted: a path to a "
                  "config.json, or package.module:function returning an nn.Module.")


def _params(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"
