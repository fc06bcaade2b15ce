"""`tilefit plan MODEL --gpu NAME --global-batch N`: the training recipe, before the first run."""

from __future__ import annotations

import typer

from tilefit.cli import model_options as mo
from tilefit.cli.common import GPU_HELP, JSON_OPTION, console, err_console, print_json, user_errors
from tilefit.cli.noise import PLAN_NOISE_OPTION, read_noise_scale


def register(app: typer.Typer) -> None:
    app.command("plan")(plan)


def plan(
    model: str = mo.MODEL_ARG,
    gpu: str = typer.Option("a100-80gb", "--gpu", help=GPU_HELP),
    global_batch: int = typer.Option(..., "--global-batch",
                                     help="Samples per optimizer step (kept exactly)."),
    seq: int | None = mo.SEQ_OPTION,
    memory_fraction: float = typer.Option(
        0.9, "--memory-fraction",
        help="Share of GPU memory a plan may use, in (0, 1]; the rest is headroom for the "
        "allocator's fragmentation."),
    objective: str = typer.Option("throughput", "--objective", help="throughput or memory."),
    optimizer: str | None = mo.OPTIMIZER_OPTION,
    allow_optimizer_change: bool = typer.Option(
        False, "--allow-optimizer-change",
        help="Also rank other optimizers (a different training algorithm)."),
    allow_peft: bool = typer.Option(
        False, "--allow-peft",
        help="Also rank LoRA fine-tuning (frozen weights, adapters; needs peft)."),
    input_shape: str | None = mo.INPUT_SHAPE_OPTION,
    task: str | None = mo.TASK_OPTION,
    max_grad_norm: str | None = mo.MAX_GRAD_NORM_OPTION,
    loss_sync: bool | None = mo.LOSS_SYNC_OPTION,
    fused_ce: bool = mo.FUSED_CE_OPTION,
    compile_: bool = mo.COMPILE_OPTION,
    top: int = typer.Option(15, "--top", help="Rows of the ranked table to show."),
    noise_scale: str | None = PLAN_NOISE_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Choose batch, accumulation, checkpointing, precision and optimizer together, with configs."""
    from tilefit.planner import plan as run_plan
    from tilefit.planner.plan import check_fraction
    from tilefit.planner.space import check_global_batch
    from tilefit.report.plan import print_plan
    from tilefit.tuning.noise import far_above_noise_scale

    with user_errors():
        check_fraction(memory_fraction)
        check_global_batch(global_batch)
        b_noise = None if noise_scale is None else read_noise_scale(noise_scale)
        work = mo.load(model, seq, input_shape, task)
        result = run_plan(work, gpu=gpu, global_batch=global_batch,
                          memory_fraction=memory_fraction, objective=objective,
                          optimizer=mo.optimizer_name(optimizer, work),
                          allow_optimizer_change=allow_optimizer_change,
                          allow_peft=allow_peft,
                          max_grad_norm=mo.max_grad_norm(max_grad_norm, work),
                          loss_sync=mo.loss_sync(loss_sync, work),
                          fused_ce=fused_ce,
                          compile=compile_)
    if work.is_factory:
        err_console.print("note: the loss is a stand-in (mean of the model's output)",
                          highlight=False)
    warning = None if b_noise is None else far_above_noise_scale(global_batch, b_noise)
    if warning is not None:
        err_console.print(f"[yellow]warning:[/] {warning}", highlight=False)
    if json_out:
        print_json({**result.to_dict(), "warnings": [] if warning is None else [warning]})
        return
    print_plan(console, result, top=top)
