"""`tilefit audit MODEL`: what slows the training step or makes it not fit, and the fixes, each
with its gain predicted by re-estimating the step with the fix applied."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from tilefit.cli.common import JSON_OPTION, console, err_console, print_json, say, user_errors
from tilefit.cli.recipe_options import RecipeFlags, takes_recipe_options

HTML_OPTION = typer.Option(None, "--html", help="Also write a self-contained HTML report "
                           "(summary, findings, plots) to this file.")


CONFIRM_OPTION = typer.Option(False, "--confirm", help="Re-trace the top dimension fix to "
                              "confirm the quick what-if (one more trace).")


# the shared recipe options the audit does not take, and why
EXCLUDED = {
    **dict.fromkeys(("gpus", "strategy", "offload"), "the audit is of one GPU's step "
                    "(tilefit estimate --gpus N predicts a job's)"),
    "graph_breaks": "the audit's compile finding traces torch.compile itself (tilefit "
    "estimate --compile --graph-breaks lists the breaks)"}


def register(app: typer.Typer) -> None:
    app.command("audit")(audit)


@takes_recipe_options("audit", excluded=EXCLUDED)
def audit(
    flags: RecipeFlags,
    json_out: bool = JSON_OPTION,
    html: Path | None = HTML_OPTION,
    confirm: bool = CONFIRM_OPTION,
) -> None:
    """Find what slows the training step or makes it not fit, with fixes and predicted gains."""
    from tilefit.advise import audit as run_audit
    from tilefit.recipe import training_loop_note

    with user_errors():
        _check_html(html)
        from tilefit.hardware import get_device

        device = get_device(flags["gpu"])  # "auto" without a GPU: says so and names --gpu
        work = flags.workload()
        recipe = flags.recipe(work)
        result = run_audit(work, recipe=recipe, gpu=device, confirm=confirm)
        if not work.is_factory:  # the loop the trace assumed, as `tilefit estimate` says it
            err_console.print(say(training_loop_note(result.recipe)), highlight=False)
        if html is not None:
            from tilefit.report.html import write_html

            write_html(result, html)
    _emit(result, html, json_out)


def _emit(result: Any, html: Path | None, json_out: bool) -> None:
    """The audit as JSON or the terminal's report, and where the HTML page went."""
    from tilefit.report.audit_terminal import print_audit

    if json_out:
        print_json(result.to_dict())
    else:
        print_audit(console, result, say)
    if html is not None:
        err_console.print(f"wrote {html}", highlight=False)


def _check_html(html: Path | None) -> None:
    """--html names a file in a folder that exists (checked before the minutes of tracing)."""
    from tilefit.errors import TilefitError

    if html is not None and not html.parent.resolve().is_dir():
        raise TilefitError(f"cannot write the report: folder {str(html.parent)!r} does "
                           "not exist", expected="a path in an existing folder",
                           given=str(html), fix="create the folder first")
