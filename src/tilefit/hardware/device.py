"""The Device: the hardware facts the rules and the cost model need, as one frozen dataclass."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from types import MappingProxyType
from typing import Any

from tilefit.dtypes import DTYPE_NAMES, DType, parse_dtype
from tilefit.errors import TilefitError
from tilefit.hardware.host import DEFAULT_HOST, HostModel
from tilefit.hardware.profile import Profile
from tilefit.html_repr import HtmlRepr

GIB = 1024**3
TB = 1e12  # datasheets quote TFLOP/s and TB/s in powers of ten
GB = 1e9

# Tensor Core alignment: 16 bytes in general, 128 bytes on A100-class and later data-center
# parts (NVIDIA "Matrix Multiplication Background" user's guide, section "Tensor Core
# Requirements", Table 1).
ALIGN_GENERAL_BYTES = 16
ALIGN_DATACENTER_BYTES = 128
# The CUDA context of a PyTorch process after a training step's kernels have loaded: 512 MiB
# with lazy module loading (CUDA >= 11.7, PyTorch >= 1.13's default). Published readings:
# 254 MiB (lazy, before a step) to 426 MiB (RTX 6000 Ada, CUDA 13.0, context alone); 616 MiB
# to 1341 MiB with every kernel loaded eagerly (older CUDA, a V100); docs/references.md, section 7
# (benchmarks/reserved_corpus/context.jsonl). A spec file's cuda_context_bytes gives a
# machine's own measured figure.
CUDA_CONTEXT_BYTES = 512 * 1024**2

# The fixed time one wave of GEMM tiles pays besides its multiply-adds (pipeline prologue and
# epilogue), the same number of seconds on every GPU; fitted on the public GPU corpus
# (docs/references.md, section 27).
GEMM_TILE_LATENCY_S = 0.0


@dataclass(frozen=True)
class Device(HtmlRepr):
    """One accelerator (or the CPU), with the source of its numbers.

    Peaks are dense (no 2:4 sparsity). A dtype absent from ``peak_flops_per_s`` is one the
    part cannot run natively (bf16 on V100 and T4, fp8 before Ada/Hopper).
    """

    name: str  # canonical catalog name, e.g. "a100-80gb"
    display_name: str  # as the vendor writes it, e.g. "NVIDIA A100 SXM4 80GB"
    architecture: str  # "Ampere", "Hopper", ...
    compute_capability: tuple[int, int] | None  # (8, 0) for sm80; None for the CPU
    sms: int  # streaming multiprocessors (CPU: cores), the unit GEMM tiles are spread over
    memory_bytes: int  # device memory capacity
    bandwidth_bytes_per_s: float  # peak memory bandwidth (datasheet)
    peak_flops_per_s: Mapping[str, float] = field(hash=False)  # dtype name -> dense FLOP/s
    alignment_bytes: int = ALIGN_GENERAL_BYTES  # GEMM dims want multiples of this many bytes
    source: str = ""  # where the numbers come from
    aliases: tuple[str, ...] = ()
    # Cost-model terms (not datasheet facts): the fraction of peak that the best GEMM kernels
    # reach on large aligned shapes, the fraction of peak bandwidth a streaming kernel reaches,
    # and the fixed time of one kernel launch. Each entry in the catalog cites its source;
    # `tilefit calibrate` replaces them with measured values.
    gemm_efficiency: float = 0.80
    bandwidth_efficiency: float = 0.90
    launch_overhead_s: float = 4e-6
    # fp32 GEMMs on the CUDA cores (no Tensor Cores, TF32 off) reach a different share of
    # their peak than Tensor Core GEMMs do of theirs: this factor scales gemm_efficiency for
    # them (capped at 1). Per architecture, from published sweeps
    # (docs/references.md, section 28): Ada counts its INT32-shared lanes in the fp32 peak.
    simt_gemm_factor: float = 1.0
    # Fixed seconds each wave of GEMM tiles pays besides its multiply-adds and its output
    # stores (those tilefit.gemm costs from the bandwidth): the pipeline prologue, the first
    # K-stages loaded before any MMA. tilefit.gemm adds it once per wave
    # (docs/references.md, section 27).
    gemm_tile_latency_s: float = GEMM_TILE_LATENCY_S
    # the host that issues the device's ops (eager PyTorch): seconds per op, per launch
    host: HostModel = DEFAULT_HOST
    kind: str = "cuda"  # "cuda" or "cpu"
    # CPU only: a newly allocated buffer of at least fresh_alloc_min_bytes costs its first-touch
    # page faults (glibc serves it with mmap and returns it to the OS on free; the CUDA caching
    # allocator reuses blocks, so GPUs pay nothing here). Measured by the CPU probe.
    fresh_alloc_s_per_byte: float = 0.0
    fresh_alloc_min_bytes: int = 0
    notes: str = ""
    # The links between GPUs (docs/references.md, section 20): each GPU's unidirectional
    # bandwidth to the others in its node (NVLink, or PCIe without it; datasheets quote
    # NVLink bidirectional, half of it each way), the share of it NCCL's collectives reach
    # (nccl-tests' bus bandwidth), GPUs per node, and each GPU's network bandwidth to other
    # nodes (0: multi-node not described). 0 link bandwidth (the CPU): collectives are
    # costed at the device's memory bandwidth.
    link_name: str = ""
    link_bytes_per_s: float = 0.0
    link_efficiency: float = 0.80
    gpus_per_node: int = 8
    network_bytes_per_s: float = 0.0
    # what a PyTorch process holds on the GPU outside the caching allocator (CUDA_CONTEXT_BYTES)
    cuda_context_bytes: int = CUDA_CONTEXT_BYTES
    # the training machine's host memory (CPU RAM per node): what `tilefit plan` judges a
    # plan's CPU memory against (ZeRO-Offload's optimizer state, DeepSpeed's copies while it
    # initialises); None: not given, the planner then takes this machine's RAM
    host_memory_bytes: int | None = None
    # The measured profile from `tilefit calibrate`, when one was found for this device; the
    # GEMM model then uses its fitted terms (tilefit.hardware.profile).
    profile: Profile | None = field(default=None, hash=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.sms <= 0 or self.memory_bytes <= 0 or self.bandwidth_bytes_per_s <= 0:
            raise ValueError(f"{self.name}: sms, memory_bytes and bandwidth must be positive")
        if self.alignment_bytes not in (ALIGN_GENERAL_BYTES, ALIGN_DATACENTER_BYTES):
            raise ValueError(f"{self.name}: alignment_bytes must be 16 or 128")
        unknown = set(self.peak_flops_per_s) - set(DTYPE_NAMES)
        if unknown:
            raise ValueError(f"{self.name}: unknown dtypes in peak_flops_per_s: {unknown}")
        if "fp32" not in self.peak_flops_per_s:
            raise ValueError(f"{self.name}: an fp32 peak is required")
        if any(v <= 0 for v in self.peak_flops_per_s.values()):
            raise ValueError(f"{self.name}: peaks must be positive")
        for name in ("gemm_efficiency", "bandwidth_efficiency"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{self.name}: {name} must be in (0, 1], got {value}")
        if self.simt_gemm_factor <= 0:
            raise ValueError(f"{self.name}: simt_gemm_factor must be > 0")
        for name in ("launch_overhead_s", "gemm_tile_latency_s", "cuda_context_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{self.name}: {name} must be >= 0")
        if self.host_memory_bytes is not None and self.host_memory_bytes <= 0:
            raise ValueError(f"{self.name}: host_memory_bytes must be positive, got "
                             f"{self.host_memory_bytes}")
        object.__setattr__(self, "peak_flops_per_s", MappingProxyType(dict(self.peak_flops_per_s)))

    def supports(self, dtype: str | DType) -> bool:
        return parse_dtype(dtype).name in self.peak_flops_per_s

    def peak(self, dtype: str | DType) -> float:
        """Dense peak FLOP/s for ``dtype``; a clear error if the part lacks it."""
        d = parse_dtype(dtype)
        try:
            return self.peak_flops_per_s[d.name]
        except KeyError:
            have = ", ".join(self.peak_flops_per_s)
            raise TilefitError(
                f"{self.display_name} has no {d.name} math",
                expected=f"a dtype this GPU runs: {have}",
                given=d.name,
                fix=f"use analyze_gemm(..., dtype={_fallback(self, d)!r}) on this GPU, or "
                f"choose a GPU that has {d.name}",
            ) from None

    def multiple(self, dtype: str | DType) -> int:
        """The element multiple GEMM dims want: alignment bytes / element size."""
        return max(1, self.alignment_bytes // parse_dtype(dtype).bytes)

    def ops_per_byte(self, dtype: str | DType) -> float:
        """Peak FLOP/s over bandwidth: below this arithmetic intensity a kernel is memory-bound."""
        return self.peak(dtype) / self.bandwidth_bytes_per_s

    def to_dict(self) -> dict[str, Any]:
        # not dataclasses.asdict: it deep-copies fields and a mappingproxy cannot be copied
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["peak_flops_per_s"] = dict(self.peak_flops_per_s)
        d["compute_capability"] = (
            None if self.compute_capability is None else ".".join(map(str, self.compute_capability))
        )
        d["aliases"] = list(self.aliases)
        d["profile"] = None if self.profile is None else self.profile.to_dict()
        d["host"] = asdict(self.host)
        return d


def _fallback(device: Device, wanted: DType) -> str:
    for name in ("bf16", "fp16", "tf32", "fp32"):
        if name in device.peak_flops_per_s and name != wanted.name:
            return name
    return "fp32"
