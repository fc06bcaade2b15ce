"""Predicted peak memory and step time against a real CUDA run (needs a GPU).

For each workload of benchmarks/workloads.py (fp32 and bf16-mixed): two real training steps
on the live GPU, measured with torch.cuda.max_memory_allocated (peak) and CUDA events (the
median of further steady steps), against tilefit's prediction for the live device
(`--gpu auto`). Targets (issue 3): peak within 3%; (issue 7) step time within 15%. Issue 26:
the reserved peak (torch.cuda.max_memory_reserved) against the replay of the traced step, and
the allocator's own recorded requests replayed through tilefit's allocator model
(``allocator_model_error``: the model alone, the tracer left out), with each case's allocator
snapshot written for PyTorch's memory visualizer (``--snapshots DIR``).

    python benchmarks/gpu_memory_check.py [--json out.json] [--snapshots DIR]

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


def _on_gpu(case: Case, precision: str) -> tuple[Any, Any, Any, Any]:
    """The case's model, batch and optimizer on the GPU, and the precision's autocast."""
    torch.manual_seed(0)
    model = case.build().cuda().train()
    if case.grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = _to(case.batch(), "cuda")
    opt = case.optimizer(model.parameters())
    ctx = (torch.autocast("cuda", dtype=torch.bfloat16) if precision == "bf16-mixed"
           else torch.autocast("cuda", enabled=False))
    return model, batch, opt, ctx


def _step(case: Case, model: Any, batch: Any, opt: Any, ctx: Any) -> None:
    """One training step as the trace runs it: forward under ``ctx``, backward, optimizer
    step, gradients set to None."""
    with ctx:
        loss = case.loss_fn(model, batch)
    loss.backward()
    del loss
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure(case: Case, precision: str, steps: int = 10,
            snapshot: Path | None = None) -> dict[str, Any]:
    """Two real steps measured, then ``steps`` timed. The allocator's history is recorded
    from the model's build to the end of the second step (every request, no stacks;
    tilefit.compat.cuda_memory): replayed through tilefit's allocator model it gives the
    reserved peak the model computes for the real stream of requests, apart from the tracer
    (``history_replay_reserved_bytes``: plus what was reserved before, the cuBLAS workspace's
    segment of an earlier case). ``snapshot``: also write the allocator's snapshot there (a
    pickle for https://pytorch.org/memory_viz)."""
    from tilefit.compat.cuda_memory import (
        allocator_history,
        dump_allocator_snapshot,
        record_allocator_history,
    )

    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()  # blocks still live: an earlier case's workspace
    record_allocator_history(True)
    try:
        model, batch, opt, ctx = _on_gpu(case, precision)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()  # parameters, buffers and the batch
        for _ in range(2):  # the two traced steps: the first makes the optimizer state
            _step(case, model, batch, opt, ctx)
        torch.cuda.synchronize()
        history = allocator_history()
        if snapshot is not None:
            snapshot.parent.mkdir(parents=True, exist_ok=True)
            dump_allocator_snapshot(str(snapshot))
    finally:
        record_allocator_history(False)
    peak, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    # the allocator's own layout, for checking the replay segment by segment
    segments = sorted(s["total_size"] for s in torch.cuda.memory_snapshot())
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    times = _timed(case, model, batch, opt, ctx, steps)
    del model, opt, batch
    torch.cuda.empty_cache()
    return {"peak_bytes": peak, "base_bytes": base, "step_time_s": statistics.median(times),
            "reserved_bytes": reserved, "segments": segments, "alloc_retries": retries,
            **_history_replay(history, before)}


def _timed(case: Case, model: Any, batch: Any, opt: Any, ctx: Any, steps: int
           ) -> list[float]:
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _step(case, model, batch, opt, ctx)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def _history_replay(history: list[dict[str, Any]], before: int) -> dict[str, Any]:
    """The recorded requests through tilefit's allocator model (PyTorch's defaults, no
    line): its reserved peak, plus what was reserved before the recording."""
    from tilefit.estimator.allocator_history import events_of_history
    from tilefit.estimator.allocator_replay import replay

    events = events_of_history(history)
    return {"history_events": len(events), "reserved_before_bytes": before,
            "history_replay_reserved_bytes": replay(events).peak_reserved_bytes + before}


def predict(case: Case, precision: str) -> dict[str, float]:
    from tilefit import Recipe
    from tilefit.bench.step import as_cuda_counts
    from tilefit.estimator import estimate

    recipe = Recipe(optimizer=case.optimizer, precision=precision,
                    grad_checkpointing=case.grad_checkpointing)
    e = estimate(case.build, case.batch(), loss_fn=case.loss_fn, recipe=recipe, gpu="auto")
    # max_memory_allocated also counts cuBLAS's workspace (one more segment of its own in
    # max_memory_reserved)
    visible, reserved = as_cuda_counts(e)
    return {"peak_bytes": visible, "step_time_s": e.step_time_s, "gpu": e.device.name,
            "reserved_bytes": reserved,
            "segments": None if e.reserved is None else e.reserved.segments}


def measure_squeezed(case: Case, precision: str, limit_bytes: int) -> dict[str, Any]:
    """Three real steps with the caching allocator capped at ``limit_bytes`` (a per-process
    memory fraction: cudaMalloc fails past it as at the device's end): the retries after a
    release of the cache (memory_stats' num_alloc_retries) over the first two steps and in
    the third, the reserved peak; ``oom`` where a step ran out of memory."""
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    torch.cuda.reset_accumulated_memory_stats()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.set_per_process_memory_fraction(limit_bytes / total)
    counts: list[int] = []
    try:
        model, batch, opt, ctx = _on_gpu(case, precision)
        for _ in range(3):
            _step(case, model, batch, opt, ctx)
            torch.cuda.synchronize()
            counts.append(torch.cuda.memory_stats().get("num_alloc_retries", 0))
        reserved = torch.cuda.max_memory_reserved()
        del model, opt, batch
    except torch.cuda.OutOfMemoryError:
        return {"oom": True, "alloc_retries": None, "steady_alloc_retries": None}
    finally:
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0)
    return {"oom": False, "alloc_retries": counts[1], "steady_alloc_retries":
            counts[2] - counts[1], "reserved_bytes": reserved}


def predict_squeezed(case: Case, precision: str, limit_bytes: int, gpu: str = "auto"
                     ) -> dict[str, Any]:
    """tilefit's replay of the same step on ``gpu`` (the live one) against the same cap,
    less cuBLAS's workspace (a segment of the allocator the trace does not hold)."""
    from tilefit import Recipe, trace
    from tilefit.estimator import cublas_workspace_bytes
    from tilefit.estimator.reserved import allocator_config_of, reserved_memory
    from tilefit.hardware import get_device

    recipe = Recipe(optimizer=case.optimizer, precision=precision,
                    grad_checkpointing=case.grad_checkpointing)
    tr = trace(case.build, case.batch(), loss_fn=case.loss_fn, recipe=recipe, gpu=gpu)
    r = reserved_memory(tr, limit_bytes - cublas_workspace_bytes(get_device(gpu)),
                        allocator_config_of(tr))
    return {"oom": not r.fits, "alloc_retries": r.alloc_retries,
            "steady_alloc_retries": r.steady_alloc_retries}


def run_squeezed(rows: list[dict[str, Any]], cap_below: int = 2**21) -> list[dict[str, Any]]:
    """Each measured row again with the allocator capped ``cap_below`` bytes under the
    reserved peak it reached uncapped, so that it must release its cache: whether tilefit's
    replay releases as often, and whether the releases recur in the third step
    (docs/references.md, section 42)."""
    cases = {c.name: c for c in CASES}
    out = []
    for row in rows:
        limit = int(row["measured_reserved_bytes"]) - cap_below
        case = cases[row["workload"]]
        real = measure_squeezed(case, row["precision"], limit)
        pred = predict_squeezed(case, row["precision"], limit)
        out.append({"workload": row["workload"], "precision": row["precision"],
                    "limit_bytes": limit, "measured": real, "predicted": pred})
    return out


def run(snapshots: Path | None = None) -> list[dict[str, Any]]:
    """Every workload in fp32 and bf16 autocast, measured and predicted; ``snapshots``: a
    directory for the allocator's snapshot of each."""
    rows = []
    for case in CASES:
        for precision in ("fp32", "bf16-mixed"):
            where = None if snapshots is None else snapshots / f"{case.name}-{precision}.pickle"
            real = measure(case, precision, snapshot=where)
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
                "history_events": real["history_events"],
                "history_replay_reserved_bytes": real["history_replay_reserved_bytes"],
                # the allocator model alone: its replay of the real requests against the
                # real reserved peak
                "allocator_model_error":
                    real["history_replay_reserved_bytes"] / real["reserved_bytes"] - 1,
            })
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--snapshots", help="write each case's allocator snapshot here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU (nothing measured)")
        return 0
    rows = run(None if args.snapshots is None else Path(args.snapshots))
    print(f"{'workload':50} {'prec':10} {'peak err':>9} {'time err':>9}")
    for r in rows:
        print(f"{r['workload']:50} {r['precision']:10} {r['peak_error']:+9.2%} "
              f"{r['step_time_error']:+9.2%}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
