"""The pure search policy, exhaustively on synthetic oracles (no torch)."""

from __future__ import annotations

import math

import pytest

from tilefit.tuning.search import (
    FitProbe,
    accelerate_walkdown,
    accumulation_for,
    candidate_sizes,
    choose_batch,
    find_max_batch,
    lightning_binsearch,
)

N = 400


@pytest.mark.parametrize("start", [None, 1, 3, 64, 1000])
def test_bool_oracle_finds_every_limit_exactly(start: int | None) -> None:
    for limit in range(1, N + 1):
        calls: list[int] = []

        def fits(b: int, limit: int = limit, calls: list[int] = calls) -> bool:
            calls.append(b)
            return b <= limit

        result = find_max_batch(fits, start=start)
        assert result.max_batch == limit
        assert len(calls) == result.trials == len(set(calls))  # no batch is tried twice
        # geometric bracketing + bisection: at most ~2*log2 of the distance from the start
        bound = 2 * math.ceil(math.log2(max(limit, start or 2) + 1)) + 2
        assert result.trials <= bound, (limit, result.trials, bound)


def test_max_batch_caps_the_search() -> None:
    result = find_max_batch(lambda b: b <= 1000, max_batch=48)
    assert result.max_batch == 48 and result.capped
    assert max(b for b, _ in result.probes) == 48
    # 2, 4, 8, 16, 32, 48: doubling until the cap, the cap itself fits -> done
    assert [b for b, _ in result.probes] == [2, 4, 8, 16, 32, 48]


def test_nothing_fits_gives_zero() -> None:
    result = find_max_batch(lambda b: False)
    assert result.max_batch == 0
    assert [b for b, _ in result.probes] == [2, 1]


def _affine_oracle(base: int, per_sample: int, budget: int):
    def fits(b: int) -> FitProbe:
        peak = base + per_sample * b
        ok = peak <= budget
        return FitProbe(ok, peak if ok else None, budget, base // 3)

    return fits


@pytest.mark.parametrize(("base", "per_sample"), [(1000, 10), (5000, 3), (123_456, 777)])
def test_affine_peaks_land_in_a_few_trials(base: int, per_sample: int) -> None:
    for limit in range(1, N + 1):
        budget = base + per_sample * limit + (limit % per_sample)  # just under limit + 1
        result = find_max_batch(_affine_oracle(base, per_sample, budget))
        assert result.max_batch == limit
        # start, one-point guess (a safe underestimate), two-point exact guess, limit + 1
        assert result.trials <= 4
        lightning = lightning_binsearch(lambda b, budget=budget: base + per_sample * b <= budget)
        if limit >= 4:  # below 4 Lightning needs 1-3 trials (it returns 1 untried after 2 fails)
            assert result.trials < lightning.trials, (limit, result.trials, lightning.trials)


def test_convex_peaks_are_still_exact() -> None:
    # Peak = max(backward-bound affine, forward-bound affine): convex in b, so extrapolating
    # from small batches overshoots; the search must recover and stay exact.
    for limit in range(1, N + 1):
        def peak(b: int) -> int:
            return max(40_000 + 400 * b, 20_000 + 1200 * b)

        budget = peak(limit)

        def fits(b: int, budget: int = budget) -> FitProbe:
            ok = peak(b) <= budget
            return FitProbe(ok, peak(b) if ok else None, budget, 11_000)

        result = find_max_batch(fits)
        assert result.max_batch == limit
        assert result.trials <= 2 * math.ceil(math.log2(limit + 1)) + 4


def test_predicted_start_is_the_first_probe() -> None:
    result = find_max_batch(lambda b: b <= 300, start=280)
    assert result.probes[0][0] == 280 and result.max_batch == 300


def test_lightning_baseline_by_hand() -> None:
    # limit 5: 2 ok, 4 ok, 8 fail (mid (8+4)//2 = 6), 6 fail (mid 5), 5 ok, 6-5 = 1 -> stop
    result = lightning_binsearch(lambda b: b <= 5)
    assert [b for b, _ in result.probes] == [2, 4, 8, 6, 5]
    assert result.max_batch == 5
    # limit 1: 2 fails, mid (2+1)//2 = 1, 2-1 = 1 -> returns 1 without running it
    result = lightning_binsearch(lambda b: b <= 1)
    assert result.trials == 1 and result.max_batch == 1


def test_accelerate_baseline_by_hand() -> None:
    # 128 fail, int(115.2) = 115 fail, int(103.5) = 103 fail, int(92.7) = 92 ok
    result = accelerate_walkdown(lambda b: b <= 100)
    assert [b for b, _ in result.probes] == [128, 115, 103, 92]
    assert result.max_batch == 92
    assert accelerate_walkdown(lambda b: True).max_batch == 128  # never above its start


def test_candidate_sizes_by_hand() -> None:
    # multiples of 8 up to 950: ..., 912, 920, 928, 936, 944; plus 950 itself -> the six
    # largest are 912..944 and 950; the largest power of two (512) replaces the smallest.
    assert candidate_sizes(950) == (512, 920, 928, 936, 944, 950)
    # divisors of 1024 up to 950 are the powers of two 1..512; the six largest
    assert candidate_sizes(950, global_batch=1024) == (16, 32, 64, 128, 256, 512)
    # divisors of 96 up to 40: 1 2 3 4 6 8 12 16 24 32; friendly: 1 2 4 8 16 24 32
    assert candidate_sizes(40, global_batch=96) == (2, 4, 8, 16, 24, 32)
    # divisors of 30 up to 12: 1 2 3 5 6 10; friendly 1 2; the largest divisor 10 is added
    assert candidate_sizes(12, global_batch=30) == (1, 2, 10)
    assert candidate_sizes(5) == (1, 2, 4, 5)
    assert candidate_sizes(100, multiple=32) == (64, 72, 80, 88, 96, 100)


def test_choose_prefers_smaller_within_noise() -> None:
    # spreads (max-min)/max: 0, 2/151, 2/152 -> sorted 0 < 2/152 < 2/151, median 2/152 = 1.32%;
    # best is 32 (152); 16 scores 151 >= 152 * (1 - 2/152) = 150, so the smaller 16 wins.
    choice = choose_batch({8: [100, 100, 100], 16: [149, 150, 151], 32: [150, 151, 152]})
    assert choice.batch_size == 16 and choice.best_batch_size == 32
    assert choice.noise == pytest.approx(2 / 152)
    # 32 wins by 50%, far beyond 2% noise
    assert choose_batch({16: [99, 100, 101], 32: [149, 150, 151]}).batch_size == 32


def test_accumulation_keeps_global_batch() -> None:
    assert accumulation_for(None, 48) == 1
    assert accumulation_for(256, 64) == 4
    with pytest.raises(ValueError):
        accumulation_for(256, 48)
