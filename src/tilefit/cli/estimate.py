"""`tilefit estimate MODEL`: predicted step time and peak memory on a GPU, without the GPU."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import typer

from tilefit.cli import model_options as mo
from tilefit.cli.common import JSON_OPTION, console, err_console, print_json, say, user_errors
from tilefit.cli.model_options import OFFLOAD_OPTION as OFFLOAD_OPTION  # words.py reads it here
from tilefit.cli.recipe_options import RecipeFlags, takes_recipe_options

if TYPE_CHECKING:
    from tilefit.models import Workload
    from tilefit.recipe import Recipe

OPS_OPTION = typer.Option(True, "--ops/--no-ops", help="With --json: include every op record "
                          "of the steady step (--no-ops for the summary only).")


def register(app: typer.Typer) -> None:
    app.command("estimate")(estimate)


@takes_recipe_options("estimate")
def estimate(
    flags: RecipeFlags,
    nodes: int | None = mo.NODES_OPTION,
    network: str | None = mo.NETWORK_OPTION,
    ops: bool = OPS_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Predict one training step's time and peak memory on a GPU, traced on fake tensors."""
    from tilefit.estimator import estimate_recipe
    from tilefit.hardware import get_device

    with user_errors():
        device = mo.placed(get_device(flags["gpu"]), flags["gpus"], nodes, network)
        work = flags.workload()
        recipe = flags.recipe(work).on(device)
        result = estimate_recipe(work, None, recipe, device)
    _notes(recipe, work.is_factory)
    revision = flags["revision"]
    where = f"{flags['model']} --gpu {flags['gpu']}" + (
        "" if revision is None else f" --revision {revision}")
    _print(result, work, recipe, where, json_out=json_out, ops=ops)


def _print(result: Any, work: Any, recipe: Recipe, command: str, *, json_out: bool,
           ops: bool) -> None:
    """The estimate as JSON, or as the terminal's table (``command``: the model and GPU
    that `tilefit audit` takes to say what would make a step that does not fit fit)."""
    from tilefit.report.terminal import print_estimate

    if json_out:
        print_json({"model": work.name, "task": work.task, "recipe": recipe.to_dict(),
                    **_lengths(work), **result.to_dict(include_ops=ops)})
        return
    print_estimate(console, result, f"tilefit estimate: {work.name}, "
                   f"{_shape(recipe.batch_size, work)}{recipe.adapters_text}", say=say)
    if not result.fits:
        console.print(f"[bold red]does not fit:[/] `tilefit audit {command}` says "
                      "what would make it fit, `tilefit plan` chooses a recipe that does",
                      highlight=False)


def _shape(batch: int, work: Workload) -> str:
    return f"batch {batch}" + (f" x seq {work.seq_len}" if work.seq_len else "") + (
        f", target {work.target_seq_len}" if work.target_seq_len else "")


def _lengths(work: Workload) -> dict[str, int | None]:
    return {"seq_len": work.seq_len, "target_seq_len": work.target_seq_len}


def _notes(recipe: Recipe, is_factory: bool) -> None:
    """What the estimate assumed: how the precision was read, the training loop, the loss."""
    from tilefit.recipe import training_loop_note

    for note in recipe.notes:
        err_console.print(f"note: {say(note)}", highlight=False)
    if not is_factory:
        err_console.print(say(training_loop_note(recipe)), highlight=False)
    else:
        err_console.print("note: the loss is a stand-in (mean of the model's output); pass your "
                          "own loss_fn through the Python API for exact numbers", highlight=False)
