"""Run a calibration on the live device: measure the grid, bandwidth and overhead, fit, build
the Profile (the CLI saves it)."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from tilefit.bench.timing import time_calls, time_gemm
from tilefit.calibrate.fit import GemmSample, fit_cpu, fit_gpu, is_aligned
from tilefit.calibrate.grid import calibration_grid
from tilefit.errors import TilefitError
from tilefit.hardware.device import Device
from tilefit.hardware.profile import Profile

Progress = Callable[[str], None]

CPU_DTYPES = ("fp32", "bf16")
GPU_DTYPES = ("bf16", "fp16", "tf32", "fp32")
ROUNDS = 3  # interleaved measurement rounds per shape (measure_samples)
COPY_BYTES = 256 * 1024**2  # bandwidth copy: 256 MiB, far above any cache


def live_device(kind: str) -> Device:
    """The uncalibrated live device of ``kind`` ("cpu" or "cuda"); a clear error otherwise."""
    from tilefit.hardware.cpu import cpu_device
    from tilefit.hardware.lookup import detect_live_device

    if kind == "cpu":
        return cpu_device()  # no profile: the probe's figures
    if kind == "cuda":
        require_cuda()
        return detect_live_device(use_profile=False)
    raise TilefitError(f"unknown device kind {kind!r}", expected="cpu or cuda", given=kind,
                       fix="pass --device cpu or --device cuda")


def device_kind(text: str) -> str:
    """"cpu" or "cuda" from --device, or a clear error (and cuda only where there is one)."""
    kind = str(text).strip().lower()
    if kind not in ("cpu", "cuda"):
        from tilefit.errors import close_matches

        near = close_matches(kind, ["cpu", "cuda"])
        raise TilefitError(f"unknown --device {text!r}", expected="cpu or cuda",
                           given=repr(text), fix=(f"did you mean {near[0]}? " if near else "")
                           + "pass --device cpu or --device cuda")
    if kind == "cuda":
        require_cuda()
    return kind


def live_kind_device(text: str) -> Device:
    """The live device for --device cpu|cuda, with its calibration profile when stored."""
    from tilefit.hardware.lookup import get_device

    return get_device(device_kind(text))


def require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise TilefitError(
            "--device cuda needs a CUDA GPU, and this machine has none",
            expected="a machine with an NVIDIA GPU and a CUDA build of PyTorch",
            given=f"torch {torch.__version__}, torch.cuda.is_available() is False",
            fix="run on the GPU machine, or use --device cpu",
        )


def measure_bandwidth(kind: str) -> float:
    """Copy bandwidth in bytes/s: (read + write bytes) / median copy time."""
    import torch

    dev = "cuda" if kind == "cuda" else "cpu"
    src = torch.ones(COPY_BYTES // 4, device=dev)
    dst = torch.empty_like(src)
    t = time_calls(lambda i: dst.copy_(src), min_reps=5, min_time_s=0.1, max_reps=50,
                   cuda=dev == "cuda")
    return 2 * COPY_BYTES / t.median_s


def measure_overhead(kind: str) -> float:
    """Median time of a 1x1x1 GEMM call: the fixed cost of one call / launch."""
    import torch

    dev = "cuda" if kind == "cuda" else "cpu"
    a = torch.ones(1, 1, device=dev)
    t = time_calls(lambda i: torch.mm(a, a), min_reps=50, min_time_s=0.05, max_reps=2000,
                   cuda=dev == "cuda")
    return t.median_s


def measure_samples(shapes: list[tuple[int, int, int]], dtype: str, device: Device,
                    min_time_s: float, progress: Progress | None = None,
                    rounds: int = ROUNDS) -> list[GemmSample]:
    """Each shape's time: the least of ``rounds`` per-round medians, rounds interleaved
    over the whole list, so that a burst of load from another process (which on a 2-core
    machine stalls a 2-thread GEMM for a 16 ms scheduler slice per call: measured here, 320^3
    fp32 at 16 ms instead of 70 us) spoils one round of a shape, not its result."""
    import random

    mult = device.multiple(dtype)
    best = [float("inf")] * len(shapes)
    order = list(range(len(shapes)))
    rng = random.Random(0)
    for r in range(rounds):
        # A new order each round, so that a drift in the machine's load does not line up
        # with the grid's structure (all large-M shapes measured in the same busy minute).
        rng.shuffle(order)
        for i in order:
            m, n, k = shapes[i]
            t = time_gemm(m, n, k, dtype, device_kind=device.kind, min_time_s=min_time_s)
            best[i] = min(best[i], t.median_s)
        if progress:
            progress(f"{dtype}: round {r + 1}/{rounds} of {len(shapes)} shapes")
    return [GemmSample(m, n, k, dtype, t, is_aligned(m, n, k, mult))
            for (m, n, k), t in zip(shapes, best, strict=True)]


OMP_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def environment() -> dict[str, str]:
    """Load average and OpenMP settings now: what a reader needs to judge the timings."""
    import os

    env = {v: os.environ[v] for v in OMP_VARS if v in os.environ}
    load = _loadavg()
    if load:
        env["loadavg"] = " ".join(load.split()[:3])
    return env


def _loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text()
    except OSError:
        return ""


def busy_warning(kind: str) -> str | None:
    """A warning when other processes keep the CPU busy (1-minute load >= half the cores).

    Measured on a 2-core VM with another process holding a core: 320^3 fp32 GEMMs took
    16-24 ms instead of 0.35 ms, because libgomp's worker threads spin-wait for a sibling
    the scheduler has parked; OMP_WAIT_POLICY=PASSIVE brought them back to 0.6 ms.
    """
    import os

    if kind != "cpu":
        return None
    try:
        load = float(_loadavg().split()[0])
    except (ValueError, IndexError):
        return None
    cores = os.cpu_count() or 1
    if load < cores / 2 + 0.5:
        return None
    policy = os.environ.get("OMP_WAIT_POLICY", "")
    hint = "" if policy.upper() == "PASSIVE" else (
        "; set OMP_WAIT_POLICY=PASSIVE (before starting Python) or wait for the load to drop")
    return (f"the machine is busy (load {load:.1f} on {cores} cores): timings include other "
            f"processes' load{hint}")


def calibrate(kind: str, *, quick: bool = False,
              progress: Progress | None = None) -> tuple[Profile, list[GemmSample]]:
    """Measure and fit; return the Profile (unsaved) and the raw samples."""
    import torch

    start = time.perf_counter()
    device = live_device(kind)
    say = progress or (lambda _msg: None)
    say(f"device: {device.display_name}")
    env_start = environment()
    warning = busy_warning(kind)
    if warning:
        say("warning: " + warning)
    bandwidth = measure_bandwidth(kind)
    overhead = measure_overhead(kind)
    say(f"bandwidth {bandwidth / 1e9:.1f} GB/s, call overhead {overhead * 1e6:.2f} us")
    fresh = 0.0
    if kind == "cpu":
        from tilefit.hardware.cpu import measure_fresh_alloc_s_per_byte

        fresh = measure_fresh_alloc_s_per_byte()
        say(f"first touch of fresh memory {fresh * 1e9 * 2**20 / 1e9:.2f} ms per MiB" if fresh
            else "first touch of fresh memory: free")
    shapes = calibration_grid(kind, quick)
    min_time_s = 0.02 if quick else 0.1
    dtypes = [d for d in (CPU_DTYPES if kind == "cpu" else GPU_DTYPES) if device.supports(d)]
    if quick and kind == "cuda":
        dtypes = dtypes[:2]
    samples: list[GemmSample] = []
    fits = []
    peaks: dict[str, float] = dict(device.peak_flops_per_s)
    for dt in dtypes:
        rows = measure_samples(shapes, dt, device, min_time_s, progress)
        samples += rows
        fits.append(fit_cpu(rows, dt) if kind == "cpu" else fit_gpu(rows, dt, device))
        if kind == "cpu":  # the CPU's peak is what its best grid shape delivered
            peaks[dt] = max(2 * s.m * s.n * s.k / s.time_s for s in rows)
        say(f"{dt}: fitted on {len(rows)} shapes, median error {fits[-1].median_error:.1%}")
    profile = Profile(
        device=device.name,
        display_name=device.display_name,
        kind=kind,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        torch_version=torch.__version__,
        threads=torch.get_num_threads() if kind == "cpu" else None,
        peak_flops_per_s=peaks,
        bandwidth_bytes_per_s=bandwidth,
        call_overhead_s=overhead,
        fresh_alloc_s_per_byte=fresh,
        gemm=tuple(fits),
        quick=quick,
        duration_s=time.perf_counter() - start,
        environment={**env_start, "loadavg_end": environment().get("loadavg", "")},
    )
    return profile, samples
