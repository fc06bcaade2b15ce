"""Model zoo (issue 27): every architecture of benchmarks/model_zoo/zoo.py, with a small
config built by transformers' own config class, through tilefit's three paths:

1. the CPU prediction (fp32, torch.optim.AdamW, batch 8) against a real CPU training step of
   the same workload and recipe (tilefit.bench.step.measure_step: the peak by PyTorch's
   MemTracker over the first two steps, the time the median of the timed steps). Target: the
   peak within 1% on every architecture whose peak does not depend on values (a mixture of
   experts' routing does; its row is reported and exempt). Time is reported only.
2. the GPU-target estimate (a100-80gb, bf16-mixed) runs and gives a step time and a peak.
3. the CLI, ``tilefit estimate DIR/config.json --gpu a100-80gb`` with the workload's sizes,
   exits 0.

timm is covered when importable (it is not installed in this environment; the header says so).

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/bench_model_zoo.py \
        [--only gpt2,t5] [--out benchmarks/results_model_zoo.txt]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

sys.path.insert(0, str(Path(__file__).parent / "model_zoo"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from zoo import ZOO, Arch

TARGET = 0.01
BATCH = 8
GPU = "a100-80gb"
GPU_PRECISION = "bf16-mixed"
COLUMNS = (f"{'arch':15} {'task':15} {'peak err':>9} {'pred ms':>8} {'real ms':>8} "
           f"{'GPU est':>16} {'CLI':>4}  note")


@dataclass
class Row:
    arch: str
    task: str = "-"
    peak_error: float | None = None
    predicted_ms: float | None = None
    measured_ms: float | None = None
    gpu: str = "FAIL"
    cli: str = "FAIL"
    note: str = ""

    def line(self) -> str:
        err = "-" if self.peak_error is None else f"{self.peak_error:+.3%}"
        pred = "-" if self.predicted_ms is None else f"{self.predicted_ms:.1f}"
        real = "-" if self.measured_ms is None else f"{self.measured_ms:.1f}"
        return (f"{self.arch:15} {self.task:15} {err:>9} {pred:>8} {real:>8} {self.gpu:>16} "
                f"{self.cli:>4}  {self.note}")


def write_config(arch: Arch, folder: Path) -> Path:
    """The small config as transformers' own class writes it (save_pretrained)."""
    from transformers import AutoConfig

    AutoConfig.for_model(arch.model_type, **arch.sizes).save_pretrained(folder)
    return folder / "config.json"


def cli_args(load: dict[str, Any]) -> list[str]:
    flags = {"seq_len": "--seq", "target_seq_len": "--target-seq", "image_size": "--image-size",
             "input_shape": "--input-shape"}
    args = []
    for key, value in load.items():
        text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
        args += [flags[key], text]
    return args


def run_cli(path: Path, arch: Arch) -> tuple[str, str]:
    cmd = [sys.executable, "-m", "tilefit", "estimate", str(path), "--gpu", GPU,
           "--batch", str(BATCH), *cli_args(arch.load), "--no-ops"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode == 0:
        return "ok", ""
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["?"]
    return f"rc{done.returncode}", f"CLI: {tail[0][:120]}"


def cpu_check(row: Row, work: Any, arch: Arch) -> None:
    from tilefit.bench.step import measure_step
    from tilefit.estimator.workload_estimate import estimate_workload
    from tilefit.recipe import Recipe

    recipe = Recipe(batch_size=BATCH, precision="fp32", optimizer="adamw")
    pred = estimate_workload(work, recipe, "cpu")
    real = measure_step(work, recipe, "cpu", steps=3, warmup=2)
    row.peak_error = pred.peak_memory_bytes / real.peak_memory_bytes - 1
    row.predicted_ms = pred.step_time_s * 1e3
    row.measured_ms = real.step_time_s * 1e3
    states = sum(pred.memory_breakdown.get(k, 0)
                 for k in ("parameters", "gradients", "optimizer_state"))
    row.note += (f"peak {real.peak_memory_bytes / 2**20:.2f} MiB real, "
                 f"{pred.peak_memory_bytes / 2**20:.2f} predicted, "
                 f"{1 - states / pred.peak_memory_bytes:.0%} not weights/grads/AdamW"
                 + ("; time noisy" if real.noisy else ""))


def gpu_check(row: Row, work: Any) -> None:
    from tilefit.estimator.workload_estimate import estimate_workload
    from tilefit.recipe import Recipe

    est = estimate_workload(work, Recipe(batch_size=BATCH, precision=GPU_PRECISION), GPU)
    row.gpu = f"{est.step_time_s * 1e3:.2f}ms/{est.peak_memory_bytes / 2**20:.0f}MiB"


def _stage(row: Row, name: str, fn: Any, *args: Any) -> bool:
    try:
        fn(*args)
        return True
    except Exception as exc:  # a failing architecture is a row, not a crash
        last = traceback.extract_tb(exc.__traceback__)[-1]
        where = f"{Path(last.filename).name}:{last.lineno}"
        row.note += f" {name} FAIL {type(exc).__name__}: {str(exc)[:160]} ({where});"
        return False


def check(arch: Arch, folder: Path) -> Row:
    from tilefit.models import load_workload

    row = Row(arch.model_type)
    path = write_config(arch, folder / arch.model_type)
    try:
        work = load_workload(str(path), **arch.load)
    except Exception as exc:  # likewise
        row.note = f"load FAIL {type(exc).__name__}: {str(exc)[:200]}"
        return row
    row.task = work.task
    _stage(row, "cpu", cpu_check, row, work, arch)
    _stage(row, "gpu", gpu_check, row, work)
    row.cli, cli_note = run_cli(path, arch)
    row.note += (f" {cli_note}" if cli_note else "") + (f" [{arch.note}]" if arch.note else "")
    if arch.exempt:
        row.note += f" [exempt: {arch.exempt}]"
    return row


def header() -> list[str]:
    import torch
    import transformers

    from tilefit.hardware import get_device

    timm = importlib.util.find_spec("timm") is not None
    return [
        f"# benchmarks/bench_model_zoo.py, {time.strftime('%Y-%m-%d %H:%M')}: "
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"timm {'installed' if timm else 'not installed (no timm rows)'}",
        f"# {torch.get_num_threads()} torch thread(s), {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.2f} at the start (a shared machine: times are indicative)",
        f"# CPU: fp32, AdamW (foreach off), batch {BATCH}; CPU numbers: "
        f"{get_device('cpu').source}",
        f"# GPU estimate: {GPU}, {GPU_PRECISION}, batch {BATCH}; CLI: tilefit estimate "
        f"DIR/config.json --gpu {GPU} --batch {BATCH} (+ --seq/--target-seq/--input-shape)",
        COLUMNS,
    ]


def summary(rows: list[Row]) -> list[str]:
    exempt = {a.model_type for a in ZOO if a.exempt}
    held = [r for r in rows if r.arch not in exempt]
    within = [r for r in held if r.peak_error is not None and abs(r.peak_error) <= TARGET]
    lines = [f"{len(rows)} architectures; {len(within)} of {len(held)} non-exempt within 1% "
             f"peak; GPU estimate ok {sum(r.gpu != 'FAIL' for r in rows)}; CLI ok "
             f"{sum(r.cli == 'ok' for r in rows)}; exempt (value-dependent): "
             f"{', '.join(sorted(exempt & {r.arch for r in rows})) or 'none'}"]
    for r in rows:
        missed = r.arch not in exempt and (r.peak_error is None or abs(r.peak_error) > TARGET)
        if missed or r.gpu == "FAIL" or r.cli != "ok":
            lines.append(f"  not met: {r.arch}: {r.note.strip()}")
    return lines


def emit(line: str, out: TextIO | None) -> None:
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")
        out.flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model types")
    parser.add_argument("--out", help="write the table here as it goes")
    args = parser.parse_args()
    archs = [a for a in ZOO if not args.only or a.model_type in args.only.split(",")]
    out = open(args.out, "w", encoding="utf-8") if args.out else None  # noqa: SIM115
    rows = []
    for line in header():
        emit(line, out)
    with tempfile.TemporaryDirectory() as folder:
        for arch in archs:
            rows.append(check(arch, Path(folder)))
            emit(rows[-1].line(), out)
    for line in summary(rows):
        emit(line, out)
    emit(f"# load average {os.getloadavg()[0]:.2f} at the end", out)
    if out is not None:
        out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
