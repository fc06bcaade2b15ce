"""The audit as one self-contained HTML page: the summary, the findings and the plots (PNG
embedded as base64, no external file, script or font)."""

from __future__ import annotations

import base64
import html
from pathlib import Path

from tilefit.advise import Audit
from tilefit.advise.rules_dims import misaligned_dims
from tilefit.errors import TilefitError
from tilefit.report.audit_terminal import gain_text
from tilefit.report.terminal import fmt_bytes, fmt_time, memory_by_category, phase_times

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
"""


def _esc(x: object) -> str:
    return html.escape(str(x))


def _img(png: bytes, alt: str) -> str:
    return (f'<img alt="{_esc(alt)}" src="data:image/png;base64,'
            f'{base64.b64encode(png).decode("ascii")}">')


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
            ("MFU", f"{estimate.mfu:.1%} of the {estimate.mfu_dtype} peak"),
            ("peak memory", f"{fmt_bytes(estimate.total_memory_bytes)} of "
             f"{fmt_bytes(device.memory_bytes)}: "
             + ("fits" if estimate.fits else "DOES NOT FIT"))]
    return "<table>" + "".join(f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>"
                               for k, v in rows) + "</table>"


def _findings(audit: Audit) -> str:
    if not audit.findings:
        return "<p>No findings: the GEMM dimensions are aligned and memory is not the limit.</p>"
    out = []
    for i, f in enumerate(audit.findings, 1):
        cls = f.severity if f.recommended else "info"
        tag = f.severity if f.recommended else "not recommended"
        mods = f"<div>modules: <code>{_esc(', '.join(f.modules))}</code></div>" if f.modules \
            else ""
        change = (f"<div>change: <b>{_esc(f.dimension)}</b> {_esc(f.current)} &rarr; "
                  f"<b>{_esc(f.suggested)}</b></div>") if f.dimension else ""
        out.append(f'<div class="finding {cls}"><div><b>{i}. [{_esc(tag)}]</b> {_esc(f.title)}'
                   f'</div><div class="gain">predicted: {_esc(gain_text(f))}</div>{mods}{change}'
                   f"<div>fix: <code>{_esc(f.fix)}</code></div>"
                   f'<div class="why">why: {_esc(f.reason)}</div></div>')
    return "".join(out)


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


def render_html(audit: Audit) -> str:
    from tilefit.report.plots import bars_png

    estimate = audit.estimate
    mods = estimate.modules_by_pattern()[:15]
    time_png = bars_png([m.module or "(root)" for m in mods], [m.time_s * 1e3 for m in mods],
                        "predicted time per step (ms)", "time by module (layers folded)")
    mem = memory_by_category(estimate)
    mem.append(("CUDA context + workspace", estimate.overhead_bytes))
    mem_png = bars_png([k for k, _ in mem], [v / 2**30 for _, v in mem], "GiB at the peak",
                       f"memory at the peak: {fmt_bytes(estimate.total_memory_bytes)} of "
                       f"{fmt_bytes(estimate.device.memory_bytes)}")
    title = f"tilefit audit: {audit.model} on {estimate.device.name}"
    notes = "".join(f"<li>{_esc(note)}</li>" for note in (*audit.notes, *estimate.warnings))
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f"<title>{_esc(title)}</title><style>{CSS}</style></head><body>"
            f"<h1>{_esc(title)}</h1><p>Predicted without the GPU: the training step traced on "
            "fake tensors and costed op by op; each fix re-estimated with the fix applied.</p>"
            f"<h2>Summary</h2>{_summary(audit)}<h2>Findings</h2>{_findings(audit)}"
            f"<h2>GEMM roofline</h2>{_img(_roofline(audit), 'roofline of every GEMM')}"
            f"<h2>Time by module</h2>{_img(time_png, 'time by module')}"
            f"<h2>Memory</h2>{_img(mem_png, 'memory breakdown')}"
            + (f"<h2>Notes</h2><ul>{notes}</ul>" if notes else "")
            + "</body></html>")


def write_html(audit: Audit, path: str | Path) -> Path:
    out = Path(path)
    if not out.parent.resolve().is_dir():
        raise TilefitError(f"cannot write the report: folder {str(out.parent)!r} does not "
                           "exist", expected="a path in an existing folder", given=str(path),
                           fix="create the folder first")
    out.write_text(render_html(audit), encoding="utf-8")
    return out
