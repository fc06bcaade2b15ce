"""The CPU of this machine as a Device: cores and memory read from the OS, peak FLOP/s,
bandwidth and per-call overhead measured (a short probe, once per process) or taken from the
calibration profile that device lookup passes in.
"""

from __future__ import annotations

import functools
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

from tilefit.hardware.device import ALIGN_GENERAL_BYTES, Device
from tilefit.hardware.profile import Profile

# CPU GEMM alignment: 16 bytes, one SSE register (4 fp32 / 8 bf16), the smallest vector the
# BLAS inner kernels load (Intel 64 and IA-32 Architectures Optimization Reference Manual,
# "data alignment": 16-byte alignment for SSE, 32 for AVX, 64 for AVX-512). The Device admits
# 16 or 128 bytes; 16 is the honest floor. On this machine's MKL/oneDNN the measured penalty
# for dimensions off it is small (fp32 K=1023 vs 1024: within 2%; bf16 odd dims: 3-10%);
# `tilefit calibrate` fits it per dtype as GemmFit.misaligned_factor.
CPU_ALIGNMENT_BYTES = ALIGN_GENERAL_BYTES

# Probe sizes: a 1024^3 GEMM (2.1 GFLOP, ~10 ms at 200 GFLOP/s fp32) is large enough to reach
# the BLAS kernel's full rate on a few cores and short enough for a sub-second probe; the copy
# is 4x the last-level cache so it streams from DRAM.
PROBE_GEMM_DIM = 1024
PROBE_REPS = 5
DEFAULT_LLC_BYTES = 32 * 1024**2  # used when /sys does not say


@dataclass(frozen=True)
class CpuProbe:
    peak_flops_per_s: dict[str, float]
    bandwidth_bytes_per_s: float
    call_overhead_s: float
    duration_s: float
    fresh_alloc_s_per_byte: float = 0.0


def cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def total_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 8 * 1024**3


def last_level_cache_bytes() -> int:
    """The largest CPU cache in bytes (Linux /sys), or 32 MiB when unknown."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    best = 0
    try:
        for idx in base.glob("index*"):
            text = (idx / "size").read_text().strip().upper()
            mult = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1:], 1)
            best = max(best, int(text.rstrip("KMG")) * mult)
    except (OSError, ValueError):
        best = 0
    return best or DEFAULT_LLC_BYTES


def _best_time(fn, reps: int) -> float:  # type: ignore[no-untyped-def]
    """The least of ``reps`` timed calls after a warm-up (thread pool start, kernel choice,
    first touch of the output). A peak is the best the machine delivers, and the least time
    is the one another process on a shared machine did not disturb."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


@functools.lru_cache(maxsize=1)
def probe_cpu() -> CpuProbe:
    """Measure this CPU: large-GEMM FLOP/s (fp32, bf16), copy bandwidth, per-call overhead."""
    import torch

    start = time.perf_counter()
    d = PROBE_GEMM_DIM
    peaks: dict[str, float] = {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a = torch.randn(d, d).to(dt)
        b = torch.randn(d, d).to(dt)
        out = torch.empty(d, d, dtype=dt)
        t = _best_time(lambda a=a, b=b, out=out: torch.mm(a, b, out=out), PROBE_REPS)
        peaks[name] = 2 * d**3 / t  # 2*M*N*K FLOPs per GEMM
    n_elem = 4 * last_level_cache_bytes() // 4  # fp32 elements in 4x the LLC
    src = torch.ones(n_elem)
    dst = torch.empty_like(src)
    t = _best_time(lambda: dst.copy_(src), PROBE_REPS)
    bandwidth = 2 * src.numel() * 4 / t  # each byte read once and written once
    one_a, one_b = torch.ones(1, 1), torch.ones(1, 1)
    overhead = _best_time(lambda: torch.mm(one_a, one_b), 201)
    fresh = fresh_alloc_s_per_byte()
    return CpuProbe(peaks, bandwidth, overhead, time.perf_counter() - start, fresh)


# glibc malloc serves requests above its mmap threshold with mmap and unmaps them on free; the
# threshold adapts upward to at most DEFAULT_MMAP_THRESHOLD_MAX = 32 MiB on 64-bit systems
# (glibc malloc/malloc.c, mallopt(3)). So every allocation of 32 MiB or more is fresh memory
# whose pages fault on first touch; smaller ones are reused from the heap.
FRESH_ALLOC_MIN_BYTES = 32 * 1024**2
FRESH_PROBE_BYTES = 128 * 1024**2


@functools.lru_cache(maxsize=1)
def fresh_alloc_s_per_byte() -> float:
    """``measure_fresh_alloc_s_per_byte``, measured once per process (the probe's figure, and
    the fallback for a profile that lacks one)."""
    return measure_fresh_alloc_s_per_byte()


def measure_fresh_alloc_s_per_byte() -> float:
    """Seconds per byte that first-touch page faults add to writing a fresh large buffer: the
    best time to allocate and fill a 128 MiB tensor, minus the best time to fill one that is
    already mapped, over its size."""
    import torch

    n = FRESH_PROBE_BYTES // 4
    warm = torch.empty(n)
    warm.fill_(1.0)
    t_warm = _best_time(lambda: warm.fill_(1.0), 5)
    t_fresh = _best_time(lambda: torch.empty(n).fill_(1.0), 5)
    return max(0.0, t_fresh - t_warm) / FRESH_PROBE_BYTES


def profile_applies(profile: Profile, threads: int, model: str) -> str | None:
    """Why a stored CPU profile does not fit this process, or None when it does."""
    if profile.threads is not None and profile.threads != threads:
        return f"it was measured with {profile.threads} threads, this process uses {threads}"
    if profile.display_name != model:
        return f"it was measured on {profile.display_name!r}, this is {model!r}"
    return None


def cpu_device(profile: Profile | None = None) -> Device:
    """This machine's CPU as a Device (name "cpu", kind "cpu").

    ``profile``: a calibration of this CPU (get_device("cpu") passes the stored one), used when
    it fits this process (same thread count and CPU model); else the probe's figures.
    """
    import torch

    threads = torch.get_num_threads()
    model = cpu_model_name()
    ignored = ""
    if profile is not None:
        why = profile_applies(profile, threads, model)
        if why:
            ignored = f"; calibrated profile {profile.path} ignored: {why}"
            profile = None
    if profile is not None:
        peaks = dict(profile.peak_flops_per_s)
        bandwidth = profile.bandwidth_bytes_per_s
        overhead = profile.call_overhead_s
        fresh = profile.fresh_alloc_s_per_byte or fresh_alloc_s_per_byte()
        source = (f"calibrated profile {profile.path} from {profile.date()} "
                  f"(torch {profile.torch_version}, {profile.threads} threads)")
    else:
        probe = probe_cpu()
        peaks, bandwidth, overhead = probe.peak_flops_per_s, probe.bandwidth_bytes_per_s, \
            probe.call_overhead_s
        fresh = probe.fresh_alloc_s_per_byte
        source = (f"measured on this machine (probe: {PROBE_GEMM_DIM}^3 fp32/bf16 matmul, "
                  f"copy of 4x the last-level cache, 1x1x1 call; {threads} threads); "
                  "not calibrated: run `tilefit calibrate --device cpu`" + ignored)
    return Device(
        name="cpu",
        display_name=model,
        architecture=platform.machine() or "cpu",
        compute_capability=None,
        sms=threads,
        memory_bytes=total_memory_bytes(),
        bandwidth_bytes_per_s=bandwidth,
        peak_flops_per_s=peaks,
        alignment_bytes=CPU_ALIGNMENT_BYTES,
        source=source,
        aliases=("host",),
        # Peaks and bandwidth are already what this machine delivers, not datasheet maxima.
        gemm_efficiency=1.0,
        bandwidth_efficiency=1.0,
        launch_overhead_s=overhead,
        kind="cpu",
        fresh_alloc_s_per_byte=fresh,
        fresh_alloc_min_bytes=FRESH_ALLOC_MIN_BYTES,
        notes="sms = torch threads; peaks are measured delivered rates",
        profile=profile,
    )
