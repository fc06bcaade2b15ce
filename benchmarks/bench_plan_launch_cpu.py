"""The configs `tilefit plan --gpus N` writes, launched as they are on this machine's CPU.

For small workloads (a 2-layer GPT-2 and Llama from their configs, a plain factory), plan for
N GPUs (``tilefit.plan(..., world_size=N)``), then for each engine (DDP, FSDP2) and
checkpointing choice take the fastest row of that kind, write its torchrun script
(``tilefit.planner.launch.torchrun_script``) and run it under ``torchrun --nproc-per-node N``
(gloo) for two steps: it must exit 0 with every rank at the planned micro-batch and
accumulation.

accelerate (GPT-2's fastest DDP and FSDP2 rows at 2 accumulation steps; the written
accelerate.yaml and train_accelerate.py, ``accelerate launch --config_file accelerate.yaml
--num_processes 2``):
as written on a machine without a GPU accelerate runs each process alone, which the script
refuses; DDP runs with ACCELERATE_USE_CPU=true (MULTI_CPU, gloo); the FSDP config with
ACCELERATE_USE_CPU=true runs DDP (accelerate has no FSDP on CPUs); FSDP2 runs through
accelerate's own path with the CPU answering its device detection as a GPU node
(tests/fixtures/accelerate_as_gpu.py): each rank reports the distributed type, world size
and whether its parameters are DTensor shards (docs/references.md, section 26).

``--deepspeed DIR`` (DeepSpeed installed apart, as benchmarks/bench_zero_cpu.py says): each
workload's plan's own fastest DeepSpeed ZeRO-1, -2, -3 rows and ZeRO-2 and -3 with the
optimizer offloaded (DeepSpeed's bf16 mode, 2 accumulation steps; ``launch_deepspeed``: its
JSON and torchrun script on DeepSpeed's engine), run under ``torchrun --nproc-per-node 2``
with DS_ACCELERATOR=cpu for two steps; each rank reports its micro-batch, accumulation,
stage, offload device, optimizer and weight dtype.
Then ``tilefit plan llama-3-8b --gpu h100 --gpus 8`` is timed.

    OMP_NUM_THREADS=1 flock /tmp/tilefit-bench.lock python benchmarks/bench_plan_launch_cpu.py \
        [--deepspeed DIR] [--out benchmarks/results_plan_launch_cpu.txt]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tilefit.vocab import ZERO_STRATEGIES

ROOT = Path(__file__).resolve().parent.parent
NPROC = 2
GLOBAL_BATCH = 8
TINY = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 512}

def workloads() -> dict[str, Any]:
    from tilefit.models import load_workload

    llama = dict(TINY, intermediate_size=128, num_key_value_heads=2)
    return {
        "gpt2": load_workload("gpt2", seq_len=32).with_config(**TINY),
        "llama": load_workload("llama-3.2-1b", seq_len=32).with_config(**llama),
        "factory": load_workload("tests.fixtures.tiny_models:mlp", input_shape=(32,)),
    }


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}


def launch_script(row: Any, work: Any, tmp: Path) -> tuple[bool, float, str]:
    from tilefit.planner.launch import torchrun_script

    path = tmp / f"train_{row.strategy}_{int(row.grad_checkpointing)}.py"
    record = tmp / f"record_{path.stem}_{time.time_ns()}"
    record.mkdir()
    path.write_text(torchrun_script(row, work))
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run",
                        f"--nproc-per-node={row.world_size}", str(path), "--steps", "2",
                        "--record", str(record)],
                       env=_env(), capture_output=True, text=True, timeout=600, cwd=tmp)
    secs = time.perf_counter() - t0
    steps = [json.loads(x) for f in sorted(record.glob("rank*.jsonl"))
             for x in f.read_text().splitlines()]
    ok = (r.returncode == 0 and len(steps) == 2 * row.world_size
          and all(s["micro_batch"] == row.micro_batch
                  and s["accumulation_steps"] == row.accumulation_steps for s in steps))
    trained = sorted({s["trainable_params"] for s in steps})
    return ok, secs, f", trainable parameters {trained}" if ok else r.stderr[-1500:]


def fastest(rows: Any, strategy: str, ckpt: bool = False, accumulation: int | None = None,
            peft: bool = False) -> Any:
    """The fastest mixed-precision row of an engine (at ``accumulation`` steps if given;
    LoRA rows when ``peft``)."""
    return max((r for r in rows if (r.strategy, r.grad_checkpointing) == (strategy, ckpt)
                and r.recipe.spec.autocast_dtype and r.peft == peft
                and accumulation in (None, r.accumulation_steps)),
               key=lambda r: r.samples_per_s)


def launch_rows(name: str, work: Any, tmp: Path, peft: bool = False
                ) -> tuple[list[str], bool, Any]:
    """Plan ``work`` on NPROC GPUs (with --allow-peft when ``peft``: its LoRA rows are the
    ones launched) and launch each engine's fastest rows."""
    from tilefit.planner import PlanSearch, plan
    from tilefit.recipe import Parallelism, Recipe

    t0 = time.perf_counter()
    p = plan(work, gpu="h100", global_batch=GLOBAL_BATCH,
             recipe=Recipe.for_model(work, parallel=Parallelism(world_size=NPROC)),
             search=PlanSearch(confirm=False, allow_lora=peft))
    lines = [f"{name}: planned {len(p.rows)} rows from {p.traces} traces in "
             f"{time.perf_counter() - t0:.1f} s"]
    ok = True
    traced = [r for r in p.rows if r.strategy not in ZERO_STRATEGIES and r.peft == peft]
    for strategy, ckpt in sorted({(r.strategy, r.grad_checkpointing) for r in traced}):
        row = fastest(p.rows, strategy, ckpt, peft=peft)
        good, secs, err = launch_script(row, work, tmp)
        ok &= good
        lines.append(f"  torchrun {row.recipe_label():36} micro-batch {row.micro_batch} x "
                     f"{row.accumulation_steps} x {NPROC} ranks: "
                     f"{'2 steps OK' if good else 'FAILED'} ({secs:.1f} s){err}")
    return lines, ok, p.rows


def free_port() -> str:
    """A free TCP port for the job's rendezvous: other jobs on this shared machine may hold
    torchrun's and accelerate's default, 29500."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def first_error(stderr: str) -> str:
    """The first line that names an error, else the end of stderr."""
    lines = [x for x in stderr.splitlines() if "Error" in x or "error:" in x]
    return lines[0][-600:] if lines else stderr[-600:]


def run_written(files: dict[str, str], tmp: Path, cmd: list[str],
                env: dict[str, str]) -> tuple[int, float, list[dict[str, Any]], str]:
    """Write ``files`` into a fresh folder, run ``cmd`` there (``--record`` added): exit
    status, seconds, every rank's step lines, stderr."""
    out = Path(tempfile.mkdtemp(dir=tmp))
    for name, text in files.items():
        (out / name).write_text(text)
    record = out / "record"
    record.mkdir()
    t0 = time.perf_counter()
    r = subprocess.run([*cmd, "--steps", "2", "--record", str(record)], env=env,
                       capture_output=True, text=True, timeout=900, cwd=out)
    secs = time.perf_counter() - t0
    steps = [json.loads(x) for f in sorted(record.glob("rank*.jsonl"))
             for x in f.read_text().splitlines()]
    return r.returncode, secs, steps, r.stderr


def per_rank(steps: list[dict[str, Any]], keys: tuple[str, ...]) -> str:
    """The last step's fields of each rank, e.g. 'rank 0: FSDP/2/True'."""
    last = {s["rank"]: s for s in steps}
    return "; ".join(f"rank {k}: " + " ".join(f"{key}={last[k][key]}" for key in keys)
                     for k in sorted(last))


ACC_KEYS = ("distributed_type", "world_size", "dtensor_shards", "micro_batch",
            "accumulation_steps", "loss")
# (what, engine, the environment beyond ours, the script through the GPU stand-in)
ACC_RUNS = (("as written, no GPU", "fsdp2", {}, False),
            ("ACCELERATE_USE_CPU=true", "ddp", {"ACCELERATE_USE_CPU": "true"}, False),
            ("ACCELERATE_USE_CPU=true", "fsdp2", {"ACCELERATE_USE_CPU": "true"}, False),
            ("CPU as a GPU node", "fsdp2", {}, True))


def accelerate_checks(rows: Any, work: Any, tmp: Path) -> tuple[list[str], bool]:
    """The written accelerate.yaml and train_accelerate.py under accelerate launch."""
    from tilefit.planner.launch import ACCELERATE_SCRIPT_NAME, launch_files

    lines, ok = [], True
    for what, strategy, extra, as_gpu in ACC_RUNS:
        row = fastest(rows, strategy, accumulation=2)  # accelerate's accumulate() too
        script = [str(ROOT / "tests" / "fixtures" / "accelerate_as_gpu.py")] if as_gpu else []
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               "accelerate.yaml", "--num_processes", str(NPROC), "--main_process_port",
               free_port(), *script,
               ACCELERATE_SCRIPT_NAME]
        rc, secs, steps, err = run_written(launch_files(row, work), tmp, cmd,
                                           {**_env(), **extra})
        expect = "FSDP" if as_gpu else "MULTI_CPU"
        good = rc == 0 and len(steps) == 2 * NPROC and all(
            s["distributed_type"] == expect and s["dtensor_shards"] is as_gpu for s in steps)
        if not extra and not as_gpu:  # refused: accelerate would run each process alone
            said = "accelerate found no GPU and runs each process alone"
            good = rc != 0 and err.count(said) == NPROC
            lines.append(f"  accelerate {strategy} {what}: exit {rc}, each rank refused to "
                         f"train alone ('{said}')" if good else f"FAILED {first_error(err)}")
        else:
            lines.append(f"  accelerate {strategy} {what}: exit {rc} ({secs:.1f} s); "
                         + (per_rank(steps, ACC_KEYS) if good else f"FAILED {first_error(err)}"))
        ok &= good
    return lines, ok


DS_KEYS = ("world_size", "micro_batch", "accumulation_steps", "zero_stage",
           "offload_optimizer", "optimizer", "param_dtype", "loss")


def fastest_zero(rows: Any, strategy: str, offload: bool) -> Any:
    """The plan's fastest row of a ZeRO stage (with or without offload) in DeepSpeed's bf16
    mode at 2 accumulation steps (DeepSpeed's accumulation boundary exercised)."""
    return max((r for r in rows if (r.strategy, r.offload, r.accumulation_steps) ==
                (strategy, offload, 2) and r.recipe.spec.param_dtype == "bf16"),
               key=lambda r: r.samples_per_s)


def deepspeed_checks(rows: Any, work: Any, tmp: Path, where: str) -> tuple[list[str], bool]:
    """The plan's own ZeRO rows (each stage, and ZeRO-2 and ZeRO-3 offloaded): their
    torchrun scripts on DeepSpeed's engine, 2 CPU ranks."""
    from tilefit.planner.launch import TORCHRUN_SCRIPT_NAME, launch_files

    env = {**_env(), "DS_ACCELERATOR": "cpu"}
    env["PYTHONPATH"] += os.pathsep + where
    lines, ok = [], True
    for strategy, offload in (("zero1", False), ("zero2", False), ("zero3", False),
                              ("zero2", True), ("zero3", True)):
        row = fastest_zero(rows, strategy, offload)
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={NPROC}",
               f"--master-port={free_port()}", TORCHRUN_SCRIPT_NAME]
        rc, secs, steps, err = run_written(launch_files(row, work), tmp, cmd, env)
        good = rc == 0 and len(steps) == 2 * NPROC and all(
            (s["micro_batch"], s["accumulation_steps"], s["zero_stage"])
            == (row.micro_batch, row.accumulation_steps, int(strategy[-1]))
            and (s["offload_optimizer"] == "cpu") is offload for s in steps)
        ok &= good
        lines.append(f"  deepspeed {row.recipe_label()}: exit {rc} ({secs:.1f} s); "
                     + (per_rank(steps, DS_KEYS) if good else f"FAILED {first_error(err)}"))
    return lines, ok


def time_plan_8b() -> str:
    cmd = [sys.executable, "-m", "tilefit", "plan", "llama-3-8b", "--gpu", "h100", "--gpus",
           "8", "--global-batch", "64", "--json"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=900)
    secs = time.perf_counter() - t0
    if r.returncode != 0:
        return f"tilefit plan llama-3-8b --gpus 8 failed: {r.stderr[-800:]}"
    d = json.loads(r.stdout)
    b = d["best"]
    return (f"tilefit plan llama-3-8b --gpu h100 --gpus 8 --global-batch 64: {secs:.1f} s "
            f"wall ({d['traces']} traces); chosen {b['strategy']} {b['precision']} ckpt="
            f"{b['grad_checkpointing']} micro-batch {b['micro_batch']} x "
            f"{b['accumulation_steps']} x 8, {b['predicted_peak_memory_bytes'] / 2**30:.1f} GiB "
            f"per GPU, step {b['predicted_step_time_s']:.2f} s")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--no-8b", action="store_true")
    ap.add_argument("--deepspeed", help="the folder DeepSpeed is installed in (its checks)")
    args = ap.parse_args()
    import torch

    lines = [f"torch {torch.__version__}, threads {torch.get_num_threads()}, OMP_NUM_THREADS="
             f"{os.environ.get('OMP_NUM_THREADS')}, load average before "
             f"{os.getloadavg()[0]:.2f}"]
    ok = True
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        works, planned = workloads(), {}
        for name, work in works.items():
            out, good, planned[name] = launch_rows(name, work, tmp)
            ok &= good
            lines.extend(out)
            print("\n".join(out), flush=True)
        out, good, _ = launch_rows("llama --allow-peft (LoRA rows)", works["llama"], tmp,
                                   peft=True)
        ok &= good
        lines.extend(out)
        print("\n".join(out), flush=True)
        checks = [("gpt2", accelerate_checks, ())]
        if args.deepspeed:
            checks += [(name, deepspeed_checks, (args.deepspeed,)) for name in works]
        for name, check, extra in checks:
            out, good = check(planned[name], works[name], tmp, *extra)  # type: ignore[operator]
            ok &= good
            lines.append(f"{name}:")
            lines.extend(out)
            print("\n".join(lines[-len(out) - 1:]), flush=True)
    if not args.no_8b:
        lines.append(time_plan_8b())
        print(lines[-1], flush=True)
    lines.append(f"load average after {os.getloadavg()[0]:.2f}; every script ran: {ok}")
    print(lines[-1])
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
