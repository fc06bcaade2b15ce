"""Affine sweep model: a few traces bound a whole micro-batch sweep.

For a fixed recipe, every figure of a training step is close to affine in the micro-batch b
(activations, FLOPs and GEMM time grow with b; weights, gradients and optimizer state do not)
and, for a stack of identical blocks, affine in the number of layers L. A figure is modelled as
f(b, L) = c0 + c1 b + c2 L + c3 b L (bilinear), fitted exactly through traces at two
micro-batches (and, with the layer lever, two layer counts): 2 or 4 traces per recipe.

Where the true figure is a maximum of affine pieces (the peak moves from the optimizer step at
small b to the end of the forward at large b), the line through the two END points of the
sweep lies above it in between (a chord of a convex function), so the model never predicts
less memory than the trace would inside the traced range; the chosen plan is traced in full to
confirm it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tilefit.errors import TilefitError
from tilefit.planner.sample import Sample


@dataclass(frozen=True)
class Line:
    """y = intercept + slope * x."""

    intercept: float
    slope: float

    def __call__(self, x: float) -> float:
        return self.intercept + self.slope * x

    @staticmethod
    def through(x0: float, y0: float, x1: float, y1: float) -> Line:
        if x1 == x0:
            if y0 != y1:
                raise TilefitError("two samples at the same point disagree",
                                   expected="one value per point", given=f"{y0} and {y1}",
                                   fix="this is a bug in tilefit's planner; please report it")
            return Line(y0, 0.0)
        slope = (y1 - y0) / (x1 - x0)
        return Line(y0 - slope * x0, slope)


@dataclass(frozen=True)
class SweepModel:
    """Bilinear model of every Sample metric in (micro_batch, layers).

    With one layer count (no layer lever) ``layers`` is ignored; with one micro-batch the
    figures are constant in b (a sweep of a single candidate).
    """

    samples: tuple[Sample, ...]

    def _bs(self) -> list[float]:
        return sorted({s.micro_batch for s in self.samples})

    def _ls(self) -> list[float]:
        return sorted({s.layers for s in self.samples})

    def _at(self, b: float, layers: float) -> Sample:
        for s in self.samples:
            if s.micro_batch == b and s.layers == layers:
                return s
        raise TilefitError("the sweep is missing a traced point",
                           expected=f"a sample at micro-batch {b}, {layers} layers",
                           given=str([(s.micro_batch, s.layers) for s in self.samples]),
                           fix="this is a bug in tilefit's planner; please report it")

    def predict(self, metric: str, micro_batch: float, layers: float | None = None) -> float:
        if metric == "micro_time_s" and all(s.micro_device_s is not None
                                            for s in self.samples):
            # the longer side of the micro-batch, each side extrapolated (Sample)
            return max(self.predict("micro_device_s", micro_batch, layers),
                       self.predict("micro_host_s", micro_batch, layers))
        bs, ls = self._bs(), self._ls()
        b0, b1 = bs[0], bs[-1]

        def along_b(layer: float) -> float:
            y0 = self._at(b0, layer).metrics()[metric]
            y1 = self._at(b1, layer).metrics()[metric]
            return Line.through(b0, y0, b1, y1)(micro_batch)

        if len(ls) == 1 or layers is None:
            return along_b(ls[-1])
        l0, l1 = ls[0], ls[-1]
        return Line.through(l0, along_b(l0), l1, along_b(l1))(layers)

    def predict_all(self, micro_batch: float, layers: float | None = None) -> dict[str, float]:
        names = self.samples[0].metrics().keys()
        return {m: self.predict(m, micro_batch, layers) for m in names}
