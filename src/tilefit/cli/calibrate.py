"""`tilefit calibrate`: measure GEMMs, bandwidth and call overhead; fit; save the profile."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import typer

from tilefit.cli.common import JSON_OPTION, console, err_console, print_json, user_errors
from tilefit.errors import TilefitError

if TYPE_CHECKING:
    from tilefit.calibrate.run import CalibrationResult, ProgressEvent


def register(app: typer.Typer) -> None:
    app.command("calibrate")(calibrate)


def calibrate(
    device: str = typer.Option("cpu", "--device", help="cpu (this machine) or cuda."),
    quick: bool = typer.Option(False, "--quick", help="A smaller grid within a time budget "
                               "(150 s unless --time-budget says otherwise)."),
    time_budget: float | None = typer.Option(
        None, "--time-budget", metavar="SECONDS",
        help="Seconds the calibration may take; the grids shrink to fit (default: 150 with "
             "--quick, unbounded without)."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Fit the GEMM cost model to this device and store the profile that get_device uses."""
    from tilefit.calibrate.run import calibrate as run_calibration
    from tilefit.calibrate.run import device_kind
    from tilefit.hardware.profiles import save_profile

    with user_errors():
        kind = device_kind(device)
        if time_budget is not None and not time_budget > 0:
            raise TilefitError("--time-budget must be a positive number of seconds",
                               expected="seconds > 0, e.g. 150", given=str(time_budget),
                               fix="pass --time-budget 150, or leave it out")
        with progress_display() as show:
            result = run_calibration(kind, quick=quick, time_budget_s=time_budget,
                                     progress=show)
        path = save_profile(result.profile)
    data = result.profile.to_dict()
    data["path"] = str(path)
    data["calibration"] = result.to_dict()
    if json_out:
        print_json(data)
        return
    render(result, str(path))


def plain_line(event: ProgressEvent) -> str:
    """``[  12 s of ~35 s] message``: the elapsed time and, once planned, the expected total."""
    clock = f"{event.elapsed_s:4.0f} s"
    if event.expected_s is not None:
        clock += f" of ~{event.expected_s:.0f} s"
    return f"[{clock}] {event.message}"


@contextmanager
def progress_display() -> Iterator[Callable[[ProgressEvent], None]]:
    """Progress on stderr: a plain line per step (also when piped to a file or a log), and on
    a terminal a live bar over the expected duration that advances with every shape."""
    if not err_console.is_terminal:
        def show_plain(event: ProgressEvent) -> None:
            if not event.tick:
                err_console.print(plain_line(event), highlight=False, soft_wrap=True)

        yield show_plain
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=err_console, transient=True) as bar:
        task = bar.add_task("calibrating", total=None)

        def show_live(event: ProgressEvent) -> None:
            if not event.tick:
                bar.console.print(plain_line(event), highlight=False, soft_wrap=True)
            total = event.expected_s
            bar.update(task, description=event.message, total=total,
                       completed=min(event.elapsed_s, total) if total else 0)

        yield show_live


def _line(text: str) -> None:
    console.print(text, highlight=False, soft_wrap=True)  # one line each, also in a pipe


def render(result: CalibrationResult, path: str) -> None:
    """The saved profile, each dtype's fit and rate, and what the time budget skipped."""
    profile = result.profile
    budget = (f" of a {result.time_budget_s:.0f} s budget"
              if result.time_budget_s != float("inf") else "")
    _line(f"profile saved to {path} ({result.duration_s:.0f} s{budget}; expected "
          f"{result.expected_s:.0f} s)")
    for dt, peak in profile.peak_flops_per_s.items():
        _line(f"  {dt} peak {peak / 1e9:.0f} GFLOP/s")
    _line(f"  bandwidth {profile.bandwidth_bytes_per_s / 1e9:.1f} GB/s, call overhead "
          f"{profile.call_overhead_s * 1e6:.2f} us")
    ref = result.dtypes[0] if result.dtypes else None
    for o in result.dtypes:
        if o.fit is not None:
            rounds = f"{o.rounds_done} round" + ("s" if o.rounds_done != 1 else "")
            _line(f"  {o.dtype}: fit on {o.fit.shapes} shapes x {rounds}, median error "
                  f"{o.fit.median_error:.1%}, p90 {o.fit.p90_error:.1%}")
        if ref is not None and o.dtype != ref.dtype:
            _line(f"  {o.dtype} GEMMs run at {o.plan.relative_rate:.0%} of {ref.dtype} here "
                  f"(probe: {o.cost.flops_per_s / 1e9:.0f} vs "
                  f"{ref.cost.flops_per_s / 1e9:.0f} GFLOP/s)")
        if o.skipped:
            _line(f"  skipped for the time budget, {o.dtype}: {o.skipped}")
    for warning in result.warnings:
        _line(f"  warning: {warning}")
