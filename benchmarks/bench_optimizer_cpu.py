"""The optimizer step as tilefit predicts it against real optimizer steps on this CPU, for
each of torch.optim's three AdamW implementations, and what the same steps cost on a GPU.

Issue 12, item 3: the optimizer step at its real bandwidth, checked against a real CPU run
where the CPU has the same implementation. On the CPU torch runs all three: the for-loop
(one op per parameter and update term: torch's CPU default), foreach (the CPU falls back to
one kernel call per tensor for each foreach op) and fused (``_fused_adamw_``: one pass over
each tensor). The prediction is the sum of the traced optimizer phase's op times on this
CPU's Device (its bandwidth and per-call cost: `tilefit calibrate --device cpu --quick`
first for calibrated figures). The real step is timed alone, with the model's gradients in
place: median of ``--steps`` steps after two warm-up steps, with the spread.

The second table costs the same traced steps on a GPU (default a100-80gb, --gpu): bytes per
parameter, kernel launches (multi_tensor_apply's chunking) and time, foreach against fused.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_optimizer_cpu.py [--steps 7] [--gpu h100]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from tilefit.recipe import Recipe

# (catalog model, config changes, batch, seq): bench_step_cpu.py's models
CASES = (
    ("gpt2", {"num_hidden_layers": 2}, 2, 64),
    ("bert-base-uncased", {"num_hidden_layers": 2}, 2, 64),
    ("qwen2.5-0.5b", {"num_hidden_layers": 2}, 1, 64),
    ("vit-base-patch16-224", {"num_hidden_layers": 2}, 2, None),
    ("roberta-base", {"num_hidden_layers": 2}, 2, 64),
)
IMPLEMENTATIONS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "for-loop": lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=False),
    "foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True),
    "fused": lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True),
}


def measure(work: Any, batch: int, make_opt: Callable[[Any], torch.optim.Optimizer],
            steps: int, device: str = "cpu") -> tuple[float, float]:
    """Median seconds of a real optimizer step (gradients in place) and the spread, on
    ``device`` ("cpu" or "cuda": timed to the GPU's completion)."""
    torch.manual_seed(0)
    model = work.build().to(device)
    model.train()
    work.loss_fn(model, work.make_batch(batch, device)).backward()
    opt = make_opt([p for p in model.parameters() if p.requires_grad])
    for _ in range(2):
        opt.step()
    times = []
    for _ in range(steps):
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return med, (max(times) - min(times)) / med


def optimizer_phase(work: Any, batch: int, make_opt: Callable[[Any], torch.optim.Optimizer],
                    device: Any) -> tuple[float, int, int, int]:
    """Predicted optimizer-phase seconds, bytes, kernel launches and ops on ``device``."""
    from tilefit.estimator import estimate_trace
    from tilefit.estimator.multitensor import kernel_launches
    from tilefit.tracing import trace

    tr = trace(work.build, work.make_batch(batch, "meta"), loss_fn=work.loss_fn,
               recipe=Recipe(precision="fp32", optimizer=make_opt), gpu=device)
    est = estimate_trace(tr, device)
    ops = [c for c in est.ops if c.record.phase == "optimizer"]
    return (sum(c.time_s * c.repeats for c in ops), sum(c.record.bytes for c in ops),
            sum(kernel_launches(c.record, device) for c in ops), len(ops))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--gpu", default="a100-80gb")
    args = parser.parse_args()
    from tilefit.hardware import get_device
    from tilefit.models import load_workload

    cpu, gpu = get_device("cpu"), get_device(args.gpu)
    print(f"CPU numbers: {cpu.source}")
    print(f"{torch.get_num_threads()} torch threads, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.2f} at the start; {args.steps} timed steps per row")
    print(f"{'model':22} {'params':>7} {'impl':9} {'measured ms':>12} {'predicted ms':>13} "
          f"{'error':>7} {'spread':>7}")
    errors: dict[str, list[float]] = {k: [] for k in IMPLEMENTATIONS}
    gpu_rows = []
    for name, changes, batch, seq in CASES:
        work = load_workload(name, seq_len=seq).with_config(**changes)
        n_params = sum(p.numel() for p in work.build().parameters())
        for impl, make_opt in IMPLEMENTATIONS.items():
            real_s, spread = measure(work, batch, make_opt, args.steps)
            pred_s = optimizer_phase(work, batch, make_opt, cpu)[0]
            errors[impl].append(pred_s / real_s - 1)
            print(f"{name:22} {n_params / 1e6:6.1f}M {impl:9} {real_s * 1e3:12.2f} "
                  f"{pred_s * 1e3:13.2f} {pred_s / real_s - 1:+7.1%} {spread:6.0%}"
                  f"{' noisy' if spread > 0.10 else ''}")
            if impl != "for-loop":
                gpu_rows.append((name, n_params, impl, *optimizer_phase(work, batch, make_opt,
                                                                       gpu)))
    print(f"median |error| by implementation (load average {os.getloadavg()[0]:.2f} at the "
          "end): " + ", ".join(f"{k} {statistics.median(abs(e) for e in v):.1%}"
                               for k, v in errors.items()))
    print(f"\nthe same optimizer steps on {gpu.name} (predicted; CUDA's foreach path):")
    print(f"{'model':22} {'impl':9} {'bytes/param':>12} {'launches':>9} {'ops':>5} "
          f"{'time us':>9}")
    for name, n_params, impl, t, nbytes, launches, n_ops in gpu_rows:
        print(f"{name:22} {impl:9} {nbytes / n_params:12.1f} {launches:9d} {n_ops:5d} "
              f"{t * 1e6:9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
