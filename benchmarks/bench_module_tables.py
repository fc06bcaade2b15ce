"""Issue 25's module-table targets for `tilefit estimate llama-3-8b` (a100-80gb, batch 8, seq
2048, the Trainer's loop):

1. the per-module table (Estimate.modules: names, times, FLOPs, bytes, op counts) identical
   across 5 runs, each in a fresh interpreter with its own PYTHONHASHSEED (set, dict and
   hash order differ between them), compared exactly (floats by repr);
2. the rows' shares (time / step time, as the CLI's "time by module" column shows them) sum
   to 100% +- 1% on one GPU and on 8 (fsdp2, traced: `--gpus 8 --strategy fsdp2`);
3. apart: DeepSpeed ZeRO 1-3 on 8 GPUs (modelled on the one-GPU trace, `--strategy zeroN`),
   and ZeRO-2 with the optimizer offloaded (`--offload`), their shares summed the same way.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_module_tables.py [--runs 5]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
MODEL = "llama-3-8b"
HERE = Path(__file__).resolve().parent
OUT = HERE / "results_module_tables.txt"
ZERO = (("zero1", False), ("zero2", False), ("zero3", False), ("zero2", True))


def table_of(est: Any) -> dict[str, Any]:
    rows = [[m.module, repr(m.time_s), m.flops, m.bytes, m.ops] for m in est.modules]
    return {"rows": rows, "step_s": repr(est.step_time_s),
            "share_sum": sum(m.time_s for m in est.modules) / est.step_time_s}


def one_gpu(model: str) -> dict[str, Any]:
    import tilefit

    return table_of(tilefit.estimate(model))


def multi_gpu(model: str) -> dict[str, Any]:
    """8 GPUs under fsdp2 (traced), and the ZeRO strategies modelled on one one-GPU trace
    (what tilefit.estimate does for each: estimator.zero_step.traced_recipe drops the
    parallelism, so the trace is the same one)."""
    import tilefit
    from tilefit.estimator import estimate_strategy
    from tilefit.estimator.zero_step import traced_recipe
    from tilefit.hardware import get_device
    from tilefit.models import load_workload
    from tilefit.recipe import Parallelism, Recipe
    from tilefit.tracing.workload_traces import trace_workload

    device = get_device("a100-80gb")
    work = load_workload(model)
    out = {"fsdp2": table_of(tilefit.estimate(work, recipe=Recipe.for_model(
        work, parallel=Parallelism(world_size=8, strategy="fsdp2")), gpu=device))}
    first = Recipe.for_model(work, parallel=Parallelism(world_size=8, strategy="zero2"))
    tr = trace_workload(work, traced_recipe(first.on(device)), device)
    for strategy, offload in ZERO:
        par = Parallelism(world_size=8, strategy=strategy, offload=offload)
        out[strategy + (" offload" if offload else "")] = table_of(
            estimate_strategy(tr, device, par))
    return out


def child(kind: str, seed: int, model: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONHASHSEED": str(seed)}
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--child", kind, "--model", model],
                          env=env, check=True,
                          capture_output=True, text=True)
    result = json.loads(done.stdout.splitlines()[-1])
    result["wall_s"] = time.perf_counter() - t0
    return result


def digest(table: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(table["rows"]).encode()).hexdigest()[:12]


def compare(runs: list[dict[str, Any]]) -> list[str]:
    ref = runs[0]
    lines = []
    for i, run in enumerate(runs):
        same = run["rows"] == ref["rows"] and run["step_s"] == ref["step_s"]
        lines.append(f"run {i + 1} (PYTHONHASHSEED={i}): {len(run['rows'])} rows, digest "
                     f"{digest(run)}, step {float(run['step_s']) * 1e3:.3f} ms, "
                     f"{run['wall_s']:.0f} s wall, identical to run 1: {same}")
        if not same:
            diff = [(a, b) for a, b in zip(ref["rows"], run["rows"], strict=False) if a != b]
            lines += [f"    first differing rows: {diff[:3]}"]
    return lines


def share_line(name: str, table: dict[str, Any]) -> str:
    s = table["share_sum"]
    return (f"{name:14s} step {float(table['step_s']) * 1e3:9.2f} ms, {len(table['rows']):4d} "
            f"rows, shares sum {s:.4%} (within 100% +- 1%: {abs(s - 1) <= 0.01})")


def config_line(model: str) -> str:
    import torch

    return (f"# bench_module_tables: {time.strftime('%Y-%m-%d %H:%M')}, torch "
            f"{torch.__version__}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, torch "
            f"threads {torch.get_num_threads()}, {os.cpu_count()} cores, load average "
            f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; model {model}, a100-80gb, "
            "the CLI's defaults (batch 8, the model's seq, the Trainer's loop)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", choices=("one", "multi"), help=argparse.SUPPRESS)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--out", help=f"results file (default {OUT.name} for {MODEL}, else none)")
    args = ap.parse_args()
    if args.child:
        print(json.dumps((one_gpu if args.child == "one" else multi_gpu)(args.model)))
        return
    lines = [config_line(args.model), "", "1. the module table across runs (exact comparison)"]
    print(lines[0], flush=True)
    runs = [child("one", seed, args.model) for seed in range(args.runs)]
    lines += compare(runs)
    print("\n".join(lines[1:]), flush=True)
    multi = child("multi", 0, args.model)
    lines += ["", "2. shares of the step time, summed over every row",
              share_line("1 GPU", runs[0]), share_line("8 GPUs fsdp2", multi.pop("fsdp2")),
              "", "3. DeepSpeed ZeRO on 8 GPUs (modelled on the one-GPU trace)"]
    lines += [share_line(name, table) for name, table in multi.items() if name != "wall_s"]
    print("\n".join(lines[-9:]), flush=True)
    out = args.out or (str(OUT) if args.model == MODEL else None)
    if out:
        Path(out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
