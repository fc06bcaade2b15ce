"""The timing helpers: medians, percentiles, buffer rotation, real GEMM timing."""

from __future__ import annotations

import time

import pytest

from tilefit.bench.timing import buffer_count, summarize, time_calls, time_gemm


def test_summarize_median_and_percentiles() -> None:
    t = summarize([5.0, 1.0, 4.0, 2.0, 3.0, 100.0, 6.0, 7.0, 8.0, 9.0, 10.0])
    # sorted: 1..10, 100 -> median 6; nearest-rank p10 at index round(0.1*10)=1 -> 2,
    # p90 at index 9 -> 10
    assert (t.median_s, t.p10_s, t.p90_s, t.reps) == (6.0, 2.0, 10.0, 11)
    with pytest.raises(ValueError):
        summarize([])


def test_time_calls_measures_a_known_sleep() -> None:
    seen: list[int] = []

    def call(i: int) -> None:
        seen.append(i)
        time.sleep(0.002)

    t = time_calls(call, warmup=2, min_reps=5, min_time_s=0.0, max_reps=5)
    assert t.reps == 5
    assert seen == list(range(7))  # 2 warm-up calls, then 5 timed ones on fresh indices
    assert 0.002 <= t.median_s < 0.02  # sleep(2 ms) never returns early


def test_buffer_count_covers_twice_the_cache() -> None:
    mib = 1024**2
    assert buffer_count(1 * mib, 32 * mib) == 64  # 2 * 32 MiB / 1 MiB
    assert buffer_count(48 * mib, 32 * mib) == 2  # ceil(64/48) = 2
    assert buffer_count(1024, 32 * mib) == 256  # capped at MAX_BUFFERS
    assert buffer_count(3 * 1024**3, 32 * mib) == 2  # at least two sets


def test_time_gemm_cpu() -> None:
    t = time_gemm(64, 64, 64, "fp32", min_time_s=0.01)
    assert t.reps >= 5 and t.p10_s <= t.median_s <= t.p90_s
    # 2*64^3 = 524288 FLOPs: at most 1 TFLOP/s on a CPU -> >= 0.5 us
    assert t.median_s > 5e-7


def test_a_step_measurement_is_noisy_when_spread_or_busy() -> None:
    from tilefit.bench.step import StepMeasurement

    quiet = StepMeasurement("cpu", 1.0, (0.98, 1.0, 1.03), 1, threads=2, load_average=1.7,
                            cores=2)
    assert quiet.spread == pytest.approx(0.05) and not quiet.noisy
    spread = StepMeasurement("cpu", 1.0, (0.9, 1.0, 1.2), 1, threads=2, load_average=1.0,
                             cores=2)
    assert spread.spread == pytest.approx(0.3) and spread.noisy
    busy = StepMeasurement("cpu", 1.0, (1.0, 1.0, 1.01), 1, threads=2, load_average=2.74,
                           cores=2)
    assert busy.busy and busy.noisy
