"""Held-out GEMM accuracy of the cost model on this machine's CPU (or the live GPU).

Measures N shapes that are NOT in the calibration grid (log-uniform per dimension in
[--lo, --hi], half aligned to 64 elements, half with an odd dimension), predicts each with
tilefit.gemm.analyze_gemm on the device as get_device gives it (the calibration profile when
one is stored, else the probe), and with the uncalibrated device for comparison. Prints the
median and p90 relative error, the count, and the aligned / misaligned split.

Target (BENCH AND CALIBRATE issue): after `tilefit calibrate --quick` on the CPU, the median
error over >= 200 held-out shapes within 20%.

    PYTHONPATH=src python benchmarks/bench_gemm_accuracy.py [--count 200] [--dtype fp32]
        [--device cpu] [--json out.json]

TODO(step time, after the estimator is merged and reviewed): the second target, predicted
training step time of five models within 25% of measured on this CPU, is NOT checked here
yet. Plan: for five small catalog workloads (tilefit.models.load_workload), build the model on
the CPU, time real steps (forward, loss, backward, optimizer step; warm-up, median of >= 5,
the same busy-machine caveats as the GEMMs) and compare with
tilefit.estimator.workload_estimate.estimate_workload(workload, Recipe(batch, "fp32"), "cpu")
.step_time_s; with `tilefit bench step` as its CLI.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

import numpy as np

from tilefit.calibrate.fit import error_summary
from tilefit.calibrate.grid import all_grid_shapes, held_out_shapes
from tilefit.calibrate.run import device_kind, live_device, measure_samples
from tilefit.gemm import analyze_gemm
from tilefit.hardware import get_device


def summarize(rows: list[dict[str, Any]], key: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, sel in (("all", rows), ("aligned", [r for r in rows if r["aligned"]]),
                      ("misaligned", [r for r in rows if not r["aligned"]])):
        med, p90 = error_summary(np.array([abs(r[key]) for r in sel]))
        out[name] = {"count": len(sel), "median_error": med, "p90_error": p90}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("--lo", type=int, default=32)
    ap.add_argument("--hi", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args(argv)
    kind = device_kind(args.device)
    start = time.perf_counter()
    calibrated = get_device(kind)
    raw = live_device(kind)
    shapes = held_out_shapes(args.count, args.lo, args.hi, all_grid_shapes(kind))
    samples = measure_samples([s for s, _ in shapes], args.dtype, raw, 0.02,
                              rounds=args.rounds)
    rows = []
    for (shape, aligned), smp in zip(shapes, samples, strict=True):
        m, n, k = shape
        p_cal = analyze_gemm(m, n, k, args.dtype, calibrated).predicted_time_s
        p_raw = analyze_gemm(m, n, k, args.dtype, dataclasses.replace(raw, profile=None))
        rows.append({"m": m, "n": n, "k": k, "aligned": aligned, "measured_s": smp.time_s,
                     "predicted_s": p_cal, "error": (p_cal - smp.time_s) / smp.time_s,
                     "predicted_uncalibrated_s": p_raw.predicted_time_s,
                     "error_uncalibrated": (p_raw.predicted_time_s - smp.time_s) / smp.time_s})
    result = {
        "device": calibrated.display_name, "dtype": args.dtype, "source": calibrated.source,
        "calibrated": calibrated.profile is not None,
        "model": summarize(rows, "error"), "uncalibrated": summarize(rows, "error_uncalibrated"),
        "target_median_error": 0.20, "duration_s": time.perf_counter() - start, "rows": rows,
    }
    print(f"device: {result['device']} ({args.dtype}); model source: {result['source']}")
    for label in ("model", "uncalibrated"):
        for part, s in result[label].items():
            print(f"{label:>13} {part:>10}: n={s['count']:4d}  median |err| "
                  f"{s['median_error']:6.1%}  p90 {s['p90_error']:6.1%}")
    ok = result["model"]["all"]["median_error"] <= 0.20
    print(f"target median <= 20%: {'PASS' if ok else 'FAIL'} "
          f"({result['duration_s']:.0f} s)")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
