"""The time budget of a calibration: which grid the measured costs choose (pure arithmetic,
hand-computed; nothing here is timed)."""

from __future__ import annotations

import math

import pytest

from tilefit.bench.timing import Timing
from tilefit.calibrate.grid import (
    SLOW_SHARE,
    GridOption,
    MeasureCost,
    choose_option,
    describe_cut,
    grid_options,
    plan_grids,
)
from tilefit.hardware.cpu import cpu_device

# A made-up device: fp32 at 1 GFLOP/s, 0.1 s to build a shape's input buffers, no call
# overhead, a 20 ms timing minimum.
FP32 = MeasureCost(flops_per_s=1e9, call_overhead_s=0.0, setup_s=0.1, min_time_s=0.02)
SLOW_BF16 = MeasureCost(flops_per_s=1e8, call_overhead_s=0.0, setup_s=0.1, min_time_s=0.02)
FAST_BF16 = MeasureCost(flops_per_s=2e9, call_overhead_s=0.0, setup_s=0.1, min_time_s=0.02)
SMALL, BIG, WIDE = (100, 100, 100), (1000, 1000, 1000), (200, 100, 100)
RICH = GridOption((SMALL, BIG), rounds=3)
ONE_ROUND = GridOption((SMALL, BIG), rounds=1)
TINY = GridOption((SMALL, WIDE), rounds=1)
LADDER = (RICH, ONE_ROUND, TINY)


def test_shape_cost_is_setup_warmup_and_the_timed_calls() -> None:
    # 100^3: 2e6 FLOP at 1e9/s = 2 ms a call; 5 calls (10 ms) < 20 ms minimum, so 20 ms timed;
    # 2 warm-up calls 4 ms; + 0.1 s setup = 0.124 s.
    assert FP32.shape_s(SMALL) == pytest.approx(0.124)
    # 1000^3: 2 s a call; 5 calls = 10 s timed, 4 s warm-up, 0.1 s setup = 14.1 s.
    assert FP32.shape_s(BIG) == pytest.approx(14.1)
    # 1x1x1 with a 1 us overhead: ~1 us a call, so the 1000-call cap (~1 ms) ends the loop
    # before the 20 ms minimum: 0.1 + 2 * 1.002e-6 + 1000 * 1.002e-6.
    tiny = MeasureCost(1e9, 1e-6, 0.1, 0.02)
    assert tiny.shape_s((1, 1, 1)) == pytest.approx(0.1 + 1002 * 1.002e-6)


def test_option_cost_is_rounds_times_its_shapes() -> None:
    assert FP32.option_s(RICH) == pytest.approx(3 * (0.124 + 14.1))  # 42.672
    assert FP32.option_s(ONE_ROUND) == pytest.approx(14.224)
    # 200x100x100: 4 ms a call, 20 ms timed, 8 ms warm-up: 0.128; with 100^3: 0.252
    assert FP32.option_s(TINY) == pytest.approx(0.252)


@pytest.mark.parametrize("budget_s, expected", [
    (50.0, RICH), (42.672, RICH), (20.0, ONE_ROUND), (1.0, TINY), (0.1, None)])
def test_choose_option_takes_the_richest_that_fits(budget_s, expected) -> None:
    assert choose_option(LADDER, FP32, budget_s) == expected


def test_a_slow_dtype_gets_a_fifth_of_the_budget_at_most() -> None:
    # bf16 at 10% of fp32: RICH would take 3 * (0.24 + 140.1) = 421 s, ONE_ROUND 140.34 s,
    # TINY 0.24 + 0.38 = 0.62 s (100^3: 20 ms a call, 5 calls 0.1 s, warm-up 0.04 s).
    fp32, bf16 = plan_grids({"fp32": FP32, "bf16": SLOW_BF16}, LADDER, 100.0)
    # weights fp32 1, bf16 0.25: fp32 may use 100 * 1 / 1.25 = 80 s; RICH (42.672 s) fits
    assert fp32.allowance_s == pytest.approx(80.0)
    assert fp32.option == RICH and fp32.predicted_s == pytest.approx(42.672)
    # 57.328 s left, but bf16 is slow: at most 0.2 * 100 = 20 s; only TINY fits
    assert bf16.slow and bf16.relative_rate == pytest.approx(0.1)
    assert bf16.allowance_s == pytest.approx(SLOW_SHARE * 100.0)
    assert bf16.option == TINY and bf16.predicted_s == pytest.approx(0.62)


def test_a_fast_dtype_shares_the_budget_evenly() -> None:
    # bf16 at 2x fp32: RICH takes 3 * (0.122 + 7.1) = 21.666 s.
    fp32, bf16 = plan_grids({"fp32": FP32, "bf16": FAST_BF16}, LADDER, 100.0)
    assert fp32.allowance_s == pytest.approx(50.0) and fp32.option == RICH
    assert not bf16.slow and bf16.relative_rate == pytest.approx(2.0)
    assert bf16.allowance_s == pytest.approx(100 - 42.672) and bf16.option == RICH
    # With 60 s, fp32 may use 30 s: RICH (42.672) does not fit, ONE_ROUND (14.224) does;
    # bf16 then has 45.776 s, enough for its RICH (21.666).
    fp32, bf16 = plan_grids({"fp32": FP32, "bf16": FAST_BF16}, LADDER, 60.0)
    assert fp32.option == ONE_ROUND and bf16.option == RICH
    assert bf16.allowance_s == pytest.approx(60 - 14.224)


def test_the_reference_dtype_is_never_skipped_and_others_are() -> None:
    # 0.1 s: fp32 may use 0.08 s, less than TINY's 0.252 s, and gets TINY anyway; nothing is
    # left for bf16, which is skipped. A negative budget (already spent) acts as zero.
    for budget_s in (0.1, -5.0):
        fp32, bf16 = plan_grids({"fp32": FP32, "bf16": FAST_BF16}, LADDER, budget_s)
        assert fp32.option == TINY and fp32.predicted_s == pytest.approx(0.252)
        assert bf16.option is None and bf16.predicted_s == 0.0


def test_an_unbounded_budget_plans_the_richest_grid_for_every_dtype() -> None:
    plans = plan_grids({"fp32": FP32, "bf16": SLOW_BF16}, LADDER, math.inf)
    assert [p.option for p in plans] == [RICH, RICH]
    assert plans[1].predicted_s == pytest.approx(3 * (0.24 + 140.1))


def test_the_issue_case_fits_the_quick_budget() -> None:
    # Issue 16's shape of problem: fp32 at 150 GFLOP/s, bf16 with no fast kernel at 1.5
    # GFLOP/s (1%: measured here with oneDNN limited to AVX2), 0.15 s setup per shape, the
    # 140 s left of the quick budget. The full quick grid would take minutes for bf16.
    fp32 = MeasureCost(150e9, 1.2e-6, 0.15, 0.02)
    bf16 = MeasureCost(1.5e9, 1.2e-6, 0.15, 0.02)
    ladder = grid_options("cpu", quick=True)
    assert bf16.option_s(ladder[0]) > 180
    plans = plan_grids({"fp32": fp32, "bf16": bf16}, ladder, 140.0)
    assert plans[0].option == ladder[0]  # fp32 keeps the whole quick grid
    assert plans[1].option is not None and plans[1].predicted_s <= SLOW_SHARE * 140.0
    assert sum(p.predicted_s for p in plans) <= 140.0


def test_quick_ladder_gets_cheaper_at_every_step() -> None:
    ladder = grid_options("cpu", quick=True)
    for cost in (MeasureCost(150e9, 1e-6, 0.1, 0.02), MeasureCost(1.5e9, 1e-6, 0.1, 0.02)):
        times = [cost.option_s(o) for o in ladder]
        assert times == sorted(times, reverse=True) and len(set(times)) == len(times)
    assert len(grid_options("cpu", quick=False)) == 1  # the full run is not scaled


@pytest.mark.parametrize("chosen, rounds_done, expected", [
    (0, 3, ""),
    (0, 2, "1 of 3 rounds"),
    (3, 2, "1 of 3 rounds; dims up to 640 instead of 1536"),
    (5, 1, "2 of 3 rounds; dims up to 512 instead of 1536; 14 shapes instead of 36"),
    (None, 0, "all of it: 36 shapes up to 1536 x 3 rounds"),
])
def test_describe_cut_says_what_was_skipped(chosen, rounds_done, expected) -> None:
    ladder = grid_options("cpu", quick=True)
    option = None if chosen is None else ladder[chosen]
    assert describe_cut(ladder[0], option, rounds_done) == expected


def test_rounds_stop_at_the_deadline(monkeypatch) -> None:
    import tilefit.calibrate.measure as measure

    # A fake clock: each measured shape takes 1 s. 3 shapes, deadline 7 s: round 1 ends at
    # 3 s, round 2 would end at 6 s (runs), round 3 at 9 s > 7 s (not started).
    now = [0.0]

    def fake_time_gemm(*_args: object, **_kw: object) -> Timing:
        now[0] += 1.0
        return Timing(1e-3, 1e-3, 1e-3, 5)

    monkeypatch.setattr(measure, "time_gemm", fake_time_gemm)
    steps: list[tuple[int, int]] = []
    samples, done = measure.measure_rounds(
        [(8, 8, 8), (16, 8, 8), (9, 8, 8)], "fp32", cpu_device(), 0.01, 3,
        deadline_s=7.0, step=lambda r, j: steps.append((r, j)), clock=lambda: now[0])
    assert done == 2 and now[0] == 6.0
    assert steps == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]
    assert [s.aligned for s in samples] == [True, True, False]  # 9 is off the multiple of 4


def test_probe_rate_is_the_faster_of_two_windows(monkeypatch) -> None:
    import dataclasses

    import tilefit.calibrate.run as run

    # The probe's 10th-percentile call: 1 ms for 512^3 = 2 * 512^3 / 1e-3 = 268.4 GFLOP/s.
    monkeypatch.setattr(run, "time_gemm", lambda *a, **kw: Timing(2e-3, 1e-3, 3e-3, 5))
    cpu = cpu_device()
    stalled = dataclasses.replace(cpu, peak_flops_per_s={"fp32": 100e9, "bf16": 1e9})
    fast = dataclasses.replace(cpu, peak_flops_per_s={"fp32": 300e9, "bf16": 1e9})
    assert run.probe_costs(["fp32"], stalled, 0.02, 1e-6)["fp32"].flops_per_s == \
        pytest.approx(2 * 512**3 / 1e-3)
    costs = run.probe_costs(["fp32", "bf16"], fast, 0.02, 1e-6)
    assert costs["fp32"].flops_per_s == 300e9  # the device probe's window was faster
    assert costs["bf16"].flops_per_s == pytest.approx(2 * 512**3 / 1e-3)
    assert costs["fp32"].call_overhead_s == 1e-6 and costs["fp32"].min_time_s == 0.02
