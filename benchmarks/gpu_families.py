"""Where a real CUDA step spends its device time, by kernel category, against the prediction
(needs a GPU; one section of benchmarks/gpu_validation.py).

Why: on the public corpus (benchmarks/results_gpu_corpus.txt) tilefit predicts NVIDIA's
eager BERT SQuAD steps in TF32 20-55% too fast on A100/H100-class parts while its fp16 rows
match, and the runs' own logs rule out warm-up as the cause (docs/references.md, section 13).
The corpus gives one number per run; this check splits a step of the same kind of model
(BERT-base, sequence 384, eager attention) into GEMMs and memory-bound kernel families with
torch.profiler (each aten op's self device time) and sets each category's measured time beside
tilefit's predicted device time for the same category, in TF32 and fp16/bf16 autocast. A
category whose ratio stands apart from the others is where the time model is wrong.

    PYTHONPATH=src python benchmarks/gpu_families.py [--json out.json]

Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch

from tilefit.estimator.cost import op_family
from tilefit.tracing.shapes import classify

MODEL, SEQ_LEN, BATCH = "bert-base-uncased", 384, 32
PRECISIONS = ("tf32", "fp16-mixed", "bf16-mixed")
WARMUP_STEPS, PROFILED_STEPS = 3, 3


def category(op: str) -> str:
    """The cost model's category of an aten op named as torch.profiler ("aten::addmm") or as
    tilefit's records ("aten.addmm.default"): its kind (gemm, conv, attention, ...) or, for
    memory-bound ops, its kernel family (tilefit.estimator.cost.op_family); "other" for a
    name that is not an aten op."""
    name = op.replace("::", ".")
    parts = name.split(".")
    if len(parts) < 2 or parts[0] != "aten":
        return "other"
    packet = getattr(torch.ops.aten, parts[1], None)
    overloads = packet.overloads() if packet is not None else []
    if not overloads:
        return "other"
    kind = classify(getattr(packet, overloads[0]))
    return op_family(f"aten.{parts[1]}") if kind in ("memory", "unknown") else kind


def by_category(rows: Iterable[tuple[str, float]]) -> dict[str, float]:
    """Sum (op name, seconds) rows by category; views and non-aten names dropped."""
    out: dict[str, float] = defaultdict(float)
    for op, seconds in rows:
        cat = category(op)
        if cat not in ("view", "other") and seconds > 0:
            out[cat] += seconds
    return dict(out)


def predicted(precision: str) -> tuple[dict[str, float], float]:
    """tilefit's device time by category for one step on the live GPU, and its step time."""
    from tilefit.estimator.workload_estimate import estimate_workload
    from tilefit.hardware import get_device
    from tilefit.models import load_workload
    from tilefit.recipe import Recipe

    work = load_workload(MODEL, task="seq-cls", seq_len=SEQ_LEN)
    recipe = Recipe(batch_size=BATCH, precision=precision, optimizer="adamw",
                    attention="eager")
    est = estimate_workload(work, recipe, get_device("auto"))
    return (by_category((c.record.op, c.time_s * c.repeats) for c in est.ops),
            est.step_time_s)


def measured(precision: str) -> tuple[dict[str, float], float]:
    """A real step's self device time by category (torch.profiler, per step) and its CUDA-event
    step time (median of the profiled steps)."""
    from torch.profiler import ProfilerActivity, profile

    from tilefit.models import load_workload

    work = load_workload(MODEL, task="seq-cls", seq_len=SEQ_LEN)
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    model = work.build("eager").cuda().train()
    batch = {k: v.cuda() for k, v in work.make_batch(BATCH).items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    half = {"fp16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(precision)
    scaler = torch.amp.GradScaler("cuda", enabled=half == torch.float16)
    times: list[float] = []

    def step() -> None:
        with torch.autocast("cuda", dtype=half or torch.float32, enabled=half is not None):
            loss = model(**batch).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    for _ in range(WARMUP_STEPS):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_STEPS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    rows = [(e.key, e.self_device_time_total / 1e6 / PROFILED_STEPS)
            for e in prof.key_averages()]
    torch.backends.cuda.matmul.allow_tf32 = False
    return by_category(rows), sorted(times)[len(times) // 2]


def compare(precision: str) -> dict[str, Any]:
    real, real_step_s = measured(precision)
    pred, pred_step_s = predicted(precision)
    cats = sorted(set(real) | set(pred), key=lambda c: -real.get(c, 0.0))
    return {"precision": precision, "measured_step_s": real_step_s,
            "predicted_step_s": pred_step_s, "step_error": pred_step_s / real_step_s - 1,
            "categories": [{"category": c, "measured_s": real.get(c, 0.0),
                            "predicted_s": pred.get(c, 0.0),
                            "predicted_over_measured": (pred.get(c, 0.0) / real[c]
                                                        if real.get(c) else None)}
                           for c in cats]}


def check_families() -> dict[str, Any]:
    """The section gpu_validation.py writes: one comparison per precision."""
    return {"status": "measured", "model": MODEL, "batch": BATCH, "seq_len": SEQ_LEN,
            "attention": "eager", "rows": [compare(p) for p in PRECISIONS]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the result to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU (nothing measured)")
        return 0
    result = check_families()
    for row in result["rows"]:
        print(f"{row['precision']}: step measured {row['measured_step_s'] * 1e3:.1f} ms, "
              f"predicted {row['predicted_step_s'] * 1e3:.1f} ms ({row['step_error']:+.1%})")
        for c in row["categories"]:
            ratio = c["predicted_over_measured"]
            print(f"  {c['category']:<20} measured {c['measured_s'] * 1e3:8.2f} ms  predicted "
                  f"{c['predicted_s'] * 1e3:8.2f} ms  "
                  + (f"x{ratio:.2f}" if ratio is not None else "-"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
