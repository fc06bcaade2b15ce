"""Rich rendering of an Audit: the estimate's summary, the findings with their fixes, and the
time-by-module table."""

from __future__ import annotations

from collections.abc import Callable

from rich.console import Console
from rich.markup import escape

from tilefit.advise import Audit, Finding
from tilefit.advise.combined import CombinedFix
from tilefit.report.terminal import fmt_bytes, fmt_time, modules_table, summary_table

SEVERITY_STYLE = {"high": "bold red", "medium": "yellow", "low": "cyan", "info": "dim"}


def gain_text(f: Finding) -> str:
    """The predicted gain in words: speedup, or memory saved for memory fixes; none where
    the fix was not re-estimated (a finding for information)."""
    if f.method == "none":
        return f"not re-estimated (the step now: {fmt_time(f.step_time_before_s)})"
    parts = []
    per = " per sample" if f.per_sample else ""
    parts.append(f"{f.predicted_speedup:.3f}x{per} ({fmt_time(f.step_time_before_s)} -> "
                 f"{fmt_time(f.step_time_after_s)} per step)")
    if f.memory_saved_bytes:
        verb = "saves" if f.memory_saved_bytes > 0 else "adds"
        parts.append(f"{verb} {fmt_bytes(abs(f.memory_saved_bytes))} of peak memory")
    return ", ".join(parts)


def not_recommended_because(f: Finding, audit: Audit) -> str:
    """Why a finding's fix is not recommended, in a few words: what its re-estimate says."""
    if f.method == "none":
        return "for information: no fix re-estimated"
    if f.method == "plan" and f.suggested is None:  # the way forward found no recipe
        return "no recipe fits one GPU"
    est = audit.estimate
    after = f.peak_memory_after_bytes + est.overhead_bytes
    if f.peak_memory_after_bytes and after > est.device.memory_bytes:
        return (f"does not fit after the fix: {fmt_bytes(after)} of "
                f"{fmt_bytes(est.device.memory_bytes)}")
    speedup = f.predicted_speedup
    if f.memory_saved_bytes > 0 and speedup < 1:
        return f"trade-off: saves {fmt_bytes(f.memory_saved_bytes)}, {speedup:.3f}x the speed"
    if speedup < 1:
        return f"slower: {speedup:.3f}x"
    return f"gain too small to count: {speedup:.3f}x, within the cost model's error"


def combined_head(c: CombinedFix) -> str:
    """The compatible fixes applied together, in words: "all 2 fixes together: 2.00 ms ->
    1.00 ms per step (2.00x), does NOT fit" (per sample where they change the batch)."""
    per = " per sample" if c.per_sample else ""
    return (f"all {len(c.fixes)} fixes together: {fmt_time(c.step_time_before_s)} -> "
            f"{fmt_time(c.step_time_after_s)} per step ({c.predicted_speedup:.2f}x{per})"
            + ("" if c.fits else ", does NOT fit"))


def combined_aside(c: CombinedFix) -> str:
    """The recommended fixes the combined step leaves out, and why ("" where none): those
    that conflict with a fix of larger gain, and those torch.compile does itself."""
    parts = []
    if c.left_out:
        parts.append("left out (each conflicts with a fix of larger gain): "
                     + "; ".join(c.left_out))
    if c.subsumed:
        parts.append("not needed with torch.compile (it fuses them itself): "
                     + "; ".join(c.subsumed))
    return "; ".join(parts)


def print_findings(console: Console, audit: Audit, say: Callable[[str], str] = str) -> None:
    """One block per finding: title and predicted gain, modules, change, fix, reason;
    ``say``: each text in the reader's words (print_estimate's)."""
    console.rule("findings, by predicted gain (each fix re-estimated)")
    c = audit.combined
    if c is not None:  # the compatible fixes at once, re-estimated as one step
        console.print(f"[bold]{escape(combined_head(c))}[/]: " + escape(say("; ".join(c.fixes))),
                      highlight=False, soft_wrap=True)
        if combined_aside(c):
            console.print(f"   [dim]{escape(combined_aside(c))}[/]", highlight=False)
    for i, f in enumerate(audit.findings, 1):
        style = SEVERITY_STYLE.get(f.severity, "")
        tag = f.severity if f.recommended else escape(not_recommended_because(f, audit))
        console.print(f"[bold]{i}.[/] [{style}]\\[{tag}][/] [bold]{escape(say(f.title))}[/]",
                      highlight=False)
        console.print(f"   predicted: {gain_text(f)}", highlight=False)
        if f.modules:
            console.print("   modules: " + ", ".join(f.modules), highlight=False)
        if f.changes_a_dimension:
            console.print(f"   change: {f.dimension} {f.current} -> {f.suggested}",
                          highlight=False)
        # the fix holds code to copy: one line, never wrapped (a terminal folds it on screen)
        console.print(f"   fix: [green]{escape(say(f.fix))}[/]", highlight=False, soft_wrap=True)
        console.print(f"   [dim]why: {escape(say(f.reason))}[/]", highlight=False)
        console.print()


def print_audit(console: Console, audit: Audit, say: Callable[[str], str] = str) -> None:
    shape = f"batch {audit.recipe.batch_size}" + (f" x seq {audit.seq_len}" if audit.seq_len
                                                  else "")
    console.print(summary_table(audit.estimate, f"tilefit audit: {audit.model}, {shape}"
                                                f"{audit.recipe.adapters_text}"))
    if audit.findings:
        print_findings(console, audit, say)
    else:
        console.print("no findings: every GEMM dimension is on the multiple, the batch keeps "
                      "the GEMMs math-bound, and memory is not the limit.")
    console.print(modules_table(audit.estimate))
    # escaped: a note quotes error messages, whose [brackets] are not markup
    for note in audit.notes:
        console.print(f"[dim]note: {escape(say(note))}[/]")
    for warning in audit.estimate.warnings:
        console.print(f"[yellow]warning:[/] {escape(say(warning))}", highlight=False)
