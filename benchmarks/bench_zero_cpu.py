"""DeepSpeed ZeRO (issue 14), modelled by tilefit, against DeepSpeed's real engine on the CPU.

DeepSpeed does not run on fake tensors, so ``estimate(..., strategy="zeroN")`` models it
(tilefit.estimator.zero). Here ``torchrun --nproc-per-node 2`` runs DeepSpeed's engine with
``DS_ACCELERATOR=cpu`` and gloo for two steps of each workload (an MLP, a tiny GPT-2 and
Llama in fp32, the MLP in DeepSpeed's bf16 mode) at stages 1, 2 and 3; each rank counts
its live tensor bytes with tilefit's ``MemoryLimitMode`` (no limit) from before
``deepspeed.initialize``, and reports its peak. tilefit's modelled per-rank peak, with the
same bucket sizes (``ZeroConfig``), stands beside each rank's
(docs/references.md, section 24, items 3 and 4).

DeepSpeed is not a tilefit dependency: install it apart, without touching torch
(``pip install --no-deps --target DIR deepspeed==0.19.8 hjson py-cpuinfo ninja msgpack
einops``) and pass ``--deepspeed DIR``. The first run builds DeepSpeed's CPU communication
op (about 100 s).

    OMP_NUM_THREADS=1 python benchmarks/bench_zero_cpu.py --deepspeed DIR [--out FILE]
        [--workloads mlp,gpt2,llama,mlp-bf16]
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


SEQ = 64  # tokens per sample for the transformer workloads


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, 256))


def make_gpt2() -> nn.Module:
    from workloads import gpt2_like
    torch.manual_seed(0)
    return gpt2_like()


def make_llama() -> nn.Module:
    from workloads import llama_like
    torch.manual_seed(0)
    return llama_like()


def mlp_batch() -> torch.Tensor:
    return torch.randn(BATCH, 256)


def mlp_batch_bf16() -> torch.Tensor:
    return torch.randn(BATCH, 256, dtype=torch.bfloat16)


def token_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 5000, (BATCH, SEQ))
    return {"input_ids": ids, "labels": ids.clone()}


def mlp_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def hf_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


# name: (build, batch, loss, description), AdamW; fp32 unless the name ends in -bf16
# (DeepSpeed's bf16 mode; tilefit's precision "bf16-true", 16-bit weights)
WORKLOADS: dict[str, tuple[Any, Any, Any, str]] = {
    "mlp": (make_mlp, mlp_batch, mlp_loss, "MLP 256-1024-1024-256"),
    "gpt2": (make_gpt2, token_batch, hf_loss,
             "GPT-2 2 layers, d 256, vocab 5000 (tied), seq 64 (workloads.gpt2_like)"),
    "llama": (make_llama, token_batch, hf_loss,
              "Llama 2 layers, d 256, GQA 8/2, vocab 5000, seq 64 (workloads.llama_like)"),
    "mlp-bf16": (make_mlp, mlp_batch_bf16, mlp_loss, "the MLP in DeepSpeed's bf16 mode"),
}


def ds_config(stage: int, bf16: bool = False) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": bf16},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKET,
                                  "allgather_bucket_size": BUCKET,
                                  "stage3_prefetch_bucket_size": BUCKET}}


def worker(name: str, stage: int, out_dir: str) -> None:
    import deepspeed  # type: ignore[import-not-found]
    import torch.distributed as dist

    from tilefit.tuning.simulate import MemoryLimitMode

    dist.init_process_group("gloo")
    build, batch, loss_fn, _ = WORKLOADS[name]
    model = build()
    mode = MemoryLimitMode(None, list(model.parameters()))
    with mode:
        config = ds_config(stage, name.endswith("-bf16"))
        engine, _, _, _ = deepspeed.initialize(model=model, config=config,
                                               model_parameters=model.parameters())
        for _ in range(2):
            loss = loss_fn(engine, batch())
            engine.backward(loss)
            engine.step()
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(
        {"peak_bytes": mode.peak_bytes, "live_after_bytes": mode.live_bytes}))
    dist.destroy_process_group()


def measured(name: str, stage: int, deepspeed_dir: str) -> list[dict[str, int]]:
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
               "PYTHONPATH": os.pathsep.join((str(ROOT / "src"), str(ROOT / "benchmarks"),
                                              deepspeed_dir))}
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={NPROC}",
               __file__, "--worker", name, str(stage), out]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            raise RuntimeError(r.stderr[-3000:])
        return [json.loads(Path(out, f"rank{i}.json").read_text()) for i in range(NPROC)]


def modelled(name: str, stage: int) -> Any:
    from tilefit import Parallelism, Recipe, ZeroConfig, estimate

    config = ZeroConfig(reduce_bucket_size=BUCKET, allgather_bucket_size=BUCKET,
                        stage3_prefetch_bucket_size=BUCKET)
    build, batch, loss_fn, _ = WORKLOADS[name]
    precision = "bf16-true" if name.endswith("-bf16") else "fp32"
    recipe = Recipe(precision=precision, optimizer="adamw",
                    parallel=Parallelism(NPROC, f"zero{stage}", zero=config))
    return estimate(build, batch(), loss_fn=loss_fn, gpu="cpu", recipe=recipe)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", nargs=3)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--deepspeed", help="the directory DeepSpeed is installed in")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.worker[2])
        return 0
    lines = [f"torch {torch.__version__}, {NPROC} ranks (gloo), OMP_NUM_THREADS="
             f"{os.environ.get('OMP_NUM_THREADS')}, load average {os.getloadavg()[0]:.2f}; "
             f"fp32 unless -bf16, AdamW, batch {BATCH}, buckets {BUCKET:,}; each rank's peak "
             "(rank 0 / rank 1) against tilefit's modelled per-rank peak (its worst rank)"]
    for name in args.workloads.split(","):
        lines.append(f"{name}: {WORKLOADS[name][3]}")
        for stage in (1, 2, 3):
            model = modelled(name, stage).peak_memory_bytes
            try:
                ranks = [r["peak_bytes"] for r in measured(name, stage, args.deepspeed or "")]
            except RuntimeError as e:  # a mode DeepSpeed's CPU accelerator does not run
                lines.append(f"  zero{stage}: DeepSpeed failed ({str(e).strip().splitlines()[-1]}),"
                             f" tilefit {model / 1e6:.2f} MB")
                print(lines[-1], flush=True)
                continue
            errs = " / ".join(f"{(model - r) / r:+.1%}" for r in ranks)
            real = " / ".join(f"{r / 1e6:.2f}" for r in ranks)
            lines.append(f"  zero{stage}: DeepSpeed {real}"
                         + f" MB, tilefit {model / 1e6:.2f} MB ({errs})")
            print(lines[-1], flush=True)
        lines.append(f"  load average {os.getloadavg()[0]:.2f}")
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
