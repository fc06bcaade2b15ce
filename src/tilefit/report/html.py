"""The audit as one self-contained HTML page: the summary, the findings and the plots (PNG
embedded as base64, no external file, script or font)."""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.text import Text

from tilefit.advise import Audit
from tilefit.advise.rules_dims import misaligned_dims
from tilefit.errors import TilefitError
from tilefit.estimator import Estimate
from tilefit.recipe import training_loop_note
from tilefit.report.audit_terminal import (
    combined_aside,
    combined_head,
    gain_text,
    not_recommended_because,
)
from tilefit.report.notebook import verdict_html
from tilefit.report.plan import best_rows, config_sections, multi_gpu_text
from tilefit.report.terminal import (
    HOST_BOUND_SHOWN,
    fmt_bytes,
    fmt_time,
    host_line,
    memory_by_category,
    phase_times,
    reserved_line,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;
max-width:1100px;color:#1a1a1a;background:#fff;line-height:1.45}
h1{font-size:1.6em;margin-bottom:.2em} h2{margin-top:1.6em;border-bottom:2px solid #ddd}
table{border-collapse:collapse;margin:.5em 0} td,th{padding:.25em .8em;text-align:left;
border-bottom:1px solid #eee} th{background:#f4f4f4}
.finding{border-left:6px solid #999;padding:.5em 1em;margin:1em 0;background:#fafafa}
.high{border-color:#d62728}.medium{border-color:#ff9f1c}.low{border-color:#1f77b4}
.info{border-color:#bbb;color:#555} .gain{font-size:1.15em;font-weight:600}
code{background:#eef;padding:.1em .3em;border-radius:3px} .why{color:#555;font-size:.92em}
img{max-width:100%;border:1px solid #eee;margin:.5em 0}
.hostbound{color:#8a5a00;font-weight:600}
.lane{display:flex;align-items:center;margin:.3em 0}.lane span{width:13em}
.lane div{height:1.1em;border-radius:2px}.lane .host{background:#ff9f1c}
.lane .gpu{background:#1f77b4}
pre{background:#f6f6f6;padding:.6em .8em;overflow-x:auto;font-size:.88em}
.wayforward{border-left:6px solid #1b7f3b;padding:.5em 1em;background:#f5fbf6}
.combined{border-left:6px solid #1b7f3b;padding:.5em 1em;margin:1em 0;background:#f5fbf6}
"""


def _esc(x: object) -> str:
    return html.escape(str(x))


def _img(png: bytes, alt: str) -> str:
    return (f'<img alt="{_esc(alt)}" src="data:image/png;base64,'
            f'{base64.b64encode(png).decode("ascii")}">')


def _table(rows: list[tuple[str, str]]) -> str:
    """A two-column table: each name escaped, each value HTML already."""
    return "<table>" + "".join(f"<tr><th>{_esc(k)}</th><td>{v}</td></tr>"
                               for k, v in rows) + "</table>"


def _summary(audit: Audit) -> str:
    estimate, device = audit.estimate, audit.estimate.device
    shape = f"batch {audit.recipe.batch_size}" + (f" x seq {audit.seq_len}" if audit.seq_len
                                                  else "")
    rows = [("GPU", f"{device.display_name} ({device.name})"),
            ("recipe", f"{shape}, {estimate.precision}, {estimate.optimizer}"),
            ("parameters", f"{estimate.param_count / 1e6:,.1f} M"),
            ("step time", f"{fmt_time(estimate.step_time_s)} ({phase_times(estimate)})"),
            ("throughput", f"{estimate.tokens_per_s:,.0f} tokens/s" if estimate.tokens_per_s
             else f"{estimate.samples_per_s:,.1f} samples/s"),
            ("MFU", f"{estimate.mfu:.1%} of the {estimate.mfu_dtype} peak")]
    memory = (f"{_esc(fmt_bytes(estimate.peak_memory_bytes))} tensors + "
              f"{_esc(fmt_bytes(estimate.overhead_bytes))} CUDA context/workspace = "
              + verdict_html(estimate))
    tail = [("reserved", _esc(reserved_line(estimate)))] if device.kind == "cuda" else []
    return _table([(k, _esc(v)) for k, v in rows] + [("peak memory", memory), *tail])


def _configs(cfg: dict[str, Any]) -> str:
    """The configs to paste, each under its name, in <pre> (escaped)."""
    return "".join(f"<h3>{_esc(name)}</h3>" + (f"<p>{_esc(aside)}</p>" if aside else "")
                   + f"<pre>{_esc(text)}</pre>" for name, aside, text in config_sections(cfg))


def _way_forward(audit: Audit) -> str:
    """When the step does not fit: the planner's recipe that does, in the plan's words, and
    its configs to paste; or why none fits one GPU and the fewest GPUs that do."""
    plan = audit.plan
    if plan is None:
        return ""
    best = plan.best
    if best is not None:
        rows = _table([(k, _esc(v)) for k, v in best_rows(plan, best)])
        body = f'<div class="wayforward">{rows}</div>{_configs(plan.configs)}'
    else:
        multi = plan.multi_gpu
        text = multi_gpu_text(plan)
        body = f'<div class="wayforward"><p>{_esc(plan.reason)}</p>' + (
            f"<p>multi-GPU: {_esc(text)}</p>" if text else "") + "</div>"
        if multi is not None and multi.gpus is not None and multi.best is not None:
            body += _configs(multi.configs)
    return f"<h2>Way forward: a recipe that fits</h2>{body}"


def _combined(audit: Audit) -> str:
    """The compatible fixes applied together and re-estimated as one step, as the terminal
    says it, with the fixes it leaves out."""
    c = audit.combined
    if c is None:
        return ""
    aside = combined_aside(c)
    left = f'<div class="why">{_esc(aside)}</div>' if aside else ""
    return (f'<div class="combined"><div class="gain">{_esc(combined_head(c))}</div>'
            f"<div>fixes: {_esc('; '.join(c.fixes))}</div>{left}</div>")


def _findings(audit: Audit) -> str:
    if not audit.findings:
        return "<p>No findings: the GEMM dimensions are aligned and memory is not the limit.</p>"
    out = []
    for i, f in enumerate(audit.findings, 1):
        cls = f.severity if f.recommended else "info"
        tag = f.severity if f.recommended else not_recommended_because(f, audit)
        mods = f"<div>modules: <code>{_esc(', '.join(f.modules))}</code></div>" if f.modules \
            else ""
        change = (f"<div>change: <b>{_esc(f.dimension)}</b> {_esc(f.current)} &rarr; "
                  f"<b>{_esc(f.suggested)}</b></div>") if f.changes_a_dimension else ""
        out.append(f'<div class="finding {cls}"><div><b>{i}. [{_esc(tag)}]</b> {_esc(f.title)}'
                   f'</div><div class="gain">predicted: {_esc(gain_text(f))}</div>{mods}{change}'
                   f"<div>fix: <code>{_esc(f.fix)}</code></div>"
                   f'<div class="why">why: {_esc(f.reason)}</div></div>')
    return _combined(audit) + "".join(out)


def _roofline(audit: Audit) -> bytes:
    from tilefit.gemm import analyze_gemm
    from tilefit.report.plots import roofline_png

    estimate = audit.estimate
    bad_values = set(misaligned_dims(estimate))
    points = []
    dtypes = []
    seen = set()
    for c, g, dt in estimate.gemms():
        if (g, dt) in seen:
            continue
        seen.add((g, dt))
        analysis = analyze_gemm(g.m, g.n, g.k, dt, estimate.device, batch=g.batch)
        dtypes.append(dt)
        points.append((analysis.arithmetic_intensity, analysis.predicted_tflops,
                       bool({g.m, g.n, g.k} & bad_values),
                       f"{g.m}x{g.n}x{g.k} {c.record.module or 'loss'}"))
    dtype = max(set(dtypes), key=dtypes.count) if dtypes else "fp32"
    return roofline_png(points, estimate.device.name, estimate.device.peak(dtype) / 1e12,
                        estimate.device.bandwidth_bytes_per_s, dtype)


GIB = 1024**3


def capacity_label(estimate: Estimate) -> str:
    """The memory chart's capacity line: the GPU's memory, the figure the verdict compares
    the total at the peak with."""
    device = estimate.device
    return f"{device.name} capacity: {fmt_bytes(device.memory_bytes)}"


def memory_chart(estimate: Estimate) -> Figure:
    """The memory at the peak by category, stacked, with the context and workspace, the
    reserved peak where modelled, and the GPU's capacity as a labelled line."""
    from tilefit.report.plots import memory_figure

    parts = [(f"{k}: {fmt_bytes(v)}", v / GIB) for k, v in memory_by_category(estimate)]
    parts.append((f"CUDA context + workspace: {fmt_bytes(estimate.overhead_bytes)}",
                  estimate.overhead_bytes / GIB))
    r = estimate.reserved
    reserved = None if r is None else (r.peak_reserved_bytes + estimate.overhead_bytes) / GIB
    title = (f"memory at the peak: {fmt_bytes(estimate.total_memory_bytes)} of "
             f"{fmt_bytes(estimate.device.memory_bytes)}")
    return memory_figure(parts, estimate.device.memory_bytes / GIB, capacity_label(estimate),
                         title, reserved)


def timeline_html(estimate: Estimate) -> str:
    """The host and the GPU over one step, as the terminal's host line says it: the host's
    issue time and the GPU's busy time as lanes scaled to the step, and the share of the
    step the GPU waits for the host (launch-bound past HOST_BOUND_SHOWN)."""
    step = max(estimate.step_time_s, 1e-30)
    lanes = "".join(f'<div class="lane"><span>{name}</span><div class="{cls}" style="width:'
                    f'{min(t / step, 1.0) * 70:.1f}%"></div></div>'
                    for name, cls, t in (("host issues the ops", "host", estimate.host_time_s),
                                         ("GPU busy", "gpu", estimate.device_time_s)))
    rows = [(name, f'<span data-seconds="{t!r}">{_esc(fmt_time(t))}</span>')
            for name, t in (("host issues the ops", estimate.host_time_s),
                            ("GPU busy", estimate.device_time_s),
                            ("step", estimate.step_time_s))]
    bound = estimate.host_bound_fraction
    verdict = (' <span class="hostbound">host-bound: kernel launches, not the GPU, set the '
               "pace</span>" if bound >= HOST_BOUND_SHOWN else "")
    rows.append(("GPU waits for the host", f"{bound:.0%} of the step{verdict}"))
    line = Text.from_markup(host_line(estimate)).plain
    return f"<p>{_esc(line)}</p>{lanes}{_table(rows)}"


def _assumptions(audit: Audit) -> str:
    """The training loop the traced step assumed, as the terminal's note gives it."""
    loop = training_loop_note(audit.recipe).removeprefix("note: ")
    return f"<p>{_esc(loop)}</p>"


def _step_sections(estimate: Estimate) -> tuple[str, str, str]:
    """The sections every report draws of a step: host and GPU (on a GPU), time by module
    and memory, as HTML."""
    from tilefit.report.plots import bars_png, png_bytes

    mods = estimate.modules_by_pattern()[:15]
    time_png = bars_png([m.module or "(root)" for m in mods], [m.time_s * 1e3 for m in mods],
                        "predicted time per step (ms)", "time by module (layers folded)")
    mem_png = png_bytes(memory_chart(estimate))
    timeline = (f"<h2>Host and GPU</h2>{timeline_html(estimate)}"
                if estimate.device.kind == "cuda" else "")
    return (timeline, f"<h2>Time by module</h2>{_img(time_png, 'time by module')}",
            f"<h2>Memory</h2>{_img(mem_png, 'memory breakdown; ' + capacity_label(estimate))}")


def _page(title: str, body: str, notes: tuple[str, ...]) -> str:
    """A self-contained page: the title, the body, the notes."""
    items = "".join(f"<li>{_esc(note)}</li>" for note in notes)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f"<title>{_esc(title)}</title><style>{CSS}</style></head><body>"
            f"<h1>{_esc(title)}</h1>{body}"
            + (f"<h2>Notes</h2><ul>{items}</ul>" if items else "") + "</body></html>")


def render_html(audit: Audit) -> str:
    estimate = audit.estimate
    timeline, time_section, memory_section = _step_sections(estimate)
    title = f"tilefit audit: {audit.model} on {estimate.device.name}"
    return _page(title, "<p>Predicted without the GPU: the training step traced on fake "
                 "tensors and costed op by op; each fix re-estimated with the fix applied.</p>"
                 f"<h2>Summary</h2>{_summary(audit)}{_way_forward(audit)}"
                 f"<h2>Findings</h2>{_findings(audit)}"
                 f"{timeline}<h2>Assumed training loop</h2>{_assumptions(audit)}"
                 f"<h2>GEMM roofline</h2>{_img(_roofline(audit), 'roofline of every GEMM')}"
                 f"{time_section}{memory_section}"
                 f'<p class="capacity">dashed line: {_esc(capacity_label(estimate))}; '
                 f"{verdict_html(estimate)}</p>", (*audit.notes, *estimate.warnings))


def render_run_html(estimate: Estimate, title: str, found: list[str]) -> str:
    """`tilefit run --html`: the script's step as the estimate shows it (summary, host and
    GPU, time by module, memory) and what was found in the script."""
    from tilefit.report.notebook import estimate_html

    timeline, time_section, memory_section = _step_sections(estimate)
    items = "".join(f"<li>{_esc(line)}</li>" for line in found)
    return _page(title, "<p>The script ran on this machine with the GPU simulated: its "
                 "tensors fake, its step traced as the GPU runs it and costed op by op.</p>"
                 f"<h2>Summary</h2>{estimate_html(estimate)}<h2>Found in the script</h2>"
                 f"<ul>{items}</ul>{timeline}{time_section}{memory_section}",
                 estimate.warnings)


def write_text(text: str, path: str | Path) -> Path:
    """A report's HTML written to ``path``, in a folder that exists."""
    out = Path(path)
    if not out.parent.resolve().is_dir():
        raise TilefitError(f"cannot write the report: folder {str(out.parent)!r} does not "
                           "exist", expected="a path in an existing folder", given=str(path),
                           fix="create the folder first")
    out.write_text(text, encoding="utf-8")
    return out


def write_html(audit: Audit, path: str | Path) -> Path:
    return write_text(render_html(audit), path)
