"""The distinct GEMM shapes of a model's traced training step, to measure one by one."""

from __future__ import annotations

from collections import Counter

from tilefit.bench.sweeps import SweepShape
from tilefit.estimator.workload_estimate import estimate_workload
from tilefit.hardware.device import Device
from tilefit.models import Workload
from tilefit.recipe import Recipe


def model_gemm_shapes(workload: Workload, recipe: Recipe, device: Device
                      ) -> tuple[str, list[SweepShape]]:
    """(the dtype the step's GEMMs run in, one SweepShape per distinct plain GEMM of the
    steady step: label "module (phase)", x = how many times it runs per step). Batched GEMMs
    (bmm) are left out: torch.mm times one GEMM."""
    counts: Counter[tuple[int, int, int, str]] = Counter()
    where: dict[tuple[int, int, int, str], str] = {}
    for c, g, dt in estimate_workload(workload, recipe, device).gemms():
        if g.batch != 1:
            continue
        key = (g.m, g.n, g.k, dt)
        counts[key] += 1
        where.setdefault(key, f"{c.record.module or '-'} ({c.record.phase})")
    if not counts:
        return "fp32", []
    dtype = Counter({k[3]: v for k, v in counts.items()}).most_common(1)[0][0]
    shapes = [SweepShape(label=where[key], x=n, m=key[0], n=key[1], k=key[2])
              for key, n in sorted(counts.items(), key=lambda kv: -kv[0][0] * kv[0][1] * kv[0][2])
              if key[3] == dtype]
    return dtype, shapes
