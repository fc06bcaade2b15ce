"""Predicted peak memory of a CPU training step (tilefit, fake tensors) against the peak
measured on a real run of the same two steps (PyTorch's MemTracker on real tensors, an
independent accounting of live tensor storages).

Target (issue 3): within 1% on every workload; MemTracker itself, run on fake tensors, lands
within 0.1%.

    python benchmarks/bench_memory_cpu.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from tilefit.recipe import Recipe
from tilefit.tracing import trace
from workloads import CASES, Case


def measured_peak_bytes(case: Case) -> int:
    from tilefit.bench.step import real_step_peak_bytes

    torch.manual_seed(0)
    model = case.build()
    if case.grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    batch = case.batch()
    opt = case.optimizer(model.parameters())
    return real_step_peak_bytes(model, opt, batch, case.loss_fn)


def predicted_peak_bytes(case: Case) -> tuple[int, float]:
    t0 = time.perf_counter()
    tr = trace(case.build, case.batch(), loss_fn=case.loss_fn,
               recipe=Recipe(precision="fp32", optimizer=case.optimizer,
                             grad_checkpointing=case.grad_checkpointing),
               gpu="cpu")
    return tr.peak(rounded=False)[0], time.perf_counter() - t0


def main() -> int:
    print(f"{'workload':52} {'measured':>12} {'predicted':>12} {'error':>8} {'trace s':>8}")
    worst = 0.0
    for case in CASES:
        real = measured_peak_bytes(case)
        pred, secs = predicted_peak_bytes(case)
        err = (pred - real) / real
        worst = max(worst, abs(err))
        print(f"{case.name:52} {real:12,d} {pred:12,d} {err:+8.3%} {secs:8.2f}")
    print(f"worst |error|: {worst:.3%} (target 1%)")
    return 0 if worst <= 0.01 else 1


if __name__ == "__main__":
    raise SystemExit(main())
