"""Predicted step time and peak memory on this CPU against real training steps.

Target (issue 12): after `tilefit calibrate --device cpu --quick`, the median step-time error
over six varied models within 20%, with the calibration and the measurement made under the
same conditions (thread count printed). Peak memory (issue 3) is printed beside it, and each
row's spread of repeated steps (the machine's noise; rows over 10% are marked noisy).
`--load N` runs N busy processes (a pure-Python loop each, bounded by the run) while
measuring: how much another process on the machine moves the error.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_step_cpu.py [--load 1] [--json out.json]

OMP_WAIT_POLICY=PASSIVE keeps libgomp's worker threads from stalling 2-thread GEMMs when the
machine is shared (measured here: 320^3 GEMMs 16-24 ms instead of 0.35 ms under load); it is
set below when absent. Run `tilefit calibrate --device cpu --quick` first for calibrated
figures; the script says which CPU numbers it used.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# (catalog model, config changes to keep a CPU step short, batch, seq)
CASES = (
    ("gpt2", {"num_hidden_layers": 2}, 4, 128),
    ("bert-base-uncased", {"num_hidden_layers": 2}, 4, 128),
    ("qwen2.5-0.5b", {"num_hidden_layers": 2}, 2, 128),
    ("llama-3.2-1b", {"num_hidden_layers": 1}, 1, 128),
    ("vit-base-patch16-224", {"num_hidden_layers": 2}, 4, None),
    ("roberta-base", {"num_hidden_layers": 2}, 4, 128),
)


def _busy(stop_at: float) -> None:
    while time.time() < stop_at:
        sum(i * i for i in range(10_000))


def _start_load(n: int, seconds: float) -> list[multiprocessing.Process]:
    procs = [multiprocessing.Process(target=_busy, args=(time.time() + seconds,), daemon=True)
             for _ in range(n)]
    for p in procs:
        p.start()
    return procs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--load", type=int, default=0, help="busy processes while measuring")
    args = parser.parse_args()
    import torch

    load = _start_load(args.load, 900.0)

    from tilefit.bench.step import measure_step
    from tilefit.estimator.workload_estimate import estimate_workload
    from tilefit.hardware import get_device
    from tilefit.models import load_workload
    from tilefit.recipe import Recipe

    dev = get_device("cpu")
    print(f"CPU numbers: {dev.source}")
    print(f"{torch.get_num_threads()} torch threads, {os.cpu_count()} cores, {args.load} busy "
          f"process(es), load average {os.getloadavg()[0]:.2f} at the start")
    print(f"{'model':24} {'measured ms':>12} {'predicted ms':>13} {'time err':>9} "
          f"{'peak err':>9} {'spread':>7}")
    rows = []
    for name, changes, batch, seq in CASES:
        work = load_workload(name, seq_len=seq).with_config(**changes)
        recipe = Recipe(batch_size=batch, precision="fp32", optimizer="adamw")
        pred = estimate_workload(work, recipe, dev)
        real = measure_step(work, recipe, "cpu", steps=5)
        row = {"model": name, "changes": changes, "batch": batch, "seq": seq,
               "measured_step_time_s": real.step_time_s,
               "predicted_step_time_s": pred.step_time_s,
               "step_time_error": pred.step_time_s / real.step_time_s - 1,
               "measured_peak_bytes": real.peak_memory_bytes,
               "predicted_peak_bytes": pred.peak_memory_bytes,
               "peak_error": pred.peak_memory_bytes / real.peak_memory_bytes - 1,
               "spread": real.spread, "noisy": real.noisy}
        rows.append(row)
        print(f"{name:24} {real.step_time_s * 1e3:12.1f} {pred.step_time_s * 1e3:13.1f} "
              f"{row['step_time_error']:+9.1%} {row['peak_error']:+9.2%} "
              f"{real.spread:6.0%}{' noisy' if real.noisy else ''}")
    for p in load:
        p.terminate()
    med = statistics.median(abs(r["step_time_error"]) for r in rows)
    noisy = sum(r["noisy"] for r in rows)
    print(f"median |step-time error| over {len(rows)} models: {med:.1%} (target 20%); "
          f"{noisy} noisy row(s); load average {os.getloadavg()[0]:.2f} at the end")
    if args.json:
        Path(args.json).write_text(json.dumps({"device_source": dev.source, "rows": rows},
                                              indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
