"""`tilefit noise-scale MODEL --data pkg.mod:fn`: the gradient noise scale on your own data."""

from __future__ import annotations

from typing import Any

import typer

from tilefit.cli import model_options as mo
from tilefit.cli.common import JSON_OPTION, console, err_console, print_json, user_errors
from tilefit.cli.recipe_options import FIELD_OPTIONS, RecipeFlags, takes_recipe_options
from tilefit.errors import TilefitError

DATA_OPTION = typer.Option(
    None, "--data", help="package.module:function returning make_batch(b), which returns b "
    "samples drawn at random from your training data on every call.")
LOSS_OPTION = typer.Option(
    None, "--loss", help="package.module:function loss(model, batch) -> the batch's mean loss "
    "(default: model(**batch).loss for dict batches).")


PLAN_NOISE_OPTION = typer.Option(
    None, "--noise-scale", help="The gradient noise scale B_noise in samples, or the JSON "
    "that `tilefit noise-scale --json` wrote: warn when the global batch is far above it.")


def read_noise_scale(text: str) -> float:
    """A number, or the b_simple of a `tilefit noise-scale --json` file."""
    import json
    from pathlib import Path

    try:
        value = float(text)
    except ValueError:
        path = Path(text).expanduser()
        try:
            value = float(json.loads(path.read_text(encoding="utf-8"))["b_simple"])
        except (OSError, ValueError, KeyError, TypeError):
            value = float("nan")
    if not value > 0:
        raise TilefitError("--noise-scale must be a positive number or a noise-scale JSON file",
                           expected="e.g. 512, or ns.json from `tilefit noise-scale --json`",
                           given=repr(text), fix="pass --noise-scale 512")
    return value

# the shared recipe options noise-scale does not take, and why: it measures gradients of the
# model as it is built, on the live device (its own --gpu), and steps no optimizer
AS_BUILT = ("noise-scale measures the gradients of the model as it is built: call "
            "tilefit.noise_scale on the model your script builds for this")
EXCLUDED = {
    **dict.fromkeys(("grad_checkpointing", "attention", "fused_ce", "compile_",
                     "compile_mode", "graph_breaks", "alloc_conf", *FIELD_OPTIONS["lora"],
                     "quantize", "double_quant", "quant_compute_dtype", "prepare_kbit",
                     "routing"), AS_BUILT),
    "gpu": "the live device to measure on",
    **dict.fromkeys(("batch", "accumulation"), "noise-scale takes its two batch sizes as "
                    "--batch-sizes SMALL,BIG (the big one accumulated from the small)"),
    **dict.fromkeys(("optimizer", "max_grad_norm", "loss_sync"), "noise-scale steps no "
                    "optimizer: it measures gradients only"),
    **dict.fromkeys(("gpus", "strategy", "offload"), "noise-scale measures on one device")}


def register(app: typer.Typer) -> None:
    app.command("noise-scale")(noise_scale_command)


def parse_batch_sizes(text: str) -> tuple[int, int]:
    """'8,64' -> (8, 64); the sizes themselves are checked by tilefit.tuning.noise."""
    parts = [p for p in text.replace("x", ",").replace(" ", ",").split(",") if p]
    try:
        sizes = tuple(int(p) for p in parts)
    except ValueError:
        sizes = ()
    if len(sizes) != 2:
        raise TilefitError("--batch-sizes takes two whole numbers", expected="SMALL,BIG, e.g. 8,64",
                           given=repr(text), fix="write it like --batch-sizes 8,64")
    return sizes[0], sizes[1]


def load_data(data: str | None) -> Any:
    """make_batch from --data (the factory is called once, with no arguments)."""
    from tilefit.models.factory import load_factory

    if data is None:
        raise TilefitError(
            "the noise scale needs your training data",
            expected="--data package.module:function returning make_batch(b)",
            given="no --data (a synthetic batch is the same on every call: no noise)",
            fix="write def make_data(): return lambda b: <b random samples> and pass "
            "--data mydata:make_data")
    make_batch = load_factory(data)()
    if not callable(make_batch):
        raise TilefitError(f"{data} did not return a function",
                           expected="a make_batch(b) function", given=type(make_batch).__name__,
                           fix=f"make {data.rpartition(':')[2]} return make_batch")
    return make_batch


def load_loss(loss: str | None) -> Any:
    from tilefit.models.factory import load_factory

    return None if loss is None else load_factory(loss)


def build_model(model: str, seq: int | None, input_shape: str | None, task: str | None,
                **source: Any) -> Any:
    """The module to measure: a module:function factory needs no --input-shape here (the
    data factory makes the batches); a catalog model, Hub id or config is built as elsewhere
    (``source``: ``mo.load``'s target_seq, image_size and revision)."""
    from tilefit.models.factory import build_module
    from tilefit.recipe import looks_like_factory

    if looks_like_factory(model) and input_shape is None:
        return build_module(model)
    return mo.load(model, seq, input_shape, task, **source).build()


@takes_recipe_options("noise-scale", excluded=EXCLUDED)
def noise_scale_command(
    flags: RecipeFlags,
    data: str | None = DATA_OPTION,
    loss: str | None = LOSS_OPTION,
    gpu: str = typer.Option("auto", "--gpu", help="The live device: auto, cuda, cuda:N or cpu."),
    batch_sizes: str = typer.Option("8,64", "--batch-sizes",
                                    help="SMALL,BIG: the big batch is accumulated from "
                                    "micro-batches of the small one."),
    measurements: int = typer.Option(10, "--measurements", help="Big batches measured."),
    checkpoint: str | None = typer.Option(
        None, "--checkpoint", help="Weights to measure at: a state-dict file (.pt, .ckpt, "
        ".safetensors) or a Hugging Face checkpoint folder."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Measure the gradient noise scale B_simple (McCandlish et al. 2018) on your data.

    Past B_simple a bigger batch stops cutting the steps to a given loss: the critical batch
    size. It grows as training proceeds: measure after warm-up, and again from later
    checkpoints (--checkpoint). Example:

        tilefit noise-scale mymodel:build --data mydata:make_data --loss mydata:loss \\
            --checkpoint runs/step-2000.pt
    """
    from tilefit.cli.tune import live_device, live_precision
    from tilefit.tuning.noise_measure import noise_scale
    from tilefit.tuning.options import NoiseMeasure

    with user_errors():
        make_batch = load_data(data)
        loss_fn = load_loss(loss)
        sizes = parse_batch_sizes(batch_sizes)
        device = live_device(gpu)
        model = flags["model"]
        module = build_model(model, flags["seq"], flags["input_shape"], flags["task"],
                             target_seq=flags["target_seq"], image_size=flags["image_size"],
                             revision=flags["revision"]).to(device)
        err_console.print(f"measuring {model} on {device}: {measurements} big batches of "
                          f"{sizes[1]} from micro-batches of {sizes[0]}", highlight=False)
        result = noise_scale(module, make_batch, loss_fn=loss_fn,
                             precision=live_precision(flags["precision"], device), device=device,
                             measure=NoiseMeasure(batch_sizes=sizes, measurements=measurements,
                                                  checkpoint=checkpoint))
    if json_out:
        print_json(result.to_dict())
        return
    render(result)


def render(r: Any) -> None:
    from rich.table import Table

    from tilefit.tuning.noise import lr_fraction

    console.print(f"gradient noise scale B_simple: [bold]{r.b_simple:,.1f}[/] samples "
                  f"({r.confidence:.0%} interval {r.b_simple_low:,.1f} to {r.b_simple_high:,.1f})")
    console.print(f"|G|^2 {r.gradient_sq_norm:.4g}, tr(Sigma) {r.trace_sigma:.4g}, mean loss "
                  f"{r.loss:.4g}; batch sizes {r.batch_small} and {r.batch_big}, "
                  f"{r.samples:,} samples, {r.time_s:.2f} s")
    if r.b_simple > 4 * r.batch_big:
        err_console.print(f"note: B_simple is {r.b_simple / r.batch_big:.0f}x the big batch, "
                          "where |G|^2 is hardest to resolve: a big batch nearer B_simple "
                          f"(--batch-sizes {r.batch_small},{4 * r.batch_big}) narrows the "
                          "interval", highlight=False)
    t = Table(title="what each batch costs to reach the same loss (eq. 2.11)")
    for col in ("batch", "steps / S_min", "samples / E_min", "SGD lr / max", "Adam lr / max"):
        t.add_column(col, justify="right")
    b = 1
    while b <= 16 * max(r.b_simple, 1):
        if b >= r.b_simple / 16:
            t.add_row(str(b), f"{r.steps_factor(b):.2f}", f"{r.samples_factor(b):.2f}",
                      f"{lr_fraction(b, r.b_simple, 'sgd'):.2f}",
                      f"{lr_fraction(b, r.b_simple, 'adam'):.2f}")
        b *= 2
    console.print(t)
    console.print("Batches near B_simple balance steps against samples; well above it, "
                  "doubling the batch doubles the samples for the same loss. The noise scale "
                  "grows as the loss falls: measure again from later checkpoints "
                  "(--checkpoint).")
