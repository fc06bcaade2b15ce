"""`tilefit tune MODEL`: the largest batch that fits and the fastest aligned one, measured."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import typer

from tilefit.cli import model_options as mo
from tilefit.cli.common import JSON_OPTION, console, err_console, print_json, user_errors
from tilefit.errors import TilefitError

# Decimal units are powers of 1000 and binary units powers of 1024 (IEC 80000-13).
UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}


def register(app: typer.Typer) -> None:
    app.command("tune")(tune_command)


def parse_bytes(text: str) -> int:
    """'2GiB' -> 2147483648, '500MB' -> 500000000, '123456' -> 123456."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in UNITS:
        raise TilefitError(
            "memory size not understood",
            expected="bytes, or a number with a unit: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB",
            given=repr(text),
            fix="write it like 24GiB, 500MB or 2000000",
        )
    value = int(float(match.group(1)) * UNITS[unit])
    if value < 1:
        raise TilefitError("memory size must be positive", expected="at least 1 byte",
                           given=repr(text), fix="write it like 24GiB")
    return value


def tune_command(
    model: str = mo.MODEL_ARG,
    gpu: str = typer.Option(
        "auto", "--gpu", help="The live device to tune on: auto (the CUDA GPU if there is "
        "one, else the CPU), cuda, cuda:N or cpu."),
    global_batch: int = typer.Option(None, "--global-batch",
                                     help="Keep this many samples per optimizer step exact."),
    memory_limit: str = typer.Option(None, "--memory-limit",
                                     help="Simulate a device of this size: bytes, 2GiB, 500MB."),
    max_batch: int = typer.Option(None, "--max-batch", help="Never try more than this."),
    seq: int | None = mo.SEQ_OPTION,
    input_shape: str | None = mo.INPUT_SHAPE_OPTION,
    task: str | None = mo.TASK_OPTION,
    optimizer: str = mo.OPTIMIZER_OPTION,
    precision: str | None = mo.PRECISION_OPTION,
    margin: float = typer.Option(None, "--margin",
                                 help="Fraction of memory kept free (default 0.10)."),
    plot: str = typer.Option(None, "--plot", help="Write samples/s against batch size here."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Run real training steps to find the largest batch that fits and the fastest aligned one."""
    with user_errors():
        options = TuneOptions(model, gpu, global_batch, memory_limit, max_batch, seq,
                              input_shape, task, optimizer, precision, margin)
        result = _run(options, show_progress=True)
        if plot:
            from tilefit.tuning.plot import plot_throughput

            plot_throughput(result, plot)
    if json_out:
        print_json(result.to_dict())
        return
    _render(result, plot)


@dataclass(frozen=True)
class TuneOptions:
    """The command line of `tilefit tune`, as given."""

    model: str
    gpu: str
    global_batch: int | None
    memory_limit: str | None
    max_batch: int | None
    seq: int | None
    input_shape: str | None
    task: str | None
    optimizer: str
    precision: str | None
    margin: float | None


def live_device(gpu: str) -> Any:
    """The torch device that --gpu names: auto is the CUDA GPU when there is one."""
    import torch

    from tilefit.tuning.tuner import resolve_device

    name = gpu.strip().lower()
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return resolve_device(name)


def live_precision(text: str | None, device: Any) -> str:
    """--precision, or the default for the live device (as the other commands default for a
    catalog GPU: tilefit.vocab.default_precision)."""
    from tilefit.hardware import detect_live_device
    from tilefit.vocab import PRECISIONS, default_precision, parse_precision

    if text:
        return parse_precision(text).name
    if device.type != "cuda":
        return "fp32"
    try:
        return default_precision(detect_live_device(device.index or 0))
    except TilefitError:  # a GPU the catalog does not know
        import torch

        half = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return next(p.name for p in PRECISIONS if p.autocast_dtype == half)


def optimizer_factory(name: str) -> Any:
    """params -> the optimizer --optimizer names, as the other commands trace it."""
    from tilefit.tracing.optimizers import make_optimizer
    from tilefit.vocab import OPTIMIZER_NAMES

    key = name.strip().lower()
    if key not in OPTIMIZER_NAMES:
        raise TilefitError(f"unknown optimizer {name!r}", expected=", ".join(OPTIMIZER_NAMES),
                           given=repr(name), fix="pass --optimizer adamw")
    if key == "adamw-8bit":
        try:
            import bitsandbytes as bnb  # type: ignore[import-not-found]
        except ImportError:
            raise TilefitError(
                "--optimizer adamw-8bit runs bitsandbytes' AdamW8bit, which is not installed",
                expected="the bitsandbytes package", given="import bitsandbytes failed",
                fix="pip install bitsandbytes, or pass --optimizer adamw") from None
        return lambda params: bnb.optim.AdamW8bit(params, lr=1e-4)
    return lambda params: make_optimizer(key, list(params), foreach=None)


def _run(options: TuneOptions, *, show_progress: bool) -> Any:
    from tilefit.tuning import DEFAULT_MARGIN, tune

    factory = optimizer_factory(options.optimizer)
    limit_bytes = None if options.memory_limit is None else parse_bytes(options.memory_limit)
    torch_device = live_device(options.gpu)
    precision = live_precision(options.precision, torch_device)
    workload = mo.load(options.model, options.seq, options.input_shape, options.task)
    module = workload.build().to(torch_device)
    module.train()

    def make_batch(b: int) -> Any:
        return workload.make_batch(b, torch_device)

    progress, on_trial = _progress(show_progress)
    try:
        return tune(
            module, make_batch, loss_fn=workload.loss_fn, optimizer=factory,
            precision=precision, device=torch_device, global_batch=options.global_batch,
            max_batch=options.max_batch, memory_limit_bytes=limit_bytes,
            margin=DEFAULT_MARGIN if options.margin is None else options.margin,
            on_trial=on_trial,
        )
    finally:
        if progress is not None:
            progress.stop()


def _progress(show: bool) -> tuple[Any, Any]:
    """A rich progress display on stderr, advanced once per finished trial."""
    if not show:
        return None, None
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                        console=err_console, transient=True)
    task = progress.add_task("tune: first trial", total=None)
    progress.start()

    def on_trial(trial: Any) -> None:
        what = "fits" if trial.fits else "out of memory"
        if trial.kind == "throughput" and trial.samples_per_s:
            what = f"{trial.samples_per_s:,.0f} samples/s"
        progress.update(task, advance=1,
                        description=f"tune: {trial.kind} trial, batch {trial.batch_size}: {what}")

    return progress, on_trial


def _render(result: Any, plot: str | None) -> None:
    from rich.table import Table

    t = Table(title="tilefit tune: trials")
    for col in ("kind", "batch", "fits", "peak memory", "samples/s", "time"):
        t.add_column(col, justify="right")
    for tr in result.trials:
        t.add_row(tr["kind"], str(tr["batch_size"]), "yes" if tr["fits"] else "[red]no[/]",
                  "" if tr["peak_memory_bytes"] is None else f"{tr['peak_memory_bytes']:,} B",
                  "" if tr["samples_per_s"] is None else f"{tr['samples_per_s']:,.0f}",
                  f"{tr['time_s']:.2f} s")
    console.print(t)
    console.print(f"largest batch that fits: [bold]{result.max_fitting_batch_size}[/]"
                  + (f" (budget {result.budget_bytes:,} B)" if result.budget_bytes else ""))
    rate = "" if result.samples_per_s is None else f", {result.samples_per_s:,.0f} samples/s"
    console.print(f"chosen batch: [bold green]{result.batch_size}[/] x "
                  f"{result.accumulation_steps} accumulation steps{rate} "
                  f"(noise band {result.noise:.1%})")
    if plot:
        console.print(f"plot written to {plot}")
