"""What `--compile` costs: `tilefit estimate gpt2` with and without it, whole CLI runs.

Target (issue 13): `estimate --compile` of gpt2 within 2x the time of the eager estimate.
Each round runs the eager command, then the compiled one (fresh processes, imports included,
a100-80gb, batch 8, seq 1024, the HF Trainer's loop defaults). Printed per run: wall time and
the child's CPU time (user + system, less sensitive to other processes on a shared machine);
then medians, spread (min-max) and the ratio of the medians, with the torch thread count and
the load average before and after. Run it alone, under the benchmark lock:

    OMP_NUM_THREADS=1 flock /tmp/tilefit-bench.lock python benchmarks/bench_compile_overhead.py \
        [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

COMMAND = [sys.executable, "-m", "tilefit", "estimate", "gpt2", "--batch", "8", "--seq", "1024",
           "--gpu", "a100-80gb", "--json", "--no-ops"]


def _child_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_once(compile_: bool) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one CLI run."""
    cpu0, t0 = _child_cpu_s(), time.perf_counter()
    subprocess.run(COMMAND + (["--compile"] if compile_ else []), check=True,
                   capture_output=True)
    return time.perf_counter() - t0, _child_cpu_s() - cpu0


def _summary(name: str, values: list[float]) -> str:
    return (f"{name}: " + " ".join(f"{v:.2f}" for v in values) + f" s; median "
            f"{statistics.median(values):.2f}, spread {min(values):.2f}-{max(values):.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} at the start; OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', '(unset)')}; {os.cpu_count()} cores")
    wall: dict[bool, list[float]] = {False: [], True: []}
    cpu: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds):
        for compile_ in (False, True):
            w, c = run_once(compile_)
            wall[compile_].append(w)
            cpu[compile_].append(c)
    for label, table in (("wall", wall), ("cpu", cpu)):
        print(_summary(f"eager     {label}", table[False]))
        print(_summary(f"--compile {label}", table[True]))
        ratio = statistics.median(table[True]) / statistics.median(table[False])
        print(f"{label} ratio of medians {ratio:.2f}x (target: under 2x)")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0 if statistics.median(wall[True]) < 2 * statistics.median(wall[False]) else 1


if __name__ == "__main__":
    sys.exit(main())
