"""Startup time of the fast commands (gemm, linear, gpus): wall time of a fresh interpreter
running the command, a few repetitions each, min / median / max printed.

The design target (docs/references.md, section 12): these commands import no torch and start
in a fraction of a second. This script prints the figures; it asserts nothing.

    python benchmarks/bench_cli_startup.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS: dict[str, list[str]] = {
    "gemm": ["gemm", "4096", "4096", "4096", "--json"],
    "linear": ["linear", "--in", "4096", "--out", "4096", "--batch", "8,64,128,256,512",
               "--json"],
    "gpus": ["gpus", "--json"],
    "python -c pass (floor)": [],
}


def time_once(args: list[str]) -> float:
    cmd = [sys.executable, "-m", "tilefit", *args] if args else [sys.executable, "-c", "pass"]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per command (default 5)")
    opts = parser.parse_args()
    time_once(COMMANDS["gpus"])  # warm the file cache once; not counted
    print(f"{'command':<24} {'min s':>7} {'median s':>9} {'max s':>7}  (n={opts.repeat})")
    for name, args in COMMANDS.items():
        runs = [time_once(args) for _ in range(opts.repeat)]
        print(f"{name:<24} {min(runs):7.3f} {statistics.median(runs):9.3f} {max(runs):7.3f}")


if __name__ == "__main__":
    main()
