"""fp8 training (torchao float8, tensorwise dynamic scaling) against bf16-mixed on an H100:
predicted step time and peak memory of a few catalog models, eager and compiled, and the
two single-linear shapes torchao's README quotes a measured speed-up for (issue 13, item 4).

Published (docs/references.md, section 21): torchao's float8 README, H100, torch.compile:
one Float8Linear forward + backward at M, K, N = 1024, 2048, 1024 runs 0.80x of bf16's
speed; at 4096, 8192, 16384, 1.39x. Llama3-8B pre-training with torchtitan on 8 H100s
(batch 1 x 8192, compile, FSDP2 with float8 all-gather, per-op selective checkpointing):
6150 -> 7689.5 tokens/s (+25.03 %), peak memory 47.65 -> 47.77 GB. Not the same setup as
one GPU here: a check of the order of the gain, not a fit.

    python benchmarks/bench_fp8.py [--gpu h100] [--batch 8] [--seq 1024]
        [--models llama-3.2-1b,qwen2.5-0.5b,gpt2]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PUBLISHED_LINEAR = {(1024, 2048, 1024): 0.80, (4096, 8192, 16384): 1.39}


def _linear_loss(mod: object, x: object) -> object:
    return mod(x.requires_grad_()).float().sum()  # type: ignore[attr-defined, operator]


def linear_speedups(gpu: str) -> None:
    import torch
    from torch import nn

    from tilefit import Recipe, estimate

    print("one nn.Linear(K, N, bias=False) on an M x K input that requires grad (three "
          "GEMMs), forward + backward GPU time, compiled; bf16: pure bf16 weights, fp8: "
          "fp32 master weights (torchao's bench: bf16 weights)")
    print(f"{'M, K, N':>20} {'bf16 ms':>9} {'fp8 ms':>9} {'predicted':>10} {'published':>10}")
    for (m, k, n), published in PUBLISHED_LINEAR.items():
        times = {}
        for precision in ("bf16-true", "fp8-mixed"):
            model = nn.Linear(k, n, bias=False)
            batch = torch.empty(m, k, device="meta")
            est = estimate(model, batch, loss_fn=_linear_loss, gpu=gpu,
                           recipe=Recipe(precision=precision, optimizer="sgd", compile=True))
            times[precision] = sum(est.time_by_phase_s.get(p, 0.0)
                                   for p in ("forward", "backward"))
        print(f"{f'{m}, {k}, {n}':>20} {times['bf16-true'] * 1e3:9.3f} "
              f"{times['fp8-mixed'] * 1e3:9.3f} "
              f"{times['bf16'] / times['fp8-mixed']:9.2f}x {published:9.2f}x")


def model_table(gpu: str, models: list[str], batch: int, seq: int) -> None:
    from tilefit.estimator.workload_estimate import estimate_workload
    from tilefit.models import load_workload
    from tilefit.recipe import Recipe

    print(f"\nmodels on {gpu}, batch {batch} x {seq}, AdamW(fused=True)")
    print(f"{'model':14} {'recipe':18} {'step ms':>9} {'vs bf16':>8} {'peak GiB':>9} "
          f"{'trace s':>8}")
    for name in models:
        work = load_workload(name, seq_len=seq)
        for compile_ in (False, True):
            base = None
            for precision in ("bf16-mixed", "fp8-mixed"):
                recipe = Recipe(batch_size=batch, precision=precision,
                                optimizer="adamw-fused", compile=compile_)
                t0 = time.perf_counter()
                est = estimate_workload(work, recipe, gpu)
                took = time.perf_counter() - t0
                base = base or est.step_time_s
                label = precision + (" +compile" if compile_ else "")
                print(f"{name:14} {label:18} {est.step_time_s * 1e3:9.1f} "
                      f"{base / est.step_time_s:7.2f}x "
                      f"{est.peak_memory_bytes / 2**30:9.2f} {took:8.1f}")
    print("\npublished: Llama3-8B, 8 H100s, torchtitan, compile: +25.03 % tokens/s with "
          "tensorwise fp8, peak 47.65 -> 47.77 GB (torchao float8 README)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--models", default="llama-3.2-1b,qwen2.5-0.5b,gpt2")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    args = parser.parse_args()
    linear_speedups(args.gpu)
    model_table(args.gpu, [m for m in args.models.split(",") if m], args.batch, args.seq)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
