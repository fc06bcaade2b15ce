"""Run a calibration on the live device: measure bandwidth and overhead, probe what each dtype
costs, plan the grids within the time budget, measure them, fit, build the Profile (the CLI
saves it). Returns a CalibrationResult: what was measured, what the budget cut, how long."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from tilefit.bench.timing import time_gemm
from tilefit.calibrate.fit import GemmSample, fit_cpu, fit_gpu
from tilefit.calibrate.grid import (
    MAX_REPS,
    MIN_REPS,
    WARMUP_CALLS,
    DtypePlan,
    GridOption,
    MeasureCost,
    Shape,
    describe_cut,
    grid_options,
    plan_grids,
)
from tilefit.calibrate.live import device_kind as device_kind  # re-exported
from tilefit.calibrate.live import live_device
from tilefit.calibrate.live import live_kind_device as live_kind_device  # re-exported
from tilefit.calibrate.measure import (
    DeviceTerms,
    environment,
    measure_device_terms,
    measure_rounds,
)
from tilefit.calibrate.measure import measure_samples as measure_samples  # re-exported
from tilefit.hardware.device import Device
from tilefit.hardware.profile import GemmFit, Profile

CPU_DTYPES = ("fp32", "bf16")  # the first is the reference the others' rates are given against
GPU_DTYPES = ("bf16", "fp16", "tf32", "fp32")
# --quick's default budget: the README promises under 3 minutes; 30 s are left for Python's
# start-up, saving the profile and a burst of load the plan could not foresee.
QUICK_TIME_BUDGET_S = 150.0
# The probe that prices each dtype: large enough to run at the kernel's rate (on the CPU
# 512^3 fp32 delivers 95% of 1536^3's FLOP/s here), small enough to cost a second where that
# rate is 1.5 GFLOP/s (bf16 without a bf16 kernel: 7 calls of 0.18 s).
PROBE_SHAPES: dict[str, Shape] = {"cpu": (512, 512, 512), "cuda": (4096, 4096, 4096)}
FIT_RESERVE_S = 1.0  # per dtype: the fit and the profile (a 36-shape CPU fit: 0.04 s here)


@dataclass(frozen=True)
class ProgressEvent:
    """One step of a calibration, for a live display or a plain line (only cli/ prints)."""

    message: str
    elapsed_s: float
    expected_s: float | None = None  # the whole run's expected duration, once planned
    tick: bool = False  # one measured shape: a live display advances, plain lines skip it


ProgressFn = Callable[[ProgressEvent], None]


class _Reporter:
    """Sends ProgressEvents with the elapsed time and, once planned, the expected total."""

    def __init__(self, start_s: float, progress: ProgressFn | None) -> None:
        self.start_s = start_s
        self.progress = progress
        self.expected_s: float | None = None

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start_s

    def say(self, message: str, tick: bool = False) -> None:
        if self.progress:
            self.progress(ProgressEvent(message, self.elapsed_s(), self.expected_s, tick))


@dataclass(frozen=True)
class DtypeOutcome:
    """One dtype of a calibration: its probe, its plan, what was measured and fitted."""

    dtype: str
    probe_shape: Shape
    cost: MeasureCost  # from the probe: its FLOP/s, setup and call overhead
    plan: DtypePlan
    full: GridOption  # what an unbounded run measures
    rounds_done: int
    measured_s: float  # seconds spent measuring its grid
    fit: GemmFit | None  # None: skipped

    @property
    def skipped(self) -> str:
        """What the time budget left out of the full grid ("" when nothing)."""
        return describe_cut(self.full, self.plan.option, self.rounds_done)

    def to_dict(self) -> dict[str, Any]:
        opt = self.plan.option
        return {"dtype": self.dtype, "probe_shape": list(self.probe_shape),
                "probe_flops_per_s": self.cost.flops_per_s,
                "relative_rate": self.plan.relative_rate, "slow": self.plan.slow,
                "allowance_s": _finite(self.plan.allowance_s),
                "predicted_s": self.plan.predicted_s, "measured_s": self.measured_s,
                "grid": opt.to_dict() if opt else None, "rounds_done": self.rounds_done,
                "full_grid": self.full.to_dict(), "skipped": self.skipped,
                "fitted": self.fit is not None}


@dataclass(frozen=True)
class CalibrationResult:
    """What calibrate() measured: the profile, the raw samples, each dtype's outcome."""

    profile: Profile
    samples: tuple[GemmSample, ...]
    dtypes: tuple[DtypeOutcome, ...]  # the first is the reference dtype for relative rates
    time_budget_s: float  # inf: unbounded
    expected_s: float  # the duration predicted once the dtypes were probed
    duration_s: float
    warnings: tuple[str, ...] = ()

    @property
    def within_budget(self) -> bool:
        return self.duration_s <= self.time_budget_s

    def to_dict(self) -> dict[str, Any]:
        return {"time_budget_s": _finite(self.time_budget_s), "expected_s": self.expected_s,
                "duration_s": self.duration_s, "within_budget": self.within_budget,
                "reference_dtype": self.dtypes[0].dtype if self.dtypes else None,
                "dtypes": [d.to_dict() for d in self.dtypes], "samples": len(self.samples),
                "warnings": list(self.warnings)}


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None  # JSON has no infinity


def default_time_budget_s(quick: bool) -> float:
    """QUICK_TIME_BUDGET_S for --quick; unbounded (inf) for the full calibration."""
    return QUICK_TIME_BUDGET_S if quick else math.inf


def probe_cost(dtype: str, device: Device, min_time_s: float, call_overhead_s: float,
               measured_flops_per_s: float = 0.0) -> MeasureCost:
    """Time the probe shape as the grid will be timed: the setup is the wall time beyond its
    calls, the FLOP/s its 10th-percentile call's, or ``measured_flops_per_s`` (a rate
    measured moments before, in another window) when higher: another process stalls GEMMs
    for whole scheduler slices (16 ms per 512^3 fp32 call instead of 1.5 ms, seen here), so
    of two windows the faster is the machine's rate, and one stalled probe does not shrink
    the grid."""
    m, n, k = PROBE_SHAPES[device.kind]
    start = time.perf_counter()
    t = time_gemm(m, n, k, dtype, device_kind=device.kind, min_time_s=min_time_s,
                  min_reps=MIN_REPS, max_reps=MAX_REPS)
    wall_s = time.perf_counter() - start
    setup_s = max(0.0, wall_s - (t.reps + WARMUP_CALLS) * t.median_s)
    flops_per_s = max(2 * m * n * k / t.p10_s, measured_flops_per_s)
    return MeasureCost(flops_per_s=flops_per_s, call_overhead_s=call_overhead_s,
                       setup_s=setup_s, min_time_s=min_time_s)


def probe_costs(dtypes: Sequence[str], device: Device, min_time_s: float,
                call_overhead_s: float) -> dict[str, MeasureCost]:
    """Each dtype's MeasureCost; on the CPU, the device's own probe (the best of five
    1024^3 GEMMs, tilefit.hardware.cpu.probe_cpu) is the second window (GPU peaks are
    datasheet figures, not measurements)."""
    measured = device.peak_flops_per_s if device.kind == "cpu" else {}
    return {dt: probe_cost(dt, device, min_time_s, call_overhead_s, measured.get(dt, 0.0))
            for dt in dtypes}


def calibration_dtypes(kind: str, quick: bool, device: Device) -> list[str]:
    dtypes = [d for d in (CPU_DTYPES if kind == "cpu" else GPU_DTYPES) if device.supports(d)]
    return dtypes[:2] if quick and kind == "cuda" else dtypes


def plan_message(plans: Sequence[DtypePlan], costs: dict[str, MeasureCost],
                 expected_s: float, budget_s: float) -> str:
    """One line: each dtype's rate against the reference, its grid, the expected total."""
    ref = plans[0].dtype
    parts = []
    for p in plans:
        rate = f"{costs[p.dtype].flops_per_s / 1e9:.0f} GFLOP/s"
        if p.dtype != ref:
            rate += f", {p.relative_rate:.0%} of {ref}"
        grid = f"{p.option.describe()} ~{p.predicted_s:.0f} s" if p.option else "skipped"
        parts.append(f"{p.dtype} ({rate}): {grid}")
    limit = f" of a {budget_s:.0f} s budget" if math.isfinite(budget_s) else ""
    return f"plan: {'; '.join(parts)}; expected {expected_s:.0f} s{limit}"


def measure_dtype(plan: DtypePlan, cost: MeasureCost, full: GridOption, device: Device,
                  report: _Reporter) -> tuple[DtypeOutcome, list[GemmSample]]:
    """Measure the planned grid of one dtype (stopping rounds at its allowance) and fit."""
    dt, option = plan.dtype, plan.option
    probe = PROBE_SHAPES[device.kind]
    if option is None:
        report.say(f"{dt}: skipped: even the smallest grid would take longer than its "
                   f"{plan.allowance_s:.0f} s share of the budget")
        return DtypeOutcome(dt, probe, cost, plan, full, 0, 0.0, None), []
    start = time.perf_counter()
    n = len(option.shapes)

    def step(r: int, j: int) -> None:
        report.say(f"{dt}: round {r + 1}/{option.rounds}, {j}/{n} shapes", tick=j < n)

    samples, rounds_done = measure_rounds(
        option.shapes, dt, device, cost.min_time_s, option.rounds,
        deadline_s=start + max(plan.allowance_s, plan.predicted_s), step=step)
    measured_s = time.perf_counter() - start
    fit = fit_cpu(samples, dt) if device.kind == "cpu" else fit_gpu(samples, dt, device)
    report.say(f"{dt}: fitted on {fit.shapes} shapes x {rounds_done} round"
               f"{'s' if rounds_done != 1 else ''} in {measured_s:.0f} s, median error "
               f"{fit.median_error:.1%}")
    return DtypeOutcome(dt, probe, cost, plan, full, rounds_done, measured_s, fit), samples


def calibrate(kind: str, *, quick: bool = False, time_budget_s: float | None = None,
              progress: ProgressFn | None = None) -> CalibrationResult:
    """Measure, plan within ``time_budget_s`` (None: default_time_budget_s(quick); inf:
    unbounded), measure the grids, fit; the Profile is not saved."""
    start = time.perf_counter()
    budget_s = default_time_budget_s(quick) if time_budget_s is None else time_budget_s
    report = _Reporter(start, progress)
    device = live_device(kind)
    report.say(f"device: {device.display_name}")
    terms = measure_device_terms(kind, report.say)
    dtypes = calibration_dtypes(kind, quick, device)
    min_time_s = 0.02 if quick else 0.1
    costs = probe_costs(dtypes, device, min_time_s, terms.call_overhead_s)
    options = grid_options(kind, quick)
    fit_reserve_s = FIT_RESERVE_S * len(dtypes)
    plans = plan_grids(costs, options, budget_s - report.elapsed_s() - fit_reserve_s)
    report.expected_s = report.elapsed_s() + sum(p.predicted_s for p in plans) + fit_reserve_s
    report.say(plan_message(plans, costs, report.expected_s, budget_s))
    outcomes: list[DtypeOutcome] = []
    samples: list[GemmSample] = []
    for plan in plans:
        outcome, rows = measure_dtype(plan, costs[plan.dtype], options[0], device, report)
        outcomes.append(outcome)
        samples += rows
    host = None
    if kind == "cuda":  # eager PyTorch's per-op host costs, for the two-timeline step model
        from tilefit.calibrate.host import measure_host

        report.say("host: timing eager steps of miniature models (per-op issue costs)")
        host = measure_host(device="cuda", repeats=10 if quick else 20).host
    profile = dataclasses.replace(
        build_profile(device, kind, quick, terms, outcomes, samples,
                      time.perf_counter() - start), host=host)
    return CalibrationResult(profile, tuple(samples), tuple(outcomes), budget_s,
                             report.expected_s, profile.duration_s,
                             (terms.warning,) if terms.warning else ())


def build_profile(device: Device, kind: str, quick: bool, terms: DeviceTerms,
                  outcomes: Sequence[DtypeOutcome], samples: Sequence[GemmSample],
                  duration_s: float) -> Profile:
    import torch

    peaks: dict[str, float] = dict(device.peak_flops_per_s)
    if kind == "cpu":  # the CPU's peak is what its best grid shape delivered
        for o in outcomes:
            rows = [s for s in samples if s.dtype == o.dtype]
            if rows:
                peaks[o.dtype] = max(2 * s.m * s.n * s.k / s.time_s for s in rows)
    return Profile(
        device=device.name,
        display_name=device.display_name,
        kind=kind,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        torch_version=torch.__version__,
        threads=torch.get_num_threads() if kind == "cpu" else None,
        peak_flops_per_s=peaks,
        bandwidth_bytes_per_s=terms.bandwidth_bytes_per_s,
        call_overhead_s=terms.call_overhead_s,
        fresh_alloc_s_per_byte=terms.fresh_alloc_s_per_byte,
        gemm=tuple(o.fit for o in outcomes if o.fit is not None),
        quick=quick,
        duration_s=duration_s,
        environment={**terms.environment, "loadavg_end": environment().get("loadavg", "")},
    )
