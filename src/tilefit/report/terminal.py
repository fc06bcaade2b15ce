"""Rich renderings shared by the commands: an estimate's summary, memory, and top tables."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

from tilefit.estimator import Estimate

GIB = 1024**3


def fmt_bytes(n: float) -> str:
    if n >= GIB:
        return f"{n / GIB:.2f} GiB"
    if n >= 1024**2:
        return f"{n / 1024**2:.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def summary_table(e: Estimate, title: str) -> Table:
    t = Table(title=title, show_header=False, box=box.SIMPLE, pad_edge=False)
    t.add_column("quantity", style="bold")
    t.add_column("value")
    t.add_row("GPU", f"{e.device.display_name} ({e.device.name})")
    t.add_row("recipe", f"{e.precision}, {e.optimizer}"
              + (f", accumulation {e.accumulation_steps}" if e.accumulation_steps > 1 else ""))
    t.add_row("parameters", f"{e.param_count / 1e6:,.1f} M")
    t.add_row("step time", fmt_time(e.step_time_s) + "  (" + ", ".join(
        f"{k} {fmt_time(v)}" for k, v in sorted(e.time_by_phase_s.items(), key=lambda kv: -kv[1])
        if v > 0) + ")")
    if e.device.kind == "cuda":
        t.add_row("host", f"{fmt_time(e.host_time_s)} to issue the ops (eager PyTorch), GPU "
                  f"busy {fmt_time(e.device_time_s)}; the GPU waits for the host "
                  f"{e.host_bound_fraction:.0%} of the step"
                  + (" [bold yellow](host-bound)[/]" if e.host_bound_fraction >= 0.2 else ""))
    if e.tokens_per_s is not None:
        t.add_row("throughput", f"{e.tokens_per_s:,.0f} tokens/s, {e.samples_per_s:,.1f} "
                  "samples/s")
    else:
        t.add_row("throughput", f"{e.samples_per_s:,.1f} samples/s")
    t.add_row("FLOPs / step", f"{e.flops:.3e} (model), MFU {e.mfu:.1%} of the {e.mfu_dtype} peak")
    total = e.total_memory_bytes
    verdict = "fits" if e.fits else "DOES NOT FIT"
    style = "green" if e.fits else "bold red"
    t.add_row("peak memory", f"{fmt_bytes(e.peak_memory_bytes)} tensors + "
              f"{fmt_bytes(e.overhead_bytes)} CUDA context/workspace = {fmt_bytes(total)} of "
              f"{fmt_bytes(e.device.memory_bytes)}: [{style}]{verdict}[/]")
    return t


def memory_table(e: Estimate) -> Table:
    t = Table(title="memory at the peak", box=box.SIMPLE_HEAD, pad_edge=False)
    t.add_column("category")
    t.add_column("bytes", justify="right")
    t.add_column("share", justify="right")
    t.add_column("")
    peak = max(e.peak_memory_bytes, 1)
    for k, v in sorted(e.memory_breakdown.items(), key=lambda kv: -kv[1]):
        if v == 0:
            continue
        share = v / peak
        t.add_row(k, fmt_bytes(v), f"{share:.0%}", "#" * max(1, round(share * 30)))
    return t


def modules_table(e: Estimate, limit: int = 10) -> Table:
    t = Table(title="time by module (layers folded: h.*.mlp = all h.N.mlp)",
              box=box.SIMPLE_HEAD, pad_edge=False)
    t.add_column("module")
    t.add_column("time / step", justify="right")
    t.add_column("share", justify="right")
    t.add_column("TFLOP/s", justify="right")
    step = max(e.step_time_s, 1e-30)
    for m in e.modules_by_pattern()[:limit]:
        rate = m.flops / m.time_s / 1e12 if m.time_s > 0 else 0.0
        t.add_row(m.module or "(root)", fmt_time(m.time_s), f"{m.time_s / step:.1%}",
                  f"{rate:.1f}" if m.flops else "-")
    return t


def ops_table(e: Estimate, limit: int = 10) -> Table:
    t = Table(title="slowest ops (one occurrence each)", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("op", "phase", "module", "shapes", "time", "kind"):
        t.add_column(col, justify="right" if col == "time" else "left", overflow="fold")
    for c in sorted(e.ops, key=lambda c: -c.time_s)[:limit]:
        r = c.record
        shapes = " x ".join(str(list(s)) for s in r.input_shapes[:3])
        t.add_row(r.op.removeprefix("aten.").removesuffix(".default"), r.phase, r.module or "-",
                  shapes, fmt_time(c.time_s), r.kind)
    return t


def print_estimate(console: Console, e: Estimate, title: str, *, top: int = 10) -> None:
    console.print(summary_table(e, title))
    console.print(memory_table(e))
    console.print(modules_table(e, top))
    console.print(ops_table(e, top))
    for w in e.warnings:
        console.print(f"[yellow]note:[/] {w}", highlight=False)
