"""`tilefit bench gemm`: the GEMM guides' sweeps measured on the live device, with the model."""

from __future__ import annotations

from typing import Any

import typer

from tilefit.cli.common import JSON_OPTION, console, err_console, print_json, user_errors

bench_app = typer.Typer(help="Measure on the live device (CPU or CUDA GPU) beside the model.",
                        no_args_is_help=True)

DEVICE_HELP = "cpu (this machine) or cuda (the live GPU)."


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")


@bench_app.command("gemm")
def gemm(
    device: str = typer.Option("cpu", "--device", help=DEVICE_HELP),
    sweep: str = typer.Option("batch", "--sweep", help="batch, k or n."),
    in_features: int = typer.Option(None, "--in", help="Layer inputs (batch sweep); the "
                                    "centre of the k / n sweeps."),
    out_features: int = typer.Option(None, "--out", help="Layer outputs (batch sweep)."),
    m: int = typer.Option(None, "--m", help="M for the k and n sweeps."),
    n: int = typer.Option(None, "--n", help="N for the k sweep."),
    dtype: str = typer.Option(None, "--dtype", help="fp32 or bf16 on the CPU; bf16, fp16, "
                              "tf32 or fp32 on a GPU."),
    quick: bool = typer.Option(False, "--quick", help="Fewer points, shorter timing."),
    plot: str = typer.Option(None, "--plot", help="Save a PNG plot to this file."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Delivered TFLOP/s against batch for a linear layer's three GEMMs, or time against K / N
    one step at a time; each row measured and predicted."""
    with user_errors():
        result = run_bench(device, sweep, in_features, out_features, m, n, dtype, quick, plot)
    if json_out:
        print_json(result)
        return
    render(result)


def run_bench(device: str, sweep: str, in_features: int | None, out_features: int | None,
              m: int | None, n: int | None, dtype: str | None, quick: bool,
              plot: str | None) -> dict[str, Any]:
    from tilefit.bench.sweeps import check_sweep, run_sweep, sweep_shapes
    from tilefit.calibrate.fit import error_summary
    from tilefit.calibrate.run import live_kind_device
    from tilefit.dtypes import parse_dtype

    check_sweep(sweep)
    dev = live_kind_device(device)
    dt = parse_dtype(dtype or ("fp32" if dev.kind == "cpu" else "bf16")).name
    for name, value in (("--in", in_features), ("--out", out_features), ("--m", m),
                        ("--n", n)):
        if value is not None and value <= 0:
            from tilefit.errors import TilefitError

            raise TilefitError(f"{name} must be a positive whole number", expected="an "
                               "integer >= 1", given=str(value), fix=f"pass {name} 1024")
    # Defaults: a 1024-wide layer on the CPU (seconds per sweep); the guide's 4096 on GPUs.
    width = 1024 if dev.kind == "cpu" else 4096
    shapes = sweep_shapes(sweep, dev.kind, in_features=in_features or width,
                          out_features=out_features or width, m=m or width // 2,
                          n=n or width // 2, quick=quick)
    rows = run_sweep(shapes, dt, dev, quick=quick)
    import numpy as np

    med, p90 = error_summary(np.array([abs(r.error) for r in rows]))
    result: dict[str, Any] = {
        "device": dev.name, "display_name": dev.display_name, "device_source": dev.source,
        "sweep": sweep, "dtype": dt, "rows": [r.to_dict() for r in rows],
        "median_abs_error": med, "p90_abs_error": p90, "plot": None,
    }
    if plot:
        from tilefit.bench.plot import plot_sweep

        title = f"{sweep} sweep, {dt} on {dev.display_name}"
        result["plot"] = str(plot_sweep(rows, sweep, title, plot))
    return result


def render(result: dict[str, Any]) -> None:
    from rich.table import Table

    t = Table(title=f"{result['sweep']} sweep, {result['dtype']} on {result['display_name']}")
    for col in ("GEMM", "M x N x K", "measured us", "TFLOP/s", "predicted us", "error"):
        t.add_column(col, justify="right")
    for r in result["rows"]:
        t.add_row(r["label"], f"{r['m']} x {r['n']} x {r['k']}",
                  f"{r['measured_time_s'] * 1e6:.1f}", f"{r['measured_tflops']:.3f}",
                  f"{r['predicted_time_s'] * 1e6:.1f}", f"{r['error']:+.0%}")
    console.print(t)
    console.print(f"median |error| {result['median_abs_error']:.1%}, p90 "
                  f"{result['p90_abs_error']:.1%}; model: {result['device_source']}",
                  highlight=False)
    if result["plot"]:
        err_console.print(f"plot saved to {result['plot']}")
