"""One GEMM on one device: FLOPs, bytes, intensity, bound, alignment, tiles, waves, time.

Pure arithmetic, no torch: C (M x N) = A (M x K) @ B (K x N).

The time model (NVIDIA "Matrix Multiplication Background" and "Linear/Fully-Connected
Layers" user's guides; docs/references.md, sections 1-4):

- math time: the output is cut into tiles (cuBLAS's tile set below); tiles run in waves of
  one tile per SM, so a wave costs the time of one tile's 2*Tm*Tn*K FLOPs at the per-SM
  rate. That rate is the dense peak times the device's large-GEMM efficiency, the tile
  shape's relative efficiency (bigger tiles reuse more data), and an alignment factor for
  dimensions off the 16-/128-byte multiple. Tile quantization (padding of the last tile)
  and wave quantization (a partly filled last wave) fall out of the counting.
- each wave may also pay a fixed time besides its multiply-adds (Device.gemm_tile_latency_s:
  pipeline prologue and epilogue, Stream-K's fixed cost per CTA;
  docs/references.md, section 27). It is 0: fitted on the public GPU corpus, it did not earn
  its place.
- epilogue time: a tile stores its Tm x Tn outputs after its main loop ends, and that store
  does not overlap the tile's multiply-adds; all tiles' stores together take the output's
  bytes (fp32 partials under split-K) at the device's achieved bandwidth. It weighs
  ops_per_byte / K against the main loop: a third at K = 768 on an H100, a few percent at
  K = 8192 (docs/references.md, section 28).
- memory time: each operand read once and the output written once, at the device's
  achieved bandwidth.
- time = max(math + epilogue, memory) + one kernel launch. Small outputs may use split-K (the
  K loop cut across more tiles, partial results reduced in fp32): it is a candidate like a
  tile.
- cuBLAS's heuristic is modelled as picking the candidate of least time.

By construction the delivered FLOP/s never exceed the peak: every factor is <= 1 and the
padded work is >= the real work.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from tilefit.dtypes import DType, parse_dtype
from tilefit.errors import check_positive_int
from tilefit.hardware.device import Device
from tilefit.html_repr import HtmlRepr

if TYPE_CHECKING:
    from tilefit.hardware.profile import GemmFit

# cuBLAS tile shapes (Tm x Tn), from the Matrix Multiplication Background guide's list of
# "typical tile dimensions": 256x128, 128x256, 128x128, 256x64, 64x256, 128x64, 64x128, 64x64.
# Relative efficiency per tile: the guide says larger tiles are more efficient (more data
# reuse per loaded byte) without giving numbers; these values follow the tile's
# operand reuse, Tm*Tn/(Tm+Tn) relative to the 256x128 tile (85.3), mapped onto the
# 0.7-1.0 range that the guide's Figure (tile size vs. performance, A100) shows between
# the smallest and largest tiles. `tilefit calibrate` refits them per device.
TILES: tuple[tuple[int, int], ...] = (
    (256, 128),
    (128, 256),
    (128, 128),
    (256, 64),
    (64, 256),
    (128, 64),
    (64, 128),
    (64, 64),
)
_REUSE_MAX = 256 * 128 / (256 + 128)
_REUSE_MIN = 64 * 64 / (64 + 64)
TILE_EFF_MIN = 0.70  # relative efficiency of the 64x64 tile (guide's tile-size figure)


def tile_shape_efficiency(tm: int, tn: int) -> float:
    """Relative per-SM throughput of a Tm x Tn tile: 1.0 for 256x128, 0.7 for 64x64."""
    reuse = tm * tn / (tm + tn)
    return TILE_EFF_MIN + (1 - TILE_EFF_MIN) * (reuse - _REUSE_MIN) / (_REUSE_MAX - _REUSE_MIN)


SPLIT_K: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16)
MIN_K_PER_SPLIT = 256  # split-K pieces shorter than this are not worth the reduction pass

# Alignment factor by the largest power-of-two byte multiple a dimension has (capped at the
# device's alignment rule). Sources:
# - 128 B on A100+ / 16 B elsewhere: full speed (the guide's rule).
# - 16-64 B on A100-class parts: the guide says larger multiples "can further improve
#   efficiency"; EleutherAI (Anthony et al. 2024) measure a few percent between multiples
#   of 8 and 64 for fp16: 0.93-0.97 here.
# - 4 B (an even fp16 dim not a multiple of 8): H100, d_ff 10922 ran at 273 TFLOP/s vs.
#   398 at 10944 (docs/references.md, section 4): 0.69.
# - 8 B: between the 4 B and 16 B figures: 0.8.
# - 2 B / 1 B (odd fp16 or int8 dims): the guide's Figure 2 (cuBLAS 11) shows odd K slower
#   than even K; 0.5 here, refined by calibration.
_ALIGN_FACTOR = {128: 1.0, 64: 0.97, 32: 0.95, 16: 0.93, 8: 0.80, 4: 0.69, 2: 0.50, 1: 0.45}
# fp32 runs on the CUDA cores, where misalignment only costs vectorised 16-byte loads.
_FP32_MISALIGNED_FACTOR = 0.90


def alignment_bytes_of(dim: int, dtype: DType, cap: int) -> int:
    """Largest power of two (<= cap) that divides dim * element size, in bytes."""
    nbytes = dim * dtype.bytes
    return min(nbytes & -nbytes, cap)


def alignment_factor(dim: int, dtype: DType, device: Device) -> float:
    """Speed factor (<= 1) for a GEMM dimension of ``dim`` elements on ``device``."""
    a = alignment_bytes_of(dim, dtype, device.alignment_bytes)
    if a >= device.alignment_bytes:
        return 1.0
    if not dtype.tensor_core:
        return 1.0 if a >= 16 else _FP32_MISALIGNED_FACTOR
    return _ALIGN_FACTOR[a]


def round_up(x: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` (>= 1) that is >= ``x``."""
    return -(-x // multiple) * multiple


@dataclass(frozen=True)
class DimAlignment:
    multiple: int  # the element multiple the device and dtype want
    aligned: bool
    suggested: int  # the next aligned value >= the input
    factor: float  # modelled speed factor of this dimension (1.0 when aligned)


@dataclass(frozen=True)
class GemmAnalysis(HtmlRepr):
    m: int
    n: int
    k: int
    dtype: str
    gpu: str
    flops: int
    bytes: int
    arithmetic_intensity: float  # FLOP per byte moved
    ops_per_byte: float  # the device's peak FLOP/s over bandwidth
    bound: str  # "memory" or "math" (intensity against ops_per_byte)
    alignment: dict[str, DimAlignment]
    tile: tuple[int, int]  # the tile the model assumes (the fastest candidate)
    split_k: int
    tiles: int  # thread blocks launched (tiles x split-K)
    waves: int
    tile_efficiency: float  # useful / padded output elements
    wave_efficiency: float  # tiles / (waves x SMs)
    alignment_efficiency: float  # the slowest dimension's factor
    math_time_s: float  # the waves' main loops
    memory_time_s: float
    predicted_time_s: float
    predicted_tflops: float
    peak_tflops: float
    error: str | None  # set when the kernel would refuse to run (fp8 misaligned)
    verdict: str
    batch: int = 1  # independent GEMMs of this shape in one call (bmm)
    epilogue_time_s: float = 0.0  # output stores after the main loops (not overlapped)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tile"] = list(self.tile)
        return d


def check_dims(**dims: int) -> None:
    for name, value in dims.items():
        check_positive_int(value, f"GEMM dimension {name} must be a positive integer",
                           expected="an integer >= 1",
                           fix=f"pass a whole number of elements for {name}")


def gemm_flops(m: int, n: int, k: int) -> int:
    """2*M*N*K: one multiply and one add per inner-product term."""
    return 2 * m * n * k


def gemm_bytes(m: int, n: int, k: int, dtype: DType) -> int:
    """Ideal traffic: A and B read once, C written once."""
    return dtype.bytes * (m * k + k * n + m * n)


@dataclass(frozen=True)
class _Candidate:
    """One tile shape and split-K, timed."""

    time_s: float
    math_s: float  # the waves' main loops (and the per-wave latency)
    epilogue_s: float  # the tiles' output stores, not overlapped with their main loops
    mem_s: float
    ctas: int
    waves: int


def _candidate_time(
    m: int, n: int, k: int, tm: int, tn: int, split: int, dtype: DType, device: Device,
    rate_per_sm: float, bw: float, align: float, batch: int = 1, mem_align: float = 1.0,
) -> _Candidate:
    tiles_mn = math.ceil(m / tm) * math.ceil(n / tn) * batch
    ctas = tiles_mn * split
    waves = math.ceil(ctas / device.sms)
    k_piece = math.ceil(k / split)
    mainloop_s = 2 * tm * tn * k_piece / (rate_per_sm * tile_shape_efficiency(tm, tn) * align)
    math_s = waves * (mainloop_s + device.gemm_tile_latency_s)
    out_bytes = 4 if split > 1 else dtype.bytes  # split-K pieces store fp32 partials
    epilogue_s = ctas * tm * tn * out_bytes / bw
    traffic = batch * gemm_bytes(m, n, k, dtype)
    launches = 1
    if split > 1:
        traffic += 2 * split * batch * m * n * 4  # fp32 partials written, then read to reduce
        launches = 2
    mem_s = traffic / (bw * mem_align)
    total = max(math_s + epilogue_s, mem_s) + launches * device.launch_overhead_s
    return _Candidate(total, math_s, epilogue_s, mem_s, ctas, waves)


@dataclass(frozen=True)
class _Problem:
    """What is known of a GEMM before any time model: sizes, work, traffic, alignment."""

    m: int
    n: int
    k: int
    batch: int
    dt: DType
    device: Device
    peak: float  # the device's dense peak FLOP/s in dt
    flops: int
    nbytes: int
    alignment: dict[str, DimAlignment]
    error: str | None  # set when the kernel would refuse to run (fp8 misaligned)

    @property
    def intensity(self) -> float:
        return self.flops / self.nbytes

    @property
    def ops_per_byte(self) -> float:
        return self.peak / self.device.bandwidth_bytes_per_s

    @property
    def bound(self) -> str:
        return "memory" if self.intensity < self.ops_per_byte else "math"


@dataclass(frozen=True)
class _Kernel:
    """The time model's pick: the fastest tile and split-K on a GPU, one BLAS call on a CPU."""

    tile: tuple[int, int]
    split_k: int
    tiles: int
    waves: int
    tile_efficiency: float
    wave_efficiency: float
    alignment_efficiency: float
    math_time_s: float
    epilogue_time_s: float
    memory_time_s: float
    predicted_time_s: float
    predicted_tflops: float


def analyze_gemm(m: int, n: int, k: int, dtype: str | DType, device: Device, *,
                 batch: int = 1) -> GemmAnalysis:
    """Analyse C(MxN) = A(MxK) B(KxN) in ``dtype`` on ``device``; ``batch`` independent
    GEMMs of that shape (a bmm) share the SMs."""
    check_dims(m=m, n=n, k=k, batch=batch)
    dt = parse_dtype(dtype)
    peak = device.peak(dt)
    alignment = _alignment(m, n, k, dt, device)
    fit = None
    if device.kind == "cpu":  # --- CPU path: packing model, no tiles or waves (gemm_cpu.py)
        from tilefit.gemm_cpu import cpu_fit

        fit = cpu_fit(device, dt)
        # the fitted factor replaces the GPU table's
        alignment = {name: replace(a, factor=1.0 if a.aligned else fit.misaligned_factor)
                     for name, a in alignment.items()}
    problem = _Problem(m, n, k, batch, dt, device, peak, flops=batch * gemm_flops(m, n, k),
                       nbytes=batch * gemm_bytes(m, n, k, dt), alignment=alignment,
                       error=_fp8_error(dt, m, n, k))
    kernel = _gpu_kernel(problem) if fit is None else _cpu_kernel(problem, fit)
    return _analysis(problem, kernel)


def _alignment(m: int, n: int, k: int, dt: DType, device: Device) -> dict[str, DimAlignment]:
    mult = device.multiple(dt)
    return {
        name: DimAlignment(
            multiple=mult,
            aligned=v % mult == 0,
            suggested=round_up(v, mult),
            factor=alignment_factor(v, dt, device),
        )
        for name, v in (("m", m), ("n", n), ("k", k))
    }


def _fp8_error(dt: DType, m: int, n: int, k: int) -> str | None:
    if dt.name != "fp8" or not any(v % 16 for v in (m, n, k)):
        return None
    return (
        "fp8 GEMMs need every dimension divisible by 16 (torch._scaled_mm and Transformer "
        "Engine refuse other shapes): pad to "
        + ", ".join(f"{n_}={round_up(v, 16)}" for n_, v in
                    (("m", m), ("n", n), ("k", k)) if v % 16)
    )


def _gpu_kernel(p: _Problem) -> _Kernel:
    """The candidate (tile x split-K) of least time, as cuBLAS's heuristic is modelled."""
    m, n, k, batch, device = p.m, p.n, p.k, p.batch, p.device
    align = min(a.factor for a in p.alignment.values())
    # Streaming operands needs only 16-byte vector loads; the 128-byte rule of A100-class
    # parts is about Tensor Core tiles. So the memory-bound time pays for misalignment only
    # below 16 bytes.
    mem_align = min(
        1.0 if alignment_bytes_of(v, p.dt, 16) >= 16 else a.factor
        for v, a in zip((m, n, k), p.alignment.values(), strict=True)
    )
    rate_per_sm = p.peak * _gemm_efficiency(device, p.dt) / device.sms
    bw = device.bandwidth_bytes_per_s * device.bandwidth_efficiency
    best: tuple[_Candidate, int, int, int] | None = None
    for tm, tn in TILES:
        for split in SPLIT_K:
            if split > 1 and (k / split < MIN_K_PER_SPLIT or
                              batch * math.ceil(m / tm) * math.ceil(n / tn) >= device.sms):
                continue
            c = _candidate_time(
                m, n, k, tm, tn, split, p.dt, device, rate_per_sm, bw, align, batch, mem_align)
            if best is None or c.time_s < best[0].time_s:
                best = (c, tm, tn, split)
    assert best is not None
    c, tm, tn, split = best
    return _Kernel(
        tile=(tm, tn), split_k=split, tiles=c.ctas, waves=c.waves,
        tile_efficiency=(m * n) / (round_up(m, tm) * round_up(n, tn)),
        wave_efficiency=c.ctas / (c.waves * device.sms), alignment_efficiency=align,
        math_time_s=c.math_s, epilogue_time_s=c.epilogue_s, memory_time_s=c.mem_s,
        predicted_time_s=c.time_s, predicted_tflops=p.flops / c.time_s / 1e12,
    )


def _gemm_efficiency(device: Device, dt: DType) -> float:
    """The device's large-GEMM efficiency (scaled by its CUDA-core factor for fp32 without
    Tensor Cores); a calibration profile's per-dtype value wins."""
    if device.profile is not None:
        fit = device.profile.fit_for(dt.name)
        if fit is not None and fit.gemm_efficiency is not None:
            return fit.gemm_efficiency
    if not dt.tensor_core:
        return min(1.0, device.gemm_efficiency * device.simt_gemm_factor)
    return device.gemm_efficiency


def _cpu_kernel(p: _Problem, fit: GemmFit) -> _Kernel:
    """One call of the BLAS, no tiles or waves (tilefit.gemm_cpu); a bmm of ``batch`` GEMMs
    pays the call overhead once and the work ``batch`` times."""
    aligned = all(a.aligned for a in p.alignment.values())
    _, math_s, mem_s = fit.cpu_time_s(p.m, p.n, p.k, aligned)
    math_s, mem_s = p.batch * math_s, p.batch * mem_s
    t = fit.call_overhead_s + math_s + mem_s
    return _Kernel(
        tile=(p.m, p.n), split_k=1, tiles=1, waves=1, tile_efficiency=1.0, wave_efficiency=1.0,
        alignment_efficiency=1.0 if aligned else fit.misaligned_factor,
        math_time_s=math_s, epilogue_time_s=0.0, memory_time_s=mem_s, predicted_time_s=t,
        predicted_tflops=p.flops / t / 1e12,
    )


def _analysis(p: _Problem, kern: _Kernel) -> GemmAnalysis:
    return GemmAnalysis(
        m=p.m, n=p.n, k=p.k, dtype=p.dt.name, gpu=p.device.name, flops=p.flops,
        bytes=p.nbytes, arithmetic_intensity=p.intensity, ops_per_byte=p.ops_per_byte,
        bound=p.bound, alignment=p.alignment, tile=kern.tile, split_k=kern.split_k,
        tiles=kern.tiles, waves=kern.waves, tile_efficiency=kern.tile_efficiency,
        wave_efficiency=kern.wave_efficiency, alignment_efficiency=kern.alignment_efficiency,
        math_time_s=kern.math_time_s, epilogue_time_s=kern.epilogue_time_s,
        memory_time_s=kern.memory_time_s,
        predicted_time_s=kern.predicted_time_s, predicted_tflops=kern.predicted_tflops,
        peak_tflops=p.peak / 1e12, error=p.error, verdict=_verdict(p, kern),
        batch=p.batch,
    )


def _verdict(p: _Problem, kern: _Kernel) -> str:
    """One line: what limits this GEMM and the fix."""
    if p.error:
        return "ERROR: " + p.error
    off = {n: al for n, al in p.alignment.items() if not al.aligned}
    parts: list[str] = []
    if off:
        fixes = ", ".join(f"{n}={al.suggested}" for n, al in off.items())
        parts.append(
            f"{', '.join(off)} off the multiple of {next(iter(off.values())).multiple} "
            f"for {p.dt.name} on {p.device.name} (runs at {kern.alignment_efficiency:.0%} "
            f"speed): pad to {fixes}"
        )
    if p.bound == "memory":
        small, value = min((("m", p.m), ("n", p.n), ("k", p.k)), key=lambda kv: kv[1])
        parts.append(
            f"memory-bound (intensity {p.intensity:.1f} < {p.ops_per_byte:.1f} "
            f"FLOP/B): the smallest dimension, {small}={value}, limits data reuse; for a linear "
            "layer, more tokens per step (batch x sequence) raise it"
        )
    if kern.wave_efficiency < 0.75 and kern.waves <= 4:
        parts.append(
            f"last wave {kern.wave_efficiency:.0%} full ({kern.tiles} tiles on "
            f"{kern.tiles / (kern.waves * kern.wave_efficiency):.0f} SMs x {kern.waves} waves)"
        )
    if kern.tile_efficiency < 0.9:
        parts.append(
            f"tile quantization wastes {1 - kern.tile_efficiency:.0%} of the output tiles")
    if parts:
        return "; ".join(parts)
    peak_tflops = p.peak / 1e12
    if p.device.kind == "cpu":  # CPU rates read in GFLOP/s, not TFLOP/s
        return (f"efficient: aligned, {kern.predicted_tflops * 1e3:.0f} of "
                f"{peak_tflops * 1e3:.0f} GFLOP/s")
    return (f"efficient: math-bound, aligned, {kern.predicted_tflops:.0f} of "
            f"{peak_tflops:.0f} TFLOP/s")
