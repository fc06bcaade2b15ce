"""Issue 25's way-forward target, measured over the catalog: for every catalog model on
rtx-4090, a100-40gb and t4 at its default batch and sequence (what `tilefit audit NAME --gpu G`
runs: micro-batch 8, the model's default seq, the Hugging Face Trainer's loop), where the step
does not fit, the audit's first finding is a recipe predicted to fit, and `tilefit plan NAME
--gpu G --global-batch 8` chooses the same recipe (label, micro-batch, accumulation, step time).

Each case runs in its own interpreter (nothing cached between cases; a timeout per case):
  1. tilefit.estimate at the CLI audit's recipe; it fits -> the row says so, nothing more;
  2. tilefit.audit with the same recipe: its first finding (rule, suggested recipe, predicted
     step time and peak) and the plan behind it (Audit.plan);
  3. tilefit.plan with the CLI plan's recipe (its own defaults, no batch) at the same global
     batch, a second, independent search: its best row against the audit's.
"Predicted to fit": the chosen row's memory (reserved peak where modelled) <= the plan's budget,
and with the CUDA context and workspaces <= the device's memory.

Rows are appended to the results file as each case finishes (a partial run keeps its rows).

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_way_forward.py \
        [--models gpt2,phi-2] [--gpus t4] [--out FILE] [--timeout 1800]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
GIB = 2**30
GPUS = ("rtx-4090", "a100-40gb", "t4")
HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results_way_forward.txt"
COLUMNS = (f"{'model':20s} {'gpu':9s} {'fits':4s} {'first finding (audit)':44s} "
           f"{'plan chooses':44s} {'agree':5s} {'peak GiB/capacity':>20s} {'case s':>6s}")


def _row_fields(row: Any) -> dict[str, Any]:
    return {"label": row.recipe_label(), "micro_batch": row.micro_batch,
            "accumulation": row.accumulation_steps, "step_s": row.predicted_step_time_s,
            "peak_bytes": row.predicted_peak_memory_bytes, "memory_bytes": row.memory_bytes,
            "budget_bytes": row.budget_bytes, "fits": row.fits, "changes": list(row.changes),
            "recipe": row.recipe.to_dict()}  # all of it: a label can hide a field


def _plan_fields(found: Any) -> dict[str, Any]:
    multi = found.multi_gpu
    return {"best": None if found.best is None else _row_fields(found.best),
            "overhead_bytes": found.overhead_bytes, "reason": found.reason,
            "traces": found.traces,
            "multi_gpu": None if multi is None or multi.best is None else
            f"{multi.gpus} GPUs: {multi.best.recipe_label()}"}


def run_case(model: str, gpu: str) -> dict[str, Any]:
    """One model on one GPU, as the CLI's audit and plan would run it."""
    import tilefit
    from tilefit.cli import model_options as mo
    from tilefit.hardware import get_device
    from tilefit.models import load_workload
    from tilefit.recipe import DEFAULT_BATCH

    device = get_device(gpu)
    work = load_workload(model)  # the model's default seq (`tilefit audit` without --seq)
    audit_recipe = mo.recipe(work, batch_size=DEFAULT_BATCH)  # `tilefit audit`'s flags
    est = tilefit.estimate(work, recipe=audit_recipe, gpu=device)
    out: dict[str, Any] = {
        "model": model, "gpu": gpu, "seq": work.seq_len, "fits": est.fits,
        "precision": est.precision, "total_bytes": est.total_memory_bytes,
        "reserved_bytes": est.peak_reserved_bytes, "capacity_bytes": device.memory_bytes,
        "global_batch": audit_recipe.global_batch}
    if est.fits:
        return out
    aud = tilefit.audit(work, recipe=audit_recipe, gpu=device)
    first = aud.findings[0] if aud.findings else None
    out["audit_fits"] = aud.estimate.fits
    out["first"] = None if first is None else {
        "rule": first.rule, "title": first.title, "suggested": first.suggested,
        "step_after_s": first.step_time_after_s, "peak_after_bytes":
        first.peak_memory_after_bytes, "recommended": first.recommended}
    out["audit_plan"] = None if aud.plan is None else _plan_fields(aud.plan)
    found = tilefit.plan(work, global_batch=audit_recipe.global_batch, gpu=device,
                         recipe=mo.recipe(work))  # `tilefit plan --global-batch 8`'s recipe
    out["plan"] = _plan_fields(found)
    return out


def suggested_of(best: dict[str, Any] | None) -> str | None:
    """way_forward's wording of a plan row (advise.way_forward._label)."""
    if best is None:
        return None
    return (f"{best['label']}, micro-batch {best['micro_batch']} x {best['accumulation']} "
            "accumulation steps")


def verdict(case: dict[str, Any]) -> tuple[bool, list[str]]:
    """Whether the not-fitting case meets the target, and what fails when it does not."""
    problems = []
    first, mine, theirs = case.get("first"), case.get("audit_plan"), case.get("plan")
    if first is None or first["rule"] != "way-forward":
        problems.append(f"first finding is {None if first is None else first['rule']}")
    best = None if theirs is None else theirs["best"]
    if best is None:
        multi = None if theirs is None else theirs["multi_gpu"]
        problems.append("plan: no recipe fits one GPU" + (f" ({multi})" if multi else ""))
        return False, problems
    if not best["fits"] or best["memory_bytes"] + theirs["overhead_bytes"] > \
            case["capacity_bytes"]:
        problems.append("plan's best is not predicted to fit")
    if first is not None and first["suggested"] != suggested_of(best):
        problems.append(f"suggested {first['suggested']!r} != plan's {suggested_of(best)!r}")
    if first is not None and first["step_after_s"] != best["step_s"]:
        problems.append(f"step {first['step_after_s']} != plan's {best['step_s']}")
    if mine is not None and mine["best"] != best:
        problems.append("audit's plan row != plan's row (fields differ)")
    return not problems, problems


def table_row(case: dict[str, Any]) -> str:
    cap = case["capacity_bytes"] / GIB
    head = f"{case['model']:20s} {case['gpu']:9s}"
    secs = f"{case.get('elapsed_s', 0):6.0f}"
    if "error" in case:
        return f"{head} {'?':4s} ERROR {case['error'][:120]}"
    if case["fits"]:
        mem = f"{case['total_bytes'] / GIB:.1f}/{cap:.1f}"
        return f"{head} {'yes':4s} {'-':44s} {'-':44s} {'-':5s} {mem:>20s} {secs}"
    first = case["first"] or {}
    plan_best = case["plan"]["best"]
    ok, _ = verdict(case)
    shown = first.get("suggested") or (first.get("rule") or "none")
    mine = suggested_of(plan_best) or "no one-GPU recipe"
    after = "" if plan_best is None else \
        f"{(plan_best['memory_bytes'] + case['plan']['overhead_bytes']) / GIB:.1f}/{cap:.1f}"
    before = f"{case['total_bytes'] / GIB:.0f}->"
    return (f"{head} {'no':4s} {shown[:44]:44s} {mine[:44]:44s} {'yes' if ok else 'NO':5s} "
            f"{(before + after):>20s} {secs}")


def run_one_subprocess(model: str, gpu: str, timeout: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    cmd = [sys.executable, __file__, "--case", model, gpu]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        case: dict[str, Any] = {"model": model, "gpu": gpu, "error": f"timeout {timeout:.0f} s",
                                "capacity_bytes": 0}
    else:
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        if done.returncode or not lines:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            case = {"model": model, "gpu": gpu, "error": tail, "capacity_bytes": 0}
        else:
            case = json.loads(lines[-1])
    case["elapsed_s"] = time.perf_counter() - t0
    return case


def config_lines() -> list[str]:
    import torch

    return [f"# bench_way_forward: {time.strftime('%Y-%m-%d %H:%M')}, torch {torch.__version__}, "
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, torch threads "
            f"{torch.get_num_threads()}, {os.cpu_count()} cores, load average "
            f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}",
            "# each case: estimate at `tilefit audit NAME --gpu G`'s recipe (batch 8, default "
            "seq); not fitting: audit, then plan --global-batch 8 (separate interpreters)",
            "# peak GiB/capacity: fitting rows the step's tensors + context; others the "
            "step's before -> the chosen plan's (reserved peak + context) / device memory"]


def by_size(models: list[str]) -> list[str]:
    """Smallest first (parameters from the catalog's cached count), so a partial run covers
    the most cases."""
    from tilefit.models.params import catalog_models

    sizes = {m.name: m.parameters for m in catalog_models()}
    return sorted(models, key=lambda m: sizes.get(m, 0))


def summary(cases: list[dict[str, Any]]) -> list[str]:
    failing = [c for c in cases if "error" not in c and not c["fits"]]
    good = [c for c in failing if verdict(c)[0]]
    errors = [c for c in cases if "error" in c]
    lines = [f"{len(good)} of {len(failing)} not-fitting cases: first finding fits and equals "
             f"plan ({len(cases)} cases run, {len(cases) - len(failing) - len(errors)} fit as "
             f"they are, {len(errors)} errors)"]
    for c in failing:
        ok, problems = verdict(c)
        if not ok:
            lines.append(f"  {c['model']} on {c['gpu']}: " + "; ".join(problems))
    for c in errors:
        lines.append(f"  {c['model']} on {c['gpu']}: ERROR {c['error']}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", nargs=2, metavar=("MODEL", "GPU"), help=argparse.SUPPRESS)
    ap.add_argument("--models", help="comma-separated catalog names (default: all)")
    ap.add_argument("--gpus", default=",".join(GPUS))
    ap.add_argument("--out", help=f"results file (default {DEFAULT_OUT.name} for a full run, "
                    "none for a subset)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per case")
    ap.add_argument("--summarize", metavar="FILE", help="append the summary of a stopped "
                    "run's rows (its '# {...}' lines) to FILE")
    args = ap.parse_args()
    if args.case:
        print(json.dumps(run_case(*args.case)))
        return
    if args.summarize:
        done = [json.loads(ln[2:]) for ln in Path(args.summarize).read_text().splitlines()
                if ln.startswith("# {")]
        with Path(args.summarize).open("a") as fh:
            fh.write("# stopped before the end: the summary of the rows above\n"
                     + "\n".join(summary(done)) + "\n")
        return
    from tilefit.models import catalog_names

    models = by_size(args.models.split(",") if args.models else catalog_names())
    gpus = args.gpus.split(",")
    out = Path(args.out) if args.out else (None if args.models or args.gpus != ",".join(GPUS)
                                           else DEFAULT_OUT)

    def emit(text: str, mode: str = "a") -> None:
        print(text, flush=True)
        if out is not None:
            with out.open(mode) as fh:
                fh.write(text + "\n")

    emit("\n".join(config_lines()), "w")
    emit(COLUMNS)
    cases = []
    for model in models:
        for gpu in gpus:
            case = run_one_subprocess(model, gpu, args.timeout)
            cases.append(case)
            emit(table_row(case))
            emit("# " + json.dumps(case))
    emit("\n".join(summary(cases)))


if __name__ == "__main__":
    main()
