"""DeepSpeed ZeRO (issue 14), modelled by tilefit, against DeepSpeed's real engine on the CPU.

DeepSpeed does not run on fake tensors, so ``estimate(..., strategy="zeroN")`` models it
(tilefit.estimator.zero). Here ``torchrun --nproc-per-node 2`` runs DeepSpeed's engine with
``DS_ACCELERATOR=cpu`` and gloo for two steps of an MLP at stages 1, 2 and 3; each rank
counts its live tensor bytes with tilefit's ``MemoryLimitMode`` (no limit) from before
``deepspeed.initialize``, and reports its peak. tilefit's modelled per-rank peak, with the
same bucket sizes (``ZeroConfig``), stands beside it.

DeepSpeed is not a tilefit dependency: install it apart, without touching torch
(``pip install --no-deps --target DIR deepspeed==0.19.8 hjson py-cpuinfo ninja msgpack
einops``) and pass ``--deepspeed DIR``. The first run builds DeepSpeed's CPU communication
op (about 100 s).

    OMP_NUM_THREADS=1 python benchmarks/bench_zero_cpu.py --deepspeed DIR [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
NPROC = 2
BATCH = 4
BUCKET = 100_000  # reduce, all-gather and prefetch buckets (elements), in both


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, 256))


def loss_fn(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def ds_config(stage: int) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKET,
                                  "allgather_bucket_size": BUCKET,
                                  "stage3_prefetch_bucket_size": BUCKET}}


def worker(stage: int, out_dir: str) -> None:
    import deepspeed  # type: ignore[import-not-found]
    import torch.distributed as dist

    from tilefit.tuning.simulate import MemoryLimitMode

    dist.init_process_group("gloo")
    model = make_model()
    mode = MemoryLimitMode(None, list(model.parameters()))
    with mode:
        engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config(stage),
                                               model_parameters=model.parameters())
        for _ in range(2):
            loss = loss_fn(engine, torch.randn(BATCH, 256))
            engine.backward(loss)
            engine.step()
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(
        {"peak_bytes": mode.peak_bytes, "live_after_bytes": mode.live_bytes}))
    dist.destroy_process_group()


def measured(stage: int, deepspeed_dir: str) -> list[dict[str, int]]:
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
               "PYTHONPATH": os.pathsep.join((str(ROOT / "src"), deepspeed_dir))}
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={NPROC}",
               __file__, "--worker", str(stage), out]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            raise RuntimeError(r.stderr[-3000:])
        return [json.loads(Path(out, f"rank{i}.json").read_text()) for i in range(NPROC)]


def modelled(stage: int) -> Any:
    from tilefit import estimate
    from tilefit.estimator import ZeroConfig

    config = ZeroConfig(reduce_bucket_size=BUCKET, allgather_bucket_size=BUCKET,
                        stage3_prefetch_bucket_size=BUCKET)
    return estimate(make_model, torch.randn(BATCH, 256), loss_fn=loss_fn, optimizer="adamw",
                    device="cpu", world_size=NPROC, strategy=f"zero{stage}",
                    zero_config=config)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", nargs=2)
    ap.add_argument("--deepspeed", help="the directory DeepSpeed is installed in")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.worker:
        worker(int(args.worker[0]), args.worker[1])
        return 0
    lines = [f"torch {torch.__version__}, {NPROC} ranks (gloo), OMP_NUM_THREADS="
             f"{os.environ.get('OMP_NUM_THREADS')}, load average {os.getloadavg()[0]:.2f}; "
             f"MLP 256-1024-1024-256 fp32, AdamW, batch {BATCH}, buckets {BUCKET:,}"]
    for stage in (1, 2, 3):
        real = max(r["peak_bytes"] for r in measured(stage, args.deepspeed or ""))
        model = modelled(stage).peak_memory_bytes
        lines.append(f"zero{stage}: DeepSpeed peak per rank {real / 1e6:.2f} MB, tilefit "
                     f"modelled {model / 1e6:.2f} MB ({(model - real) / real:+.1%})")
        print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
