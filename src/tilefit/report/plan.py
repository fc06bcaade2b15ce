"""Rich rendering of a Plan: the ranked table, the chosen plan and why, configs to paste."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tilefit.planner import Plan
from tilefit.planner.result import Confirmation
from tilefit.planner.rows import PlanRow
from tilefit.report.terminal import fmt_bytes, fmt_time, times_text
from tilefit.vocab import ZERO_STRATEGIES


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f}G"


def _ms(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f}s"
    return f"{seconds * 1e3:.0f}ms" if seconds >= 0.01 else f"{seconds * 1e3:.2f}ms"


def short_label(row: PlanRow) -> str:
    """The recipe in a few words: the optimizer only when it is not the user's."""
    parts = [] if row.strategy is None else [row.strategy]
    prec = row.recipe.spec
    # "bf16" for autocast, "bf16-true" (Lightning's word) for 16-bit weights: both are planned
    pure = prec.autocast_dtype is None and prec.param_dtype != "fp32"
    parts.append(f"{prec.param_dtype}-true" if pure else row.precision.replace("-mixed", ""))
    if row.changes_optimizer:
        parts.append(row.optimizer.upper())
    if row.fuses_optimizer:
        parts.append("fopt")
    if row.recipe.fused_ce:
        parts.append("fce")
    if row.recipe.compile:
        parts.append("compiled")
    if row.grad_checkpointing:
        parts.append("ckpt")
    if row.attention == "eager":
        parts.append("eager")
    if row.peft:
        parts.append("qlora" if row.recipe.quantize else "lora")
    if row.offload:
        parts.append("offload")
    return " ".join(parts)


def plans_table(plan: Plan, top: int) -> Table:
    """The ranked rows; a ``cpu`` column (each row's CPU memory per node, red over the
    host's) where a row shown needs CPU memory."""
    shown = plan.rows[:top]
    cpu = any(r.host_memory_bytes is not None for r in shown)
    host = "" if not cpu or plan.host_budget is None else \
        f"; host {_gib(plan.host_budget.memory_bytes)}iB"
    table = Table(title=f"plans, ranked (affine predictions; peak: the caching allocator's "
                  f"reserved memory; budget {_gib(plan.budget_bytes)}iB{host})",
                  box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
    for name, just in (("recipe", "left"), ("mb", "right"),
                       ("acc", "right"), ("peak", "right"), ("free", "right"),
                       *([("cpu", "right")] if cpu else []),
                       ("step", "right"), ("smp/s", "right"), ("tok/s", "right"),
                       ("MFU", "right")):
        table.add_column(name, justify=just, no_wrap=True)  # type: ignore[arg-type]
    for row in shown:
        style = None if row.fits else "dim"
        head = f"[green]{_gib(row.headroom_bytes)}[/]" if row.fits_gpu else \
            f"[red]{_gib(row.headroom_bytes)}[/]"
        label = short_label(row)
        if row.fits and row.steady_alloc_retries:  # see notes.releasing
            head = f"[yellow]{_gib(row.headroom_bytes)}[/]"
            label += " (releases cache)"
        table.add_row(label, str(row.micro_batch),
                      str(row.accumulation_steps), _gib(row.memory_bytes), head,
                      *([_cpu_cell(row)] if cpu else []),
                      _ms(row.predicted_step_time_s), f"{row.samples_per_s:,.1f}",
                      f"{row.tokens_per_s:,.0f}" if row.tokens_per_s is not None else "-",
                      f"{row.mfu:.0%}", style=style)
    return table


def _cpu_cell(row: PlanRow) -> str:
    """The row's CPU memory per node, red where the host's memory does not hold it."""
    if row.host_memory_bytes is None:
        return "-"
    return _gib(row.host_memory_bytes) if row.fits_host else \
        f"[red]{_gib(row.host_memory_bytes)}[/]"


def host_text(plan: Plan, row: PlanRow) -> str:
    """The row's CPU memory beside the host's budget, in words."""
    assert row.host_memory_bytes is not None
    what = "the offloaded optimizer state and its buffers" if row.offload else \
        "the model's fp32 copy per process while DeepSpeed initialises"
    budget = "" if plan.host_budget is None else (
        f" of {plan.host_budget.words()}" if row.fits_host else
        f", OVER {plan.host_budget.words()}")
    return (f"{fmt_bytes(row.host_memory_bytes)} per node{budget} (DeepSpeed's own "
            f"estimate: {what})")


def changes_legend(plan: Plan, top: int) -> list[str]:
    """One line per recipe shown: what it changes about training."""
    seen: dict[str, str] = {}
    for row in plan.rows[:top]:
        label = short_label(row)
        seen.setdefault(label, "; ".join(row.changes) or "nothing")
    return [f"  {k}: {v}" for k, v in seen.items()]


def best_rows(plan: Plan, best: PlanRow) -> list[tuple[str, str]]:
    """The chosen plan in words, (quantity, value) rows: recipe, batch, memory, step, why,
    changes and the confirming trace (the terminal's table and the audit's HTML page)."""
    rows = [("recipe", best.recipe_label())]
    gpus = "" if best.strategy is None else f" x {best.world_size} GPUs ({best.strategy})"
    rows.append(("batch", f"micro-batch {best.micro_batch} x {best.accumulation_steps} "
                 f"accumulation steps{gpus} = global batch {best.global_batch}"))
    if best.strategy in ZERO_STRATEGIES:
        rows.append(("memory", "per GPU (DeepSpeed modelled on one-GPU traces: its engine "
                     "does not run on fake tensors)"))
    elif best.strategy is not None:
        rows.append(("memory", "per GPU (rank 0 traced under the fake process group)"))
    held = fmt_bytes(best.predicted_peak_memory_bytes) if best.predicted_reserved_bytes \
        is None else (f"{fmt_bytes(best.predicted_reserved_bytes)} reserved by the caching "
                      f"allocator ({fmt_bytes(best.predicted_peak_memory_bytes)} of tensors)")
    rows.append(("peak memory", f"{held} of "
                 f"{fmt_bytes(plan.budget_bytes)} budget ({plan.memory_fraction:.0%} of "
                 f"{fmt_bytes(plan.device.memory_bytes)} minus "
                 f"{fmt_bytes(plan.overhead_bytes)} CUDA context/workspace)"))
    if best.host_memory_bytes:
        rows.append(("CPU memory", host_text(plan, best)))
    tput = f"{best.samples_per_s:,.2f} samples/s"
    if best.tokens_per_s is not None:
        tput += f", {best.tokens_per_s:,.0f} tokens/s"
    rows.append(("step", f"{fmt_time(best.predicted_step_time_s)}, {tput}, MFU {best.mfu:.0%}"))
    rows.append(("why", plan.reason))
    if best.changes:
        rows.append(("changes", "; ".join(best.changes)))
    check = plan.confirmation
    if check is not None:
        reserved = "" if check.reserved_error is None else (
            f", reserved {fmt_bytes(check.traced_reserved_bytes or 0)} (affine "
            f"{fmt_bytes(check.affine_reserved_bytes or 0)}, {check.reserved_error:+.1%})")
        rows.append(("confirmed", f"full trace: peak {fmt_bytes(check.traced_peak_bytes)} "
                     f"(affine {fmt_bytes(check.affine_peak_bytes)}, {check.peak_error:+.1%})"
                     f"{reserved}, step {fmt_time(check.traced_step_time_s)} (affine "
                     f"{fmt_time(check.affine_step_time_s)}, {check.time_error:+.1%})"
                     f"{releases_text(check)}"))
    return rows


def releases_text(check: Confirmation) -> str:
    """The full trace's releases of the allocator's cache, where it made any."""
    n, steady = check.alloc_retries, check.steady_alloc_retries
    if not n:
        return ""
    if steady:
        return (f"; the caching allocator releases its cache and retries in every step "
                f"({steady} num_alloc_retries a step)")
    return (f"; the caching allocator reaches the line and releases its cache {times_text(n)} "
            "(num_alloc_retries) over the first two steps, none in the steady state after "
            "(a synchronization at the start only)")


def best_table(plan: Plan, best: PlanRow, say: Callable[[str], str] = str) -> Table:
    table = Table(title="chosen plan", show_header=False, box=box.SIMPLE, pad_edge=False)
    table.add_column("quantity", style="bold")
    table.add_column("value")
    for name, value in best_rows(plan, best):
        table.add_row(name, say(value))
    return table


def config_sections(cfg: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The configs to paste, in order, as (name, aside, text): a one-GPU plan's Trainer,
    Lightning and plain PyTorch (with LoRA, 4-bit and DeepSpeed where the plan has them),
    or a multi-GPU plan's launch (the torchrun script itself: --write-configs DIR or
    --json)."""
    if "torchrun_script" in cfg:
        out = [("launch", "(--write-configs DIR writes the script and configs)",
                str(cfg["launch"]))]
        if "accelerate_yaml" in cfg:
            out.append(("accelerate.yaml", "", str(cfg["accelerate_yaml"])))
        return [*out, ("DeepSpeed (ds_config.json)", f"({cfg['deepspeed_note']})",
                       json.dumps(cfg["deepspeed"], indent=2))]
    out = [("Hugging Face TrainingArguments", "", cfg["hf_python"]),
           ("as JSON", "", cfg["hf_training_arguments_json"]),
           ("Lightning", "", json.dumps(cfg["lightning"], indent=2)),
           ("plain PyTorch", "", cfg["pytorch_loop"])]
    if "peft_lora_config" in cfg:
        out.append(("peft.LoraConfig", "", json.dumps(cfg["peft_lora_config"], indent=2)))
    if "bitsandbytes_config" in cfg:
        out.append(("transformers.BitsAndBytesConfig", "(QLoRA's 4-bit base)",
                    json.dumps(cfg["bitsandbytes_config"], indent=2)))
    if "deepspeed" in cfg:
        out.append(("DeepSpeed (ds_config.json)", "", json.dumps(cfg["deepspeed"], indent=2)))
    return out


def _print_configs(console: Console, cfg: dict[str, Any]) -> None:
    for name, aside, text in config_sections(cfg):
        console.print(f"[bold]{escape(name)}[/]" + (f" {escape(aside)}" if aside else ""),
                      highlight=False)
        print_code(console, text)


def print_code(console: Console, text: str) -> None:
    """Code or JSON to paste, each line as it is: never wrapped at the console's width (a
    wrapped line breaks a string or a key, on a terminal and in a pipe alike)."""
    console.print(text, highlight=False, markup=False, soft_wrap=True)


def print_plan(console: Console, plan: Plan, *, top: int = 15,
               say: Callable[[str], str] = str) -> None:
    """The plan as the CLI prints it; ``say``: each note in the reader's words
    (print_estimate's)."""
    gpus = "" if plan.world_size == 1 else f"{plan.world_size} x "
    console.print(f"[bold]tilefit plan[/]: {plan.model} on {gpus}{plan.device.display_name}, "
                  f"global batch {plan.global_batch}"
                  + (f", seq {plan.seq_len}" if plan.seq_len else "")
                  + f", objective {plan.objective}", highlight=False)
    console.print(plans_table(plan, top))
    console.print("what each recipe changes about training:", highlight=False)
    for line in changes_legend(plan, top):
        console.print(line, highlight=False, markup=False)
    if len(plan.rows) > top:
        console.print(f"({len(plan.rows) - top} more plans: --top {len(plan.rows)} or --json)",
                      highlight=False)
    for note in plan.notes:
        console.print(f"note: {escape(say(note))}", highlight=False)
    if plan.best is None:
        console.print(f"[bold red]{escape(say(plan.reason))}[/]", highlight=False)
    else:
        console.print(best_table(plan, plan.best, say))
        _print_configs(console, plan.configs)
        if "torchrun_script" in plan.configs:  # a multi-GPU plan: its launch is the answer
            return
    _print_multi_gpu(console, plan, say)


def multi_gpu_text(plan: Plan) -> str | None:
    """The fewest GPUs that fit when nothing fits one, in words (after "multi-GPU: "); None
    where the plan did not look."""
    multi = plan.multi_gpu
    if multi is None:
        return None
    best = multi.best
    if multi.gpus is None or best is None:
        return multi.note
    return (f"nothing fits one GPU with the optimizer on it; traced from the "
            f"ZeRO-3 formula's GPU count ({multi.formula_gpus}) up, the first that fits: "
            f"{multi.gpus} x {plan.device.display_name} with {best.strategy}: "
            f"micro-batch {best.micro_batch} x {best.accumulation_steps} accumulation x "
            f"{multi.gpus} GPUs, {fmt_bytes(best.predicted_peak_memory_bytes)} per GPU, "
            f"step {fmt_time(best.predicted_step_time_s)}, {best.samples_per_s:,.1f} "
            f"samples/s on all GPUs ({multi.method})")


def _print_multi_gpu(console: Console, plan: Plan, say: Callable[[str], str]) -> None:
    text = multi_gpu_text(plan)
    if text is None:
        return
    text = say(text)
    multi = plan.multi_gpu
    if multi is None or multi.gpus is None or multi.best is None:
        console.print(f"multi-GPU: {escape(text)}", highlight=False)
        return
    console.print(f"[bold]multi-GPU[/]: {escape(text)}", highlight=False)
    _print_configs(console, multi.configs)
