"""Each result's notebook view (``_repr_html_``, see tilefit.html_repr): a small self-contained
HTML fragment, a table of the key figures, every value escaped, no script or stylesheet. One
function per result kind, one table helper; ``render`` picks the function by the result's
class name, so this module imports no result class (nor torch) to show one."""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tilefit.report.terminal import fmt_bytes, fmt_time, host_line, phase_times

if TYPE_CHECKING:
    from tilefit.advise import Audit
    from tilefit.estimator import Estimate
    from tilefit.gemm import GemmAnalysis
    from tilefit.hardware import Device
    from tilefit.linear import LinearAnalysis
    from tilefit.planner import Plan
    from tilefit.tracing import Trace
    from tilefit.tuning import NoiseScale, TuneResult

GREEN, RED = "#1b7f3b", "#c62828"
_CELL = "padding:2px 10px;text-align:left;border-bottom:1px solid #eee"


def esc(x: object) -> str:
    return html.escape(str(x))


def table(title: str, rows: list[tuple[str, str]], *, raw: frozenset[str] = frozenset()
          ) -> str:
    """A two-column table under a bold title: each name and value escaped, except the values
    of the rows named in ``raw`` (HTML built here, its own parts escaped)."""
    body = "".join(f'<tr><th style="{_CELL}">{esc(k)}</th><td style="{_CELL}">'
                   f"{v if k in raw else esc(v)}</td></tr>" for k, v in rows)
    return (f'<div class="tilefit"><b>{esc(title)}</b>'
            f'<table style="border-collapse:collapse">{body}</table></div>')


def verdict_html(estimate: Estimate) -> str:
    """The fit verdict in words and colour (green fits, red does not): the total at the peak
    against the GPU's memory, the numbers the terminal's summary gives."""
    word, cls, colour = (("fits", "fits", GREEN) if estimate.fits
                         else ("DOES NOT FIT", "nofit", RED))
    return (f"{esc(fmt_bytes(estimate.total_memory_bytes))} of "
            f"{esc(fmt_bytes(estimate.device.memory_bytes))}: "
            f'<span class="verdict {cls}" style="color:#fff;background:{colour};'
            f'font-weight:700;padding:0 .4em;border-radius:3px">{word}</span>')


def _plain(markup: str) -> str:
    from rich.text import Text

    return Text.from_markup(markup).plain


def estimate_html(e: Estimate) -> str:
    rows = [("GPU", f"{e.device.display_name} ({e.device.name})"),
            ("recipe", f"{e.precision}, {e.optimizer}"),
            ("parameters", f"{e.param_count / 1e6:,.1f} M"),
            ("step time", f"{fmt_time(e.step_time_s)} ({phase_times(e)})"),
            ("throughput", f"{e.samples_per_s:,.1f} samples/s" + (
                f", {e.tokens_per_s:,.0f} tokens/s" if e.tokens_per_s else "")),
            ("MFU", f"{e.mfu:.1%} of the {e.mfu_dtype} peak")]
    if e.device.kind == "cuda":
        rows.append(("host", _plain(host_line(e))))
    rows.append(("peak memory", verdict_html(e)))
    return table("tilefit estimate", rows, raw=frozenset({"peak memory"}))


def audit_html(a: Audit) -> str:
    from tilefit.report.audit_terminal import (
        combined_aside,
        combined_head,
        gain_text,
        not_recommended_because,
    )

    e = a.estimate
    rows = [("model", a.model), ("GPU", e.device.name),
            ("step time", fmt_time(e.step_time_s)), ("peak memory", verdict_html(e))]
    c = a.combined
    if c is not None:  # the compatible fixes applied together, re-estimated as one step
        rows.append(("combined", f"{combined_head(c)}: {'; '.join(c.fixes)}"
                     + (f"; {combined_aside(c)}" if combined_aside(c) else "")))
    for i, f in enumerate(a.findings, 1):
        tag = f.severity if f.recommended else not_recommended_because(f, a)
        rows.append((f"{i}. [{tag}]", f"{f.title}: {gain_text(f)}"))
    if not a.findings:
        rows.append(("findings", "none"))
    return table(f"tilefit audit: {len(a.recommended)} fix(es) recommended", rows,
                 raw=frozenset({"peak memory"}))


def plan_html(p: Plan) -> str:
    rows = [("model", p.model), ("GPU", f"{p.device.name} x {p.world_size}"),
            ("global batch", str(p.global_batch)),
            ("memory budget", fmt_bytes(p.budget_bytes))]
    b = p.best
    if b is None:
        gpus = None if p.multi_gpu is None else p.multi_gpu.gpus
        rows.append(("plan", "nothing fits one GPU" + (f"; {gpus} GPUs do" if gpus else "")))
    else:
        rows += [("micro-batch", f"{b.micro_batch} x {b.accumulation_steps} accumulation"),
                 ("recipe", f"{b.precision}, {b.optimizer}"
                  + (", checkpointing" if b.grad_checkpointing else "")),
                 ("step time", fmt_time(b.predicted_step_time_s)),
                 ("throughput", f"{b.samples_per_s:,.1f} samples/s"),
                 ("peak memory", f"{fmt_bytes(b.predicted_peak_memory_bytes)} of "
                  f"{fmt_bytes(p.budget_bytes)}")]
    rows.append(("why", p.reason))
    return table("tilefit plan", rows)


def trace_html(t: Trace) -> str:
    rows = [("target", t.target.kind), ("recipe", f"{t.precision}, {t.optimizer}, "
                                                  f"attention {t.attention}"),
            ("parameters", f"{t.param_count:,} ({t.trainable_param_count:,} trainable)"),
            ("micro-batch", f"{t.samples_per_micro_batch} samples" + (
                f", {t.tokens_per_micro_batch} tokens" if t.tokens_per_micro_batch else "")),
            ("ops recorded", f"{len(t.ops):,}"), ("tensor storages", f"{len(t.storages):,}")]
    return table("tilefit trace", rows)


def tune_html(r: TuneResult) -> str:
    rows = [("chosen batch", str(r.batch_size)),
            ("largest that fits", str(r.max_fitting_batch_size)),
            ("accumulation", str(r.accumulation_steps)),
            ("throughput", "-" if r.samples_per_s is None else f"{r.samples_per_s:,.1f} samples/s"),
            ("trials", f"{len(r.trials)} ({r.fit_trials} fit)")]
    if r.capacity_bytes is not None:
        rows.append(("memory", f"budget {fmt_bytes(r.budget_bytes or 0)} of "
                     f"{fmt_bytes(r.capacity_bytes)}"))
    return table("tilefit tune", rows)


def noise_html(n: NoiseScale) -> str:
    rows = [("B_simple", f"{n.b_simple:,.1f} samples ({n.confidence:.0%} interval "
             f"{n.b_simple_low:,.1f} to {n.b_simple_high:,.1f})"),
            ("batches", f"{n.batch_small} and {n.batch_big}"),
            ("measurements", f"{n.measurements} ({n.samples:,} samples, {fmt_time(n.time_s)})")]
    return table("gradient noise scale", rows)


def gemm_html(g: GemmAnalysis) -> str:
    rows = [("GEMM", f"{g.m} x {g.n} x {g.k}" + (f" (x {g.batch})" if g.batch > 1 else "")
             + f", {g.dtype} on {g.gpu}"),
            ("predicted", f"{fmt_time(g.predicted_time_s)}, {g.predicted_tflops:.1f} of "
             f"{g.peak_tflops:.0f} TFLOP/s"),
            ("bound", f"{g.bound} ({g.arithmetic_intensity:.1f} FLOP/byte)"),
            ("efficiency", f"tile {g.tile_efficiency:.1%}, wave {g.wave_efficiency:.1%}, "
             f"alignment {g.alignment_efficiency:.1%}"),
            ("verdict", g.error or g.verdict)]
    return table("tilefit GEMM", rows)


def linear_html(a: LinearAnalysis) -> str:
    rows = [(f"batch {t.batch}", f"{fmt_time(t.predicted_time_s)}, "
             f"{t.predicted_tflops:.1f} TFLOP/s, {t.bound}-bound"
             + ("" if t.aligned else ", misaligned")) for t in a.totals]
    b = a.recommendations.min_math_bound_batch
    rows.append(("math-bound from", "-" if b is None else f"batch {b}"))
    return table(f"Linear {a.in_features} -> {a.out_features}, {a.dtype} on {a.gpu}", rows)


def device_html(d: Device) -> str:
    peaks = ", ".join(f"{k} {v / 1e12:,.0f}" for k, v in d.peak_flops_per_s.items())
    rows = [("name", f"{d.display_name} ({d.name})"), ("memory", fmt_bytes(d.memory_bytes)),
            ("bandwidth", f"{d.bandwidth_bytes_per_s / 1e12:.2f} TB/s"),
            ("dense peaks (TFLOP/s)", peaks), ("SMs", str(d.sms))]
    return table(f"{d.architecture} {d.kind} device", rows)


RENDERERS: dict[str, Callable[[Any], str]] = {
    "Estimate": estimate_html, "Audit": audit_html, "Plan": plan_html, "Trace": trace_html,
    "TuneResult": tune_html, "NoiseScale": noise_html, "GemmAnalysis": gemm_html,
    "LinearAnalysis": linear_html, "Device": device_html}


def render(result: object) -> str:
    """The notebook fragment of one of tilefit's results (RENDERERS, by class name)."""
    return RENDERERS[type(result).__name__](result)
