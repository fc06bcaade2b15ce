"""The shapes calibration measures, what measuring them costs, and held-out shapes.

The grid crosses a few sizes per dimension (M, N, K independently, so the MK, KN and MN terms
of the CPU model are told apart) and adds misaligned shapes (odd dims) for the alignment
factor. Held-out shapes are drawn log-uniformly and never equal a grid shape.

A quick calibration bounds its own time: each mode has a ladder of grids (GridOption), richest
first; a short probe of each dtype gives its cost (MeasureCost) and plan_grids picks, per
dtype, the richest grid whose predicted measuring time fits that dtype's share of the budget.
All of it is pure arithmetic on measured numbers, so it is tested with hand-computed cases.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Shape = tuple[int, int, int]

# CPU sizes span 32..2048, the range of the held-out check; --quick uses 3 per dimension.
CPU_DIMS_QUICK = (48, 320, 1536)
CPU_DIMS_FULL = (32, 128, 512, 1024, 2048)
CPU_MISALIGNED_QUICK = (37, 203, 1001)
CPU_MISALIGNED_FULL = (37, 131, 509, 1001, 1999)
# GPU sizes: from launch-bound (128) to full-wave (8192) on an H100/H200-class part.
GPU_DIMS_QUICK = (128, 1024, 4096, 8192)
GPU_DIMS_FULL = (128, 512, 1024, 2048, 4096, 8192)
GPU_MISALIGNED = (127, 1001, 4095, 8191)
ROUNDS = 3  # interleaved measurement rounds per shape (calibrate.measure.measure_samples)


def crossed_shapes(dims: Sequence[int], odd: Sequence[int], seed: int = 0) -> list[Shape]:
    """Every (M, N, K) from ``dims``, then max(6, a third as many) shapes mixing in ``odd``."""
    shapes = list(itertools.product(dims, repeat=3))
    rng = random.Random(seed)
    n_odd = max(6, len(shapes) // 3)
    mixed = sorted(set(dims) | set(odd))
    while n_odd > 0:
        s = (rng.choice(mixed), rng.choice(mixed), rng.choice(mixed))
        if any(v in odd for v in s) and s not in shapes:
            shapes.append(s)
            n_odd -= 1
    return shapes


@dataclass(frozen=True)
class GridOption:
    """One grid a calibration can measure: its shapes, each measured ``rounds`` times."""

    shapes: tuple[Shape, ...]
    rounds: int

    @property
    def max_dim(self) -> int:
        return max(max(s) for s in self.shapes)

    def describe(self) -> str:
        rounds = f"{self.rounds} round" + ("s" if self.rounds != 1 else "")
        return f"{len(self.shapes)} shapes up to {self.max_dim} x {rounds}"

    def to_dict(self) -> dict[str, Any]:
        return {"shapes": len(self.shapes), "max_dim": self.max_dim, "rounds": self.rounds}


def crossed_option(dims: Sequence[int], odd: Sequence[int], rounds: int) -> GridOption:
    return GridOption(tuple(crossed_shapes(dims, odd)), rounds)


def grid_options(kind: str, quick: bool) -> tuple[GridOption, ...]:
    """The grids a calibration may measure, richest first (a full run measures the first).

    --quick on the CPU steps down from the 36-shape grid in three rounds: first a round
    fewer (the fit already drops stalled measurements), then smaller dimensions (a 1024^3
    GEMM is 30% of the FLOPs of 1536^3, 640^3 7%), then one round, then 2 sizes per dimension
    (8 crossed shapes + 6 odd ones: still enough for the fit's 6 terms).
    """
    if kind == "cpu" and not quick:
        return (crossed_option(CPU_DIMS_FULL, CPU_MISALIGNED_FULL, ROUNDS),)
    if kind == "cpu":
        return (
            crossed_option(CPU_DIMS_QUICK, CPU_MISALIGNED_QUICK, 3),
            crossed_option(CPU_DIMS_QUICK, CPU_MISALIGNED_QUICK, 2),
            crossed_option((48, 256, 1024), (37, 203, 1001), 2),
            crossed_option((32, 160, 640), (37, 131, 509), 2),
            crossed_option((32, 160, 640), (37, 131, 509), 1),
            crossed_option((32, 512), (37, 509), 1),
        )
    if not quick:
        return (crossed_option(GPU_DIMS_FULL, GPU_MISALIGNED, ROUNDS),)
    return tuple(crossed_option(GPU_DIMS_QUICK, GPU_MISALIGNED, r) for r in (3, 2, 1))


def calibration_grid(kind: str, quick: bool) -> list[Shape]:
    """The shapes an unbounded calibration of this mode measures."""
    return list(grid_options(kind, quick)[0].shapes)


def all_grid_shapes(kind: str) -> set[Shape]:
    """Every shape any calibration of ``kind`` may measure (held-out shapes avoid them)."""
    return {s for quick in (True, False) for o in grid_options(kind, quick) for s in o.shapes}


# How tilefit.bench.timing.time_gemm times one shape: WARMUP_CALLS untimed calls, then timed
# calls until both MIN_REPS calls and min_time_s have passed, at most MAX_REPS calls
# (calibrate.run and calibrate.measure pass MIN_REPS and MAX_REPS to it).
WARMUP_CALLS = 2
MIN_REPS = 5
MAX_REPS = 1000


@dataclass(frozen=True)
class MeasureCost:
    """What measuring one shape of one dtype costs on this device (from a probe GEMM)."""

    flops_per_s: float  # the dtype's GEMM rate on the probe shape
    call_overhead_s: float  # the fixed time of one call
    setup_s: float  # building the rotating input buffers, once per shape and round
    min_time_s: float  # the timing loop's minimum per shape

    def call_s(self, shape: Shape) -> float:
        m, n, k = shape
        return self.call_overhead_s + 2 * m * n * k / self.flops_per_s

    def shape_s(self, shape: Shape) -> float:
        """Seconds to measure ``shape`` once: setup, warm-up, the timed calls."""
        t = self.call_s(shape)
        timed = min(MAX_REPS * t, max(MIN_REPS * t, self.min_time_s))
        return self.setup_s + WARMUP_CALLS * t + timed

    def option_s(self, option: GridOption) -> float:
        return option.rounds * sum(self.shape_s(s) for s in option.shapes)

    def to_dict(self) -> dict[str, float]:
        return {"flops_per_s": self.flops_per_s, "call_overhead_s": self.call_overhead_s,
                "setup_s": self.setup_s, "min_time_s": self.min_time_s}


def choose_option(options: Sequence[GridOption], cost: MeasureCost,
                  budget_s: float) -> GridOption | None:
    """The first (richest) option whose predicted time is within ``budget_s``; None if none."""
    return next((o for o in options if cost.option_s(o) <= budget_s), None)


# A dtype this device runs below half the reference dtype's rate is worth knowing, not worth
# minutes: a quarter of a normal dtype's weight in the split of the budget, and never more
# than a fifth of the whole budget. bf16 on a CPU without a bf16 GEMM kernel, measured on this
# 2-core EPYC: 1% of fp32 with oneDNN limited to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2), 45% limited
# to AVX-512 without its bf16 instructions (AVX512_CORE), 220% with them.
SLOW_RELATIVE_RATE = 0.5
SLOW_WEIGHT = 0.25
SLOW_SHARE = 0.2


@dataclass(frozen=True)
class DtypePlan:
    """The grid chosen for one dtype, and why."""

    dtype: str
    relative_rate: float  # its probe FLOP/s over the reference (first) dtype's
    allowance_s: float  # its share of the budget (inf: unbounded)
    option: GridOption | None  # None: skipped, even the smallest grid exceeds the allowance
    predicted_s: float  # the cost model's time to measure option (0 when skipped)

    @property
    def slow(self) -> bool:
        return self.relative_rate < SLOW_RELATIVE_RATE


def plan_grids(costs: Mapping[str, MeasureCost], options: Sequence[GridOption],
               budget_s: float) -> tuple[DtypePlan, ...]:
    """Per dtype, in the order of ``costs`` (the first is the reference), the richest option
    within its allowance: the budget not yet planned, split by weight over it and the dtypes
    after it (1 each, SLOW_WEIGHT for a slow one; a slow one at most SLOW_SHARE of
    ``budget_s``). The reference dtype gets the smallest option when none fits: a profile
    without it is no calibration. ``budget_s`` = inf plans every dtype's first option."""
    names = list(costs)
    if not names:
        return ()
    ref_flops_per_s = costs[names[0]].flops_per_s
    rel = {d: costs[d].flops_per_s / ref_flops_per_s for d in names}
    weight = {d: SLOW_WEIGHT if rel[d] < SLOW_RELATIVE_RATE else 1.0 for d in names}
    left_s = max(0.0, budget_s)
    plans = []
    for i, d in enumerate(names):
        allowance_s = left_s * weight[d] / sum(weight[e] for e in names[i:])
        if rel[d] < SLOW_RELATIVE_RATE:
            allowance_s = min(allowance_s, SLOW_SHARE * budget_s)
        option = choose_option(options, costs[d], allowance_s)
        if option is None and i == 0:
            option = options[-1]
        predicted_s = costs[d].option_s(option) if option else 0.0
        left_s = max(0.0, left_s - predicted_s)
        plans.append(DtypePlan(d, rel[d], allowance_s, option, predicted_s))
    return tuple(plans)


def describe_cut(full: GridOption, chosen: GridOption | None, rounds_done: int) -> str:
    """What a bounded run left out of ``full`` ("" when nothing), e.g. "1 of 3 rounds; dims
    up to 640 instead of 1536"."""
    if chosen is None or rounds_done == 0:
        return f"all of it: {full.describe()}"
    parts = []
    if rounds_done < full.rounds:
        parts.append(f"{full.rounds - rounds_done} of {full.rounds} rounds")
    if chosen.max_dim < full.max_dim:
        parts.append(f"dims up to {chosen.max_dim} instead of {full.max_dim}")
    if len(chosen.shapes) < len(full.shapes):
        parts.append(f"{len(chosen.shapes)} shapes instead of {len(full.shapes)}")
    return "; ".join(parts)


def held_out_shapes(count: int, lo: int, hi: int, exclude: set[Shape], seed: int = 1,
                    align_to: int = 64) -> list[tuple[Shape, bool]]:
    """``count`` shapes (half aligned to ``align_to`` elements, half with an odd dim),
    log-uniform in [lo, hi] per dim, none in ``exclude``; each with its aligned flag."""
    rng = random.Random(seed)
    out: list[tuple[Shape, bool]] = []
    seen = set(exclude)
    while len(out) < count:
        dims = [round(lo * (hi / lo) ** rng.random()) for _ in range(3)]
        aligned = len(out) % 2 == 0
        if aligned:
            dims = [max(align_to, round(d / align_to) * align_to) for d in dims]
        else:
            j = rng.randrange(3)
            dims[j] |= 1  # an odd dimension: off every multiple
        s = (dims[0], dims[1], dims[2])
        if s in seen:
            continue
        seen.add(s)
        out.append((s, aligned))
    return out
