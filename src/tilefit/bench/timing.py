"""Timing done right: warm-up, fresh inputs, synchronisation, a median over enough runs.

- Fresh inputs: each call uses the next of several input buffers whose total size is at
  least twice the last-level cache (CPU) or L2 (GPU), so a call does not find its operands
  in a cache the previous call filled; training reads activations that were just written
  elsewhere, not the same operands over and over.
- GPUs: CUDA events around each call on the current stream, after a synchronize.
- CPUs: time.perf_counter around each call (BLAS calls return when done).
- Repeat until both a minimum count and a minimum total time are reached (the median of the
  per-call times is then stable to a few percent), capped by a maximum count.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tilefit.errors import TilefitError

# H200 L2 is 50 MB (NVIDIA H100/H200 whitepaper: 50 MB L2); used when torch cannot say.
DEFAULT_GPU_L2_BYTES = 50 * 1024**2
MAX_BUFFERS = 256  # tiny GEMMs: enough rotation without thousands of tensors
MAX_BUFFER_BYTES = 2 * 1024**3  # never allocate more than this for rotation


@dataclass(frozen=True)
class Timing:
    median_s: float
    p10_s: float
    p90_s: float
    reps: int

    def to_dict(self) -> dict[str, Any]:
        return {"median_s": self.median_s, "p10_s": self.p10_s, "p90_s": self.p90_s,
                "reps": self.reps}


def summarize(times_s: list[float]) -> Timing:
    """Median and 10th/90th percentiles (nearest rank) of per-call times."""
    if not times_s:
        raise ValueError("no timings to summarise")
    ordered = sorted(times_s)
    n = len(ordered)

    def rank(q: float) -> float:
        return ordered[min(n - 1, max(0, round(q * (n - 1))))]

    return Timing(statistics.median(ordered), rank(0.10), rank(0.90), n)


def time_calls(
    call: Callable[[int], object],
    *,
    warmup: int = 2,
    min_reps: int = 5,
    min_time_s: float = 0.05,
    max_reps: int = 1000,
    cuda: bool = False,
) -> Timing:
    """Per-call times of ``call(i)`` for i = 0, 1, 2, ... (i picks the input buffer)."""
    if min_reps < 1 or max_reps < min_reps:
        raise ValueError("need 1 <= min_reps <= max_reps")
    i = 0
    for _ in range(warmup):
        call(i)
        i += 1
    times: list[float] = []
    if cuda:
        import torch

        torch.cuda.synchronize()
        deadline = time.perf_counter() + min_time_s
        while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() < deadline):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call(i)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)  # elapsed_time is in ms
            i += 1
        return summarize(times)
    deadline = time.perf_counter() + min_time_s
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() < deadline):
        t0 = time.perf_counter()
        call(i)
        times.append(time.perf_counter() - t0)
        i += 1
    return summarize(times)


def cache_bytes(device_kind: str) -> int:
    if device_kind == "cuda":
        import torch

        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return int(getattr(props, "L2_cache_size", 0) or DEFAULT_GPU_L2_BYTES)
    from tilefit.hardware.cpu import last_level_cache_bytes

    return last_level_cache_bytes()


def buffer_count(bytes_per_set: int, cache: int) -> int:
    """How many input sets to rotate: total >= 2x the cache, within the caps."""
    want = -(-2 * cache // max(1, bytes_per_set))
    by_memory = max(1, MAX_BUFFER_BYTES // max(1, bytes_per_set))
    return max(2, min(want, MAX_BUFFERS, by_memory))


_WARM = {"cpu": False}


def warm_cpu_threads() -> None:
    """Run a few mid-size GEMMs once per process before timing anything on the CPU.

    Measured here: right after start-up, 32^3 GEMMs took 16 ms each (a scheduler tick: the
    BLAS worker threads were not yet spinning) for the first ~3 s, 3-5 us afterwards; a few
    512^3 GEMMs first remove the transient.
    """
    if _WARM["cpu"]:
        return
    import torch

    x = torch.randn(512, 512)
    for _ in range(5):
        torch.mm(x, x)
    _WARM["cpu"] = True


TORCH_DTYPES = {"fp32": "float32", "tf32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def time_gemm(
    m: int, n: int, k: int, dtype: str, *, device_kind: str = "cpu",
    min_time_s: float = 0.05, min_reps: int = 5, max_reps: int = 1000,
) -> Timing:
    """Time C = A @ B (A: M x K, B: K x N) with torch on the live CPU or GPU."""
    import torch

    if dtype not in TORCH_DTYPES:
        raise TilefitError(
            f"dtype {dtype} cannot be timed with torch.mm here",
            expected=", ".join(TORCH_DTYPES), given=dtype,
            fix="use --dtype fp32 or bf16 on the CPU; fp16/bf16/tf32/fp32 on a GPU",
        )
    dev = "cuda" if device_kind == "cuda" else "cpu"
    if dev == "cpu":
        warm_cpu_threads()
    tdt = getattr(torch, TORCH_DTYPES[dtype])
    elem = torch.tensor([], dtype=tdt).element_size()
    nbuf = buffer_count((m * k + k * n) * elem, cache_bytes(device_kind))
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32 if dev == "cuda" else False
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    try:
        gen = torch.Generator(device=dev).manual_seed(0)
        a_bufs = [torch.randn(m, k, device=dev, generator=gen).to(tdt) for _ in range(nbuf)]
        b_bufs = [torch.randn(k, n, device=dev, generator=gen).to(tdt) for _ in range(nbuf)]
        out = torch.empty(m, n, device=dev, dtype=tdt)

        def call(i: int) -> None:
            torch.mm(a_bufs[i % nbuf], b_bufs[i % nbuf], out=out)

        return time_calls(call, min_time_s=min_time_s, min_reps=min_reps, max_reps=max_reps,
                          cuda=dev == "cuda")
    finally:
        if dev == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = prev_tf32
