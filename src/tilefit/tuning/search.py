"""The batch-size search as pure policy over oracles: no torch, no device, no clock.

``find_max_batch`` finds the exact largest batch for which ``fits(b)`` holds, assuming ``fits``
is monotone (if b fits, every smaller batch fits). ``fits`` returns a bool, or a ``FitProbe``
that also carries the peak memory of the trial and the memory budget; with peaks the search
extrapolates memory as an affine function of the batch size (memory is close to affine in
batch size: parameters, gradients and optimizer state are fixed, activations grow linearly —
docs/references.md, section 11), so it lands on the answer in a handful of trials. Without peaks it
grows or shrinks geometrically to bracket the answer and bisects.

``candidate_sizes`` and ``choose_batch`` are the throughput half: which hardware-friendly sizes
to time, and which to pick from the measurements.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from tilefit.batches import divisors

GROWTH_FACTOR = 2  # geometric bracketing step without memory information (as Lightning's)
DEFAULT_START = 2  # the first probe without a prediction: Lightning's init_val, for comparison
# The candidate list is capped so that timing stays cheap: each candidate costs warm-up plus
# repeated timed steps. Six covers max, the aligned sizes just below it and a power of two.
MAX_CANDIDATES = 6
# Safeguard: after this many affine predictions in a row without closing the bracket, take one
# plain (geometric or bisection) step, so a memory profile that is not affine still costs
# O(log n) trials. Three covers the usual one-point guess, two-point guess, confirmation.
MAX_PREDICTED_IN_A_ROW = 3


@dataclass(frozen=True)
class FitProbe:
    """What one fit trial tells the search: did it fit, and (when known) how much it used.

    ``phase_peaks`` are the highest memory in use during each phase of the step (forward,
    backward, optimizer); each phase is close to affine in the batch size on its own, while
    the overall peak (their max) is convex: it moves from one phase to another as the batch
    grows. Without phases, ``peak_bytes`` (the overall peak) is extrapolated.
    """

    fits: bool
    peak_bytes: int | None = None  # highest memory in use during the trial
    budget_bytes: int | None = None  # the memory the trial was allowed (after the margin)
    baseline_bytes: int | None = None  # memory in use before the trial (weights, state)
    phase_peaks: Mapping[str, int] | None = None


@dataclass(frozen=True)
class FitSearch:
    """The result of ``find_max_batch``: the largest fitting batch and every probe, in order."""

    max_batch: int  # 0 when not even a batch of 1 fits
    probes: tuple[tuple[int, FitProbe], ...] = field(default=())
    capped: bool = False  # True when max_batch is the caller's upper bound, not a failure

    @property
    def trials(self) -> int:
        return len(self.probes)


FitOracle = Callable[[int], "bool | FitProbe"]


def find_max_batch(
    fits: FitOracle,
    *,
    start: int | None = None,
    max_batch: int | None = None,
) -> FitSearch:
    """The exact largest b in [1, max_batch] with fits(b), for a monotone ``fits``.

    ``start`` is the first probe (the estimator's predicted maximum when there is one; else
    DEFAULT_START). The search keeps ``lo`` (largest batch known to fit) and ``hi`` (smallest
    known to fail) and probes strictly between them, so it always terminates; each probe is
    the affine memory prediction when peaks are known, else a geometric step or the midpoint.
    A prediction that turns out wrong is followed by one plain step (safeguard), so the worst
    case stays logarithmic.
    """
    if max_batch is not None and max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    upper = max_batch if max_batch is not None else math.inf
    lo, hi = 0, upper + 1  # invariant: lo fits (0: none known), hi fails (or is past the cap)
    failed_seen = False
    fitting: dict[int, FitProbe] = {}
    probes: list[tuple[int, FitProbe]] = []
    predicted_in_a_row = 0
    b = int(max(1, min(int(start if start is not None else DEFAULT_START), upper)))
    while True:
        raw = fits(b)
        probe = raw if isinstance(raw, FitProbe) else FitProbe(bool(raw))
        probes.append((b, probe))
        if probe.fits:
            lo = b
            fitting[b] = probe
        else:
            hi, failed_seen = b, True
        if hi - lo <= 1:
            break
        # A prediction that failed overshot (peak memory is convex in the batch: the step's
        # peak moves from the backward pass to the forward pass as activations grow), and the
        # same points would only predict hi - 1 next: bisect once instead.
        overshot = predicted_in_a_row > 0 and not probe.fits
        predicted = None
        if predicted_in_a_row < MAX_PREDICTED_IN_A_ROW and not overshot:
            predicted = _predict(fitting, lo, hi)
        if predicted is not None:
            b, predicted_in_a_row = predicted, predicted_in_a_row + 1
            continue
        predicted_in_a_row = 0
        if lo == 0:
            b = max(1, hi // GROWTH_FACTOR)  # nothing fits yet: shrink geometrically
        elif not failed_seen:
            b = int(min(lo * GROWTH_FACTOR, upper))  # no failure yet: grow geometrically
        else:
            b = (lo + hi) // 2  # bracketed: bisect
    capped = max_batch is not None and lo == max_batch
    return FitSearch(max_batch=lo, probes=tuple(probes), capped=capped)


def _predict(fitting: Mapping[int, FitProbe], lo: int, hi: float) -> int | None:
    """The next probe from affine fits of peak memory against batch size, or None.

    Per phase (or on the overall peak when phases are unknown): two fitting probes give slope
    and intercept exactly; one probe plus the memory in use before the trial gives an upper
    bound on the slope (fixed costs counted as if they grew with the batch), hence a safe
    underestimate. The largest b whose every phase is predicted within the budget is the
    guess, clamped strictly inside (lo, hi); when it says lo is the answer we probe lo + 1.
    """
    known = sorted((b, p) for b, p in fitting.items() if p.peak_bytes is not None)
    if not known or known[-1][1].budget_bytes is None:
        return None
    budget = known[-1][1].budget_bytes
    assert budget is not None
    phases = known[-1][1].phase_peaks
    keys = list(phases) if phases else [None]
    guesses = []
    for key in keys:
        series = [(b, _phase(p, key)) for b, p in known]
        series = [(b, v) for b, v in series if v is not None]
        guess = _affine_guess(series, budget, known[-1][1].baseline_bytes)
        if guess is not None:
            guesses.append(guess)
    if not guesses:
        return None
    guess = min(guesses)
    if guess <= lo:
        guess = lo + 1
    if guess >= hi:
        guess = int(hi) - 1
    if guess <= lo:
        return None
    return int(guess)


def _phase(p: FitProbe, key: str | None) -> int | None:
    if key is None:
        return p.peak_bytes
    return None if p.phase_peaks is None else p.phase_peaks.get(key)


def _affine_guess(series: Sequence[tuple[int, int]], budget: int,
                  baseline_bytes: int | None) -> float | None:
    """The largest b with intercept + slope * b <= budget, from the two largest points (or one
    point and the baseline); None when there is no positive slope to extrapolate."""
    if not series:
        return None
    b1, p1 = series[-1]
    if len(series) >= 2:
        b0, p0 = series[-2]
        slope = (p1 - p0) / (b1 - b0)
        intercept = p1 - slope * b1
    elif baseline_bytes is not None:
        slope = (p1 - baseline_bytes) / b1
        intercept = baseline_bytes
    else:
        return None
    if slope <= 0:
        return None  # flat in b (or noise): this phase does not limit the batch
    return math.floor((budget - intercept) / slope)


# --- baselines: the peers' policies on the same oracle, for the benchmark's trial counts ---


def lightning_binsearch(fits: Callable[[int], bool], *, init_val: int = 2,
                        max_trials: int = 25) -> FitSearch:
    """Lightning's BatchSizeFinder mode="binsearch" (tuner/batch_size_scaling.py,
    ``_run_binary_scaling``): double from init_val until a failure, then bisect between the
    last success and the failure until they are 1 apart. Counts every trial it runs; note it
    may return a size it never ran (e.g. 1 after 2 failed)."""
    low, high = 1, None
    new_size = init_val
    probes: list[tuple[int, FitProbe]] = []
    count = 0
    while True:
        ok = bool(fits(new_size))
        probes.append((new_size, FitProbe(ok)))
        if ok:
            count += 1
            if count > max_trials:
                break
            low = new_size
            if high is not None:
                if high - low <= 1:
                    break
                new_size = (high + low) // 2
            else:
                new_size = new_size * 2
        else:
            high = new_size
            new_size = (high + low) // 2
            if high - low <= 1:
                break
    return FitSearch(max_batch=new_size, probes=tuple(probes))


def accelerate_walkdown(fits: Callable[[int], bool], *, starting_batch_size: int = 128
                        ) -> FitSearch:
    """accelerate's find_executable_batch_size (utils/memory.py): start at 128 and on each
    OOM retry with int(0.9 * batch_size); returns the first size that runs (never larger than
    the start), or 0 when it reaches 0."""
    b = starting_batch_size
    probes: list[tuple[int, FitProbe]] = []
    while b > 0:
        ok = bool(fits(b))
        probes.append((b, FitProbe(ok)))
        if ok:
            return FitSearch(max_batch=b, probes=tuple(probes))
        b = int(b * 0.9)
    return FitSearch(max_batch=0, probes=tuple(probes))


# --- throughput: which sizes to time, and which to choose ---


def candidate_sizes(
    max_batch: int,
    *,
    multiple: int = 8,
    global_batch: int | None = None,
    limit: int = MAX_CANDIDATES,
) -> tuple[int, ...]:
    """Hardware-friendly batch sizes up to ``max_batch`` worth timing, ascending.

    Friendly = a multiple of 8, of the device's preferred multiple for the dtype, or a power of
    two (Tensor Cores want GEMM dims in multiples of 16 bytes, 128 on A100 and later: NVIDIA
    "Matrix Multiplication Background" guide, Table 1); plus ``max_batch`` itself. With
    ``global_batch`` only divisors of it qualify (accumulation keeps the global batch exact),
    and the largest divisor <= max_batch is always included. The largest ``limit`` qualify,
    since throughput grows with batch size until the device saturates.
    """
    if max_batch < 1:
        return ()
    friendly: set[int] = set()
    for b in range(1, max_batch + 1):
        if b % 8 == 0 or b % multiple == 0 or (b & (b - 1)) == 0:
            friendly.add(b)
    if global_batch is None:
        friendly.add(max_batch)
    else:
        friendly = {b for b in friendly if global_batch % b == 0}
        friendly.add(max(d for d in divisors(global_batch) if d <= max_batch))
    chosen = sorted(friendly)[-limit:]
    # Keep one power of two below the top when the cap dropped them all (a reference point).
    pow2 = [b for b in sorted(friendly) if (b & (b - 1)) == 0]
    if pow2 and pow2[-1] not in chosen and limit > 1:
        chosen = sorted({*chosen[1:], pow2[-1]})
    return tuple(chosen)


@dataclass(frozen=True)
class Choice:
    batch_size: int
    samples_per_s: float  # the fastest repeat of the chosen size
    best_batch_size: int  # the size with the highest mean
    noise: float  # relative spread of the measurements used as the tie band


def choose_batch(measurements: Mapping[int, Sequence[float]]) -> Choice:
    """The fastest per sample, preferring the smaller size unless a larger one wins by more
    than the measured noise.

    Each size scores its fastest repeat (the repeat least disturbed by the rest of the
    machine: the usual practice of timeit and torch.utils.benchmark's min-time reporting).
    noise = the median over sizes of the relative spread (max - min) / max of the repeats. The
    smallest size whose score is within ``noise`` of the best score wins (less memory, more room
    for longer sequences later).
    """
    scores = {b: max(v) for b, v in measurements.items() if v}
    if not scores:
        raise ValueError("no throughput measurements to choose from")
    spreads = [
        (max(v) - min(v)) / max(v) for v in measurements.values() if len(v) > 1 and max(v) > 0
    ]
    noise = statistics.median(spreads) if spreads else 0.0
    best = max(scores, key=lambda b: (scores[b], b))
    for b in sorted(scores):
        if scores[b] >= scores[best] * (1 - noise):
            return Choice(b, scores[b], best, noise)
    return Choice(best, scores[best], best, noise)  # pragma: no cover - best always qualifies


def accumulation_for(global_batch: int | None, batch_size: int) -> int:
    """Accumulation steps keeping ``global_batch`` exact; 1 without a global batch."""
    if global_batch is None:
        return 1
    if batch_size < 1 or global_batch % batch_size:
        raise ValueError(f"batch {batch_size} does not divide global batch {global_batch}")
    return global_batch // batch_size
