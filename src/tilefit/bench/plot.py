"""PNG plots of sweeps (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

from tilefit.bench.sweeps import SweepRow
from tilefit.report.plots import pyplot


def plot_sweep(rows: list[SweepRow], sweep: str, title: str, path: str | Path) -> Path:
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
