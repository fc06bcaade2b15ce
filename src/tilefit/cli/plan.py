"""`tilefit plan MODEL --gpu NAME --global-batch N`: the training recipe, before the first run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from tilefit.cli.common import JSON_OPTION, console, err_console, print_json, say, user_errors
from tilefit.cli.noise import PLAN_NOISE_OPTION, read_noise_scale
from tilefit.cli.recipe_options import RecipeFlags, takes_recipe_options
from tilefit.units import parse_bytes
from tilefit.vocab import STRATEGIES, ZERO_STRATEGIES

ALLOW_PEFT_OPTION = typer.Option(
    False, "--allow-peft",
    help="Also rank LoRA fine-tuning (frozen weights, adapters; needs peft). "
    "--lora-rank, --lora-alpha, --lora-targets, --lora-dropout, --dora and "
    "--modules-to-save set its adapters (and imply --allow-peft).")
GPUS_OPTION = typer.Option(
    1, "--gpus", help="Plan for this many data-parallel GPUs (one rank each): engine x "
    "micro-batch x accumulation x checkpointing x precision from traces of rank 0; "
    "writes configs that launch (torchrun script, accelerate, DeepSpeed).")
STRATEGY_OPTION = typer.Option(
    None, "--strategy", help="With --gpus > 1: search this engine only (" +
    ", ".join((*STRATEGIES, *ZERO_STRATEGIES)) + "; DeepSpeed ZeRO modelled, stages 2 "
    "and 3 also with the optimizer offloaded to the CPU); default: all of them.")
WRITE_CONFIGS_OPTION = typer.Option(
    None, "--write-configs", help="Write the chosen plan's files into this directory: on "
    "one GPU train_hf.py, training_args.json, train_lightning.py and train_pytorch.py (and "
    "the LoRA, 4-bit and DeepSpeed JSON where the plan has them); on several, "
    "train_tilefit.py (torchrun), ds_config.json, and for DDP/FSDP2 accelerate.yaml with "
    "train_accelerate.py.")
MEMORY_FRACTION_OPTION = typer.Option(
    1.0, "--memory-fraction",
    help="Share of GPU memory a plan may use, in (0, 1] (default all of it: plans are "
    "judged by the caching allocator's predicted reserved memory); less keeps headroom, "
    "e.g. for longer sequences later in training.")
ALLOW_QUANTIZE_OPTION = typer.Option(
    False, "--allow-quantize",
    help="Also rank QLoRA: LoRA adapters on a base quantized to 4-bit NF4 by bitsandbytes "
    "(needs peft and bitsandbytes); its configs include the BitsAndBytesConfig.")

HOST_MEMORY_OPTION = typer.Option(
    None, "--host-memory",
    help="The training machine's RAM per node, e.g. 64GiB or 128GB: plans whose CPU memory "
    "(ZeRO-Offload, DeepSpeed) is over it do not fit (default: the GPU spec file's "
    "host.memory_bytes, else this machine's RAM).")

# the shared recipe options plan does not take, and why (its own --gpus and --strategy bound
# its search instead of fixing the recipe's)
EXCLUDED = {
    **{name: f"plan chooses the {what} itself{why}" for name, what, why in (
        ("batch", "micro-batch", ": micro-batch x accumulation = --global-batch"),
        ("accumulation", "accumulation", ": micro-batch x accumulation = --global-batch"),
        ("precision", "precision", ""), ("grad_checkpointing", "activation checkpointing", ""),
        ("attention", "attention kernel", ""))},
    **dict.fromkeys(("lora", "quantize", "double_quant", "quant_compute_dtype",
                     "prepare_kbit"), "plan ranks LoRA and QLoRA among other recipes: "
                    "--allow-peft and --allow-quantize (--lora-rank ... set the adapters)"),
    "offload": "plan ranks ZeRO stages 2 and 3 with and without offload itself",
    "gpus": "a bound of the search: plan for this many GPUs",
    "strategy": "a bound of the search: the one engine to rank",
    "graph_breaks": "plan does not list graph breaks (tilefit estimate --compile "
    "--graph-breaks does)"}


def register(app: typer.Typer) -> None:
    app.command("plan")(plan)


@takes_recipe_options("plan", excluded=EXCLUDED)
def plan(
    flags: RecipeFlags,
    global_batch: int = typer.Option(..., "--global-batch",
                                     help="Samples per optimizer step (kept exactly)."),
    memory_fraction: float = MEMORY_FRACTION_OPTION,
    objective: str = typer.Option("throughput", "--objective", help="throughput or memory."),
    allow_optimizer_change: bool = typer.Option(
        False, "--allow-optimizer-change",
        help="Also rank other optimizers (a different training algorithm)."),
    allow_peft: bool = ALLOW_PEFT_OPTION,
    allow_quantize: bool = ALLOW_QUANTIZE_OPTION,
    gpus: int = GPUS_OPTION,
    strategy: str | None = STRATEGY_OPTION,
    write_configs: str | None = WRITE_CONFIGS_OPTION,
    top: int = typer.Option(15, "--top", help="Rows of the ranked table to show."),
    noise_scale: str | None = PLAN_NOISE_OPTION,
    host_memory: str | None = HOST_MEMORY_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Choose batch, accumulation, checkpointing, precision and optimizer together, with configs."""
    from tilefit.planner import PlanSearch
    from tilefit.planner import plan as run_plan
    from tilefit.tuning.noise import far_above_noise_scale

    with user_errors():
        host_bytes = _check_early(memory_fraction, global_batch, gpus, host_memory)
        b_noise = None if noise_scale is None else read_noise_scale(noise_scale)
        work = flags.workload()
        recipe = flags.recipe(work, lora=None, gpus=gpus, strategy=strategy)
        search = PlanSearch(memory_fraction, objective, allow_optimizer_change, allow_peft,
                            lora=flags.lora(), allow_quantize=allow_quantize,
                            host_memory_bytes=host_bytes)
        result = run_plan(work, gpu=flags["gpu"], global_batch=global_batch, recipe=recipe,
                          search=search)
        written = None if write_configs is None else write_launch_files(
            result, Path(write_configs))
    warning = None if b_noise is None else far_above_noise_scale(global_batch, b_noise)
    _render(result, warning, written or [], json_out=json_out, top=top,
            stand_in_loss=work.is_factory)


def _check_early(memory_fraction: float, global_batch: int, gpus: int,
                 host_memory: str | None) -> int | None:
    """What can be checked before the model is loaded: fail in a second, not a minute. The
    host memory in bytes (None: not given)."""
    from tilefit.planner.checks import check_fraction
    from tilefit.planner.multiplan import check_divisible
    from tilefit.planner.space import check_global_batch

    check_fraction(memory_fraction)
    check_global_batch(global_batch)
    if gpus > 1:
        check_divisible(global_batch, gpus)
    return None if host_memory is None else parse_bytes(host_memory, option="--host-memory")


def _render(result: Any, warning: str | None, written: list[Path], *, json_out: bool,
            top: int, stand_in_loss: bool) -> None:
    from tilefit.report.plan import print_plan

    if stand_in_loss:
        err_console.print("note: the loss is a stand-in (mean of the model's output)",
                          highlight=False)
    if warning is not None:
        err_console.print(f"[yellow]warning:[/] {say(warning)}", highlight=False)
    if json_out:
        print_json({**result.to_dict(), "warnings": [] if warning is None else [warning],
                    "written": [str(w) for w in written]})
        return
    print_plan(console, result, top=top, say=say)
    for path in written:
        console.print(f"wrote {path}", highlight=False, soft_wrap=True)


def write_launch_files(result: object, directory: Path) -> list[Path]:
    """The chosen plan's files in ``directory``: a one-GPU plan's scripts and configs, or
    a multi-GPU plan's launch files, where nothing fits one GPU the fallback's (the library
    returns the text; writing files is the command's job)."""
    from tilefit.errors import TilefitError
    from tilefit.planner import Plan

    assert isinstance(result, Plan)
    cfg = result.configs
    if result.best is None and result.multi_gpu and result.multi_gpu.configs:
        cfg = result.multi_gpu.configs
    if "files" not in cfg:
        raise TilefitError("there is no plan to write: nothing fits",
                           expected="a plan that fits one GPU or several",
                           given=f"--gpus {result.world_size}",
                           fix="add --gpus 2 (or more), --allow-peft or --allow-quantize, or "
                           "lower --global-batch")
    directory.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = cfg["files"]
    for name, text in files.items():
        (directory / name).write_text(text)
    return [directory / name for name in files]
