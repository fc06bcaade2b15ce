"""The shapes calibration measures, and held-out shapes for checking it.

The grid crosses a few sizes per dimension (M, N, K independently, so the MK, KN and MN terms
of the CPU model are told apart) and adds misaligned shapes (odd dims) for the alignment
factor. Held-out shapes are drawn log-uniformly and never equal a grid shape.
"""

from __future__ import annotations

import itertools
import random

Shape = tuple[int, int, int]

# CPU sizes span 32..2048, the range of the held-out check; --quick uses 3 per dimension.
CPU_DIMS_QUICK = (48, 320, 1536)
CPU_DIMS_FULL = (32, 128, 512, 1024, 2048)
CPU_MISALIGNED_QUICK = (37, 203, 1001)
CPU_MISALIGNED_FULL = (37, 131, 509, 1001, 1999)
# GPU sizes: from launch-bound (128) to full-wave (8192) on an H100/H200-class part.
GPU_DIMS_QUICK = (128, 1024, 4096, 8192)
GPU_DIMS_FULL = (128, 512, 1024, 2048, 4096, 8192)
GPU_MISALIGNED = (127, 1001, 4095, 8191)


def calibration_grid(kind: str, quick: bool, seed: int = 0) -> list[Shape]:
    if kind == "cpu":
        dims, odd = (CPU_DIMS_QUICK, CPU_MISALIGNED_QUICK) if quick else \
            (CPU_DIMS_FULL, CPU_MISALIGNED_FULL)
    else:
        dims, odd = (GPU_DIMS_QUICK if quick else GPU_DIMS_FULL), GPU_MISALIGNED
    shapes = list(itertools.product(dims, repeat=3))
    rng = random.Random(seed)
    n_odd = max(6, len(shapes) // 3)
    mixed = sorted(set(dims) | set(odd))
    while n_odd > 0:
        s = (rng.choice(mixed), rng.choice(mixed), rng.choice(mixed))
        if any(v in odd for v in s) and s not in shapes:
            shapes.append(s)
            n_odd -= 1
    return shapes


def held_out_shapes(count: int, lo: int, hi: int, exclude: set[Shape], seed: int = 1,
                    align_to: int = 64) -> list[tuple[Shape, bool]]:
    """``count`` shapes (half aligned to ``align_to`` elements, half with an odd dim),
    log-uniform in [lo, hi] per dim, none in ``exclude``; each with its aligned flag."""
    rng = random.Random(seed)
    out: list[tuple[Shape, bool]] = []
    seen = set(exclude)
    while len(out) < count:
        dims = [round(lo * (hi / lo) ** rng.random()) for _ in range(3)]
        aligned = len(out) % 2 == 0
        if aligned:
            dims = [max(align_to, round(d / align_to) * align_to) for d in dims]
        else:
            j = rng.randrange(3)
            dims[j] |= 1  # an odd dimension: off every multiple
        s = (dims[0], dims[1], dims[2])
        if s in seen:
            continue
        seen.add(s)
        out.append((s, aligned))
    return out
