"""One validation script for a CUDA machine (target: under 8 minutes on an H200).

    PYTHONPATH=src python benchmarks/gpu_validation.py OUT.json [--dtype bf16] [--count 300]

Checks, each a section of the one JSON written to OUT.json:
1. gemm: >= 300 held-out GEMM shapes (not in the calibration grid; half aligned, half with an
   odd dimension; log-uniform 128..8192 per dim), measured with CUDA events, predicted by
   tilefit.gemm with the catalog device (no calibration) and after an in-process
   `calibrate --quick` (profile written to a temporary cache dir, never the user's).
   Target: median |error| <= 10%.
2. estimate_memory: peak memory within 3% of torch.cuda.max_memory_allocated over real
   training steps (the workloads and measurement of benchmarks/gpu_memory_check.py);
   estimate_reserved: the replay's reserved peak against max_memory_reserved (issue 26), and
   the allocator model alone on the real allocator's recorded requests; each case's allocator
   snapshot is written beside OUT.json (allocator-snapshots/, for pytorch.org/memory_viz).
3. estimate_step_time: step time within 15% of the measured median step (same runs).
4. tune: on three models the chosen batch's samples/s within 3% of an exhaustive sweep
   (benchmarks/bench_tune_search.py's CUDA check).
5. families: a BERT-base step (sequence 384, eager attention) in TF32, fp16 and bf16 autocast,
   its device time by category (GEMMs and each memory-bound kernel family) from
   torch.profiler beside tilefit's prediction (benchmarks/gpu_families.py): where the
   corpus's TF32 over-prediction comes from.
6. host: the per-op host issue costs of eager CUDA on this machine (miniature models,
   tilefit.calibrate.host.measure_host(device="cuda")) beside the shipped defaults
   (tilefit.hardware.host.DEFAULT_HOST, fitted on the public corpus): the figures the
   two-timeline step model uses, measured for this GPU machine's own CPU.
7. lora: LoRA (r8 on q_proj/v_proj, bf16 autocast; r16 on every linear layer, pure bf16)
   and QLoRA (nf4 through transformers' from_pretrained) steps of a 4-layer Llama 3.2 1B,
   built for real by peft and bitsandbytes (benchmarks/gpu_lora_check.py): peak and
   reserved memory and step time beside the estimate. Target (issue 28): peak within 5%.
8. rnn: cuDNN's fused RNN (benchmarks/gpu_rnn_check.py): the reserve space _cudnn_rnn
   returns over a grid of shapes (not published; PyTorch's meta kernel leaves it empty) and
   nn.LSTM's output dtype under bf16 and fp16 autocast: what tracing RNNs as cuDNN runs them
   needs (issue 46, item 3).

Without CUDA it writes {"status": "skipped", ...} and exits 0 with a message, so it is safe to
import and run anywhere; the CPU-only parts (shape lists, summaries, hooks' pending answers)
are unit-tested.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GEMM_TARGET = 0.10
MEMORY_TARGET = 0.03
STEP_TIME_TARGET = 0.15
BUDGET_S = 8 * 60
GPU_LO, GPU_HI = 128, 8192


def summarize_errors(errors: list[float], aligned: list[bool]) -> dict[str, Any]:
    """Median / p90 of |error| overall and split aligned vs misaligned."""
    import numpy as np

    from tilefit.calibrate.fit import error_summary

    out: dict[str, Any] = {}
    for name, sel in (("all", [True] * len(errors)), ("aligned", aligned),
                      ("misaligned", [not a for a in aligned])):
        vals = np.array([abs(e) for e, s in zip(errors, sel, strict=True) if s])
        med, p90 = error_summary(vals)
        out[name] = {"count": int(vals.size), "median_error": med, "p90_error": p90}
    return out


def gemm_shapes(count: int) -> list[tuple[tuple[int, int, int], bool]]:
    from tilefit.calibrate.grid import all_grid_shapes, held_out_shapes

    return held_out_shapes(count, GPU_LO, GPU_HI, all_grid_shapes("cuda"), seed=7)


def check_gemm(dtype: str, count: int) -> dict[str, Any]:
    from tilefit.calibrate.run import calibrate, measure_samples
    from tilefit.gemm import analyze_gemm
    from tilefit.hardware.lookup import detect_live_device
    from tilefit.hardware.profiles import save_profile

    start = time.perf_counter()
    os.environ["TILEFIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="tilefit-val-")
    base = detect_live_device(use_profile=False)
    shapes = gemm_shapes(count)
    samples = measure_samples([s for s, _ in shapes], dtype, base, 0.01, rounds=2)
    profile = calibrate("cuda", quick=True).profile
    save_profile(profile)
    calibrated = detect_live_device()  # now carries the profile
    err_raw, err_cal, rows = [], [], []
    for (shape, aligned), smp in zip(shapes, samples, strict=True):
        p_raw = analyze_gemm(*shape, dtype, base).predicted_time_s
        p_cal = analyze_gemm(*shape, dtype, calibrated).predicted_time_s
        err_raw.append((p_raw - smp.time_s) / smp.time_s)
        err_cal.append((p_cal - smp.time_s) / smp.time_s)
        rows.append({"shape": list(shape), "aligned": aligned, "measured_s": smp.time_s,
                     "predicted_s": p_raw, "predicted_calibrated_s": p_cal})
    aligned = [a for _, a in shapes]
    cal = summarize_errors(err_cal, aligned)
    return {
        "status": "pass" if cal["all"]["median_error"] <= GEMM_TARGET else "fail",
        "target_median_error": GEMM_TARGET, "dtype": dtype, "device": base.display_name,
        "uncalibrated": summarize_errors(err_raw, aligned), "calibrated": cal,
        "profile": profile.to_dict(), "duration_s": time.perf_counter() - start, "rows": rows,
    }


def estimate_rows(snapshots: Path | None = None) -> list[dict[str, Any]]:
    """Real CUDA training steps against the estimator: the rows of the lead's
    benchmarks/gpu_memory_check.py (peak_error, step_time_error per workload and precision),
    loaded by path so that this script stays import-safe without CUDA; ``snapshots``: where
    each case's allocator snapshot goes."""
    import importlib.util
    from pathlib import Path

    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))
    spec = importlib.util.spec_from_file_location("gpu_memory_check",
                                                  here / "gpu_memory_check.py")
    if spec is None or spec.loader is None:
        raise ImportError("benchmarks/gpu_memory_check.py not found")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.run(snapshots)


def check_estimate(rows: list[dict[str, Any]], key: str, target: float) -> dict[str, Any]:
    """Every row's |error| in ``key`` within ``target``: pass/fail with the figures."""
    import statistics

    if not rows:
        return _pending("tilefit.estimator", f"{key} within {target:.0%}")
    errs = [abs(r[key]) for r in rows]
    return {"status": "pass" if max(errs) <= target else "fail", "target": target,
            "median_error": statistics.median(errs), "max_error": max(errs),
            "count": len(errs),
            "worst": max(rows, key=lambda r: abs(r[key])).get("workload", "")}


def check_estimate_memory(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Estimate.peak_memory_bytes (+ cuBLAS workspace) vs torch.cuda.max_memory_allocated."""
    return check_estimate(rows, "peak_error", MEMORY_TARGET)


# issue 26: the caching allocator's reserved peak, worst record within 12%
RESERVED_TARGET = 0.12


def check_estimate_reserved(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Estimate.reserved's peak (+ cuBLAS workspace) vs torch.cuda.max_memory_reserved; and
    the allocator model alone: the real allocator's recorded requests replayed through it,
    against the same reading (``allocator_model``)."""
    out = check_estimate(rows, "reserved_error", RESERVED_TARGET)
    model = [r["allocator_model_error"] for r in rows if "allocator_model_error" in r]
    out["allocator_model"] = {"errors": model, "worst": max(map(abs, model), default=None)}
    return out


def check_alloc_retries(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each workload with the allocator capped 2 MiB under its measured reserved peak
    (gpu_memory_check.run_squeezed): the real num_alloc_retries of the first two steps and
    of the third against the replay's (Estimate.reserved.alloc_retries and
    steady_alloc_retries). Recorded for the model's check; no target yet (pass when every
    row agrees on whether the third step retries)."""
    if not rows:
        return _pending("tilefit.estimator.reserved", "retries under a cap")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_memory_check import run_squeezed

    squeezed = run_squeezed(rows)
    agree = [bool(r["measured"]["steady_alloc_retries"]) ==
             bool(r["predicted"]["steady_alloc_retries"]) for r in squeezed
             if not r["measured"]["oom"] and not r["predicted"]["oom"]]
    return {"status": "pass" if agree and all(agree) else "fail", "rows": squeezed,
            "agree": sum(agree), "compared": len(agree)}


def check_estimate_step_time(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Estimate.step_time_s vs the measured median step."""
    return check_estimate(rows, "step_time_error", STEP_TIME_TARGET)


TUNE_TARGET = 0.97  # the chosen batch's samples/s within 3% of the sweep's best (issue 6)


def check_tune(scale: int = 8) -> dict[str, Any]:
    """tune on the live GPU for three models; the chosen batch against an exhaustive sweep."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_tune_search import cuda_throughput_rows

    rows = cuda_throughput_rows(scale)
    worst = min(r["ratio"] for r in rows)
    return {"status": "pass" if worst >= TUNE_TARGET else "fail",
            "target": f"chosen samples/s >= {TUNE_TARGET:.0%} of the sweep's best",
            "worst_ratio": worst, "rows": rows}


def check_host() -> dict[str, Any]:
    """Eager CUDA's per-op host costs measured here, beside the shipped defaults."""
    from dataclasses import asdict

    from tilefit.calibrate.host import measure_host
    from tilefit.hardware.host import DEFAULT_HOST

    try:
        fit = measure_host(device="cuda")
    except Exception as exc:  # report, don't lose the other sections
        return {"status": "error", "reason": f"{type(exc).__name__}: {exc}"}
    measured, default = asdict(fit.host), asdict(DEFAULT_HOST)
    ratio = {k: measured[k] / default[k] for k in measured
             if isinstance(default[k], float) and default[k] > 0}
    return {"status": "measured", "measured": measured, "default": default,
            "measured_over_default": ratio,
            "samples": [asdict(s) for s in fit.samples], "threads": fit.threads}


def check_optimizer() -> dict[str, Any]:
    """Real foreach and fused AdamW steps (GPT-2 small, BERT base) against the predicted
    optimizer phase on this GPU (docs/references.md, section 16)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_optimizer_cpu import IMPLEMENTATIONS, measure, optimizer_phase
    from tilefit.hardware import get_device
    from tilefit.models import load_workload

    dev = get_device("auto")
    rows = []
    for name in ("gpt2", "bert-base-uncased"):
        work = load_workload(name, seq_len=128)
        for impl in ("foreach", "fused"):
            real_s, spread = measure(work, 2, IMPLEMENTATIONS[impl], 20, device="cuda")
            pred_s = optimizer_phase(work, 2, IMPLEMENTATIONS[impl], dev)[0]
            rows.append({"model": name, "impl": impl, "measured_s": real_s,
                         "predicted_s": pred_s, "error": pred_s / real_s - 1,
                         "spread": spread})
    return {"status": "measured", "device": dev.name, "rows": rows}


def check_lora() -> dict[str, Any]:
    """LoRA and QLoRA steps measured against the estimate (gpu_lora_check.py)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from gpu_lora_check import run, summary

    return summary(run())


def check_rnn() -> dict[str, Any]:
    """cuDNN's fused RNN: its reserve space and its dtype under autocast (gpu_rnn_check.py)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from gpu_rnn_check import run, summary

    return summary(run())


def check_families() -> dict[str, Any]:
    """Device time by kernel category, measured against predicted (gpu_families.py)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from gpu_families import check_families as run

    return run()


def _pending(module: str, target: str) -> dict[str, Any]:
    import importlib.util

    have = importlib.util.find_spec(module) is not None
    why = "hook not filled in yet" if have else f"{module} is not available on this branch"
    return {"status": "pending", "target": target, "reason": why}


def _guarded_sections(rows: list[dict[str, Any]], result: dict[str, Any],
                      save: Any) -> None:
    """The sections after the estimate's, each run on its own (an error is reported in its
    section and the others still run) and saved as it ends (a run stopped at its time limit
    keeps what it measured); the open issues' first."""
    sections: dict[str, Any] = {
        "alloc_retries": lambda: check_alloc_retries(rows),  # issue 26: a real cap
        "lora": check_lora,  # issue 28: LoRA and QLoRA as peft and bitsandbytes build them
        "rnn": check_rnn,  # issue 46: cuDNN RNN's reserve space and autocast dtype
        "tune": check_tune, "host": check_host, "families": check_families,
        "optimizer": check_optimizer,
    }
    for key, check in sections.items():
        try:
            result[key] = check()
        except Exception as exc:  # report, don't lose the other sections
            result[key] = {"status": "error", "reason": f"{type(exc).__name__}: {exc}"}
        save(key)


def _saver(result: dict[str, Any], out: str, start: float) -> Any:
    """save(section): the result so far written to ``out`` (whole, replaced at once)."""
    def save(section: str) -> None:
        result["duration_s"] = time.perf_counter() - start
        tmp = f"{out}.partial"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=2)
        os.replace(tmp, out)
        print(f"[{result['duration_s']:6.0f} s] {section} done, saved to {out}", flush=True)

    return save


def _on_cuda(args: Any, result: dict[str, Any], save: Any) -> None:
    result["gemm"] = check_gemm(args.dtype, args.count)
    save("gemm")
    try:
        rows = estimate_rows(Path(args.out).resolve().parent / "allocator-snapshots")
    except Exception as exc:  # report, don't lose the GEMM section
        rows = []
        result["estimate_error"] = f"{type(exc).__name__}: {exc}"
    result["estimate_rows"] = rows
    result["estimate_memory"] = check_estimate_memory(rows)
    result["estimate_reserved"] = check_estimate_reserved(rows)
    result["estimate_step_time"] = check_estimate_step_time(rows)
    save("estimate")
    _guarded_sections(rows, result, save)
    statuses = [v["status"] for v in result.values() if isinstance(v, dict) and "status" in v]
    result["status"] = "fail" if "fail" in statuses else "pass"
    g = result["gemm"]
    print(f"gemm {g['dtype']} on {g['device']}: median |err| uncalibrated "
          f"{g['uncalibrated']['all']['median_error']:.1%}, calibrated "
          f"{g['calibrated']['all']['median_error']:.1%} (target {GEMM_TARGET:.0%})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="tilefit validation on a CUDA GPU")
    ap.add_argument("out", help="where to write the JSON result (rewritten after each section)")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--count", type=int, default=300)
    args = ap.parse_args(argv)
    start = time.perf_counter()
    result: dict[str, Any] = {"script": "gpu_validation", "budget_s": BUDGET_S}
    try:
        import torch

        has_cuda = torch.cuda.is_available()
        result["torch"] = torch.__version__
    except ImportError:
        has_cuda = False
    save = _saver(result, args.out, start)
    if not has_cuda:
        msg = "no CUDA GPU here: gpu_validation skipped (run it on a machine with one)"
        print(msg)
        result.update(status="skipped", reason=msg)
    else:
        _on_cuda(args, result, save)
    save("all")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
