"""How long `tilefit calibrate --device cpu --quick` takes, beside the fit it gives per dtype.

For each scenario, in fresh processes with their own cache directory (so no stored profile is
touched):
1. `python -m tilefit calibrate --device cpu --quick --json`, timed from outside: the wall
   time a user waits, Python's start-up included;
2. held-out GEMMs per dtype, as benchmarks/bench_gemm_accuracy.py measures them: shapes in no
   calibration grid (grid.held_out_shapes: log-uniform in 32..2048 per dimension, half
   aligned to 64, half with an odd dimension), each the least of 2 interleaved rounds' medians
   (measure_samples), predicted by tilefit.gemm.analyze_gemm on get_device("cpu"), which now
   carries the profile; the median and p90 of |predicted - measured| / measured.

Scenarios: "native" (this CPU as it is) and "no-bf16-kernel": ONEDNN_MAX_CPU_ISA=AVX2 keeps
oneDNN off AVX-512 and its bf16 instructions, so torch's bf16 GEMM falls back to a generic
kernel (1.5 GFLOP/s against fp32's 150-180 on this 2-core EPYC: measured), the CPU of issue 16
that has no fast bf16 path. A dtype the calibration found slow gets a fifth of the held-out
shapes, so that checking it does not take longer than calibrating.

Before and after each scenario: CPU model, torch threads, load average (busy neighbours slow
2-thread GEMMs by whole scheduler slices; see tilefit.calibrate.measure.busy_warning).

Targets (issue 16): the quick calibration under 180 s in every scenario; fp32 held-out median
error <= 5%.

    PYTHONPATH=src python benchmarks/bench_calibrate_quick.py [--count 100]
        [--scenario native --scenario no-bf16-kernel] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

SCENARIOS: dict[str, dict[str, str]] = {
    "native": {},
    "no-bf16-kernel": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
}
TARGET_S = 180.0
TARGET_FP32_MEDIAN = 0.05
SLOW_COUNT_DIVISOR = 5  # held-out shapes for a dtype the calibration reported slow


def machine_line() -> str:
    import torch

    from tilefit.hardware.cpu import cpu_model_name

    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    return (f"CPU {cpu_model_name()}, {os.cpu_count()} cores, torch {torch.__version__} "
            f"threads {torch.get_num_threads()}, load average {load}")


def run_child(args: list[str], env: dict[str, str], timeout_s: float) -> tuple[str, float]:
    """stdout of ``python ARGS`` with ``env`` added, and its wall time."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *args], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=timeout_s, check=False)
    wall_s = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{args} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout, wall_s


def held_out(dtypes: list[str], count: int, slow: list[str]) -> dict[str, Any]:
    """(In the child process.) Held-out error per dtype against the stored profile."""
    import numpy as np

    from tilefit.calibrate.fit import error_summary
    from tilefit.calibrate.grid import all_grid_shapes, held_out_shapes
    from tilefit.calibrate.run import live_device, measure_samples
    from tilefit.gemm import analyze_gemm
    from tilefit.hardware import get_device

    calibrated, raw = get_device("cpu"), live_device("cpu")
    out: dict[str, Any] = {"calibrated": calibrated.profile is not None}
    for dt in dtypes:
        n = max(10, count // SLOW_COUNT_DIVISOR) if dt in slow else count
        shapes = held_out_shapes(n, 32, 2048, all_grid_shapes("cpu"))
        start = time.perf_counter()
        samples = measure_samples([s for s, _ in shapes], dt, raw, 0.02, rounds=2)
        errors = [abs(analyze_gemm(s.m, s.n, s.k, dt, calibrated).predicted_time_s - s.time_s)
                  / s.time_s for s in samples]
        med, p90 = error_summary(np.array(errors))
        out[dt] = {"count": n, "median_error": med, "p90_error": p90,
                   "measure_s": time.perf_counter() - start}
    return out


def scenario(name: str, count: int) -> dict[str, Any]:
    env = {**SCENARIOS[name], "TILEFIT_CACHE_DIR": tempfile.mkdtemp(prefix="tilefit-bcq-")}
    me = os.path.abspath(__file__)
    before, _ = run_child([me, "--machine"], env, 120)
    stdout, wall_s = run_child(["-m", "tilefit", "calibrate", "--device", "cpu", "--quick",
                                "--json"], env, 900)
    cal = json.loads(stdout)
    dtypes = [d["dtype"] for d in cal["calibration"]["dtypes"]]
    slow = [d["dtype"] for d in cal["calibration"]["dtypes"] if d["slow"]]
    after_cal, _ = run_child([me, "--machine"], env, 120)
    ho_out, _ = run_child([me, "--held-out", ",".join(dtypes), "--count", str(count),
                           "--slow", ",".join(slow)], env, 1800)
    after, _ = run_child([me, "--machine"], env, 120)
    return {"scenario": name, "env": SCENARIOS[name], "machine_before": before.strip(),
            "machine_after_calibrate": after_cal.strip(), "machine_after": after.strip(),
            "wall_s": wall_s, "calibration": cal["calibration"],
            "fits": {g["dtype"]: g for g in cal["gemm"]}, "held_out": json.loads(ho_out)}


def report(r: dict[str, Any]) -> list[str]:
    cal = r["calibration"]
    env = " ".join(f"{k}={v}" for k, v in r["env"].items()) or "no extra environment"
    ok = r["wall_s"] <= TARGET_S
    lines = [f"== {r['scenario']} ({env})", f"before:            {r['machine_before']}",
             f"calibrate --quick: {r['wall_s']:.1f} s wall ({cal['duration_s']:.1f} s inside; "
             f"expected {cal['expected_s']:.1f} s; budget {cal['time_budget_s']:.0f} s) "
             f"target < {TARGET_S:.0f} s: {'PASS' if ok else 'FAIL'}",
             f"after calibrate:   {r['machine_after_calibrate']}"]
    ref = cal["reference_dtype"]
    for d in cal["dtypes"]:
        dt, fit, ho = d["dtype"], r["fits"].get(d["dtype"]), r["held_out"][d["dtype"]]
        rounds = f"{d['rounds_done']} round" + ("s" if d["rounds_done"] != 1 else "")
        grid = (f"{d['grid']['shapes']} shapes up to {d['grid']['max_dim']} x {rounds}"
                if d["grid"] else "not measured")
        lines.append(f"  {dt}: {d['probe_flops_per_s'] / 1e9:.0f} GFLOP/s on the probe "
                     f"({d['relative_rate']:.0%} of {ref}{', slow' if d['slow'] else ''}); "
                     f"{grid} in {d['measured_s']:.1f} s (predicted {d['predicted_s']:.1f})")
        lines.append(f"    skipped: {d['skipped'] or 'nothing'}")
        if fit:
            lines.append(f"    grid fit:  median {fit['median_error']:6.1%}  p90 "
                         f"{fit['p90_error']:6.1%}  ({fit['shapes']} shapes)")
        lines.append(f"    held-out:  median {ho['median_error']:6.1%}  p90 "
                     f"{ho['p90_error']:6.1%}  ({ho['count']} shapes, {ho['measure_s']:.0f} s)")
    fp32 = r["held_out"].get("fp32")
    if fp32:
        ok = fp32["median_error"] <= TARGET_FP32_MEDIAN
        lines.append(f"  fp32 held-out median <= {TARGET_FP32_MEDIAN:.0%}: "
                     f"{'PASS' if ok else 'FAIL'}")
    lines.append(f"after:             {r['machine_after']}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", action="append", choices=list(SCENARIOS))
    ap.add_argument("--count", type=int, default=100, help="held-out shapes per dtype")
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--machine", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--held-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--slow", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.machine:  # child: the machine line, in the scenario's environment
        print(machine_line())
        return 0
    if args.held_out is not None:  # child: held-out errors against the stored profile
        print(json.dumps(held_out(args.held_out.split(","), args.count,
                                  [s for s in args.slow.split(",") if s])))
        return 0
    results = []
    for name in args.scenario or list(SCENARIOS):
        results.append(scenario(name, args.count))
        print("\n".join(report(results[-1])), flush=True)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
