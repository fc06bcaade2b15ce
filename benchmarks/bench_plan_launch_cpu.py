"""The configs `tilefit plan --gpus N` writes, launched as they are on this machine's CPU.

For small workloads (a 2-layer GPT-2 and Llama from their configs, a plain factory), plan for
N GPUs (``tilefit.plan(..., world_size=N)``), then for each engine (DDP, FSDP2) and
checkpointing choice take the fastest row of that kind, write its torchrun script
(``tilefit.planner.launch.torchrun_script``) and run it under ``torchrun --nproc-per-node N``
(gloo) for two steps: it must exit 0 with every rank at the planned micro-batch and
accumulation. The accelerate config is loaded by accelerate's own config loader and launched
with ``accelerate launch`` and a minimal Accelerator script; on a machine without a GPU
accelerate runs each process alone (DistributedType.NO), which is recorded, not hidden.
Then ``tilefit plan llama-3-8b --gpu h100 --gpus 8`` is timed.

    OMP_NUM_THREADS=1 flock /tmp/tilefit-bench.lock python benchmarks/bench_plan_launch_cpu.py \
        [--out benchmarks/results_plan_launch_cpu.txt]
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

ROOT = Path(__file__).resolve().parent.parent
NPROC = 2
GLOBAL_BATCH = 8
TINY = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 512}

_ACCELERATE_SCRIPT = '''
import json, sys
import torch, transformers
from accelerate import Accelerator
cfg = json.loads(sys.argv[1]); micro, accum = int(sys.argv[2]), int(sys.argv[3])
acc = Accelerator(gradient_accumulation_steps=accum)
config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
model, opt = acc.prepare(model, opt)
for step in range(2):
    for _ in range(accum):
        with acc.accumulate(model):
            ids = torch.randint(0, config.vocab_size, (micro, 32), device=acc.device)
            loss = model(input_ids=ids, labels=ids).loss
            acc.backward(loss); opt.step(); opt.zero_grad()
    print("accelerate-step " + json.dumps({"rank": acc.process_index, "step": step,
          "world": acc.num_processes, "type": str(acc.distributed_type)}), flush=True)
'''


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
    return ok, secs, "" if ok else r.stderr[-1500:]


def launch_rows(name: str, work: Any, tmp: Path) -> tuple[list[str], bool]:
    from tilefit.planner import plan

    t0 = time.perf_counter()
    p = plan(work, gpu="h100", global_batch=GLOBAL_BATCH, world_size=NPROC, confirm=False)
    lines = [f"{name}: planned {len(p.rows)} rows from {p.traces} traces in "
             f"{time.perf_counter() - t0:.1f} s"]
    ok = True
    kinds = sorted({(r.strategy, r.grad_checkpointing) for r in p.rows})
    for strategy, ckpt in kinds:
        row = max((r for r in p.rows if (r.strategy, r.grad_checkpointing) == (strategy, ckpt)
                   and r.recipe.spec.autocast_dtype), key=lambda r: r.samples_per_s)
        good, secs, err = launch_script(row, work, tmp)
        ok &= good
        lines.append(f"  torchrun {row.recipe_label():36} micro-batch {row.micro_batch} x "
                     f"{row.accumulation_steps} x {NPROC} ranks: "
                     f"{'2 steps OK' if good else 'FAILED'} ({secs:.1f} s){err}")
    return lines, ok


def accelerate_check(work: Any, tmp: Path) -> str:
    """accelerate's loader parses the config; accelerate launch runs it."""
    from accelerate.commands.config.config_args import load_config_from_file

    from tilefit.planner import launch, plan

    p = plan(work, gpu="h100", global_batch=GLOBAL_BATCH, world_size=NPROC, strategy="fsdp2",
             confirm=False)
    assert p.best is not None
    cfg = tmp / "accelerate.yaml"
    cfg.write_text(launch.yaml_text(launch.accelerate_config(p.best)) + "\n")
    loaded = load_config_from_file(str(cfg))
    script = tmp / "accelerate_train.py"
    script.write_text(_ACCELERATE_SCRIPT)
    hf = {k: v for k, v in work.config.items() if not k.startswith("_")}
    r = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                        str(cfg), str(script), json.dumps(hf), str(p.best.micro_batch),
                        str(p.best.accumulation_steps)], env=_env(), capture_output=True,
                       text=True, timeout=600, cwd=tmp)
    steps = [json.loads(x.split(" ", 1)[1]) for x in r.stdout.splitlines()
             if x.startswith("accelerate-step ")]
    kinds = sorted({s["type"] for s in steps})
    return (f"accelerate: config loaded by accelerate ({loaded.distributed_type}, fsdp_version "
            f"{loaded.fsdp_config.get('fsdp_version')}); accelerate launch exit "
            f"{r.returncode}, {len(steps)} step lines, distributed type seen by the script "
            f"{kinds} (without a GPU accelerate runs each process alone: FSDP is not "
            "exercised here)")


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
    args = ap.parse_args()
    import torch

    lines = [f"torch {torch.__version__}, threads {torch.get_num_threads()}, OMP_NUM_THREADS="
             f"{os.environ.get('OMP_NUM_THREADS')}, load average before "
             f"{os.getloadavg()[0]:.2f}"]
    ok = True
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        works = workloads()
        for name, work in works.items():
            out, good = launch_rows(name, work, tmp)
            ok &= good
            lines.extend(out)
            print("\n".join(out), flush=True)
        lines.append(accelerate_check(works["gpt2"], tmp))
        print(lines[-1], flush=True)
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
