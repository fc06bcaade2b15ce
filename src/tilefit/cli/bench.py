"""`tilefit bench gemm`: the GEMM guides' sweeps measured on the live device, with the model."""

from __future__ import annotations

from typing import Any

import typer

from tilefit.cli.common import JSON_OPTION, console, err_console, print_json, user_errors
from tilefit.cli.recipe_options import RecipeFlags, takes_recipe_options

bench_app = typer.Typer(help="Measure on the live device (CPU or CUDA GPU) beside the model.",
                        no_args_is_help=True)

DEVICE_HELP = "cpu (this machine) or cuda (the live GPU)."
# the shared recipe options bench step does not take, and why
EXCLUDED = {
    "gpu": "bench step measures the live --device (cpu or cuda) and predicts for it",
    **dict.fromkeys(("compile_", "compile_mode", "graph_breaks"), "bench step runs the step "
                    "eagerly (tilefit run measures a torch.compile'd script)"),
    "alloc_conf": "the real step's allocator reads PYTORCH_CUDA_ALLOC_CONF from the "
    "environment, and so does its prediction: set it there",
    **dict.fromkeys(("gpus", "strategy", "offload"), "bench step measures one device")}


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")


@bench_app.command("step")
@takes_recipe_options("bench step", excluded=EXCLUDED, defaults={"batch": 4})
def step(
    flags: RecipeFlags,
    device: str = typer.Option("cpu", "--device", help=DEVICE_HELP),
    layers: int = typer.Option(None, "--layers", help="Build the model with this many layers "
                               "(num_hidden_layers), to fit a small device."),
    steps: int = typer.Option(5, "--steps", help="Timed steps after warm-up."),
    json_out: bool = JSON_OPTION,
) -> None:
    """A real training step on the live device: its time and peak memory beside the
    estimate's prediction for the same device and the same step (the model's usual loop,
    as tilefit estimate: clipping and the loss read included). With --lora (and --quantize)
    the model is built for real as peft (and bitsandbytes, through from_pretrained) build
    it."""
    from tilefit.bench.step import measure_step
    from tilefit.calibrate.run import live_kind_device
    from tilefit.estimator.workload_estimate import estimate_workload

    with user_errors():
        dev = live_kind_device(device)
        work = flags.workload()
        if layers is not None:
            work = work.with_config(num_hidden_layers=layers)
        recipe = flags.recipe(work).on(dev)
        predicted = estimate_workload(work, recipe, dev)
        measured = measure_step(work, recipe, dev.kind, steps=steps)
    row = _step_row(work, dev, recipe, predicted, measured)
    if json_out:
        print_json(row)
        return
    _print_step(row, work, dev, recipe, measured)


def _step_row(work: Any, dev: Any, recipe: Any, predicted: Any, measured: Any
              ) -> dict[str, Any]:
    """The measured step beside its prediction (tilefit.bench.step.comparison): what --json
    prints."""
    from tilefit.bench.step import comparison

    return {
        "model": work.name, "device": dev.name, "recipe": recipe.to_dict(),
        **comparison(predicted, measured),
        "step_times_s": list(measured.step_times_s), "device_source": dev.source,
        "step_time_spread": measured.spread, "noisy": measured.noisy,
        "threads": measured.threads, "load_average": measured.load_average,
    }


def _print_step(row: dict[str, Any], work: Any, dev: Any, recipe: Any, measured: Any) -> None:
    adapters = "" if recipe.lora is None else f", {recipe.lora.label(recipe.quantize)}"
    accumulated = (f" x {recipe.accumulation_steps} accumulation steps"
                   if recipe.accumulation_steps > 1 else "")
    console.print(f"{work.name} on {dev.display_name}, batch {recipe.batch_size}{accumulated}, "
                  f"{recipe.precision}{adapters}:")
    console.print(f"  step time   measured {row['measured_step_time_s'] * 1e3:9.2f} ms   "
                  f"predicted {row['predicted_step_time_s'] * 1e3:9.2f} ms   "
                  f"error {row['step_time_error']:+.1%}")
    console.print(f"  peak memory measured {row['measured_peak_memory_bytes'] / 2**20:9.1f} MiB  "
                  f"predicted {row['predicted_peak_memory_bytes'] / 2**20:9.1f} MiB  "
                  f"error {row['peak_memory_error']:+.1%}")
    if row["peak_reserved_error"] is not None:
        console.print(f"  reserved    measured "
                      f"{row['measured_peak_reserved_bytes'] / 2**20:9.1f} MiB  predicted "
                      f"{row['predicted_peak_reserved_bytes'] / 2**20:9.1f} MiB  "
                      f"error {row['peak_reserved_error']:+.1%}")
    err_console.print(f"device numbers: {dev.source}", highlight=False)
    if measured.noisy:
        err_console.print(
            f"[bold yellow]noisy machine:[/] the {len(measured.step_times_s)} timed steps "
            f"spread {measured.spread:.0%}, load average {measured.load_average:.1f} on "
            f"{measured.cores} cores ({measured.threads} threads here): the measured time is "
            "not trustworthy; rerun on a quiet machine (or with more --steps)",
            highlight=False)


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
    model: str = typer.Option(None, "--model", help="Measure the distinct GEMM shapes of this "
                              "model's traced training step instead of a sweep."),
    batch: int = typer.Option(1, "--batch", help="With --model: the micro-batch."),
    seq: int = typer.Option(None, "--seq", help="With --model: tokens per sample."),
    layers: int = typer.Option(None, "--layers", help="With --model: build it with this many "
                               "layers (the shapes repeat per layer)."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Delivered TFLOP/s against batch for a linear layer's three GEMMs, or time against K / N
    one step at a time, or a model's own GEMMs (--model); each row measured and predicted."""
    with user_errors():
        if model is not None:
            result = run_model_bench(device, model, batch, seq, layers, quick)
        else:
            result = run_bench(device, sweep, in_features, out_features, m, n, dtype, quick,
                               plot)
    if json_out:
        print_json(result)
        return
    render(result)


def run_model_bench(device: str, model: str, batch: int, seq: int | None,
                    layers: int | None, quick: bool) -> dict[str, Any]:
    import numpy as np

    from tilefit.bench.model_gemms import model_gemm_shapes
    from tilefit.bench.sweeps import run_sweep
    from tilefit.calibrate.fit import error_summary
    from tilefit.calibrate.run import live_kind_device
    from tilefit.cli.model_options import load
    from tilefit.recipe import Recipe

    dev = live_kind_device(device)
    work = load(model, seq, None, None)
    if layers is not None:
        work = work.with_config(num_hidden_layers=layers)
    recipe = Recipe(batch_size=batch).on(dev)
    dt, shapes = model_gemm_shapes(work, recipe, dev)
    rows = run_sweep(shapes, dt, dev, quick=quick)
    med, p90 = error_summary(np.array([abs(r.error) for r in rows])) if rows else (0.0, 0.0)
    return {
        "device": dev.name, "display_name": dev.display_name, "device_source": dev.source,
        "sweep": "model", "model": work.name, "dtype": dt, "rows": [r.to_dict() for r in rows],
        "median_abs_error": med, "p90_abs_error": p90, "plot": None,
    }


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
        from tilefit.report.plots import plot_sweep

        title = f"{sweep} sweep, {dt} on {dev.display_name}"
        result["plot"] = str(plot_sweep(rows, sweep, title, plot))
    return result


def render(result: dict[str, Any]) -> None:
    from rich.table import Table

    per_model = result["sweep"] == "model"
    title = (f"GEMMs of {result['model']}'s training step" if per_model
             else f"{result['sweep']} sweep") + f", {result['dtype']} on {result['display_name']}"
    t = Table(title=title)
    first = "module (phase) x per step" if per_model else "GEMM"
    for col in (first, "M x N x K", "measured us", "TFLOP/s", "predicted us", "error"):
        t.add_column(col, justify="right")
    for r in result["rows"]:
        label = f"{r['label']} x{r['x']}" if per_model else r["label"]
        t.add_row(label, f"{r['m']} x {r['n']} x {r['k']}",
                  f"{r['measured_time_s'] * 1e6:.1f}", f"{r['measured_tflops']:.3f}",
                  f"{r['predicted_time_s'] * 1e6:.1f}", f"{r['error']:+.0%}")
    console.print(t)
    console.print(f"median |error| {result['median_abs_error']:.1%}, p90 "
                  f"{result['p90_abs_error']:.1%}; model: {result['device_source']}",
                  highlight=False)
    if result["plot"]:
        err_console.print(f"plot saved to {result['plot']}")
