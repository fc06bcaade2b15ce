"""Rich renderings shared by the commands: an estimate's summary, memory, and top tables."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:  # annotations alone: a torch-free result's notebook view imports no torch
    from tilefit.estimator import Estimate
from tilefit.units import GIB, fmt_bytes, fmt_time  # noqa: F401 - re-exported

HOST_BOUND_SHOWN = 0.2  # a step whose GPU waits this share of the time is called host-bound


def phase_times(estimate: Estimate) -> str:
    """'backward 2.10 ms, forward 1.02 ms': the step's time by phase, largest first."""
    return ", ".join(f"{k} {fmt_time(v)}" for k, v in sorted(estimate.time_by_phase_s.items(),
                                                            key=lambda kv: -kv[1]) if v > 0)


def memory_by_category(estimate: Estimate) -> list[tuple[str, int]]:
    """The live bytes at the peak by category, largest first, empty categories left out."""
    return [(k, v) for k, v in sorted(estimate.memory_breakdown.items(), key=lambda kv: -kv[1])
            if v]


def host_line(estimate: Estimate) -> str:
    """The host's issue time beside the GPU's busy time, and how long the GPU waits."""
    bound = estimate.host_bound_fraction
    issuer = {None: "eager PyTorch", "default": "torch.compile"}.get(
        estimate.compile_mode, "torch.compile, its graphs replayed as CUDA graphs")
    return (f"{fmt_time(estimate.host_time_s)} to issue the ops ({issuer}), GPU busy "
            f"{fmt_time(estimate.device_time_s)}; the GPU waits for the host {bound:.0%} of "
            "the step" + (" [bold yellow](host-bound)[/]" if bound >= HOST_BOUND_SHOWN else ""))


def summary_table(estimate: Estimate, title: str) -> Table:
    table = Table(title=title, show_header=False, box=box.SIMPLE, pad_edge=False)
    table.add_column("quantity", style="bold")
    table.add_column("value")
    device = estimate.device
    table.add_row("GPU", f"{device.display_name} ({device.name})")
    accumulation = estimate.accumulation_steps
    table.add_row("recipe", f"{estimate.precision}, {estimate.optimizer}"
                  + (f", accumulation {accumulation}" if accumulation > 1 else ""))
    frozen = 0 < estimate.trainable_param_count < estimate.param_count
    table.add_row("parameters", f"{estimate.param_count / 1e6:,.1f} M" + (
        f" ({estimate.trainable_param_count / 1e6:,.2f} M trainable)" if frozen else ""))
    table.add_row("step time", f"{fmt_time(estimate.step_time_s)}  ({phase_times(estimate)})")
    if device.kind == "cuda":
        table.add_row("host", host_line(estimate))
    if estimate.tokens_per_s is not None:
        table.add_row("throughput", f"{estimate.tokens_per_s:,.0f} tokens/s, "
                      f"{estimate.samples_per_s:,.1f} samples/s")
    else:
        table.add_row("throughput", f"{estimate.samples_per_s:,.1f} samples/s")
    table.add_row("FLOPs / step", f"{estimate.flops:.3e} (model), MFU {estimate.mfu:.1%} of the "
                  f"{estimate.mfu_dtype} peak")
    if estimate.parallel is not None:
        for name, value in parallel_rows(estimate):
            table.add_row(name, value)
    verdict = "fits" if estimate.fits else "DOES NOT FIT"
    style = "green" if estimate.fits else "bold red"
    table.add_row("peak memory", f"{fmt_bytes(estimate.peak_memory_bytes)} tensors + "
                  f"{fmt_bytes(estimate.overhead_bytes)} CUDA context/workspace = "
                  f"{fmt_bytes(estimate.total_memory_bytes)} of "
                  f"{fmt_bytes(device.memory_bytes)}: [{style}]{verdict}[/]")
    if device.kind == "cuda":
        table.add_row("reserved", reserved_line(estimate))
    return table


def times_text(n: int) -> str:
    """'once', 'twice', 'N times'."""
    return {1: "once", 2: "twice"}.get(n, f"{n} times")


def reserved_line(estimate: Estimate) -> str:
    """What the caching allocator holds: the reserved peak, its fragmentation, the line."""
    r = estimate.reserved
    if r is None:
        return "not modelled (DeepSpeed ZeRO is modelled, not traced)"
    conf = f"PYTORCH_CUDA_ALLOC_CONF={r.alloc_conf}" if r.alloc_conf else "PyTorch's defaults"
    if not r.fits:
        return (f"the caching allocator runs out of memory at {fmt_bytes(r.limit_bytes)} (the "
                f"device less context and workspace) on a {fmt_bytes(r.failed_request_bytes or 0)}"
                f" request ({r.failed_where}), after releasing its cache; {conf}")
    line = (f"{fmt_bytes(r.peak_reserved_bytes)} held by the caching allocator at its peak "
            f"({fmt_bytes(r.fragmentation_bytes)} beyond the tensors' peak, cached or split; "
            f"{r.segments} segments), of {fmt_bytes(r.limit_bytes)} it may hold; {conf}")
    if r.fits_by_releasing:
        n = r.steady_alloc_retries
        line += (f"; fits only by releasing its cache ({n} retr{'ies' if n > 1 else 'y'} "
                 "in every step, num_alloc_retries: each release synchronizes the GPU, a "
                 "cost the step time leaves out)")
    elif r.alloc_retries:
        n = r.alloc_retries
        line += (f"; it releases its cache {times_text(n)} over the first two steps "
                 "(num_alloc_retries), not in the steady state after")
    return line


def parallel_rows(estimate: Estimate) -> list[tuple[str, str]]:
    """The data-parallel rows of the summary: engine, communication, the job's throughput."""
    p = estimate.parallel
    if p is None:
        return []
    how = "; MODELLED, not traced (see the notes)" if p.modelled else ""
    rows = [("GPUs", f"{p.world_size} x {p.strategy} over {p.link} (NCCL bus bandwidth "
             f"{p.bus_bandwidth_bytes_per_s / 1e9:,.0f} GB/s); figures per GPU unless "
             f"said{how}"),
            ("communication", f"{fmt_time(p.communication_time_s)} in collectives, "
             f"{fmt_time(p.exposed_communication_s)} not hidden by compute (in the step time)")]
    total = (f"{p.tokens_per_s_total:,.0f} tokens/s, " if p.tokens_per_s_total else "") + \
        f"{p.samples_per_s_total:,.1f} samples/s"
    above = (" (over 100%: each GPU steps 1/N of the optimizer, one GPU all of it)"
             if p.scaling_efficiency > 1 else "")
    rows.append(("all GPUs", f"{total}; scaling efficiency {p.scaling_efficiency:.0%} of one "
                 f"GPU's throughput per GPU{above}"))
    return rows


def memory_table(estimate: Estimate) -> Table:
    table = Table(title="memory at the peak", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("category")
    table.add_column("bytes", justify="right")
    table.add_column("share", justify="right")
    table.add_column("")
    peak = max(estimate.peak_memory_bytes, 1)
    for category, nbytes in memory_by_category(estimate):
        share = nbytes / peak
        table.add_row(category, fmt_bytes(nbytes), f"{share:.0%}",
                      "#" * max(1, round(share * 30)))
    return table


def modules_table(estimate: Estimate, limit: int = 10) -> Table:
    table = Table(title="time by module (layers folded: h.*.mlp = all h.N.mlp)",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("module")
    table.add_column("time / step", justify="right")
    table.add_column("share", justify="right")
    table.add_column("TFLOP/s", justify="right")
    step = max(estimate.step_time_s, 1e-30)
    for m in estimate.modules_by_pattern()[:limit]:
        rate = m.flops / m.time_s / 1e12 if m.time_s > 0 else 0.0
        table.add_row(m.module or "(root)", fmt_time(m.time_s), f"{m.time_s / step:.1%}",
                      f"{rate:.1f}" if m.flops else "-")
    return table


def ops_table(estimate: Estimate, limit: int = 10) -> Table:
    table = Table(title="slowest ops (one occurrence each)", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("op", "phase", "module", "shapes", "time", "kind"):
        table.add_column(col, justify="right" if col == "time" else "left", overflow="fold")
    for c in sorted(estimate.ops, key=lambda c: -c.time_s)[:limit]:
        r = c.record
        shapes = " x ".join(str(list(s)) for s in r.input_shapes[:3])
        name = r.op.removeprefix("aten.").removesuffix(".default")
        kind = r.kind
        if r.kernel is not None:  # a torch.compile kernel, costed on its first op
            name, kind = f"fused kernel: {name} + {r.kernel.ops - 1} op(s)", "fused"
            shapes = (f"{fmt_bytes(r.kernel.read_bytes)} read, "
                      f"{fmt_bytes(r.kernel.write_bytes)} written")
        table.add_row(name, r.phase, r.module or "-", shapes, fmt_time(c.time_s), kind)
    return table


def print_estimate(console: Console, estimate: Estimate, title: str, *, top: int = 10,
                   say: Callable[[str], str] = str) -> None:
    """The estimate's tables and its notes; ``say``: each note in the reader's words (the
    CLI's: cli.common.say, the library's Python calls as the command's flags)."""
    console.print(summary_table(estimate, title))
    console.print(memory_table(estimate))
    console.print(modules_table(estimate, top))
    console.print(ops_table(estimate, top))
    for warning in estimate.warnings:
        console.print(f"[yellow]note:[/] {escape(say(warning))}", highlight=False)
