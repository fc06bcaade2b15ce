"""`tilefit run` of a Hugging Face Trainer script beside `tilefit estimate` of the same step
(issue 42, items 7 and 10): the predictions (step time, peak and reserved memory) must agree,
and the run's wall time be at most twice the estimate's. Two cases: GPT-2 (batch 8 x 1024,
bf16=True; the default) and QLoRA (`--case qlora`: Llama 3.2 1B, nf4 with double
quantization, LoRA r=16 on q_proj and v_proj, batch 4 x 512, bf16=True).

Each command runs as a user runs it (a fresh process, the CLI, --json), alternating, REPEATS
times; printed: both predictions and their ratio, each command's wall time (median and
spread), the ratio of the medians, the thread count and the load average before and after.

    OMP_NUM_THREADS=2 python benchmarks/bench_run_vs_estimate.py [--gpu a100-80gb] [--case qlora]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPEATS = 3
SCRIPTS = Path(__file__).parent / "scripts"
# each case: its script, and the estimate's model and flags for the same step
CASES = {
    "gpt2": (SCRIPTS / "hf_gpt2_trainer.py",
             ["gpt2", "--batch", "8", "--seq", "1024", "--precision", "bf16-mixed"]),
    "qlora": (SCRIPTS / "hf_qlora_trainer.py",
              ["llama-3.2-1b", "--batch", "4", "--seq", "512", "--precision", "bf16-mixed",
               "--quantize", "nf4", "--lora-rank", "16", "--lora-alpha", "32",
               "--lora-targets", "q_proj,v_proj"]),
}


def _timed(cmd: list[str]) -> tuple[float, dict[str, object]]:
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    wall = time.perf_counter() - t0
    return wall, json.loads(out.stdout[out.stdout.index("{"):])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpu", default="a100-80gb")
    parser.add_argument("--case", choices=sorted(CASES), default="gpt2")
    opts = parser.parse_args()
    script, flags = CASES[opts.case]
    tilefit = [sys.executable, "-m", "tilefit"]
    estimate = [*tilefit, "estimate", *flags, "--gpu", opts.gpu, "--json", "--no-ops"]
    run = [*tilefit, "run", "--gpu", opts.gpu, "--json", "--no-ops", str(script)]
    print(f"case {opts.case}: {script.name} beside estimate {' '.join(flags)}")
    print(f"threads OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
          f"load before {os.getloadavg()}")
    walls: dict[str, list[float]] = {"estimate": [], "run": []}
    last: dict[str, dict[str, object]] = {}
    for _ in range(REPEATS):
        for name, cmd in (("estimate", estimate), ("run", run)):
            wall, data = _timed(cmd)
            walls[name].append(wall)
            last[name] = data
    print(f"load after {os.getloadavg()}")
    for key in ("step_time_s", "peak_memory_bytes"):
        e, r = float(last["estimate"][key]), float(last["run"][key])  # type: ignore[arg-type]
        print(f"{key:20s} estimate {e:.6g}  run {r:.6g}  run/estimate {r / e:.4f}")
    e_res, r_res = (last[n].get("reserved") or {} for n in ("estimate", "run"))
    if isinstance(e_res, dict) and isinstance(r_res, dict) and e_res and r_res:
        e, r = float(e_res["peak_reserved_bytes"]), float(r_res["peak_reserved_bytes"])
        print(f"{'peak_reserved_bytes':20s} estimate {e:.6g}  run {r:.6g}  run/estimate "
              f"{r / e:.4f}")
    for name, times in walls.items():
        print(f"wall {name:8s} median {statistics.median(times):.2f} s  "
              f"(min {min(times):.2f}, max {max(times):.2f}, n={len(times)})")
    ratio = statistics.median(walls["run"]) / statistics.median(walls["estimate"])
    print(f"wall run/estimate {ratio:.2f} (target: at most 2)")


if __name__ == "__main__":
    main()
