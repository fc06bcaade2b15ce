"""`tilefit audit MODEL`: what slows the training step or makes it not fit, and the fixes, each
with its gain predicted by re-estimating the step with the fix applied."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from tilefit.cli import model_options as mo
from tilefit.cli.common import JSON_OPTION, console, err_console, print_json, user_errors

HTML_OPTION = typer.Option(None, "--html", help="Also write a self-contained HTML report "
                           "(summary, findings, plots) to this file.")


CONFIRM_OPTION = typer.Option(False, "--confirm", help="Re-trace the top dimension fix to "
                              "confirm the quick what-if (one more trace).")


def register(app: typer.Typer) -> None:
    app.command("audit")(audit)


def audit(
    model: str = mo.MODEL_ARG,
    gpu: str = mo.GPU_OPTION,
    batch: int = mo.BATCH_OPTION,
    seq: int | None = mo.SEQ_OPTION,
    precision: str | None = mo.PRECISION_OPTION,
    optimizer: str | None = mo.OPTIMIZER_OPTION,
    grad_checkpointing: bool = mo.CHECKPOINTING_OPTION,
    accumulation: int = mo.ACCUMULATION_OPTION,
    attention: str = mo.ATTENTION_OPTION,
    input_shape: str | None = mo.INPUT_SHAPE_OPTION,
    task: str | None = mo.TASK_OPTION,
    target_seq: int | None = mo.TARGET_SEQ_OPTION,
    image_size: int | None = mo.IMAGE_SIZE_OPTION,
    revision: str | None = mo.REVISION_OPTION,
    max_grad_norm: str | None = mo.MAX_GRAD_NORM_OPTION,
    loss_sync: bool | None = mo.LOSS_SYNC_OPTION,
    fused_ce: bool = mo.FUSED_CE_OPTION,
    lora: bool = mo.LORA_OPTION,
    quantize: str | None = mo.QUANTIZE_OPTION,
    lora_rank: int | None = mo.LORA_RANK_OPTION,
    lora_alpha: float | None = mo.LORA_ALPHA_OPTION,
    lora_targets: str | None = mo.LORA_TARGETS_OPTION,
    lora_dropout: float | None = mo.LORA_DROPOUT_OPTION,
    dora: bool = mo.DORA_OPTION,
    modules_to_save: str | None = mo.MODULES_TO_SAVE_OPTION,
    routing: str | None = mo.ROUTING_OPTION,
    compile_: bool = mo.COMPILE_OPTION,
    compile_mode: str = mo.COMPILE_MODE_OPTION,
    alloc_conf: str | None = mo.ALLOC_CONF_OPTION,
    html: Path | None = HTML_OPTION,
    confirm: bool = CONFIRM_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Find what slows the training step or makes it not fit, with fixes and predicted gains."""
    from tilefit.advise import audit as run_audit
    from tilefit.recipe import training_loop_note

    with user_errors():
        _check_html(html)
        from tilefit.hardware import get_device

        device = get_device(gpu)  # "auto" without a GPU: says so and names --gpu
        work = mo.load(model, seq, input_shape, task, target_seq, image_size, revision)
        recipe = mo.recipe(
            work, batch_size=batch, precision=precision, optimizer=optimizer, routing=routing,
            grad_checkpointing=grad_checkpointing, accumulation_steps=accumulation,
            attention=attention, max_grad_norm=max_grad_norm, loss_sync=loss_sync,
            fused_ce=fused_ce, lora=mo.lora_of(lora, lora_rank, lora_alpha, lora_targets,
                                                lora_dropout, dora, modules_to_save),
            quantize=quantize, compile_=compile_, compile_mode=compile_mode,
            alloc_conf=alloc_conf)
        result = run_audit(work, recipe=recipe, gpu=device, confirm=confirm)
        if not work.is_factory:  # the loop the trace assumed, as `tilefit estimate` says it
            err_console.print(training_loop_note(result.recipe), highlight=False)
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
        print_audit(console, result)
    if html is not None:
        err_console.print(f"wrote {html}", highlight=False)


def _check_html(html: Path | None) -> None:
    """--html names a file in a folder that exists (checked before the minutes of tracing)."""
    from tilefit.errors import TilefitError

    if html is not None and not html.parent.resolve().is_dir():
        raise TilefitError(f"cannot write the report: folder {str(html.parent)!r} does "
                           "not exist", expected="a path in an existing folder",
                           given=str(html), fix="create the folder first")
