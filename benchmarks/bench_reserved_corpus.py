"""Published GPU memory readings and out-of-memory points (issue 26) against tilefit's replay
of the CUDA caching allocator.

Reads ``benchmarks/reserved_corpus/records.jsonl`` (its README gives the schema and sources)
and predicts each record tilefit can express: the step traced on fake tensors, its storages
replayed through tilefit's model of PyTorch's caching allocator (``Estimate.reserved``,
docs/references.md, section 31) under the record's PYTORCH_CUDA_ALLOC_CONF (PyTorch's
defaults where none is stated). Nothing is fitted on these records.

- ``reserved-peak`` (torch.cuda.max_memory_reserved) is compared with the predicted reserved
  peak.
- ``nvml-used`` (the device's used memory after training) is compared with the reserved peak
  plus what the process holds outside the allocator: the CUDA context as the same source
  measured it on the same machine (``context.jsonl``, less the allocator's 2 MiB segment its
  probe tensor made) and cuBLAS's workspace (tilefit.estimator.cublas_workspace_bytes).
- ``fit`` / ``oom`` verdicts are compared with ``Estimate.fits`` (the replay against the
  device's memory less context and workspace, the allocator's release-and-retry included).
- A record whose PyTorch (stated, else the release current at its date) held a tensor the
  installed one frees is traced with that tensor held (``old_torch``, benchmarks/old_torch.py):
  foreach Adam's second parameter-sized list before July 2023 (pytorch/pytorch issue #97712;
  docs/references.md, section 43), softmax's input before 1.11 (PR #65242; section 44).
- A record tilefit cannot express is printed with the reason: DeepSpeed without ZeRO
  (``zero0``), a model whose config tilefit does not ship, a metric that is not one of these.

Prints each record's measured and predicted figure and the signed error (predicted -
measured) / measured, the allocated peak beside it, then the median and worst absolute error
and the verdicts.

    OMP_NUM_THREADS=2 python benchmarks/bench_reserved_corpus.py \
        [--only ID ...] [--out benchmarks/results_reserved_corpus.txt]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from old_torch import old_torch
from tilefit.errors import TilefitError

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "benchmarks" / "reserved_corpus"
GIB = 2**30
MIB = 2**20
FIGURES = ("reserved-peak", "nvml-used")
VERDICTS = ("fit", "oom")


def load(name: str) -> list[dict[str, Any]]:
    with open(CORPUS / name, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def context_bytes(rec: dict[str, Any], contexts: list[dict[str, Any]]) -> int | None:
    """The CUDA context the record's own source measured on its GPU, less what its probe
    left in the allocator; None when the corpus has none for that GPU."""
    for c in contexts:
        if c["gpu"] == rec["gpu"] and c["source"]["url"] == rec["source"]["url"]:
            return int(c["measured"]["bytes"] - c.get("includes_allocator_bytes", 0))
    return None


def why_not(rec: dict[str, Any]) -> str | None:
    """Why tilefit cannot predict the record, or None."""
    kind = rec["measured"]["kind"]
    if kind not in (*FIGURES, *VERDICTS):
        return f"measurement {kind!r} is neither the reserved peak, NVML nor a verdict"
    if rec["strategy"] == "zero0":
        return "DeepSpeed data parallelism without ZeRO has no tilefit strategy"
    if rec["activation_checkpointing"] == "unstated":
        return "checkpointing not stated"
    return None


def recipe_of(rec: dict[str, Any]) -> Any:
    from tilefit.recipe import Parallelism, Recipe

    parallel = Parallelism() if rec["strategy"] == "none" else Parallelism(
        rec["world_size"], rec["strategy"])
    return Recipe(batch_size=rec["micro_batch"], accumulation_steps=rec["accumulation"],
                  precision=rec["precision"], optimizer=optimizer_of(rec),
                  grad_checkpointing=rec["activation_checkpointing"] == "full",
                  attention=rec.get("attention") or "auto", parallel=parallel,
                  zero_grad_to_none=rec.get("zero_grad_to_none", True),
                  alloc_conf=rec.get("alloc_conf"))


def optimizer_of(rec: dict[str, Any]) -> Any:
    """The record's optimizer: tilefit's name, or the class the record names
    (``optimizer_class``, a dotted path; else the torch.optim class of that name) with the
    record's own arguments (``optimizer_kwargs``) as the recipe's factory."""
    kwargs = rec.get("optimizer_kwargs")
    if not kwargs:
        return rec["optimizer"]
    import functools
    import importlib

    import torch

    path = rec.get("optimizer_class")
    if path:
        module, _, name = path.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
    else:
        cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam,
               "adamw": torch.optim.AdamW}[rec["optimizer"]]
    return functools.partial(cls, **kwargs)


def device_of(rec: dict[str, Any]) -> Any:
    """The record's GPU; a record that does not name one (Raschka's) runs on an A100 80GB,
    which only decides the attention kernel (the allocator is the same on every GPU)."""
    from tilefit.hardware import get_device

    gpu = rec["gpu"] or "a100-80gb"
    return get_device(str(ROOT / gpu) if gpu.endswith(".toml") else gpu)


def predict(rec: dict[str, Any]) -> Any:
    from tilefit.estimator import estimate_recipe
    from tilefit.models import load_workload

    model = rec["model"]
    work = load_workload(model["base"], task=model.get("task"),
                         seq_len=None if model.get("task") == "image-cls" else rec["seq"])
    if model["changes"]:
        work = work.with_config(**model["changes"])
    device = device_of(rec)
    with old_torch(rec):
        return estimate_recipe(work, None, recipe_of(rec).on(device), device)


def measured_and_predicted(rec: dict[str, Any], est: Any, contexts: list[dict[str, Any]]
                           ) -> tuple[float, float] | str:
    """(measured, predicted) bytes of a figure record, or why there is none."""
    from tilefit.estimator import cublas_workspace_bytes

    r = est.reserved
    if r is None:
        return "no reserved model for this estimate"
    if not r.fits:
        return f"predicted out of memory ({r.failed_where})"
    measured = float(rec["measured"]["bytes"])
    if rec["measured"]["kind"] == "reserved-peak":
        return measured, float(r.peak_reserved_bytes)
    ctx = context_bytes(rec, contexts)
    if ctx is None:
        return "no published CUDA context for this GPU and source"
    return measured, float(ctx + cublas_workspace_bytes(est.device) + r.peak_reserved_bytes)


def run(records: list[dict[str, Any]], contexts: list[dict[str, Any]], out: list[str]
        ) -> tuple[list[float], list[bool]]:
    errors, verdicts = [], []
    for rec in records:
        reason = why_not(rec)
        if reason is None:
            t0 = time.perf_counter()
            try:
                est = predict(rec)
            except TilefitError as err:
                reason = f"tilefit refuses it: {err.problem}"
        if reason is not None:
            out.append(f"{rec['id']:<50} not predicted: {reason}")
            continue
        took = time.perf_counter() - t0
        alloc = est.peak_memory_bytes / GIB
        if rec["measured"]["kind"] in VERDICTS:
            right = est.fits == (rec["measured"]["kind"] == "fit")
            verdicts.append(right)
            out.append(f"{rec['id']:<50} published {rec['measured']['kind']:<4} predicted "
                       f"{'fit' if est.fits else 'oom':<4} {'right' if right else 'WRONG'}"
                       f"  (allocated {alloc:.2f} GiB, reserved "
                       f"{_gib(est.peak_reserved_bytes)}; {took:.0f} s)")
            continue
        pair = measured_and_predicted(rec, est, contexts)
        if isinstance(pair, str):
            out.append(f"{rec['id']:<50} not compared: {pair}")
            continue
        measured, predicted = pair
        err = predicted / measured - 1
        errors.append(err)
        out.append(f"{rec['id']:<50} {rec['measured']['kind']:<13} measured "
                   f"{measured / GIB:7.2f} GiB predicted {predicted / GIB:7.2f} GiB "
                   f"{err:+7.1%}  (allocated {alloc:.2f} GiB; {took:.0f} s)")
    return errors, verdicts


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f} GiB"


def summary(errors: list[float], verdicts: list[bool]) -> list[str]:
    out = []
    if errors:
        abs_err = [abs(e) for e in errors]
        out.append(f"figures: {len(errors)} records, median |error| "
                   f"{statistics.median(abs_err):.1%}, worst {max(abs_err):.1%} "
                   f"(targets: median <= 5%, worst <= 12%)")
    out.append(f"verdicts: {sum(verdicts)} of {len(verdicts)} right")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="record ids")
    parser.add_argument("--out", help="also write the table here")
    args = parser.parse_args(argv)
    records = load("records.jsonl")
    if args.only:
        records = [r for r in records if r["id"] in set(args.only)]
    out = ["tilefit's caching-allocator replay against published memory readings "
           "(benchmarks/reserved_corpus)"]
    errors, verdicts = run(records, load("context.jsonl"), out)
    out.extend(summary(errors, verdicts))
    text = "\n".join(out)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
