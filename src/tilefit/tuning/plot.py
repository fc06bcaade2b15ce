"""samples/s against batch size from a TuneResult (matplotlib, Agg: no display needed)."""

from __future__ import annotations

from pathlib import Path

from tilefit.tuning.tuner import TuneResult


def plot_throughput(result: TuneResult, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = sorted(
        (t["batch_size"], t["samples_per_s"])
        for t in result.trials
        if t["kind"] == "throughput" and t["samples_per_s"]
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
