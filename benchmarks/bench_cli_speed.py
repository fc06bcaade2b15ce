"""Interactive speed of audit, plan and models (issue 25, item 5): wall time of the CLI in a
fresh interpreter, a few repetitions each (min and spread), beside the baseline
`python -c "import torch, transformers; transformers.GPT2LMHeadModel"` measured in the same
run, printed as ratios against the targets. bench_cli_startup.py covers the torch-free
commands; this script prints the figures and asserts nothing.

    OMP_NUM_THREADS=1 python benchmarks/bench_cli_speed.py [--repeat 3] [--skip-plan] [--only plan]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

BASELINE = "import torch, transformers; transformers.GPT2LMHeadModel"
# command -> (CLI arguments, target wall time as a multiple of the baseline)
COMMANDS: dict[str, tuple[list[str], float]] = {
    "audit gpt2": (["audit", "gpt2", "--json"], 2.5),
    "audit llama-3.2-1b": (["audit", "llama-3.2-1b", "--json"], 4.0),
    "plan llama-2-7b --global-batch 32": (["plan", "llama-2-7b", "--global-batch", "32",
                                           "--json"], 6.0),
    "models": (["models"], 0.5),
}


def time_once(cmd: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds (user + system of the child) of one run."""
    start, before = time.perf_counter(), os.times()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    after = os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system -
                                                          before.children_system)
    return time.perf_counter() - start, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per command (default 3)")
    parser.add_argument("--skip-plan", action="store_true", help="leave the 7B plan out")
    parser.add_argument("--only", help="time only the commands whose name contains this "
                        "(the baseline is always timed)")
    opts = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"torch {torch.__version__}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
          f"torch threads {torch.get_num_threads()}, {os.cpu_count()} cores")
    print(f"load at start: {uptime}")
    base = [time_once([sys.executable, "-c", BASELINE]) for _ in range(opts.repeat)]
    floor = min(w for w, _ in base)
    floor_cpu = min(c for _, c in base)
    print(f"\n{'command':<36} {'min s':>7} {'max s':>7} {'CPU s':>7} {'ratio':>6} "
          f"{'CPU ratio':>9} {'target':>6}  (n={opts.repeat})")
    print(f"{'baseline (import torch, transformers)':<36} {floor:7.2f} "
          f"{max(w for w, _ in base):7.2f} {floor_cpu:7.2f} {1:6.2f} {1:9.2f}")
    for name, (args, target) in COMMANDS.items():
        if (opts.skip_plan and args[0] == "plan") or (opts.only and opts.only not in name):
            continue
        runs = [time_once([sys.executable, "-m", "tilefit", *args])
                for _ in range(opts.repeat)]
        wall, cpu = min(w for w, _ in runs), min(c for _, c in runs)
        ok = "ok" if wall / floor <= target else "MISS"
        print(f"{name:<36} {wall:7.2f} {max(w for w, _ in runs):7.2f} {cpu:7.2f} "
              f"{wall / floor:6.2f} {cpu / floor_cpu:9.2f} {target:6.1f}  {ok}", flush=True)
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"\nload at end: {uptime}")


if __name__ == "__main__":
    main()
