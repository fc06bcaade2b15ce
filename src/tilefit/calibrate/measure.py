"""What a calibration measures besides the GEMM grid's fit: copy bandwidth, the call overhead,
the grid's GEMMs in interleaved rounds, and the machine's state (load, OpenMP settings) that
a reader needs to judge the timings."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tilefit.bench.timing import time_calls, time_gemm
from tilefit.calibrate.fit import GemmSample, is_aligned
from tilefit.calibrate.grid import MAX_REPS, MIN_REPS, ROUNDS, Shape
from tilefit.hardware.device import Device

COPY_BYTES = 256 * 1024**2  # bandwidth copy: 256 MiB, far above any cache


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


StepFn = Callable[[int, int], None]  # (round index, shapes measured in it) after each shape


def measure_rounds(shapes: Sequence[Shape], dtype: str, device: Device, min_time_s: float,
                   rounds: int = ROUNDS, *, deadline_s: float = math.inf,
                   step: StepFn | None = None,
                   clock: Callable[[], float] = time.perf_counter,
                   ) -> tuple[list[GemmSample], int]:
    """Each shape's time: the least of its per-round medians, rounds interleaved over the
    whole list, so that a burst of load from another process (which on a 2-core machine
    stalls a 2-thread GEMM for a 16 ms scheduler slice per call: measured here, 320^3 fp32 at
    16 ms instead of 70 us) spoils one round of a shape, not its result. A round after the
    first starts only if it would end (as long as the last one took) by ``deadline_s`` (on
    ``clock``). Returns the samples and the rounds measured."""
    import random

    mult = device.multiple(dtype)
    best = [math.inf] * len(shapes)
    order = list(range(len(shapes)))
    rng = random.Random(0)
    done = 0
    last_round_s = 0.0
    while done < rounds and (done == 0 or clock() + last_round_s <= deadline_s):
        round_start = clock()
        # A new order each round, so that a drift in the machine's load does not line up
        # with the grid's structure (all large-M shapes measured in the same busy minute).
        rng.shuffle(order)
        for j, i in enumerate(order):
            m, n, k = shapes[i]
            t = time_gemm(m, n, k, dtype, device_kind=device.kind, min_time_s=min_time_s,
                          min_reps=MIN_REPS, max_reps=MAX_REPS)
            best[i] = min(best[i], t.median_s)
            if step:
                step(done, j + 1)
        last_round_s = clock() - round_start
        done += 1
    samples = [GemmSample(m, n, k, dtype, t, is_aligned(m, n, k, mult))
               for (m, n, k), t in zip(shapes, best, strict=True)]
    return samples, done


def measure_samples(shapes: Sequence[Shape], dtype: str, device: Device, min_time_s: float,
                    rounds: int = ROUNDS) -> list[GemmSample]:
    """measure_rounds, all ``rounds`` of them."""
    return measure_rounds(shapes, dtype, device, min_time_s, rounds)[0]


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



@dataclass(frozen=True)
class DeviceTerms:
    """The measurements besides the GEMM grid."""

    bandwidth_bytes_per_s: float
    call_overhead_s: float
    fresh_alloc_s_per_byte: float
    environment: dict[str, str]
    warning: str | None


def measure_device_terms(kind: str, say: Callable[[str], None]) -> DeviceTerms:
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
    return DeviceTerms(bandwidth, overhead, fresh, env_start, warning)
