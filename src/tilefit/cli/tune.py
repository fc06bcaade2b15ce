"""`tilefit tune MODEL`: the largest batch that fits and the fastest aligned one, measured."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import typer

from tilefit.cli import model_options as mo
from tilefit.cli.common import JSON_OPTION, console, err_console, print_json, say, user_errors
from tilefit.cli.job import Job, torchrun_job
from tilefit.cli.noise import DATA_OPTION, LOSS_OPTION, build_model, load_data, load_loss
from tilefit.cli.recipe_options import FIELD_OPTIONS, RecipeFlags, takes_recipe_options
from tilefit.errors import TilefitError
from tilefit.units import parse_bytes

LIVE_GPU_OPTION = typer.Option(
    "auto", "--gpu", help="The live device to tune on: auto (the CUDA GPU if there is one, "
    "else the CPU), cuda, cuda:N or cpu.")
OBJECTIVE_OPTION = typer.Option(
    "samples-per-s", "--objective",
    help="samples-per-s (the fastest batch) or time-to-loss (the batch reaching a given loss "
    "soonest, from the gradient noise scale).")

# the shared recipe options tune does not take, and why: it runs the model as it is built,
# in a plain loop, on the live device (its own --gpu)
AS_BUILT = ("tune trains the model as it is built, in a plain loop: call tilefit.tune on the "
            "model and optimizer your script builds for this")
EXCLUDED = {
    **dict.fromkeys(("grad_checkpointing", "attention", "fused_ce", "compile_", "compile_mode",
                     "graph_breaks", "alloc_conf",
                     *FIELD_OPTIONS["lora"], "quantize", "double_quant", "quant_compute_dtype",
                     "prepare_kbit"), AS_BUILT),
    "gpu": "the live device to tune on",
    "batch": "tune searches the batch itself (--max-batch bounds it)",
    "accumulation": "tune sets accumulation from --global-batch",
    **dict.fromkeys(("gpus", "strategy", "offload"), "under torchrun every rank tunes "
                    "(torchrun --nproc-per-node N -m tilefit tune ...)")}


def register(app: typer.Typer) -> None:
    app.command("tune")(tune_command)


@takes_recipe_options("tune", excluded=EXCLUDED)
def tune_command(
    flags: RecipeFlags,
    gpu: str = LIVE_GPU_OPTION,
    global_batch: int = typer.Option(None, "--global-batch",
                                     help="Keep this many samples per optimizer step exact."),
    memory_limit: str = typer.Option(None, "--memory-limit",
                                     help="Simulate a device of this size: bytes, 2GiB, 500MB."),
    max_batch: int = typer.Option(None, "--max-batch", help="Never try more than this."),
    margin: float = typer.Option(None, "--margin",
                                 help="Fraction of memory kept free (default 0.10)."),
    plot: str = typer.Option(None, "--plot", help="Write samples/s against batch size here."),
    objective: str = OBJECTIVE_OPTION,
    noise_scale: float | None = typer.Option(
        None, "--noise-scale", help="B_noise in samples for --objective time-to-loss "
        "(default: measured on --data)."),
    data: str | None = DATA_OPTION,
    loss: str | None = LOSS_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Run real training steps to find the largest batch that fits and the fastest aligned one.

    Before the first trial it says about how many trials and how long; then one line per
    trial on stderr, also when the output is piped or in a CI log.

    Example, a 2.4 GiB device simulated on the CPU (GPT-2 small is 1.85 GiB of weights,
    gradients and AdamW state): 4 fit trials find that 7 fits, then 4 timed trials
    choose among 1, 2, 4 and 7. Measured on 2026-11-30 on a 2-core AMD EPYC with torch on
    2 threads: 103 s on a quiet machine (load average 1.9), 961 s when other jobs loaded it
    (load average 5 to 6).

        tilefit tune gpt2 --seq 64 --max-batch 8 --memory-limit 2.4GiB

    Under torchrun (torchrun --nproc-per-node N -m tilefit tune ...) every rank trains the
    model in DistributedDataParallel, the ranks agree on every trial, and rank 0 alone
    prints; the batch is per rank, --global-batch the job's.
    """
    with user_errors(), torchrun_job(gpu) as job:
        options = TuneOptions(flags["model"], gpu, global_batch, memory_limit, max_batch,
                              flags["seq"], flags["input_shape"], flags["task"],
                              flags["optimizer"], flags["precision"], margin, objective,
                              noise_scale, data, loss, target_seq=flags["target_seq"],
                              image_size=flags["image_size"], revision=flags["revision"],
                              routing=flags["routing"],
                              max_grad_norm=flags["max_grad_norm"],
                              loss_sync=flags["loss_sync"])
        result = _run(options, show_progress=job.is_main, job=job)
        if plot and job.is_main:
            _plot(result, plot)
    if not job.is_main:
        return
    if json_out:
        print_json(result.to_dict())
        return
    _render(result, plot)


def _plot(result: Any, path: str) -> None:
    from tilefit.report.plots import plot_throughput

    plot_throughput(result, path)


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
    optimizer: str | None
    precision: str | None
    margin: float | None
    objective: str = "samples-per-s"
    noise_scale: float | None = None
    data: str | None = None
    loss: str | None = None
    target_seq: int | None = None
    image_size: int | None = None
    revision: str | None = None
    routing: str | None = None  # the first probe's MoE routing (the trials run the router)
    # the loop's clipping and loss read (None: the model's framework's, as estimate's)
    max_grad_norm: str | None = None
    loss_sync: bool | None = None

    def __post_init__(self) -> None:
        if self.routing is not None:  # a malformed form exits 2 before the model is built
            from tilefit.vocab import parse_routing

            parse_routing(self.routing)

    @property
    def source(self) -> dict[str, Any]:
        """The model options beyond --seq, --input-shape and --task, as ``mo.load`` takes them."""
        return {"target_seq": self.target_seq, "image_size": self.image_size,
                "revision": self.revision}


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
    from tilefit.vocab import default_precision, mixed_precision, parse_precision

    if text:
        return parse_precision(text).name
    if device.type != "cuda":
        return "fp32"
    try:
        return default_precision(detect_live_device(device.index or 0))
    except TilefitError:  # a GPU the catalog does not know
        import torch

        half = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return mixed_precision(half).name


def optimizer_factory(name: str) -> Any:
    """params -> the optimizer --optimizer names, as the other commands trace it."""
    from tilefit.recipe import check_optimizer
    from tilefit.tracing.optimizers import make_optimizer

    key = name.strip().lower()
    check_optimizer(key)  # an unknown name: the error suggests the close ones
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


def _run(options: TuneOptions, *, show_progress: bool, job: Job | None = None) -> Any:
    from tilefit.recipe import Recipe
    from tilefit.tuning import DEFAULT_MARGIN, TuneSearch, tune

    report = TuneReport(err_console, enabled=show_progress)
    try:
        limit_bytes = None if options.memory_limit is None else parse_bytes(options.memory_limit)
        workload = _workload(options)
        loop = mo.recipe(workload, max_grad_norm=options.max_grad_norm,
                         loss_sync=options.loss_sync)
        factory = optimizer_factory(options.optimizer or loop.to_dict()["optimizer"])
        torch_device = live_device(options.gpu)
        precision = live_precision(options.precision, torch_device)
        report.line(f"building {options.model} on {torch_device} ({precision})")
        module, make_batch, loss_fn = _model_and_batches(options, workload, torch_device)
        module = (job or Job()).wrap(module, torch_device)

        report.line("predicting the largest batch from fake-tensor traces of the step, then "
                    "timing a step at batch 1 and at a quarter of that batch")
        return tune(
            module, make_batch, optimizer=factory, loss_fn=loss_fn,
            # the framework's loop, as estimate predicts it: its clipping and loss read
            recipe=Recipe(precision=precision, max_grad_norm=loop.max_grad_norm,
                          loss_sync=loop.loss_sync),
            device=torch_device, search=TuneSearch(
                global_batch=options.global_batch, max_batch=options.max_batch,
                memory_limit_bytes=limit_bytes,
                margin=DEFAULT_MARGIN if options.margin is None else options.margin,
                objective=options.objective, noise_scale=options.noise_scale,
                on_trial=report.trial, on_outlook=report.outlook,
                routing=options.routing or "balanced"),
        )
    finally:
        report.stop()


@dataclass(frozen=True)
class _PlainModule:
    """What the optimizer default needs to know of a module:function model measured on --data
    without --input-shape (no Workload: the data factory makes the batches)."""

    is_factory: bool = True


def _workload(options: TuneOptions) -> Any:
    from tilefit.recipe import looks_like_factory

    if options.data is not None and options.input_shape is None \
            and looks_like_factory(options.model):
        return _PlainModule()
    return mo.load(options.model, options.seq, options.input_shape, options.task,
                   **options.source)


def _model_and_batches(options: TuneOptions, workload: Any, device: Any
                       ) -> tuple[Any, Any, Any]:
    """The module on the device (tune trains it in train mode), make_batch and loss_fn:
    --data and --loss (a module:function model then needs no --input-shape), else the
    workload's synthetic batches (no gradient noise: time-to-loss then needs --noise-scale)."""
    if options.data is not None:
        module = build_model(options.model, options.seq, options.input_shape, options.task,
                             **options.source)
        return module.to(device), load_data(options.data), load_loss(options.loss)
    if options.objective == "time-to-loss" and options.noise_scale is None:
        raise TilefitError(
            "--objective time-to-loss needs the gradient noise scale",
            expected="--data (measured on your data) or --noise-scale N",
            given="neither (synthetic batches are the same on every call: no noise)",
            fix="pass --data mydata:make_data, or --noise-scale from `tilefit noise-scale`")

    def make_batch(b: int) -> Any:
        return workload.make_batch(b, device)

    return (workload.build().to(device), make_batch,
            load_loss(options.loss) or workload.loss_fn)


class TuneReport:
    """tune's progress on stderr, one plain line per event (building, the outlook, each
    trial), each stamped with the time since the start: piped output and CI logs show it
    as it happens. On a terminal a spinner with the elapsed time runs below the lines."""

    def __init__(self, out: Any, *, enabled: bool) -> None:
        self.out = out
        self.enabled = enabled
        self.start_s = time.perf_counter()
        self.trials = 0
        self.expected_trials: int | None = None
        self.progress: Any = None
        if enabled and out.is_terminal:
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"),
                                     TimeElapsedColumn(), console=out, transient=True)
            self.task = self.progress.add_task("tune", total=None)
            self.progress.start()

    def line(self, text: str) -> None:
        if not self.enabled:
            return
        elapsed_s = time.perf_counter() - self.start_s
        self.out.print(f"tune [{elapsed_s:6.1f} s] {text}", highlight=False, markup=False,
                       soft_wrap=True)
        if self.progress is not None:
            self.progress.update(self.task, description=f"tune: {text}")

    def outlook(self, o: Any) -> None:
        self.expected_trials = o.trials
        timed = f", then {len(o.timed_batches)} timed" if o.timed_batches else ""
        self.line(f"about {o.trials} trials ({o.fit_trials} to find the largest batch, "
                  f"expected near {o.batch_guess}{timed}), ~{o.expected_s:.0f} s: a step "
                  f"took {o.step_s_at_1:.2f} s at batch 1, +{o.step_s_per_sample:.3f} s "
                  "per further sample")

    def trial(self, t: Any) -> None:
        from tilefit.tuning.tuner import gib

        self.trials += 1
        of = f" of ~{self.expected_trials}" if self.expected_trials else ""
        if t.kind == "fit":
            what = "out of memory" if not t.fits else "fits" + (
                "" if t.peak_memory_bytes is None else f", peak {gib(t.peak_memory_bytes)}")
        else:
            what = "out of memory" if not t.fits else f"{t.samples_per_s:,.1f} samples/s"
        self.line(f"trial {self.trials}{of}: {t.kind} at batch {t.batch_size}: {what} "
                  f"({t.time_s:.1f} s)")

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def _rate(samples_per_s: float) -> str:
    """Three significant figures below 100 samples/s (a large model on a CPU runs 0.2)."""
    return f"{samples_per_s:,.0f}" if samples_per_s >= 100 else f"{samples_per_s:.3g}"


def _render(result: Any, plot: str | None) -> None:
    from rich.table import Table

    from tilefit.report.terminal import fmt_bytes

    t = Table(title="tilefit tune: trials")
    for col in ("kind", "batch", "fits", "peak memory", "samples/s", "time"):
        t.add_column(col, justify="right")
    for tr in result.trials:
        t.add_row(tr.kind, str(tr.batch_size), "yes" if tr.fits else "[red]no[/]",
                  "" if tr.peak_memory_bytes is None else fmt_bytes(tr.peak_memory_bytes),
                  "" if tr.samples_per_s is None else _rate(tr.samples_per_s),
                  f"{tr.time_s:.2f} s")
    console.print(t)
    console.print(f"largest batch that fits: [bold]{result.max_fitting_batch_size}[/]"
                  + (f" (budget {fmt_bytes(result.budget_bytes)})" if result.budget_bytes else ""))
    rate = "" if result.samples_per_s is None else f", {_rate(result.samples_per_s)} samples/s"
    if result.world_size > 1 and result.samples_per_s is not None:  # the slowest rank's
        rate += f" per rank ({_rate(result.samples_per_s * result.world_size)} for the job)"
    ranks = "" if result.world_size == 1 else f" per rank, x {result.world_size} ranks " \
        f"= {result.global_batch_size} samples per step"
    console.print(f"chosen batch: [bold green]{result.batch_size}[/] x "
                  f"{result.accumulation_steps} accumulation steps{ranks}{rate} "
                  f"(noise band {result.noise:.1%})")
    for note in result.notes:  # what tune skipped, and why
        console.print(f"note: {say(note)}", highlight=False)
    if result.objective == "time-to-loss":
        _render_time_to_loss(result)
    if plot:
        console.print(f"plot written to {plot}")


def _render_time_to_loss(result: Any) -> None:
    measured = "" if result.noise_measurement is None else \
        f" (measured: {result.noise_measurement.b_simple_low:,.1f} to " \
        f"{result.noise_measurement.b_simple_high:,.1f})"
    console.print(f"gradient noise scale B_noise ~ {result.b_noise:,.1f} samples{measured}")
    for row in result.time_to_loss:
        console.print(f"  batch {row.batch_size}: {_rate(row.samples_per_s)} samples/s, "
                      f"{row.steps_factor:.2f} x S_min steps, time to the loss "
                      f"{row.time_factor:.2f} x the best", highlight=False)
    console.print(f"soonest to a given loss: batch [bold green]{result.batch_size}[/]; the "
                  f"fastest in samples/s, {result.samples_per_s_batch}, would take "
                  f"{result.time_to_loss_slowdown:.2f}x as long")
    if result.learning_rate is not None:
        console.print(f"learning rate: {result.learning_rate.text}", highlight=False)
    for warning in result.warnings:
        err_console.print(f"[yellow]warning:[/] {say(warning)}", highlight=False)
