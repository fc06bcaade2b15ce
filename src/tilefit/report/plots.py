"""Figures. matplotlib is imported inside each function, with the non-interactive Agg backend,
so that importing this module (and the commands that may plot) stays fast and headless."""

from __future__ import annotations

from pathlib import Path

from tilefit.errors import TilefitError
from tilefit.linear import PHASES, LinearAnalysis

PHASE_LABELS = {
    "forward": "forward (M=T, N=out, K=in)",
    "activation_grad": "activation gradient (M=T, N=in, K=out)",
    "weight_grad": "weight gradient (M=out, N=in, K=T)",
}


def plot_linear(analysis: LinearAnalysis, path: str | Path,
                highlight: tuple[int, ...] = ()) -> Path:
    """Write a PNG of predicted TFLOP/s against batch size for the three training GEMMs
    (the NVIDIA FC-layer guide's throughput-vs-batch figure, predicted by tilefit's model).
    ``highlight``: batch sizes to mark (the ones the user asked about)."""
    out = Path(path)
    if out.suffix.lower() != ".png":
        raise TilefitError(
            "the plot is written as a PNG file",
            expected="a file name ending in .png",
            given=str(path),
            fix=f"pass --plot {out.with_suffix('.png').name}",
        )
    if not out.parent.is_dir():
        raise TilefitError(
            f"cannot write the plot: folder {str(out.parent)!r} does not exist",
            expected="a path in an existing folder",
            given=str(path),
            fix="create the folder first, or pass a path in the current folder",
        )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
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
