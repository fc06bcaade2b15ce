"""`tilefit tune MODEL`: the largest batch that fits and the fastest aligned one, measured."""

from __future__ import annotations

import re
from typing import Any

import typer

from tilefit.cli.common import JSON_OPTION, console, err_console, print_json, user_errors
from tilefit.cli.model_options import parse_shape
from tilefit.errors import TilefitError

# Decimal units are powers of 1000 and binary units powers of 1024 (IEC 80000-13).
UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
OPTIMIZERS = ("adamw", "adam", "sgd")


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
    model: str = typer.Argument(..., help="Catalog name, config.json path, or package.module:fn."),
    device: str = typer.Option("auto", "--device", help="cuda, cpu or auto (cuda if present)."),
    global_batch: int = typer.Option(None, "--global-batch",
                                     help="Keep this many samples per optimizer step exact."),
    memory_limit: str = typer.Option(None, "--memory-limit",
                                     help="Simulate a device of this size: bytes, 2GiB, 500MB."),
    max_batch: int = typer.Option(None, "--max-batch", help="Never try more than this."),
    seq: int = typer.Option(None, "--seq", help="Tokens per sample (language models)."),
    input_shape: str = typer.Option(None, "--input-shape",
                                    help="One sample's shape for factories, e.g. 3,224,224."),
    optimizer: str = typer.Option("adamw", "--optimizer", help="adamw, adam or sgd."),
    precision: str = typer.Option("fp32", "--precision",
                                  help="fp32, tf32, bf16-mixed, fp16-mixed or bf16."),
    margin: float = typer.Option(None, "--margin",
                                 help="Fraction of memory kept free (default 0.10)."),
    plot: str = typer.Option(None, "--plot", help="Write samples/s against batch size here."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Run real training steps to find the largest batch that fits and the fastest aligned one."""
    with user_errors():
        result = _run(model, device, global_batch, memory_limit, max_batch, seq, input_shape,
                      optimizer, precision, margin, show_progress=True)
        if plot:
            from tilefit.tuning.plot import plot_throughput

            plot_throughput(result, plot)
    if json_out:
        print_json(result.to_dict())
        return
    _render(result, plot)


def _run(model: str, device: str, global_batch: int | None, memory_limit: str | None,
         max_batch: int | None, seq: int | None, input_shape: str | None, optimizer: str,
         precision: str, margin: float | None, *, show_progress: bool) -> Any:
    import torch

    from tilefit.models import load_workload
    from tilefit.tuning import DEFAULT_MARGIN, tune

    if optimizer not in OPTIMIZERS:
        raise TilefitError(f"unknown optimizer {optimizer!r}", expected=", ".join(OPTIMIZERS),
                           given=repr(optimizer), fix="pass --optimizer adamw")
    limit_bytes = None if memory_limit is None else parse_bytes(memory_limit)
    workload = load_workload(model, seq_len=seq, input_shape=parse_shape(input_shape))
    dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    from tilefit.tuning.tuner import resolve_device

    torch_device = resolve_device(dev)
    module = workload.build().to(torch_device)
    module.train()
    factories = {
        "adamw": lambda params: torch.optim.AdamW(params, lr=1e-4),
        "adam": lambda params: torch.optim.Adam(params, lr=1e-4),
        "sgd": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
    }

    def make_batch(b: int) -> Any:
        return workload.make_batch(b, torch_device)

    progress, on_trial = _progress(show_progress)
    try:
        return tune(
            module, make_batch, loss_fn=workload.loss_fn, optimizer=factories[optimizer],
            precision=precision, device=torch_device, global_batch=global_batch,
            max_batch=max_batch, memory_limit_bytes=limit_bytes,
            margin=DEFAULT_MARGIN if margin is None else margin, on_trial=on_trial,
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
