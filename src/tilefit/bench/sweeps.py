"""The sweeps of NVIDIA's GEMM guides, measured on the live device beside the model.

- batch: a linear layer (in -> out) at growing batch T, its three training GEMMs
  ("Linear/Fully-Connected Layers User's Guide", Table 1; docs/references.md, section 1):
  forward M=T, N=out, K=in; activation gradient M=T, N=in, K=out; weight gradient M=out,
  N=in, K=T. Delivered FLOP/s rise with T until the GEMMs become math-bound.
- k: time against K at fixed M, N, one step at a time: the steps at multiples of 8 (and
  even/odd) of the "Matrix Multiplication Background" guide's alignment figure.
- n: the same for N at fixed M, K.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from tilefit.errors import TilefitError, close_matches
from tilefit.hardware.device import Device

SWEEPS = ("batch", "k", "n")


@dataclass(frozen=True)
class SweepShape:
    label: str  # "forward", "activation-grad", "weight-grad", or "gemm"
    x: int  # the swept value (batch T, K or N)
    m: int
    n: int
    k: int


@dataclass(frozen=True)
class SweepRow:
    label: str
    x: int
    m: int
    n: int
    k: int
    dtype: str
    measured_time_s: float
    measured_tflops: float
    predicted_time_s: float
    predicted_tflops: float
    error: float  # (predicted - measured) / measured

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_sweep(name: str) -> str:
    if name in SWEEPS:
        return name
    near = close_matches(name, list(SWEEPS))
    raise TilefitError(
        f"unknown sweep {name!r}",
        expected="one of " + ", ".join(SWEEPS),
        given=repr(name),
        fix=(f"did you mean {near[0]}? " if near else "") + "pass --sweep batch, k or n",
    )


def batch_values(kind: str, quick: bool) -> list[int]:
    # CPU: 16..2048 tokens (a 2-core CPU takes ~0.1 s for a 2048^3 fp32 GEMM);
    # GPU: 128..16384, past where a 4096-wide layer turns math-bound (the guide's figure).
    lo, hi = (16, 2048) if kind == "cpu" else (128, 16384)
    vals = [v for v in (2**i for i in range(4, 15)) if lo <= v <= hi]
    if not quick:
        return vals
    picked = vals[::2]
    return picked if picked[-1] == vals[-1] else [*picked, vals[-1]]


def sweep_shapes(sweep: str, kind: str, *, in_features: int, out_features: int, m: int,
                 n: int, quick: bool) -> list[SweepShape]:
    check_sweep(sweep)
    if sweep == "batch":
        out = []
        for t in batch_values(kind, quick):
            out += [
                SweepShape("forward", t, t, out_features, in_features),
                SweepShape("activation-grad", t, t, in_features, out_features),
                SweepShape("weight-grad", t, out_features, in_features, t),
            ]
        return out
    # One step at a time across two multiples of 8 either side of the base value, so the
    # aligned/even/odd pattern shows; --quick halves the span.
    base = in_features
    span = 16 if quick else 32
    values = range(base - span // 2, base + span // 2 + 1)
    if sweep == "k":
        return [SweepShape("gemm", v, m, n, v) for v in values]
    return [SweepShape("gemm", v, m, v, base) for v in values if v > 0]


def run_sweep(shapes: list[SweepShape], dtype: str, device: Device, *, quick: bool,
              rounds: int = 2) -> list[SweepRow]:
    """Measure every shape (least of ``rounds`` interleaved medians) and predict it."""
    from tilefit.bench.timing import time_gemm
    from tilefit.gemm import analyze_gemm

    device.peak(dtype)  # a clear error for a dtype the device lacks, before any timing
    best = [float("inf")] * len(shapes)
    for _ in range(rounds):
        for i, s in enumerate(shapes):
            t = time_gemm(s.m, s.n, s.k, dtype, device_kind=device.kind,
                          min_time_s=0.02 if quick else 0.1)
            best[i] = min(best[i], t.median_s)
    rows = []
    for s, meas in zip(shapes, best, strict=True):
        pred = analyze_gemm(s.m, s.n, s.k, dtype, device).predicted_time_s
        flops = 2 * s.m * s.n * s.k
        rows.append(SweepRow(s.label, s.x, s.m, s.n, s.k, dtype, meas, flops / meas / 1e12,
                             pred, flops / pred / 1e12, (pred - meas) / meas))
    return rows
