"""`tilefit run SCRIPT [ARGS]...`: your own training script, unmodified, on a simulated GPU."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from tilefit.cli import model_options as mo
from tilefit.cli.audit import HTML_OPTION, _check_html
from tilefit.cli.common import JSON_OPTION, console, err_console, print_json, say, user_errors
from tilefit.cli.estimate import OPS_OPTION
from tilefit.units import fmt_time

if TYPE_CHECKING:
    from tilefit.simulation.findings import Findings

STEPS_OPTION = typer.Option(3, "--steps", min=1, help="Stop the script after its Nth "
                            "optimizer step; the report is of the last (the first also "
                            "creates the optimizer state).")
MODULE_OPTION = typer.Option(None, "--module", "-m", help="Run a module as `python -m` "
                             "does, instead of a script.")
AUDIT_OPTION = typer.Option(False, "--audit", help="Also audit the script's step: what slows "
                            "it or makes it not fit, each finding with its fix and predicted "
                            "gain (the what-ifs that need a re-trace are skipped).")
GPUS_OPTION = typer.Option(1, "--gpus", min=1, help="Run the script as rank 0 of N GPUs on "
                           "one node, as torchrun --nproc-per-node N does (its environment, "
                           "a simulated process group for init_process_group; DDP).")
SCRIPT_ARG = typer.Argument(None, help="The training script, then its own arguments.",
                            show_default=False)


def register(app: typer.Typer) -> None:
    app.command("run", context_settings={"allow_interspersed_args": False,
                                         "ignore_unknown_options": True})(run)


def run(
    script_and_args: list[str] = SCRIPT_ARG,
    module: str | None = MODULE_OPTION,
    gpu: str = mo.GPU_OPTION,
    steps: int = STEPS_OPTION,
    gpus: int = GPUS_OPTION,
    ops: bool = OPS_OPTION,
    html: Path | None = HTML_OPTION,
    audit: bool = AUDIT_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Run your training script as if `cuda` were the chosen GPU, on this machine, and
    predict its training step: the script's own model, loop, precision and optimizers."""
    from tilefit.hardware import get_device
    from tilefit.simulation.script import ScriptFailed, run_script

    words = list(script_and_args or [])
    script = None if module is not None else (words.pop(0) if words else None)
    started = time.perf_counter()
    with user_errors():
        _check_html(html)
        device = get_device(gpu)
        try:
            sim = run_script(script, words, module=module, gpu=device, steps=steps, gpus=gpus)
        except ScriptFailed as failed:
            sys.stderr.write(failed.traceback_text)
            err_console.print("[bold red]error:[/] the script raised before its first "
                              "optimizer step: nothing was predicted", highlight=False)
            raise typer.Exit(code=1) from None
    wall_s = time.perf_counter() - started
    assert sim.result is not None and sim.found is not None
    name = script or f"-m {module}"
    if json_out:
        print_json({"script": name, "args": words, "found": sim.found.to_dict(),
                    "not_written": sim.unwritten, "from_pretrained": sim.pretrained,
                    "simulation_wall_s": wall_s, **sim.result.to_dict(include_ops=ops)})
        return
    from tilefit.report.terminal import print_estimate

    title = f"tilefit run: {name} on {device.display_name}, the script's step " \
        f"{sim.found.steps_run}"
    print_estimate(console, sim.result, title, say=say)
    lines = found_lines(sim.found) + [
        f"from_pretrained({p!r}): built from its config, no weights read"
        for p in sim.pretrained] + [
        f"not written (its tensors are simulated): {path}" for path in sim.unwritten]
    console.print("[bold]found in the script[/]", highlight=False)
    for line in lines:
        console.print(f"  {line}", highlight=False, soft_wrap=True)
    if audit:
        _print_audit(sim, name)
    if html is not None:
        from tilefit.report.html import render_run_html, write_text

        with user_errors():
            out = write_text(render_run_html(sim.result, title, lines), html)
        console.print(f"wrote {out}", highlight=False, soft_wrap=True)


def _print_audit(sim: Any, name: str) -> None:
    """The audit's findings for the script's step (tilefit.advise.audit_trace)."""
    from tilefit.advise.audit import audit_trace
    from tilefit.report.audit_terminal import print_findings
    from tilefit.simulation.findings import recipe_of

    recipe = recipe_of(sim.found, sim.trace.samples_per_micro_batch)
    result = audit_trace(sim.trace, recipe, sim.device, name=name)
    console.print("[bold]audit of the script's step[/]", highlight=False)
    print_findings(console, result, say)
    for note in result.notes:
        console.print(f"note: {say(note)}", highlight=False, soft_wrap=True)


def found_lines(found: Findings) -> list[str]:
    """What the script was seen to do: what the prediction rests on, a line each."""
    lines = [f"precision: {found.precision}"
             + (" with a GradScaler" if found.grad_scaler else ""),
             "optimizers: " + (", ".join(_optimizer(o) for o in found.optimizers) or "none"),
             f"micro-batches per step (backward passes): {found.accumulation_steps}",
             "gradient clipping: " + (", ".join(found.clipping) or "none"),
             f"activation checkpointing: {'yes' if found.grad_checkpointing else 'no'}",
             "torch.compile: " + _compiled(found),
             "models called: " + (", ".join(found.models) or "none"),
             f"host-to-device copies in the run: {found.copies_to_gpu}",
             f"ops on CPU tensors in the step (data loading, collation): "
             f"{found.host_ops_per_step}, run by this machine's CPU, not in the prediction"]
    if found.zero_grad_to_none is not None:
        lines.append("zero_grad: " + ("set_to_none" if found.zero_grad_to_none
                                      else "zeroed in place (set_to_none=False)"))
    for r in found.host_reads:
        lines.append(f"host read of a value at {r.site}, {r.count} time(s) in the run "
                     f"(a GPU sync; the simulation answered {r.placeholder!r})")
    for s in found.syncs:
        lines.append(f"{s} (the host waits for the GPU: costed in the step)")
    if found.between_steps_s:
        gaps = sorted(found.between_steps_s)
        lines.append(f"time between steps (data loading, logging): "
                     f"{fmt_time(gaps[len(gaps) // 2])}, median of {len(gaps)}, measured on "
                     "this machine under the simulation (its tensor ops on fake tensors), not "
                     "in the predicted step")
    return lines


def _compiled(found: Findings) -> str:
    if found.compiled_modules:
        return f"{found.compiled_modules} module(s), predicted as Inductor runs them"
    return "called on a function (run eagerly here)" if found.compiled else "no"


def _optimizer(o: Any) -> str:
    extra = [f"{k}={v}" for k, v in (("fused", o.fused), ("foreach", o.foreach))
             if v is not None]
    return o.name + (f" ({', '.join(extra)})" if extra else "")
