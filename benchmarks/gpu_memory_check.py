"""Predicted peak memory and step time against a real CUDA run (needs a GPU).

For each workload of benchmarks/workloads.py (fp32 and bf16-mixed): two real training steps
on the live GPU, measured with torch.cuda.max_memory_allocated (peak) and CUDA events (the
median of further steady steps), against tilefit's prediction for the live device
(`--gpu auto`). Targets (issue 3): peak within 3%; (issue 7) step time within 15%.

    python benchmarks/gpu_memory_check.py [--json out.json]

Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from workloads import CASES, Case


def _to(batch: Any, device: str) -> Any:
    if isinstance(batch, dict):
        return {k: v.to(device) for k, v in batch.items()}
    return tuple(t.to(device) for t in batch)


def measure(case: Case, precision: str, steps: int = 10) -> dict[str, float]:
    torch.manual_seed(0)
    model = case.build().cuda().train()
    if case.grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = _to(case.batch(), "cuda")
    opt = case.optimizer(model.parameters())
    ctx = (torch.autocast("cuda", dtype=torch.bfloat16) if precision == "bf16-mixed"
           else torch.autocast("cuda", enabled=False))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()  # parameters, buffers and the batch
    times = []
    for i in range(2 + steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with ctx:
            loss = case.loss_fn(model, batch)
        loss.backward()
        del loss
        opt.step()
        opt.zero_grad(set_to_none=True)
        end.record()
        torch.cuda.synchronize()
        if i == 1:  # the two traced steps: the first makes the optimizer state
            peak = torch.cuda.max_memory_allocated()
            reserved = torch.cuda.max_memory_reserved()
            # the allocator's own layout, for checking the replay segment by segment
            segments = sorted(s["total_size"] for s in torch.cuda.memory_snapshot())
            retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        if i >= 2:
            times.append(start.elapsed_time(end) / 1e3)
    del model, opt, batch
    torch.cuda.empty_cache()
    return {"peak_bytes": peak, "base_bytes": base, "step_time_s": statistics.median(times),
            "reserved_bytes": reserved, "segments": segments, "alloc_retries": retries}


def predict(case: Case, precision: str) -> dict[str, float]:
    from tilefit import Recipe
    from tilefit.estimator import cublas_workspace_bytes, estimate

    recipe = Recipe(optimizer=case.optimizer, precision=precision,
                    grad_checkpointing=case.grad_checkpointing)
    e = estimate(case.build, case.batch(), loss_fn=case.loss_fn, recipe=recipe, gpu="auto")
    # max_memory_allocated also counts cuBLAS's workspace, which the caching allocator holds
    # (one more segment of its own in max_memory_reserved)
    workspace = cublas_workspace_bytes(e.device)
    visible = e.peak_memory_bytes + workspace
    reserved = None if e.reserved is None else e.reserved.peak_reserved_bytes + workspace
    return {"peak_bytes": visible, "step_time_s": e.step_time_s, "gpu": e.device.name,
            "reserved_bytes": reserved,
            "segments": None if e.reserved is None else e.reserved.segments}


def run() -> list[dict[str, Any]]:
    rows = []
    for case in CASES:
        for precision in ("fp32", "bf16-mixed"):
            real = measure(case, precision)
            pred = predict(case, precision)
            rows.append({
                "workload": case.name, "precision": precision, "gpu": pred["gpu"],
                "measured_peak_bytes": real["peak_bytes"],
                "predicted_peak_bytes": pred["peak_bytes"],
                "peak_error": pred["peak_bytes"] / real["peak_bytes"] - 1,
                "measured_step_time_s": real["step_time_s"],
                "predicted_step_time_s": pred["step_time_s"],
                "step_time_error": pred["step_time_s"] / real["step_time_s"] - 1,
                "measured_reserved_bytes": real["reserved_bytes"],
                "predicted_reserved_bytes": pred["reserved_bytes"],
                "reserved_error": (pred["reserved_bytes"] or 0) / real["reserved_bytes"] - 1,
                "measured_segments": real["segments"], "predicted_segments": pred["segments"],
                "alloc_retries": real["alloc_retries"],
            })
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU (nothing measured)")
        return 0
    rows = run()
    print(f"{'workload':50} {'prec':10} {'peak err':>9} {'time err':>9}")
    for r in rows:
        print(f"{r['workload']:50} {r['precision']:10} {r['peak_error']:+9.2%} "
              f"{r['step_time_error']:+9.2%}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
