"""The gradient noise scale and what it says about the batch size: pure arithmetic, no torch.

McCandlish et al., "An Empirical Model of Large-Batch Training" (2018),
docs/references.md, section 18. With G the true gradient and Sigma the per-sample gradient
covariance, a batch of B samples has E|G_B|^2 = |G|^2 + tr(Sigma) / B. Two batch sizes give
unbiased estimates of |G|^2 and tr(Sigma) (its appendix A), whose ratio is the simple noise scale
B_simple = tr(Sigma) / |G|^2. The steps and samples to reach a given loss are
S(B) = S_min (1 + B_noise / B) and E(B) = E_min (1 + B / B_noise) (its eq. 2.11, with
B_crit = E_min / S_min ~ B_noise); the measuring loop lives in ``noise_measure.py``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from tilefit.errors import TilefitError
from tilefit.html_repr import HtmlRepr

# Resamples of the percentile bootstrap (Efron & Tibshirani, docs/references.md, section 18):
# the interval's end points move by well under 1% between seeds at 2000.
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0  # a private numpy Generator: the user's RNG streams are never touched
DEFAULT_CONFIDENCE = 0.90
# Below this relative difference between |G_Bsmall|^2 and |G_Bbig|^2 the two are the same
# up to float32 rounding of the summed gradients (unit roundoff 6e-8, IEEE 754): no noise.
SAME_GRADIENT_RELATIVE = 1e-6
# A global batch this many times the noise scale needs (1 + 2) = 3 times the samples of the
# most sample-efficient run for the same loss (eq. 2.11): plan's and tune's warning. A policy.
FAR_ABOVE_NOISE_SCALE = 2.0

LrRule = Literal["sgd", "adam"]


@dataclass(frozen=True)
class Measurement:
    """One measurement: a big batch made of micro-batches of the small size."""

    small_sq: float  # mean over the micro-batches of |G_Bsmall|^2
    big_sq: float  # |G_Bbig|^2, the gradient of all of them together

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def check_batch_sizes(b_small: object, b_big: object) -> tuple[int, int]:
    """(B_small, B_big) when they can measure the noise: B_small >= 2 (one sample has no
    batch-to-batch spread to compare), B_big a larger multiple of B_small (the big batch is
    accumulated from micro-batches of the small size)."""
    fix = "pass batch_sizes=(8, 64): a small batch of at least 2 and a big one 4 to 16 times it"
    for name, value in (("B_small", b_small), ("B_big", b_big)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TilefitError(f"{name} must be a whole number", expected="e.g. (8, 64)",
                               given=repr(value), fix=fix)
    assert isinstance(b_small, int) and isinstance(b_big, int)
    if b_small < 2:
        raise TilefitError(
            "the small batch has too few samples to measure the gradient noise",
            expected="B_small >= 2", given=f"batch_sizes=({b_small}, {b_big})", fix=fix)
    if b_big <= b_small or b_big % b_small:
        raise TilefitError(
            "the big batch must be a larger multiple of the small one (it is accumulated "
            "from micro-batches of the small size)",
            expected=f"B_big > B_small and B_big % B_small == 0, e.g. {8 * b_small}",
            given=f"batch_sizes=({b_small}, {b_big})", fix=fix)
    return b_small, b_big


def unbiased_gradient_sq(small_sq: float, big_sq: float, b_small: int, b_big: int) -> float:
    """|G|^2 = (B_big |G_Bbig|^2 - B_small |G_Bsmall|^2) / (B_big - B_small) (appendix A)."""
    return (b_big * big_sq - b_small * small_sq) / (b_big - b_small)


def unbiased_trace_sigma(small_sq: float, big_sq: float, b_small: int, b_big: int) -> float:
    """tr(Sigma) = (|G_Bsmall|^2 - |G_Bbig|^2) / (1/B_small - 1/B_big) (appendix A)."""
    return (small_sq - big_sq) / (1 / b_small - 1 / b_big)


def estimates(measurements: Sequence[Measurement], b_small: int, b_big: int
              ) -> tuple[float, float]:
    """(|G|^2, tr(Sigma)), each averaged over the measurements before the ratio is taken (a
    ratio of means: the mean of ratios is biased by the noise in each |G|^2, as the paper
    notes when it averages the two estimates separately)."""
    n = len(measurements)
    g2 = sum(unbiased_gradient_sq(m.small_sq, m.big_sq, b_small, b_big)
             for m in measurements) / n
    trace = sum(unbiased_trace_sigma(m.small_sq, m.big_sq, b_small, b_big)
                for m in measurements) / n
    return g2, trace


def ratio(g2: float, trace: float) -> float:
    """B_simple = tr(Sigma) / |G|^2; +inf when the |G|^2 estimate is not positive (the noise
    swamps the gradient at these batch sizes)."""
    return trace / g2 if g2 > 0 else math.inf


def bootstrap_interval(measurements: Sequence[Measurement], b_small: int, b_big: int,
                       confidence: float = DEFAULT_CONFIDENCE,
                       resamples: int = BOOTSTRAP_RESAMPLES) -> tuple[float, float]:
    """The percentile bootstrap interval of B_simple over the measurements (resampled with
    replacement, the ratio of means each time), from a private seeded generator."""
    import numpy as np

    if not 0 < confidence < 1:
        raise TilefitError("confidence must be a fraction in (0, 1)", expected="e.g. 0.9",
                           given=repr(confidence), fix="pass confidence=0.9")
    g2 = np.array([unbiased_gradient_sq(m.small_sq, m.big_sq, b_small, b_big)
                   for m in measurements])
    trace = np.array([unbiased_trace_sigma(m.small_sq, m.big_sq, b_small, b_big)
                      for m in measurements])
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    idx = rng.integers(0, len(measurements), size=(resamples, len(measurements)))
    g2_means, trace_means = g2[idx].mean(axis=1), trace[idx].mean(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = np.where(g2_means > 0, trace_means / g2_means, np.inf)
    tail = expanded_tail(confidence, len(measurements))
    low, high = np.quantile(ratios, [tail, 1 - tail], method="inverted_cdf")
    return float(low), float(high)


def student_t_quantile(p: float, df: int) -> float:
    """The Student t quantile from the normal one by the Cornish-Fisher expansion
    (Abramowitz & Stegun 26.7.5; docs/references.md, section 18): within 0.01 for df >= 4
    at the usual levels."""
    from statistics import NormalDist

    z = NormalDist().inv_cdf(p)
    return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3))


def expanded_tail(confidence: float, n: int) -> float:
    """The tail probability of Hesterberg's expanded percentile interval
    (docs/references.md, section 18): the percentile bootstrap is too narrow with few
    measurements, so its tails are taken at Phi(-sqrt(n / (n - 1)) t_{n-1}) instead of
    (1 - confidence) / 2."""
    from statistics import NormalDist

    tail = (1 - confidence) / 2
    if n < 2:
        return tail
    t = student_t_quantile(1 - tail, n - 1)
    return NormalDist().cdf(-math.sqrt(n / (n - 1)) * t)


@dataclass(frozen=True)
class NoiseScale(HtmlRepr):
    """The measured simple noise scale B_simple = tr(Sigma) / |G|^2
    (docs/references.md, section 18) and what it was measured from. Batch sizes are in
    samples (a sample is one row of what make_batch returns: a sequence for a language
    model)."""

    b_simple: float
    b_simple_low: float  # the bootstrap interval at ``confidence``
    b_simple_high: float
    confidence: float
    gradient_sq_norm: float  # |G|^2, unbiased estimate
    trace_sigma: float  # tr(Sigma), unbiased estimate
    batch_small: int
    batch_big: int
    measurements: int
    samples: int  # samples drawn: measurements * batch_big
    time_s: float
    per_measurement: tuple[Measurement, ...] = ()
    loss: float | None = None  # mean loss over the micro-batches measured
    optimizer: str | None = None  # the optimizer's class name, when one was given
    learning_rate: float | None = None  # its first group's lr

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["per_measurement"] = [m.to_dict() for m in self.per_measurement]
        return d

    def steps_factor(self, batch_size: int) -> float:
        """S(B) / S_min = 1 + B_simple / B (eq. 2.11)."""
        return steps_factor(batch_size, self.b_simple)

    def samples_factor(self, batch_size: int) -> float:
        """E(B) / E_min = 1 + B / B_simple (eq. 2.11)."""
        return samples_factor(batch_size, self.b_simple)


def from_measurements(measurements: Sequence[Measurement], b_small: int, b_big: int, *,
                      time_s: float, confidence: float = DEFAULT_CONFIDENCE,
                      **extra: Any) -> NoiseScale:
    """The NoiseScale of these measurements; a TilefitError when they cannot give one."""
    if not measurements:
        raise TilefitError("no measurements to estimate the noise scale from",
                           expected="measurements >= 2", given="0", fix="pass measurements=10")
    g2, trace = estimates(measurements, b_small, b_big)
    small = sum(m.small_sq for m in measurements) / len(measurements)
    big = sum(m.big_sq for m in measurements) / len(measurements)
    if small - big <= SAME_GRADIENT_RELATIVE * abs(small):
        trace = min(trace, 0.0)  # no noise beyond rounding
    check_estimates(g2, trace, b_small, b_big, len(measurements))
    low, high = bootstrap_interval(measurements, b_small, b_big, confidence)
    return NoiseScale(
        b_simple=ratio(g2, trace), b_simple_low=low, b_simple_high=high,
        confidence=confidence, gradient_sq_norm=g2, trace_sigma=trace, batch_small=b_small,
        batch_big=b_big, measurements=len(measurements),
        samples=len(measurements) * b_big, time_s=time_s,
        per_measurement=tuple(measurements), **extra)


def check_estimates(g2: float, trace: float, b_small: int, b_big: int, n: int) -> None:
    """Stop on estimates that give no noise scale, saying why."""
    given = f"|G|^2 ~ {g2:.4g}, tr(Sigma) ~ {trace:.4g} from {n} measurements at " \
        f"batch_sizes=({b_small}, {b_big})"
    if trace <= 0:
        raise TilefitError(
            "the small batches' gradients are no noisier than the big batch's: no gradient "
            "noise to measure",
            expected="make_batch(b) returning fresh, randomly drawn samples on every call",
            given=given,
            fix="draw each batch at random from the training data (a synthetic batch that is "
            "the same on every call has no noise); if it does, pass more measurements")
    if g2 <= 0:
        raise TilefitError(
            "the noise swamps the gradient at these batch sizes: the |G|^2 estimate is not "
            "positive, so the noise scale is far above the big batch",
            expected=f"a big batch near the noise scale (more than {b_big})",
            given=given,
            fix=f"pass a bigger batch_sizes=({b_small}, {16 * b_big}) or more measurements "
            "(measure after warm-up: early in training the noise scale is smallest)")


# ---- the steps, samples and time to a given loss (eq. 2.11) --------------------------------


def steps_factor(batch_size: float, b_noise: float) -> float:
    """S(B) / S_min = 1 + B_noise / B."""
    return 1 + b_noise / batch_size


def samples_factor(batch_size: float, b_noise: float) -> float:
    """E(B) / E_min = 1 + B / B_noise."""
    return 1 + batch_size / b_noise


@dataclass(frozen=True)
class StepsFit:
    """S(B) = S_min (1 + B_crit / B) fitted to measured steps-to-target."""

    s_min: float
    b_crit: float
    max_relative_error: float  # the worst |fit - measured| / measured

    def steps(self, batch_size: float) -> float:
        return self.s_min * steps_factor(batch_size, self.b_crit)


def fit_steps_curve(batch_sizes: Sequence[float], steps: Sequence[float]) -> StepsFit:
    """Least squares in relative error of S = a + c / B (a = S_min, c = S_min B_crit): the
    weighted linear fit minimising sum(((a + c/B_i) - S_i) / S_i)^2, in closed form."""
    if len(batch_sizes) != len(steps) or len(steps) < 2:
        raise TilefitError("the fit needs steps at two or more batch sizes",
                           expected="equal-length sequences, at least 2 points",
                           given=f"{len(batch_sizes)} batch sizes, {len(steps)} step counts",
                           fix="measure steps-to-target at several batch sizes")
    rows = [(1 / s, 1 / (b * s)) for b, s in zip(batch_sizes, steps, strict=True)]
    # minimise sum((a u + c v - 1)^2) with u = 1/S, v = 1/(B S): normal equations
    suu = sum(u * u for u, _ in rows)
    suv = sum(u * v for u, v in rows)
    svv = sum(v * v for _, v in rows)
    su = sum(u for u, _ in rows)
    sv = sum(v for _, v in rows)
    det = suu * svv - suv * suv
    a = (su * svv - sv * suv) / det
    c = (sv * suu - su * suv) / det
    fit = StepsFit(a, c / a, 0.0)
    worst = max(abs(fit.steps(b) - s) / s for b, s in zip(batch_sizes, steps, strict=True))
    return StepsFit(a, c / a, worst)


@dataclass(frozen=True)
class TimeToLoss:
    """Per batch: measured samples/s, predicted steps and time to the loss (relative)."""

    batch_size: int
    samples_per_s: float
    steps_factor: float  # S(B) / S_min
    time_factor: float  # time to the loss / that of the best batch

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def time_to_loss(rates: Mapping[int, float], b_noise: float) -> tuple[TimeToLoss, ...]:
    """Time to a given loss at each batch: S(B) steps of B / rate(B) seconds each, i.e.
    S_min (B + B_noise) / rate(B); relative to the fastest. Sorted by batch size."""
    seconds = {b: steps_factor(b, b_noise) * b / r for b, r in rates.items() if r > 0}
    best = min(seconds.values())
    return tuple(TimeToLoss(b, rates[b], steps_factor(b, b_noise), seconds[b] / best)
                 for b in sorted(seconds))


def choose_time_to_loss(rows: Sequence[TimeToLoss], noise: float) -> TimeToLoss:
    """The smallest batch whose time to the loss is within ``noise`` (the throughput's
    relative spread) of the best: as choose_batch prefers the smaller size, which also
    needs the fewest samples for the loss (E grows with B)."""
    for row in sorted(rows, key=lambda r: r.batch_size):
        if row.time_factor <= 1 + noise:
            return row
    return min(rows, key=lambda r: r.time_factor)  # pragma: no cover - the best qualifies


# ---- learning-rate advice (eq. 2.7 and the paper's Adam discussion) ------------------------


def lr_fraction(batch_size: float, b_noise: float, rule: LrRule) -> float:
    """epsilon_opt(B) / epsilon_max: 1 / (1 + B_noise/B) for SGD (eq. 2.7); for Adam the
    square root of it (the sign-like update; docs/references.md, section 18)."""
    f = 1 / steps_factor(batch_size, b_noise)
    return f if rule == "sgd" else math.sqrt(f)


def lr_scale(from_batch: float, to_batch: float, b_noise: float, rule: LrRule) -> float:
    """The factor on a learning rate tuned at ``from_batch`` for training at ``to_batch``."""
    return lr_fraction(to_batch, b_noise, rule) / lr_fraction(from_batch, b_noise, rule)


def lr_rule_of(optimizer_name: str | None) -> LrRule:
    """"adam" for the Adam family (Adam, AdamW, their 8-bit and fused kinds), else "sgd"."""
    return "adam" if optimizer_name and "adam" in optimizer_name.lower() else "sgd"


@dataclass(frozen=True)
class LearningRateAdvice:
    """How to scale a learning rate tuned at one batch size for another, and on what it
    rests."""

    rule: LrRule
    b_noise: float
    from_batch: int | None
    to_batch: int
    scale: float | None  # factor on the lr tuned at from_batch; None without one
    fraction_of_max: float  # epsilon_opt(to_batch) / epsilon_max
    text: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def learning_rate_advice(to_batch: int, b_noise: float, rule: LrRule,
                         from_batch: int | None = None) -> LearningRateAdvice:
    """Advice, with its assumptions stated, for the learning rate at ``to_batch``."""
    frac = lr_fraction(to_batch, b_noise, rule)
    scale = None if from_batch is None else lr_scale(from_batch, to_batch, b_noise, rule)
    form = ("McCandlish et al.'s eq. 2.7 for SGD, epsilon_opt(B) = epsilon_max / "
            "(1 + B_noise/B)" if rule == "sgd" else
            "for Adam tilefit's square-root reading of McCandlish et al. (eq. 2.7 is for "
            "SGD), epsilon_opt(B) = epsilon_max / sqrt(1 + B_noise/B)")
    head = (f"scale the learning rate tuned at batch {from_batch} by {scale:.3g} for batch "
            f"{to_batch}" if scale is not None else
            f"at batch {to_batch} the best learning rate is about {frac:.2f} x the "
            "largest useful one")
    text = (f"{head}: {form}, with B_noise ~ {b_noise:.3g}. Assumes the lr was "
            "near-optimal where it was tuned, the noise scale measured near the loss you "
            "train at, and no change of schedule; check with a short lr sweep.")
    return LearningRateAdvice(rule, b_noise, from_batch, to_batch, scale, frac, text)


def far_above_noise_scale(batch_size: int, b_noise: float) -> str | None:
    """A warning when ``batch_size`` is at least FAR_ABOVE_NOISE_SCALE times the noise scale:
    how many more samples it needs for the same loss (eq. 2.11)."""
    if b_noise <= 0 or batch_size < FAR_ABOVE_NOISE_SCALE * b_noise:
        return None
    more = samples_factor(batch_size, b_noise) / 2  # against training at B = B_noise
    return (f"the batch of {batch_size} is {batch_size / b_noise:.1f}x the gradient noise "
            f"scale ({b_noise:.3g}): each step gains little over a smaller batch, and reaching "
            f"the same loss needs about {samples_factor(batch_size, b_noise):.1f}x the fewest "
            f"samples ({more:.1f}x those of a batch at the noise scale); measure again later in "
            "training, where the noise scale is larger")
