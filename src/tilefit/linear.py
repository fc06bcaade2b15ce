"""One fully-connected layer's training step: its three GEMMs at each batch size.

A linear layer y = x W^T with x of shape (T, in), T = batch x sequence tokens, runs three
GEMMs per training step (NVIDIA "Linear/Fully-Connected Layers User's Guide", Table 1;
docs/references.md, section 1):

| phase            | output     | M x N, reduction K |
|------------------|------------|--------------------|
| forward          | y  (T, out) | T x out, K = in   |
| activation_grad  | dx (T, in)  | T x in,  K = out  |
| weight_grad      | dW (out, in)| out x in, K = T   |

Each GEMM is analysed by `tilefit.gemm.analyze_gemm`, the one cost model. Pure arithmetic,
no torch: the `linear` command starts in a fraction of a second.

All three GEMMs move s*(T*in + in*out + T*out) bytes for 2*T*in*out FLOPs, so they share
one arithmetic intensity, 2 / (s * (1/T + 1/in + 1/out)), which grows with T. Whether the
layer is math-bound is therefore monotonic in the batch size, and the smallest math-bound
batch is found by bisection over every integer batch up to a cap, not just the given list.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from tilefit.dtypes import DType, parse_dtype
from tilefit.errors import TilefitError, check_positive_int
from tilefit.gemm import GemmAnalysis, analyze_gemm, round_up
from tilefit.hardware.device import Device
from tilefit.html_repr import HtmlRepr

PHASES: tuple[str, ...] = ("forward", "activation_grad", "weight_grad")

# The batch search stops at this many tokens per step (2**20 = 1,048,576): beyond it no
# single-GPU training step of one layer is realistic, and a layer still memory-bound there is
# memory-bound for any practical batch (its intensity limit 2/(s*(1/in+1/out)) is below the
# device's ops:byte ratio).
MAX_SEARCH_TOKENS = 2**20


@dataclass(frozen=True)
class LinearRow:
    """One GEMM of the training step at one batch size."""

    batch: int
    tokens: int  # batch x seq: the M dimension of forward / activation_grad, K of weight_grad
    phase: str  # "forward" | "activation_grad" | "weight_grad"
    gemm: GemmAnalysis

    def to_dict(self) -> dict[str, Any]:
        """The row's batch, tokens and phase, then the GEMM's fields; the GEMM's own ``batch``
        (its count of batched GEMMs, 1 here) is renamed ``gemm_batch`` so that it cannot
        overwrite the row's batch size."""
        gemm = self.gemm.to_dict()
        gemm["gemm_batch"] = gemm.pop("batch")
        return {**gemm, "batch": self.batch, "tokens": self.tokens, "phase": self.phase}


@dataclass(frozen=True)
class LinearTotal:
    """The three GEMMs of one batch size together."""

    batch: int
    tokens: int
    flops: int  # sum over the three phases: 3 x 2*T*in*out
    predicted_time_s: float  # sum of the three predicted times (the GEMMs run one after another)
    predicted_tflops: float  # flops / predicted_time_s / 1e12
    bound: str  # "math" when all three GEMMs are math-bound, else "memory"
    aligned: bool  # T is a multiple of the device's element multiple for this dtype

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class LinearRecommendations:
    """Batch sizes worth choosing, from searching every batch up to a cap."""

    min_math_bound_batch: int | None  # smallest batch with all three GEMMs math-bound
    min_math_bound_batch_aligned: int | None  # the same, rounded up to batch_multiple
    min_math_bound_batch_pow2: int | None  # the smallest aligned power of two that is math-bound
    batch_multiple: int  # batches that are multiples of this give an aligned T
    token_multiple: int  # the device's element multiple for this dtype (T should divide by it)
    aligned_batches: tuple[int, ...]  # the given batches whose T is aligned
    misaligned_batches: tuple[int, ...]  # the given batches whose T is not
    max_intensity: float  # the layer's intensity limit as T grows: 2 / (s*(1/in + 1/out))
    ops_per_byte: float  # the device's peak FLOP/s over bandwidth for this dtype
    search_max_batch: int  # the cap of the search (MAX_SEARCH_TOKENS // seq)
    notes: tuple[str, ...]  # plain-language advice derived from the fields above

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(aligned_batches=list(self.aligned_batches),
                 misaligned_batches=list(self.misaligned_batches), notes=list(self.notes))
        return d


@dataclass(frozen=True)
class LinearAnalysis(HtmlRepr):
    gpu: str
    dtype: str
    in_features: int
    out_features: int
    seq: int
    batches: tuple[int, ...]
    rows: tuple[LinearRow, ...]  # three per batch, in PHASES order
    totals: tuple[LinearTotal, ...]  # one per batch
    recommendations: LinearRecommendations

    def rows_for(self, batch: int) -> tuple[LinearRow, ...]:
        return tuple(r for r in self.rows if r.batch == batch)

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu,
            "dtype": self.dtype,
            "in_features": self.in_features,
            "out_features": self.out_features,
            "seq": self.seq,
            "batches": list(self.batches),
            "rows": [r.to_dict() for r in self.rows],
            "totals": [t.to_dict() for t in self.totals],
            "recommendations": self.recommendations.to_dict(),
        }


def phase_shapes(
    tokens: int, in_features: int, out_features: int
) -> dict[str, tuple[int, int, int]]:
    """(M, N, K) of each training GEMM (the FC-layer guide's Table 1)."""
    return {
        "forward": (tokens, out_features, in_features),
        "activation_grad": (tokens, in_features, out_features),
        "weight_grad": (out_features, in_features, tokens),
    }


def _check_positive(name: str, value: object) -> int:
    return check_positive_int(
        value, f"{name} must be a positive integer", expected="a whole number >= 1",
        fix=f"pass {name} as a count (features, samples or tokens), e.g. 4096")


def _phase_gemms(tokens: int, in_f: int, out_f: int, dt: DType, device: Device
                 ) -> dict[str, GemmAnalysis]:
    return {p: analyze_gemm(m, n, k, dt, device)
            for p, (m, n, k) in phase_shapes(tokens, in_f, out_f).items()}


def _all_math_bound(tokens: int, in_f: int, out_f: int, dt: DType, device: Device) -> bool:
    return all(g.bound == "math" for g in _phase_gemms(tokens, in_f, out_f, dt, device).values())


def _min_math_bound_batch(seq: int, in_f: int, out_f: int, dt: DType, device: Device,
                          max_batch: int) -> int | None:
    """Smallest batch in [1, max_batch] with all three GEMMs math-bound (bisection: the
    shared intensity grows with T, so math-boundness is monotonic in the batch)."""
    if not _all_math_bound(max_batch * seq, in_f, out_f, dt, device):
        return None
    lo, hi = 1, max_batch  # invariant: hi is math-bound; everything below lo is not
    while lo < hi:
        mid = (lo + hi) // 2
        if _all_math_bound(mid * seq, in_f, out_f, dt, device):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _next_pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


def analyze_linear(
    in_features: int,
    out_features: int,
    batches: int | list[int] | tuple[int, ...],
    *,
    seq: int = 1,
    dtype: str | DType = "fp16",
    device: Device,
) -> LinearAnalysis:
    """The three training GEMMs of an ``in_features -> out_features`` layer at each batch
    size (tokens T = batch x seq), their totals, and batch-size recommendations."""
    in_f = _check_positive("in_features", in_features)
    out_f = _check_positive("out_features", out_features)
    seq = _check_positive("seq", seq)
    batch_list = [batches] if isinstance(batches, int) else list(batches)
    if not batch_list:
        raise TilefitError(
            "no batch size given",
            expected="one or more positive integers",
            given="an empty list",
            fix="pass batch sizes, e.g. analyze_linear(..., batches=(8, 64, 256))",
        )
    given = tuple(dict.fromkeys(_check_positive("batch", b) for b in batch_list))
    dt = parse_dtype(dtype)
    device.peak(dt)  # a clear error now if the device lacks the dtype

    rows: list[LinearRow] = []
    totals: list[LinearTotal] = []
    token_multiple = device.multiple(dt)
    for b in given:
        t = b * seq
        gemms = _phase_gemms(t, in_f, out_f, dt, device)
        rows.extend(LinearRow(b, t, p, gemms[p]) for p in PHASES)
        flops = sum(g.flops for g in gemms.values())
        time_s = sum(g.predicted_time_s for g in gemms.values())
        totals.append(LinearTotal(
            batch=b, tokens=t, flops=flops, predicted_time_s=time_s,
            predicted_tflops=flops / time_s / 1e12,
            bound="math" if all(g.bound == "math" for g in gemms.values()) else "memory",
            aligned=t % token_multiple == 0,
        ))
    recs = _recommend(in_f, out_f, seq, dt, device, given)
    return LinearAnalysis(
        gpu=device.name, dtype=dt.name, in_features=in_f, out_features=out_f, seq=seq,
        batches=given, rows=tuple(rows), totals=tuple(totals), recommendations=recs,
    )


def _recommend(in_f: int, out_f: int, seq: int, dt: DType, device: Device,
               given: tuple[int, ...]) -> LinearRecommendations:
    token_multiple = device.multiple(dt)
    # T = batch*seq is a multiple of `token_multiple` exactly when batch is a multiple of
    # token_multiple / gcd(token_multiple, seq).
    batch_multiple = token_multiple // math.gcd(token_multiple, seq)
    max_batch = max(1, MAX_SEARCH_TOKENS // seq)
    b_min = _min_math_bound_batch(seq, in_f, out_f, dt, device, max_batch)
    b_aligned = None if b_min is None else round_up(b_min, batch_multiple)
    # batch_multiple is a power of two (a power-of-two token multiple over a gcd), so this
    # is the smallest power of two that is both aligned and math-bound
    b_pow2 = None if b_min is None else max(_next_pow2(b_min), batch_multiple)
    aligned = tuple(b for b in given if b % batch_multiple == 0)
    misaligned = tuple(b for b in given if b % batch_multiple)
    max_intensity = 2 / (dt.bytes * (1 / in_f + 1 / out_f))
    ratio = device.ops_per_byte(dt)

    notes: list[str] = []
    if b_min is None:
        notes.append(
            f"memory-bound at every batch up to {max_batch}: this layer's intensity tends to "
            f"{max_intensity:.1f} FLOP/B as the batch grows, below the {ratio:.1f} FLOP/B "
            f"{device.name} needs for {dt.name}; a wider layer or fusing it with its neighbours "
            "helps, a larger batch does not"
        )
    else:
        tokens_note = f" ({b_min * seq} tokens)" if seq > 1 else ""
        notes.append(
            f"all three GEMMs are math-bound from batch {b_min}{tokens_note}; the smallest "
            f"aligned choice is {b_aligned}"
            + (f", the smallest power of two {b_pow2}" if b_pow2 != b_aligned else "")
        )
    if misaligned:
        fixes = ", ".join(f"{b}->{round_up(b, batch_multiple)}" for b in misaligned)
        which = (f"batch {misaligned[0]} gives" if len(misaligned) == 1 else
                 f"batches {', '.join(map(str, misaligned))} give")
        notes.append(
            f"{which} a token count T not a multiple of {token_multiple} ({dt.name} on "
            f"{device.name}), and T is a dimension of all three GEMMs; "
            f"batches that are multiples of {batch_multiple} are aligned: {fixes}"
        )
    for name, dim in (("in_features", in_f), ("out_features", out_f)):
        if dim % token_multiple:
            notes.append(
                f"{name}={dim} is not a multiple of {token_multiple}; "
                f"{round_up(dim, token_multiple)} would be aligned"
            )
    return LinearRecommendations(
        min_math_bound_batch=b_min, min_math_bound_batch_aligned=b_aligned,
        min_math_bound_batch_pow2=b_pow2, batch_multiple=batch_multiple,
        token_multiple=token_multiple, aligned_batches=aligned, misaligned_batches=misaligned,
        max_intensity=max_intensity, ops_per_byte=ratio, search_max_batch=max_batch,
        notes=tuple(notes),
    )


def plot_batches(analysis: LinearAnalysis) -> tuple[int, ...]:
    """Batch sizes for a throughput-vs-batch figure: the given ones, the powers of two up to
    twice the largest given batch or the first math-bound one, and that batch."""
    recs = analysis.recommendations
    top = max(*analysis.batches, recs.min_math_bound_batch_aligned or 1)
    pts = {1 << i for i in range((2 * top).bit_length())}
    pts.update(analysis.batches)
    if recs.min_math_bound_batch is not None:
        pts.add(recs.min_math_bound_batch)
    step = recs.batch_multiple
    if 2 * top // step <= 64:  # aligned batches too, where that keeps the figure readable
        pts.update(range(step, 2 * top + 1, step))
    return tuple(sorted(p for p in pts if p <= 2 * top))
