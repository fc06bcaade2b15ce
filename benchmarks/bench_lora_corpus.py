"""Published LoRA and QLoRA runs (issue 28) against tilefit's prediction of their throughput
and peak memory.

Reads ``benchmarks/lora_corpus/records.jsonl`` (its README gives the schema and sources) and
predicts each record tilefit can express through the library (``estimate_recipe``): the
record's model as the catalog builds it (with ``changes``), peft's LoRA at the stated rank,
alpha, dropout and targets, bitsandbytes' NF4 where the record is QLoRA, the stated
micro-batch, sequence, accumulation, precision, optimizer, checkpointing and compile, on the
stated GPU. Nothing is fitted on these records.

- throughput: the published tokens/s against ``Estimate.tokens_per_s`` (on several GPUs,
  the job's: ``Estimate.parallel.tokens_per_s_total``).
- memory: ``allocated-peak`` (torch.cuda.max_memory_allocated) against the predicted
  allocated peak, ``reserved-peak`` against the allocator replay's reserved peak; an
  ``unnamed-peak`` (the source does not say which) against the allocated peak, the reserved
  one printed beside it; ``active-peak`` is not compared.
- ``oom`` verdicts against ``Estimate.fits``.
- A record tilefit cannot express is printed with the reason (its ``unsupported`` field, or
  tilefit's own refusal).
- A QLoRA record measured with bitsandbytes before 0.43.2 (its ``software.bitsandbytes``) is
  traced with that version's ``MatMul4Bit``, which held each quantized layer's input for the
  backward (``ctx.tensors = (A, B)``, bitsandbytes 0.41.1 ``autograd/_functions.py``) where
  the installed one holds none (``(None, B)``, bitsandbytes PR #1270, commit 9e75374, first
  in 0.43.2): the measured quantity is that older library's, so it is predicted as such.
  tilefit itself needs bitsandbytes >= 0.45, whose layers do not hold it.

Prints per record the measured and predicted figures and the signed error (predicted -
measured) / measured, then the median and worst absolute error for throughput and for memory
separately. Results are written as each record finishes (big models trace slowly on a CPU).

    OMP_NUM_THREADS=1 python benchmarks/bench_lora_corpus.py \
        [--only ID ...] [--out benchmarks/results_lora_corpus.txt]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from packaging.version import Version

from tilefit.errors import TilefitError

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "benchmarks" / "lora_corpus"
GIB = 2**30
TARGETS = "throughput median |error| <= 15%, worst <= 30%; memory median <= 5%"


def load() -> list[dict[str, Any]]:
    with open(CORPUS / "records.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def recipe_of(rec: dict[str, Any]) -> Any:
    from tilefit.recipe import Lora, Parallelism, Recipe

    lora = rec["lora"]
    parallel = Parallelism() if rec["strategy"] == "none" else Parallelism(
        rec["world_size"], rec["strategy"])
    return Recipe(parallel=parallel, batch_size=rec["micro_batch"],
                  accumulation_steps=rec["accumulation"],
                  precision=rec["precision"], optimizer=rec["optimizer"],
                  grad_checkpointing=rec["activation_checkpointing"] == "full",
                  attention=rec.get("attention") or "auto", compile=bool(rec["compiled"]),
                  lora=Lora(rank=lora["rank"], alpha=lora["alpha"], dropout=lora["dropout"],
                            targets=tuple(lora["targets"])),
                  quantize=rec["quantize"], alloc_conf=rec.get("alloc_conf"),
                  # both sources' loops: no clipping, the loss read on the host each step
                  max_grad_norm=None, loss_sync=True)


# bitsandbytes' first release whose MatMul4Bit no longer holds its input A for the backward
# (PR #1270, "fix QLoRA mem bug: delete useless buffered activation", commit 9e75374)
BNB_DROPS_INPUT = Version("0.43.2")


def holds_matmul_input(rec: dict[str, Any]) -> bool:
    """Whether the record's 4-bit layers ran a bitsandbytes that held each input A."""
    stated = rec.get("software", {}).get("bitsandbytes")
    return rec["quantize"] in ("nf4", "fp4") and stated is not None \
        and Version(stated) < BNB_DROPS_INPUT


@contextmanager
def matmul_4bit_holding_input() -> Iterator[None]:
    """bitsandbytes' MatMul4Bit as before 0.43.2: the installed forward, then its input A
    kept on the context beside B (``ctx.tensors = (A, B)`` where 0.43.2 keeps
    ``(None, B)``) until the autograd graph is freed; its backward never reads A."""
    from bitsandbytes.autograd._functions import MatMul4Bit

    installed = MatMul4Bit.forward

    def forward(ctx: Any, A: Any, B: Any, *args: Any, **kwargs: Any) -> Any:
        out = installed(ctx, A, B, *args, **kwargs)
        held = getattr(ctx, "tensors", (None, None))
        if held[1] is not None:  # any(ctx.needs_input_grad[:2]), as the forward decided
            ctx.tensors = (A, held[1])
        return out

    MatMul4Bit.forward = staticmethod(forward)
    try:
        yield
    finally:
        MatMul4Bit.forward = staticmethod(installed)


def predict(rec: dict[str, Any]) -> Any:
    from tilefit.estimator import estimate_recipe
    from tilefit.hardware import get_device
    from tilefit.models import load_workload

    work = load_workload(rec["model"]["base"], seq_len=rec["seq"])
    if rec["model"]["changes"]:
        work = work.with_config(**rec["model"]["changes"])
    device = get_device(rec["gpu"])
    with matmul_4bit_holding_input() if holds_matmul_input(rec) else nullcontext():
        return estimate_recipe(work, None, recipe_of(rec).on(device), device)


def job_tokens_per_s(est: Any) -> float:
    """Tokens per second of the whole job: one GPU's, or every rank's together."""
    if est.parallel is not None:
        return float(est.parallel.tokens_per_s_total or 0.0)
    return float(est.tokens_per_s or 0.0)


def memory_pair(rec: dict[str, Any], est: Any) -> tuple[float, float] | str:
    """(measured, predicted) bytes of the record's memory figure, or why there is none."""
    mem = rec["measured"].get("memory")
    if mem is None:
        return "no memory figure"
    kind = mem["kind"]
    if kind in ("allocated-peak", "unnamed-peak"):
        return float(mem["bytes"]), float(est.peak_memory_bytes)
    if kind == "reserved-peak":
        if est.peak_reserved_bytes is None:
            return "no reserved model for this estimate"
        return float(mem["bytes"]), float(est.peak_reserved_bytes)
    return f"memory kind {kind!r} is neither allocated nor reserved"


def one(rec: dict[str, Any], thr: list[float], mem: list[float], verdicts: list[bool]) -> str:
    name = f"{rec['id']:<46}"
    if rec.get("unsupported"):
        return f"{name} not predicted: {rec['unsupported']}"
    t0 = time.perf_counter()
    try:
        est = predict(rec)
    except TilefitError as err:
        return f"{name} not predicted: tilefit refuses it: {err.problem}"
    took = time.perf_counter() - t0
    tps = job_tokens_per_s(est)
    reserved = "-" if est.peak_reserved_bytes is None else f"{est.peak_reserved_bytes / GIB:.2f}"
    tail = (f"(allocated {est.peak_memory_bytes / GIB:.2f} GiB, reserved {reserved} GiB, "
            f"{tps:.0f} tok/s; {took:.0f} s)")
    if rec["measured"].get("verdict") == "oom":
        right = not est.fits
        verdicts.append(right)
        return f"{name} published oom  predicted {'fit' if est.fits else 'oom'}  " \
               f"{'right' if right else 'WRONG'}  {tail}"
    parts = []
    value = rec["throughput"].get("value")
    if value:
        err = tps / value - 1
        thr.append(err)
        parts.append(f"tok/s {value:7.0f} -> {tps:7.0f} {err:+6.1%}")
    else:
        parts.append("tok/s      not published      ")
    pair = memory_pair(rec, est)
    if isinstance(pair, str):
        parts.append(f"memory not compared: {pair}")
    else:
        err = pair[1] / pair[0] - 1
        mem.append(err)
        kind = rec["measured"]["memory"]["kind"]
        parts.append(f"{kind} {pair[0] / GIB:6.2f} -> {pair[1] / GIB:6.2f} GiB {err:+6.1%}")
    return f"{name} " + "  ".join(parts) + f"  {tail}"


def summary(label: str, errors: list[float]) -> str:
    if not errors:
        return f"{label}: no records compared"
    abs_err = [abs(e) for e in errors]
    return (f"{label}: {len(errors)} records, median |error| {statistics.median(abs_err):.1%}, "
            f"worst {max(abs_err):.1%}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="record ids")
    parser.add_argument("--out", help="also write the table here, line by line")
    args = parser.parse_args(argv)
    records = load()
    if args.only:
        records = [r for r in records if r["id"] in set(args.only)]
    out = Path(args.out) if args.out else None
    lines = ["tilefit against published LoRA / QLoRA runs (benchmarks/lora_corpus); "
             "error = predicted / measured - 1"]

    def emit(line: str) -> None:
        lines.append(line)
        print(line, flush=True)
        if out is not None:
            out.write_text("\n".join(lines) + "\n", encoding="utf-8")

    emit(lines.pop())
    thr: list[float] = []
    mem: list[float] = []
    verdicts: list[bool] = []
    for rec in records:
        emit(one(rec, thr, mem, verdicts))
    emit(summary("throughput", thr))
    emit(summary("memory", mem))
    emit(f"oom verdicts: {sum(verdicts)} of {len(verdicts)} right")
    emit(f"targets (issue 28): {TARGETS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
