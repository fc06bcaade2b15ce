"""What the caller may set for ``tune`` (``TuneSearch``) and ``noise_scale``
(``NoiseMeasure``), each validated once, in its constructor.

``tilefit.tune(model, make_batch, optimizer=opt, max_batch=64)`` is
``tilefit.tune(model, make_batch, optimizer=opt, search=TuneSearch(max_batch=64))``; the old
keywords are refused with that spelling (``tilefit.old_keywords``). What depends on the
device (a memory limit or a cap on the CPU, the model on it) is checked when the call runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tilefit.errors import TilefitError, check_positive_int
from tilefit.tuning.noise import DEFAULT_CONFIDENCE, NoiseScale, check_batch_sizes
from tilefit.tuning.objective import check_objective
from tilefit.vocab import parse_routing

if TYPE_CHECKING:
    from tilefit.tuning.executor import Trial
    from tilefit.tuning.outlook import Outlook

# Fraction of device memory kept free. Not a measurement: a policy. The caching allocator
# fragments (PyTorch "CUDA memory management" notes: reserved > allocated), and batches later
# in training can be larger than the synthetic ones (longer sequences, more targets), which is
# how tuned runs OOM later. 10% is the default; pass margin=0 to pack the device full.
DEFAULT_MARGIN = 0.10
# Steps per fit trial: the optimizer state is created by the first step, so the second step is
# the first with weights + gradients + optimizer state + activations all live (the steady-state
# peak). Lightning runs 3 steps per trial (BatchSizeFinder steps_per_trial=3).
DEFAULT_STEPS_PER_TRIAL = 2

# A small batch of 8 and a big one of 64 (8 micro-batches): B_big / B_small = 8 keeps the
# tr(Sigma) difference well above the noise of one measurement; ten measurements of 64 are
# ten forward/backward passes' worth of samples at the big batch: 7 training steps at 64 where
# compute grows with the batch, 40 to 75 where every micro-batch costs a whole step
# (benchmarks/results_noise_scale_cpu.txt). Policy defaults; the interval in the result says
# whether they resolved the noise scale.
DEFAULT_BATCH_SIZES = (8, 64)
DEFAULT_MEASUREMENTS = 10


def _positive(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise TilefitError(
            f"{name} must be a positive whole number",
            expected="an integer >= 1 or None",
            given=repr(value),
            fix=f"pass {name}=<n> with n >= 1",
        )


@dataclass(frozen=True)
class TuneSearch:
    """What tune searches and how: the limits, the trials, the objective, the progress."""

    global_batch: int | None = None  # kept exact with accumulation; the batch divides it
    max_batch: int | None = None  # the largest batch to try
    memory_limit_bytes: int | None = None  # simulate a device of this size (also on the CPU)
    margin: float = DEFAULT_MARGIN  # fraction of memory kept free
    steps_per_trial: int = DEFAULT_STEPS_PER_TRIAL
    predicted_max_batch: int | None = None  # the first probe (default: the estimator's)
    predict: bool = True  # predict the first probe from fake-tensor traces of the step
    measure_throughput: bool = True  # time the candidates (else: the largest that fits)
    keep_modes: bool = False  # trials in the modules' own modes (else model.train())
    objective: str = "samples-per-s"  # or "time-to-loss" (tuning/objective.py)
    noise_scale: float | NoiseScale | None = None  # B_noise for time-to-loss (else measured)
    on_trial: Callable[[Trial], None] | None = None  # each Trial as it completes
    on_outlook: Callable[[Outlook], None] | None = None  # what tune expects, before trial 1
    # a mixture-of-experts model's tokens per expert in the first probe's prediction
    # (vocab.parse_routing: "balanced" or "skewed:F"); the trials run the real router
    routing: str = "balanced"

    def __post_init__(self) -> None:
        check_objective(self.objective, self.noise_scale)
        object.__setattr__(self, "routing", parse_routing(self.routing).name)
        for name in ("global_batch", "max_batch", "memory_limit_bytes", "steps_per_trial",
                     "predicted_max_batch"):
            _positive(name, getattr(self, name))
        if not 0 <= self.margin < 1:
            raise TilefitError("margin must be a fraction in [0, 1)", expected="e.g. 0.1",
                               given=repr(self.margin), fix="pass margin=0.1 to keep 10% free")


@dataclass(frozen=True)
class NoiseMeasure:
    """How noise_scale measures: the two batch sizes, how many big batches, the interval,
    the weights measured at and the modules' modes."""

    batch_sizes: tuple[int, int] | None = None  # (B_small, B_big); None: DEFAULT_BATCH_SIZES
    measurements: int = DEFAULT_MEASUREMENTS  # big batches measured (>= 2)
    confidence: float = DEFAULT_CONFIDENCE  # of the bootstrap interval
    checkpoint: str | Path | None = None  # weights loaded for the measurement only
    keep_modes: bool = False  # measure in the modules' own modes (else model.train())

    def __post_init__(self) -> None:
        check_batch_sizes(*(self.batch_sizes or DEFAULT_BATCH_SIZES))
        check_positive_int(self.measurements, "measurements must be a whole number >= 2",
                           expected="e.g. 10", fix="pass measurements=10")
        if self.measurements < 2:
            raise TilefitError("one measurement gives no interval",
                               expected="measurements >= 2", given=repr(self.measurements),
                               fix="pass measurements=10")
        if not 0 < self.confidence < 1:
            raise TilefitError("confidence must be a fraction in (0, 1)", expected="e.g. 0.9",
                               given=repr(self.confidence), fix="pass confidence=0.9")

    @property
    def sizes(self) -> tuple[int, int]:
        """(B_small, B_big), the defaults when none were given."""
        return self.batch_sizes or DEFAULT_BATCH_SIZES
