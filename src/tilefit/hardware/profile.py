"""A measured profile of one device: what `tilefit calibrate` fitted, layered on the Device.

Pure data (no torch): the GEMM cost model reads the fitted terms from here, the store in
``tilefit.hardware.profiles`` saves and loads it as JSON.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tilefit.hardware.host import HostModel

# The GEMM time models a profile can hold.
# - "cpu-packing": t = overhead + (2MNK s_flop + MK s_a + KN s_b + MN s_c) / f_align, with
#   f_align = misaligned_factor when a dimension is off the device's multiple, else 1. The
#   MK and KN terms are the packing of A and B that BLAS libraries do before the inner
#   kernel, the MN term the write of C (Goto & van de Geijn, "Anatomy of High-Performance
#   Matrix Multiplication", ACM TOMS 34(3), 2008). Linear in its coefficients, so a weighted
#   least-squares fit recovers them.
# - "gpu-tile-wave": tilefit.gemm's tile/wave/alignment model; the fit replaces the device's
#   gemm_efficiency (per dtype) and launch_overhead_s.
MODEL_CPU = "cpu-packing"
MODEL_GPU = "gpu-tile-wave"


@dataclass(frozen=True)
class GemmFit:
    """The fitted GEMM terms for one dtype, with the fit's own error on its grid."""

    dtype: str
    model: str  # MODEL_CPU or MODEL_GPU
    call_overhead_s: float  # fixed time of one call (CPU) / one kernel launch (GPU)
    s_per_flop: float = 0.0  # cpu: inverse of the inner kernel's FLOP/s
    s_per_a_element: float = 0.0  # cpu: packing A (M x K), per element
    s_per_b_element: float = 0.0  # cpu: packing B (K x N), per element
    s_per_c_element: float = 0.0  # cpu: writing C (M x N), per element
    misaligned_factor: float = 1.0  # speed (<= 1) when a dim is off the device's multiple
    gemm_efficiency: float | None = None  # gpu: fraction of the dense peak
    shapes: int = 0  # measurements the fit used
    median_error: float = 0.0  # median |pred - meas| / meas on those shapes
    p90_error: float = 0.0

    def __post_init__(self) -> None:
        if self.model not in (MODEL_CPU, MODEL_GPU):
            raise ValueError(f"unknown GEMM model {self.model!r}")
        if not 0 < self.misaligned_factor <= 1:
            raise ValueError(f"misaligned_factor must be in (0, 1], got {self.misaligned_factor}")
        if self.gemm_efficiency is not None and not 0 < self.gemm_efficiency <= 1:
            raise ValueError(f"gemm_efficiency must be in (0, 1], got {self.gemm_efficiency}")
        values = (self.call_overhead_s, self.s_per_flop, self.s_per_a_element,
                  self.s_per_b_element, self.s_per_c_element)
        if any(v < 0 for v in values):
            raise ValueError("fitted GEMM coefficients must be >= 0")

    def cpu_time_s(self, m: int, n: int, k: int, aligned: bool) -> tuple[float, float, float]:
        """(total, math, memory) seconds of the cpu-packing model for one GEMM."""
        f = 1.0 if aligned else self.misaligned_factor
        math_s = 2 * m * n * k * self.s_per_flop / f
        mem_s = (m * k * self.s_per_a_element + k * n * self.s_per_b_element
                 + m * n * self.s_per_c_element) / f
        return self.call_overhead_s + math_s + mem_s, math_s, mem_s


@dataclass(frozen=True)
class Profile:
    """What calibration measured and fitted on one device."""

    device: str  # "cpu" or the catalog name ("h200")
    display_name: str  # the CPU model or the CUDA device name
    kind: str  # "cpu" or "cuda"
    created: str  # ISO 8601 UTC time of the calibration
    torch_version: str
    threads: int | None  # torch.get_num_threads() during calibration (cpu)
    peak_flops_per_s: dict[str, float] = field(hash=False)  # measured large-GEMM rate by dtype
    bandwidth_bytes_per_s: float = 0.0  # measured copy bandwidth (read + write bytes / time)
    call_overhead_s: float = 0.0  # measured time of a 1x1x1 GEMM call
    fresh_alloc_s_per_byte: float = 0.0  # cpu: first-touch cost of a fresh large buffer
    gemm: tuple[GemmFit, ...] = ()
    quick: bool = False
    duration_s: float = 0.0  # how long the calibration took
    path: str = ""  # where it was loaded from (not saved)
    # What else ran: load average and the OpenMP settings during the measurement (on a busy
    # machine, libgomp's default active wait stalls 2-thread GEMMs; tilefit.calibrate.measure).
    environment: dict[str, str] = field(default_factory=dict, hash=False)
    # cuda: eager PyTorch's per-op host issue costs measured on this machine
    # (tilefit.calibrate.host), which replace the shipped defaults for this GPU
    host: HostModel | None = None

    def fit_for(self, dtype: str) -> GemmFit | None:
        return next((g for g in self.gemm if g.dtype == dtype), None)

    def date(self) -> str:
        return self.created[:10]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["gemm"] = [asdict(g) for g in self.gemm]
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any], path: str = "") -> Profile:
        d = dict(data)
        d["gemm"] = tuple(GemmFit(**g) for g in d.get("gemm", ()))
        d["host"] = HostModel(**d["host"]) if d.get("host") else None
        d["peak_flops_per_s"] = {str(k): float(v) for k, v in d["peak_flops_per_s"].items()}
        d["path"] = path
        return cls(**d)
