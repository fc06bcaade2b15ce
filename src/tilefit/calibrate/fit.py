"""Fitting the GEMM cost model's few terms to measured times (pure: numpy, no torch).

- CPU ("cpu-packing", tilefit.gemm_cpu): t = c0 + 2MNK s_flop + MK s_a + KN s_b + MN s_c,
  divided by f_align for shapes with a dimension off the device's multiple. Linear in the
  five coefficients: a least-squares fit of the RELATIVE error (each row divided by the
  measured time), coefficients kept >= 0 by an active-set loop (drop the most negative, refit).
  f_align is the median measured/predicted ratio of the misaligned shapes, alternated with
  the linear fit.
- GPU ("gpu-tile-wave", tilefit.gemm): two terms by median ratios, robust to outliers:
  launch overhead = median of (measured - model at zero overhead) over the smallest shapes;
  gemm_efficiency = median of (model math time at efficiency 1) / (measured - overhead -
  fixed time) over the math-bound shapes, the fixed time being the output tiles' stores
  (bandwidth, not math: docs/references.md, section 28) and the per-wave latency. The latter
  (Device.gemm_tile_latency_s, a corpus fit: docs/references.md, section 27) is kept, not
  refitted: on one-wave shapes it is indistinguishable from the launch overhead, and the
  calibration grid has too few many-wave shapes of short K to tell it apart.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tilefit.hardware.device import Device
from tilefit.hardware.profile import MODEL_CPU, MODEL_GPU, GemmFit


@dataclass(frozen=True)
class GemmSample:
    """One measured GEMM."""

    m: int
    n: int
    k: int
    dtype: str
    time_s: float
    aligned: bool


def is_aligned(m: int, n: int, k: int, multiple: int) -> bool:
    return all(v % multiple == 0 for v in (m, n, k))


def relative_errors(pred_s: Sequence[float], meas_s: Sequence[float]) -> np.ndarray:
    p, t = np.asarray(pred_s, float), np.asarray(meas_s, float)
    return np.abs(p - t) / t


def error_summary(errors: np.ndarray) -> tuple[float, float]:
    """(median, 90th percentile) of relative errors."""
    if errors.size == 0:
        return 0.0, 0.0
    return float(np.median(errors)), float(np.percentile(errors, 90))


def _features(samples: Sequence[GemmSample]) -> np.ndarray:
    return np.array([[1.0, 2.0 * s.m * s.n * s.k, s.m * s.k, s.k * s.n, s.m * s.n]
                     for s in samples])


def _nonneg_weighted_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Minimise sum(((x b - y) / y)^2) with b >= 0 (active set: drop the most negative)."""
    w = 1.0 / y
    a = x * w[:, None]
    rhs = np.ones_like(y)  # y * w
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active] / scale[active], rhs, rcond=None)
        sol = sol / scale[active]
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return coef


def _scale_misaligned(x: np.ndarray, mis: np.ndarray, factor: float) -> np.ndarray:
    """Feature rows with the misaligned shapes' work terms divided by the factor (the call
    overhead, column 0, is not slowed by alignment)."""
    scaled = x.copy()
    scaled[mis, 1:] /= factor
    return scaled


def _fit_with_factor(x: np.ndarray, y: np.ndarray, mis: np.ndarray,
                     iterations: int = 60) -> tuple[float, np.ndarray]:
    """The misaligned factor f (golden-section search on [0.1, 1]) and, for each f, the
    nonnegative linear coefficients; the pair with the least relative squared error."""

    def solve(f: float) -> tuple[float, np.ndarray]:
        scaled = _scale_misaligned(x, mis, f)
        coef = _nonneg_weighted_lstsq(scaled, y)
        return float((((scaled @ coef) - y) / y) @ (((scaled @ coef) - y) / y)), coef

    if not mis.any():
        return 1.0, solve(1.0)[1]
    lo, hi = 0.1, 1.0
    g = (math.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = solve(a)[0], solve(b)[0]
    for _ in range(iterations):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = solve(a)[0]
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = solve(b)[0]
    best = min((lo + hi) / 2, 1.0)
    if solve(1.0)[0] <= solve(best)[0]:
        best = 1.0
    return best, solve(best)[1]


OUTLIER_RATIO = 2.0  # measured / fitted above this: a disturbed measurement (fit_cpu)


def fit_cpu(samples: Sequence[GemmSample], dtype: str) -> GemmFit:
    """Fit the cpu-packing model to ``samples`` of one dtype."""
    rows = [s for s in samples if s.dtype == dtype]
    if len(rows) < 6:
        raise ValueError(f"need at least 6 {dtype} measurements to fit 6 terms, got {len(rows)}")
    x_all = _features(rows)
    y_all = np.array([s.time_s for s in rows])
    mis_all = np.array([not s.aligned for s in rows])
    keep = np.ones(len(rows), bool)
    factor, coef = 1.0, np.zeros(5)
    for _pass in range(2):  # second pass: without the gross outliers of the first
        factor, coef = _fit_with_factor(x_all[keep], y_all[keep], mis_all[keep])
        pred_all = _scale_misaligned(x_all, mis_all, factor) @ coef
        # A measurement more than OUTLIER_RATIO x slower than the fit is a stalled run
        # (another process held a core), never faster: drop at most a fifth of them.
        ratio_all = y_all / pred_all
        worst = np.argsort(-ratio_all)[: len(rows) // 5]
        keep = np.ones(len(rows), bool)
        keep[[i for i in worst if ratio_all[i] > OUTLIER_RATIO]] = False
        if keep.all():
            break
    pred = _scale_misaligned(x_all[keep], mis_all[keep], factor) @ coef
    med, p90 = error_summary(relative_errors(pred, y_all[keep]))
    c0, s_flop, s_a, s_b, s_c = (float(v) for v in coef)
    return GemmFit(dtype=dtype, model=MODEL_CPU, call_overhead_s=c0, s_per_flop=s_flop,
                   s_per_a_element=s_a, s_per_b_element=s_b, s_per_c_element=s_c,
                   misaligned_factor=factor, shapes=int(keep.sum()), median_error=med,
                   p90_error=p90)


SMALL_SHAPE_S = 10e-6  # "smallest shapes": modelled below 10 us, where launch cost dominates


def fit_gpu(samples: Sequence[GemmSample], dtype: str, device: Device) -> GemmFit:
    """Fit gemm_efficiency and the launch overhead of tilefit.gemm's GPU model."""
    from tilefit.gemm import analyze_gemm

    rows = [s for s in samples if s.dtype == dtype]
    if len(rows) < 3:
        raise ValueError(f"need at least 3 {dtype} measurements, got {len(rows)}")
    base = dataclasses.replace(device, gemm_efficiency=1.0, simt_gemm_factor=1.0,
                               launch_overhead_s=0.0, gemm_tile_latency_s=0.0, profile=None)
    ideal = [analyze_gemm(s.m, s.n, s.k, dtype, base) for s in rows]
    meas = np.array([s.time_s for s in rows])
    # kept, not fitted: the per-wave latency and the output stores (bandwidth, not math)
    latency = np.array([a.waves * device.gemm_tile_latency_s for a in ideal])
    fixed = latency + np.array([a.epilogue_time_s for a in ideal])
    t0 = np.array([a.predicted_time_s for a in ideal]) + latency
    small = t0 < SMALL_SHAPE_S
    pool = small if small.sum() >= 3 else t0 <= np.percentile(t0, 20)
    math_rows = np.array([a.bound == "math" and a.math_time_s >= a.memory_time_s for a in ideal])
    math0 = np.array([a.math_time_s for a in ideal])
    mem0 = np.array([a.memory_time_s for a in ideal])
    eff = 1.0
    launch = 0.0
    for _ in range(5):  # alternate: launch from the small shapes, efficiency from the large
        body = np.maximum(math0 / eff + fixed, mem0)  # the model's time without the launch
        launch = max(0.0, float(np.median(meas[pool] - body[pool])))
        useful = math_rows & (meas > 3 * launch + fixed)
        if useful.sum() < 3:
            eff = device.gemm_efficiency
            break
        mainloop = meas[useful] - launch - fixed[useful]
        eff = min(1.0, max(0.05, float(np.median(math0[useful] / mainloop))))
    fitted = dataclasses.replace(device, gemm_efficiency=eff, launch_overhead_s=launch,
                                 profile=None)
    pred = [analyze_gemm(s.m, s.n, s.k, dtype, fitted).predicted_time_s for s in rows]
    med, p90 = error_summary(relative_errors(pred, meas))
    return GemmFit(dtype=dtype, model=MODEL_GPU, call_overhead_s=launch, gemm_efficiency=eff,
                   shapes=len(rows), median_error=med, p90_error=p90)
