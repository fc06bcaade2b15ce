"""Rich rendering of a Plan: the ranked table, the chosen plan and why, configs to paste."""

from __future__ import annotations

import json

from rich import box
from rich.console import Console
from rich.table import Table

from tilefit.planner import Plan
from tilefit.planner.rows import PlanRow
from tilefit.report.terminal import fmt_bytes, fmt_time


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}G"


def _ms(s: float) -> str:
    if s >= 1:
        return f"{s:.2f}s"
    return f"{s * 1e3:.0f}ms" if s >= 0.01 else f"{s * 1e3:.2f}ms"


def short_label(r: PlanRow) -> str:
    """The recipe in a few words: the optimizer only when it is not the user's."""
    parts = [r.precision.replace("-mixed", "")]
    if r.changes_optimizer:
        parts.append(r.optimizer.upper())
    if r.grad_checkpointing:
        parts.append("ckpt")
    if r.attention == "eager":
        parts.append("eager")
    if r.peft:
        parts.append("lora")
    if r.offload:
        parts.append("offload")
    return " ".join(parts)


def plans_table(plan: Plan, top: int) -> Table:
    t = Table(title=f"plans, ranked (affine predictions; budget {_gib(plan.budget_bytes)}iB)",
              box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
    for name, just in (("recipe", "left"), ("mb", "right"),
                       ("acc", "right"), ("peak", "right"), ("free", "right"),
                       ("step", "right"), ("smp/s", "right"), ("tok/s", "right"),
                       ("MFU", "right")):
        t.add_column(name, justify=just, no_wrap=True)  # type: ignore[arg-type]
    for r in plan.rows[:top]:
        style = None if r.fits else "dim"
        head = f"[green]{_gib(r.headroom_bytes)}[/]" if r.fits else \
            f"[red]{_gib(r.headroom_bytes)}[/]"
        t.add_row(short_label(r), str(r.micro_batch),
                  str(r.accumulation_steps), _gib(r.predicted_peak_memory_bytes), head,
                  _ms(r.predicted_step_time_s), f"{r.samples_per_s:,.1f}",
                  f"{r.tokens_per_s:,.0f}" if r.tokens_per_s is not None else "-",
                  f"{r.mfu:.0%}", style=style)
    return t


def changes_legend(plan: Plan, top: int) -> list[str]:
    """One line per recipe shown: what it changes about training."""
    seen: dict[str, str] = {}
    for r in plan.rows[:top]:
        label = short_label(r)
        seen.setdefault(label, "; ".join(r.changes) or "nothing")
    return [f"  {k}: {v}" for k, v in seen.items()]


def best_table(plan: Plan, best: PlanRow) -> Table:
    t = Table(title="chosen plan", show_header=False, box=box.SIMPLE, pad_edge=False)
    t.add_column("quantity", style="bold")
    t.add_column("value")
    t.add_row("recipe", best.recipe_label())
    t.add_row("batch", f"micro-batch {best.micro_batch} x {best.accumulation_steps} "
              f"accumulation steps = global batch {best.global_batch}")
    t.add_row("peak memory", f"{fmt_bytes(best.predicted_peak_memory_bytes)} of "
              f"{fmt_bytes(plan.budget_bytes)} budget ({plan.memory_fraction:.0%} of "
              f"{fmt_bytes(plan.device.memory_bytes)} minus {fmt_bytes(plan.overhead_bytes)} "
              "CUDA context/workspace)")
    tput = f"{best.samples_per_s:,.2f} samples/s"
    if best.tokens_per_s is not None:
        tput += f", {best.tokens_per_s:,.0f} tokens/s"
    t.add_row("step", f"{fmt_time(best.predicted_step_time_s)}, {tput}, MFU {best.mfu:.0%}")
    t.add_row("why", plan.reason)
    if best.changes:
        t.add_row("changes", "; ".join(best.changes))
    c = plan.confirmation
    if c is not None:
        t.add_row("confirmed", f"full trace: peak {fmt_bytes(c.traced_peak_bytes)} (affine "
                  f"{fmt_bytes(c.affine_peak_bytes)}, {c.peak_error:+.1%}), step "
                  f"{fmt_time(c.traced_step_time_s)} (affine {fmt_time(c.affine_step_time_s)}, "
                  f"{c.time_error:+.1%})")
    return t


def print_plan(console: Console, plan: Plan, *, top: int = 15) -> None:
    console.print(f"[bold]tilefit plan[/]: {plan.model} on {plan.device.display_name}, global "
                  f"batch {plan.global_batch}" + (f", seq {plan.seq_len}" if plan.seq_len else "")
                  + f", objective {plan.objective}", highlight=False)
    console.print(plans_table(plan, top))
    console.print("what each recipe changes about training:", highlight=False)
    for line in changes_legend(plan, top):
        console.print(line, highlight=False, markup=False)
    if len(plan.rows) > top:
        console.print(f"({len(plan.rows) - top} more plans: --top {len(plan.rows)} or --json)",
                      highlight=False)
    for note in plan.notes:
        console.print(f"note: {note}", highlight=False)
    if plan.best is None:
        console.print(f"[bold red]{plan.reason}[/]", highlight=False)
    else:
        console.print(best_table(plan, plan.best))
        cfg = plan.configs
        console.print("[bold]Hugging Face TrainingArguments[/]")
        console.print(cfg["hf_python"], highlight=False, markup=False)
        console.print("[bold]as JSON[/]")
        console.print(cfg["hf_training_arguments_json"], highlight=False, markup=False)
        console.print("[bold]Lightning[/]")
        console.print(json.dumps(cfg["lightning"], indent=2), highlight=False, markup=False)
        console.print("[bold]plain PyTorch[/]")
        console.print(cfg["pytorch_loop"], highlight=False, markup=False)
        if "peft_lora_config" in cfg:
            console.print("[bold]peft.LoraConfig[/]")
            console.print(json.dumps(cfg["peft_lora_config"], indent=2), highlight=False,
                          markup=False)
        if "deepspeed" in cfg:
            console.print("[bold]DeepSpeed (ds_config.json)[/]")
            console.print(json.dumps(cfg["deepspeed"], indent=2), highlight=False, markup=False)
    m = plan.multi_gpu
    if m is not None:
        if m.get("gpus") is None:
            console.print(f"multi-GPU: {m['note']}", highlight=False)
            return
        console.print(
            f"[bold]multi-GPU[/]: nothing fits one GPU with the optimizer on it; the smallest "
            f"sharded setup is {m['gpus']} x {plan.device.display_name} ({m['engine']}): "
            f"micro-batch {m['micro_batch']} x {m['accumulation_steps']} accumulation x "
            f"{m['gpus']} GPUs, {fmt_bytes(m['predicted_per_gpu_memory_bytes'])} per GPU "
            f"({m['model']})", highlight=False)
        console.print(m["configs"]["launch"], highlight=False, markup=False)
        console.print(json.dumps({"accelerate_fsdp2": m["configs"]["accelerate_fsdp2"],
                                  "deepspeed_zero3": m["configs"]["deepspeed_zero3"]}, indent=2),
                      highlight=False, markup=False)
