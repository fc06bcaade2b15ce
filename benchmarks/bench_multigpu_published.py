"""Published multi-GPU training figures (issue 14) against tilefit's prediction.

Reads ``benchmarks/multigpu_corpus/published.jsonl`` (its README gives the schema and the
sources) and predicts each record that tilefit can express: one rank's step under the
record's engine (FSDP2 and DDP traced; DeepSpeed ZeRO stages 1-3 and ZeRO-Offload modelled
on the one-GPU trace, with the record's ``zero_config`` buckets where its source sets them)
on the record's GPU (a catalog name or a TOML spec file beside the corpus), its micro-batch,
sequence length, precision, accumulation, compile and activation checkpointing. Prints, per
record, the measured and predicted memory per GPU and tokens/s per GPU with the signed error
(predicted - measured) / measured, then the medians by engine.

Rules (as the corpus README says):

- A record tilefit cannot express is printed with the reason and predicted not at all:
  context parallelism (tilefit does not trace it; it would silently predict data
  parallelism), and whatever tilefit itself refuses (its TilefitError is the reason: today
  ``compile=True`` on several GPUs, or with activation checkpointing). float8 records run as
  tilefit's fp8-mixed (torchao's float8 training, docs/references.md, section 21). The
  corpus records the configuration, not tilefit's limits, so a record is predicted once
  tilefit can express it.
- Selective activation checkpointing (torchtitan's op policy, every n-th layer) has no tilefit
  equivalent, and a source may not say whether it checkpointed (``unstated``): such records
  get two predictions, without checkpointing and with full checkpointing of every block, and
  the measurement should fall between them. Both ends are printed and neither is chosen;
  their errors have medians of their own.
- tilefit predicts the tensors' peak (``Estimate.peak_memory_bytes``, like
  ``torch.cuda.max_memory_allocated``) and the caching allocator's reserved peak
  (``Estimate.reserved``, its replay). A record that measured the reserved peak (torchtitan)
  is compared with the replay's where the step fits under the device's line (printed
  "reserved"), else with the tensors' peak (printed "memory"). An ``nvidia-smi``
  reading counts the CUDA context and the caching allocator's whole pool (DeepSpeed's
  tutorials show the GPU nearly full): it bounds the peak from above and is no measure of it,
  so it is checked as a bound (tilefit's peak plus its CUDA context and workspace, at or
  below the reading) and enters no median.
- Nothing is cached across runs; within one run, two records with the same configuration
  share one estimate.

    flock /tmp/tilefit-bench.lock python benchmarks/bench_multigpu_published.py \
        [--only ID ...] [--out benchmarks/results_multigpu_published.txt]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tilefit.errors import TilefitError

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "benchmarks" / "multigpu_corpus" / "published.jsonl"
GIB = 2**30
BRACKETED = ("selective-op", "selective-layer", "unstated")  # both ends predicted


def load(path: Path = CORPUS) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip()]


def checkpointing_ends(rec: dict[str, Any]) -> tuple[bool, ...]:
    """The grad_checkpointing values to predict: one for none/full, both for selective or
    unstated checkpointing."""
    ac = rec["activation_checkpointing"]
    if ac in BRACKETED:
        return (False, True)
    if ac not in ("none", "full"):
        raise ValueError(f"{rec['id']}: unknown activation_checkpointing {ac!r}")
    return (ac == "full",)


def gpu_spec(rec: dict[str, Any]) -> str:
    """A catalog name, or a spec file path relative to the repository root."""
    gpu = rec["gpu"]
    return str(ROOT / gpu) if gpu.endswith(".toml") else gpu


_SEEN: dict[str, Any] = {}  # one run's estimates, by configuration (never written to disk)


def predict(rec: dict[str, Any], checkpoint: bool) -> tuple[Any, float]:
    """(Estimate, seconds spent) of the record's step with or without full checkpointing."""
    from tilefit.estimator.workload_estimate import estimate_workload
    from tilefit.models import load_workload
    from tilefit.recipe import Parallelism, Recipe, ZeroConfig

    model = rec["model"]
    # torchao float8 linears over bf16 autocast: tilefit's fp8-mixed
    # (docs/references.md, section 21)
    precision = "fp8-mixed" if rec["float8"] else rec["precision"]
    ws, zero = rec["world_size"], rec["strategy"].startswith("zero")
    # ZeRO is modelled on one GPU too (ZeRO-Offload on one GPU); a traced engine needs two
    strategy = rec["strategy"] if ws > 1 or zero else None
    offload = bool(rec.get("offload", False))
    zero_config = ZeroConfig(**rec.get("zero_config", {}))
    recipe = Recipe(batch_size=rec["micro_batch"], precision=precision,
                    optimizer=rec["optimizer"], grad_checkpointing=checkpoint,
                    accumulation_steps=rec["accumulation"],
                    max_grad_norm=rec.get("max_grad_norm"), compile=rec["compiled"],
                    parallel=Parallelism(ws, strategy, offload, zero_config))
    key = json.dumps([model["base"], model.get("task"), model["changes"], rec["seq"],
                      repr(recipe), rec["gpu"], ws, strategy, offload, repr(zero_config)],
                     sort_keys=True)
    if key in _SEEN:
        return _SEEN[key], 0.0
    work = load_workload(model["base"], seq_len=rec["seq"], task=model.get("task"))
    if model["changes"]:
        work = work.with_config(**model["changes"])
    t0 = time.perf_counter()
    est = estimate_workload(work, recipe, gpu_spec(rec))
    _SEEN[key] = est
    return est, time.perf_counter() - t0


def not_expressible(rec: dict[str, Any]) -> str | None:
    """Why tilefit cannot predict the record before it is traced, or None."""
    if rec["context_parallel"] > 1:
        return "context parallelism: tilefit traces data parallelism only"
    return None


def err(pred: float, meas: float | None) -> float | None:
    return None if meas is None else (pred - meas) / meas


def fmt_err(e: float | None) -> str:
    return "   n/a" if e is None else f"{e:+6.1%}"


def engine(rec: dict[str, Any]) -> str:
    """The record's engine as the medians group it: ddp, fsdp2, zero1-3 (+ "-offload"), or
    none (one GPU)."""
    return rec["strategy"] + ("-offload" if rec.get("offload") else "")


def headline(rec: dict[str, Any]) -> str:
    acc = rec["accumulation"]
    return (f"{rec['id']}: {rec['world_size']} x {rec['gpu'].rsplit('/', 1)[-1]}, "
            f"{engine(rec)}, micro-batch {rec['micro_batch']} x {rec['seq']}"
            f"{f' x {acc} accumulated' if acc > 1 else ''}"
            f", {rec['precision']}, AC {rec['activation_checkpointing']}"
            f"{', compiled' if rec['compiled'] else ''}{', float8' if rec['float8'] else ''}")


def memory_text(est: Any, mem: float | None, kind: str | None) -> tuple[str, float | None]:
    """The predicted memory and its signed error, or for an nvidia-smi reading the bound check
    (tensors' peak + CUDA context and workspace, at or below the reading) and no error."""
    p_mem = est.peak_memory_bytes / GIB
    if kind != "nvidia-smi" or mem is None:
        label, held = "memory", est.reserved if kind == "reserved-peak" else None
        if held is not None and held.fits:  # the allocator's reserved peak, replayed
            label, p_mem = "reserved", held.peak_reserved_bytes / GIB
        e_mem = err(p_mem, mem)
        return f"{label} {p_mem:6.1f} GiB ({fmt_err(e_mem)})", e_mem
    total = est.total_memory_bytes / GIB
    verdict = "at or below the reading" if total <= mem else "ABOVE the reading"
    return f"memory {p_mem:6.1f} GiB + context = {total:.1f} GiB: {verdict}", None


def predict_record(rec: dict[str, Any], out: Any, errors: dict[str, list[float]]) -> None:
    """Print the record's prediction (both ends of a bracket) and collect its errors."""
    m = rec["measured"]
    tps, mem, kind = m.get("tokens_per_s_per_gpu"), m.get("memory_gib"), m.get("memory_kind")
    ends = checkpointing_ends(rec)
    try:  # every end, or none: half a bracket is not a prediction
        results = [predict(rec, ck) for ck in ends]
    except TilefitError as exc:
        out(f"    SKIPPED: tilefit refuses it: {str(exc).splitlines()[0]}")
        return
    both: list[tuple[float, float]] = []  # (tokens/s, GiB) of each end of a bracket
    for ck, (est, secs) in zip(ends, results, strict=True):
        label = ("no AC  " if not ck else "full AC") if len(ends) == 2 else "predicted"
        e_tps = err(est.tokens_per_s, tps)
        mem_out, e_mem = memory_text(est, mem, kind)
        par = est.parallel
        comm = (f", comm {par.communication_time_s * 1e3:.0f} ms "
                f"({par.exposed_communication_s * 1e3:.0f} exposed)") if par else ""
        out(f"    {label:9} {est.tokens_per_s:>8,.0f} tokens/s/GPU ({fmt_err(e_tps)})   "
            f"{mem_out}   step {est.step_time_s:.3f} s, MFU {est.mfu:.1%}{comm}   "
            f"[{secs:.0f} s]")
        group = "direct" if len(ends) == 1 else ("no-AC end" if not ck else "full-AC end")
        if e_tps is not None:
            errors.setdefault(f"{engine(rec)}, {group}, tokens/s", []).append(e_tps)
        if e_mem is not None:
            errors.setdefault(f"{engine(rec)}, {group}, memory ({kind})", []).append(e_mem)
        both.append((est.tokens_per_s, est.peak_memory_bytes / GIB))
    if len(both) == 2:
        (t0, m0), (t1, m1) = both
        inside_t = min(t0, t1) <= tps <= max(t0, t1)
        inside_m = (None if mem is None or kind == "nvidia-smi"
                    else min(m0, m1) <= mem <= max(m0, m1))
        out(f"    bracket: tokens/s {'inside' if inside_t else 'OUTSIDE'}"
            + ("" if inside_m is None else f", memory {'inside' if inside_m else 'OUTSIDE'}"))


def run(records: list[dict[str, Any]]) -> tuple[list[str], dict[str, list[float]]]:
    lines: list[str] = []
    errors: dict[str, list[float]] = {}

    def out(text: str) -> None:
        lines.append(text)
        print(text, flush=True)

    for rec in records:
        m = rec["measured"]
        mem, kind = m.get("memory_gib"), m.get("memory_kind")
        out(headline(rec))
        mem_text = f"{mem:.1f} GiB ({kind})" if mem is not None else "not stated"
        out(f"    measured   {m['tokens_per_s_per_gpu']:>8,.0f} tokens/s/GPU   "
            f"memory {mem_text}")
        reason = not_expressible(rec)
        if reason:
            out(f"    SKIPPED: {reason}")
            continue
        predict_record(rec, out, errors)
    return lines, errors


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="+", help="record ids to run")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import torch

    records = load()
    if args.only:
        records = [r for r in records if r["id"] in args.only]
    t0 = time.perf_counter()
    header = (f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
              f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
              f"load average before {os.getloadavg()[0]:.2f}; corpus {CORPUS.name}, "
              f"{len(records)} records")
    print(header, flush=True)
    lines, errors = run(records)
    summary = ["", "medians of the signed error (predicted - measured) / measured, by engine:"]
    for group, vals in sorted(errors.items()):
        summary.append(f"    {group:44} median {statistics.median(vals):+6.1%}  "
                       f"(n = {len(vals)}, range {min(vals):+.1%} .. {max(vals):+.1%})")
    summary.append(f"load average after {os.getloadavg()[0]:.2f}; "
                   f"{time.perf_counter() - t0:.0f} s in all")
    print("\n".join(summary))
    if args.out:
        args.out.write_text("\n".join([header, *lines, *summary]) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
