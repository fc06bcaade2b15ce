"""Figures. matplotlib is imported inside each function, with the non-interactive Agg backend,
so that importing this module (and the commands that may plot) stays fast and headless."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from tilefit.errors import TilefitError
from tilefit.linear import PHASES, LinearAnalysis

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from tilefit.bench.sweeps import SweepRow
    from tilefit.tuning.tuner import TuneResult

PHASE_LABELS = {
    "forward": "forward (M=T, N=out, K=in)",
    "activation_grad": "activation gradient (M=T, N=in, K=out)",
    "weight_grad": "weight gradient (M=out, N=in, K=T)",
}


def _png_path(path: str | Path) -> Path:
    """The plot's path, once it is known to name a PNG file in an existing folder."""
    out = Path(path)
    if out.suffix.lower() != ".png":
        raise TilefitError(
            "the plot is written as a PNG file",
            expected="a file name ending in .png",
            given=str(path),
            fix=f"name a .png file, e.g. {out.with_suffix('.png').name}",
        )
    if not out.parent.is_dir():
        raise TilefitError(
            f"cannot write the plot: folder {str(out.parent)!r} does not exist",
            expected="a path in an existing folder",
            given=str(path),
            fix="create the folder first, or pass a path in the current folder",
        )
    return out


def plot_linear(analysis: LinearAnalysis, path: str | Path,
                highlight: tuple[int, ...] = ()) -> Path:
    """Write a PNG of predicted TFLOP/s against batch size for the three training GEMMs
    (the NVIDIA FC-layer guide's throughput-vs-batch figure, predicted by tilefit's model).
    ``highlight``: batch sizes to mark (the ones the user asked about)."""
    out = _png_path(path)
    plt = pyplot()
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    batches = list(analysis.batches)
    # distinct markers and line styles: with in == out, forward and activation gradient
    # are the same GEMM shape and their curves coincide
    styles = {"forward": ("o", "-"), "activation_grad": ("x", "--"), "weight_grad": ("s", "-")}
    for phase in PHASES:
        rows = [r for r in analysis.rows if r.phase == phase]
        marker, line = styles[phase]
        ax.plot([r.batch for r in rows], [r.gemm.predicted_tflops for r in rows],
                marker=marker, markersize=4, linestyle=line, label=PHASE_LABELS[phase])
    totals = analysis.totals
    ax.plot([t.batch for t in totals], [t.predicted_tflops for t in totals], color="black",
            linestyle=":", label="all three (total FLOPs / total time)")
    if highlight:
        marked = [t for t in totals if t.batch in set(highlight)]
        ax.scatter([t.batch for t in marked], [t.predicted_tflops for t in marked],
                   color="black", zorder=3, label="batch sizes asked for")
    peak = analysis.rows[0].gemm.peak_tflops
    ax.axhline(peak, color="grey", linewidth=0.8)
    ax.text(batches[-1], peak, f"{analysis.dtype} dense peak {peak:.0f} ", va="bottom",
            ha="right", fontsize=8, color="grey")
    b_min = analysis.recommendations.min_math_bound_batch
    if b_min is not None and batches[0] <= b_min <= batches[-1]:
        ax.axvline(b_min, color="grey", linestyle=":", linewidth=1)
        ax.text(b_min, peak * 0.97, f" math-bound from batch {b_min}", va="top", fontsize=8,
                color="grey")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    ax.set_xlabel("batch size" + (f" (x seq {analysis.seq} tokens)" if analysis.seq > 1 else ""))
    ax.set_ylabel("predicted TFLOP/s")
    ax.set_ylim(0, peak * 1.3)  # headroom for the legend
    ax.set_title(f"Linear {analysis.in_features} -> {analysis.out_features}, {analysis.dtype} "
                 f"on {analysis.gpu} (tilefit model)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, format="png")
    plt.close(fig)
    return out


# ---- audit figures: PNG bytes for the self-contained HTML report ----------------------------

def png_bytes(fig: Figure) -> bytes:
    """The figure as PNG bytes (laid out tight), closed after."""
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def pyplot() -> Any:  # the matplotlib.pyplot module
    """matplotlib.pyplot on the non-interactive Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def roofline_png(points: list[tuple[float, float, bool, str]], device_name: str,
                 peak_tflops: float, bandwidth_bytes_per_s: float, dtype: str) -> bytes:
    """Every GEMM of the step on the device's roofline: (FLOP/byte, predicted TFLOP/s,
    misaligned, label). The roof is min(peak, bandwidth x intensity) (Williams et al., 2009)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    if points:
        xs = [p[0] for p in points]
        lo, hi = min(xs) / 2, max(xs) * 2
    else:
        lo, hi = 1.0, 1e4
    ridge = peak_tflops * 1e12 / bandwidth_bytes_per_s
    lo, hi = min(lo, ridge / 4), max(hi, ridge * 4)  # show both sides of the ridge
    grid = sorted({lo, ridge, hi} | {lo * (hi / lo) ** (i / 50) for i in range(51)})
    ax.plot(grid, [min(peak_tflops, bandwidth_bytes_per_s * x / 1e12) for x in grid],
            color="grey", label=f"roofline ({dtype} peak {peak_tflops:.0f} TFLOP/s)")
    ok = [p for p in points if not p[2]]
    bad = [p for p in points if p[2]]
    ax.scatter([p[0] for p in ok], [p[1] for p in ok], s=14, color="tab:blue",
               label=f"aligned GEMMs ({len(ok)})", zorder=3)
    ax.scatter([p[0] for p in bad], [p[1] for p in bad], s=40, marker="x", color="tab:red",
               label=f"misaligned GEMMs ({len(bad)})", zorder=4)
    labelled: set[str] = set()
    for p in sorted(bad, key=lambda p: p[1]):  # the slowest GEMM of each module, once
        module = p[3].split(" ", 1)[-1]
        if module in labelled or len(labelled) >= 4:
            continue
        labelled.add(module)
        ax.annotate(p[3], (p[0], p[1]), fontsize=7, xytext=(6, -12 * len(labelled)),
                    textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("predicted TFLOP/s")
    ax.set_ylim(0, peak_tflops * 1.15)
    ax.set_title(f"GEMMs of one training step on {device_name} (tilefit model)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    return png_bytes(fig)


def bars_png(labels: list[str], values: list[float], xlabel: str, title: str) -> bytes:
    """A horizontal bar chart (largest on top): time by module, memory by category."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.9 + 0.32 * max(len(labels), 1)), dpi=110)
    ax.barh(labels[::-1], values[::-1], color="tab:blue")
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.tick_params(axis="y", labelsize=8)
    ax.grid(True, axis="x", alpha=0.3)
    return png_bytes(fig)


def memory_figure(parts: list[tuple[str, float]], capacity_gib: float, capacity_label: str,
                  title: str, reserved_gib: float | None = None) -> Figure:
    """The memory at the peak as one column stacked by category (GiB), beside the caching
    allocator's reserved peak where it is modelled, under a labelled horizontal line at the
    GPU's capacity: the verdict's numbers, drawn. ``parts``: (legend label, GiB)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    bottom = 0.0
    for i, (label, gib) in enumerate(parts):
        ax.bar(0, gib, bottom=bottom, width=0.5, color=f"C{i % 10}",
               label=label)
        bottom += gib
    ax.text(0, bottom, f"{bottom:.2f} GiB", ha="center", va="bottom", fontsize=8)
    names = ["at the peak\n(tensors + context)"]
    if reserved_gib is not None:
        ax.bar(1, reserved_gib, width=0.5, color="0.6",
               label=f"reserved by the caching allocator: {reserved_gib:.2f} GiB")
        ax.text(1, reserved_gib, f"{reserved_gib:.2f} GiB", ha="center", va="bottom",
                fontsize=8)
        names.append("reserved\n(allocator + context)")
    ax.axhline(capacity_gib, color="black", linewidth=1.2, linestyle="--")
    ax.text(len(names) - 0.55, capacity_gib, capacity_label, ha="right", va="bottom",
            fontsize=8)
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_xlim(-0.6, len(names) + 1.4)  # room for the legend on the right
    ax.set_ylim(0, max(capacity_gib, bottom, reserved_gib or 0.0) * 1.12)
    ax.set_ylabel("GiB")
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="center right")
    return fig


# ---- measurements: bench sweeps and tune's trials -----------------------------------------

def plot_sweep(rows: list[SweepRow], sweep: str, title: str, path: str | Path) -> Path:
    """Measured against predicted for a ``tilefit bench`` sweep (tilefit.bench.sweeps): delivered
    TFLOP/s by batch for the batch sweep, time by the swept dimension for the others."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = list(dict.fromkeys(r.label for r in rows))
    for i, label in enumerate(labels):
        sub = [r for r in rows if r.label == label]
        xs = [r.x for r in sub]
        color = f"C{i}"
        if sweep == "batch":
            ax.plot(xs, [r.measured_tflops for r in sub], "o", color=color,
                    label=f"{label} measured")
            ax.plot(xs, [r.predicted_tflops for r in sub], "-", color=color,
                    label=f"{label} predicted")
        else:
            ax.plot(xs, [r.measured_time_s * 1e6 for r in sub], "o-", color=color,
                    label="measured")
            ax.plot(xs, [r.predicted_time_s * 1e6 for r in sub], "--", color="C1",
                    label="predicted")
    if sweep == "batch":
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (tokens T)")
        ax.set_ylabel("delivered TFLOP/s")
    else:
        ax.set_xlabel(sweep.upper())
        ax.set_ylabel("time (us)")
        for r in rows:
            if r.x % 8 == 0:
                ax.axvline(r.x, color="0.85", lw=0.8, zorder=0)
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_throughput(result: TuneResult, path: str | Path) -> Path:
    """samples/s against batch size from a TuneResult: the measured throughput trials, the
    chosen batch and the largest that fits."""
    plt = pyplot()
    points = sorted(
        (t.batch_size, t.samples_per_s)
        for t in result.trials
        if t.kind == "throughput" and t.samples_per_s
    )
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    if points:
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, "o-", label="measured (fastest repeat)")
        if result.samples_per_s:
            ax.plot([result.batch_size], [result.samples_per_s], "r*", markersize=14,
                    label=f"chosen: {result.batch_size}")
    ax.axvline(result.max_fitting_batch_size, color="grey", linestyle="--",
               label=f"largest fitting: {result.max_fitting_batch_size}")
    ax.set_xlabel("batch size (samples per step)")
    ax.set_ylabel("samples / s")
    ax.set_title("tilefit tune: throughput by batch size")
    ax.legend()
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    plt.close(fig)
    return out
