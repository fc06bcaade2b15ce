"""How long tracing one training step takes, in a warm process: the time the tracer adds
per step, compared between two versions of tilefit by running this script under each.

Each case is traced once to warm imports and caches, then REPEATS times; printed: the median,
the spread (min-max) and the thread count. Compare two versions in one sitting on the same
machine, alternating runs (``--label``), as ratios: the machine is shared.

    OMP_NUM_THREADS=1 python benchmarks/bench_trace_time.py --label after
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPEATS = 5
CASES = (("gpt2", 8, 1024, "bf16-mixed"), ("llama-3.2-1b", 1, 2048, "bf16-mixed"),
         ("bert-base-uncased", 16, 512, "fp16-mixed"), ("gpt2", 8, 1024, "fp32"))


def time_trace(model: str, batch: int, seq: int, precision: str) -> list[float]:
    from tilefit.hardware import get_device
    from tilefit.models import load_workload
    from tilefit.recipe import Recipe
    from tilefit.tracing.workload_traces import trace_workload

    work = load_workload(model, seq_len=seq)
    recipe, device = Recipe(batch, precision=precision), get_device("a100-80gb")
    trace_workload(work, recipe, device)  # warm
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        trace_workload(work, recipe, device)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    os.environ["TILEFIT_JOBS"] = "0"
    print(f"# {args.label} torch threads {torch.get_num_threads()}, "
          f"load {os.getloadavg()[0]:.1f}, {REPEATS} repeats")
    for model, batch, seq, precision in CASES:
        t = time_trace(model, batch, seq, precision)
        print(f"{args.label:8} trace {model} b{batch} s{seq} {precision:10} median "
              f"{statistics.median(t):6.3f} s  spread {min(t):.3f}-{max(t):.3f}")


if __name__ == "__main__":
    main()
