"""Predicted step time and peak memory on this CPU against real training steps.

Target (issue 7): after `tilefit calibrate --device cpu --quick`, the median step-time error
over at least five models within 25%. Peak memory (issue 3) is printed beside it.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_step_cpu.py [--json out.json]

OMP_WAIT_POLICY=PASSIVE keeps libgomp's worker threads from stalling 2-thread GEMMs when the
machine is shared (measured here: 320^3 GEMMs 16-24 ms instead of 0.35 ms under load); it is
set below when absent. Run `tilefit calibrate --device cpu --quick` first for calibrated
figures; the script says which CPU numbers it used.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()

    from tilefit.bench.step import measure_step
    from tilefit.estimator.workloads import Recipe, estimate_workload
    from tilefit.hardware import get_device
    from tilefit.models import load_workload

    dev = get_device("cpu")
    print(f"CPU numbers: {dev.source}")
    print(f"{'model':24} {'measured ms':>12} {'predicted ms':>13} {'time err':>9} "
          f"{'peak err':>9}")
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
               "peak_error": pred.peak_memory_bytes / real.peak_memory_bytes - 1}
        rows.append(row)
        print(f"{name:24} {real.step_time_s * 1e3:12.1f} {pred.step_time_s * 1e3:13.1f} "
              f"{row['step_time_error']:+9.1%} {row['peak_error']:+9.2%}")
    med = statistics.median(abs(r["step_time_error"]) for r in rows)
    print(f"median |step-time error| over {len(rows)} models: {med:.1%} (target 25%)")
    if args.json:
        Path(args.json).write_text(json.dumps({"device_source": dev.source, "rows": rows},
                                              indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
