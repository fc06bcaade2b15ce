"""Fused linear cross-entropy (Liger Kernel's algorithm, tilefit.models.fused_loss): the
traced peak against real CPU steps, and what it changes on GPUs.

Issue 13, item 3. First table: small causal LMs trained for real on this CPU (fp32), peak
memory measured with PyTorch's MemTracker (an independent method) against tilefit's
fake-tensor trace, with the head's own loss and with the fused loss. Second table: the
predicted peak and step time of real model configs on a GPU, eager loss against fused, beside
one fp32 copy of the logits (tokens x vocabulary x 4 bytes) for scale.

    python benchmarks/bench_fused_ce.py [--gpu h100]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GIB = 2**30
SMALL = (  # (catalog model, config changes): one layer, small widths and vocabularies
    ("gpt2", {"num_hidden_layers": 1, "n_embd": 64, "n_head": 2, "vocab_size": 4000}),
    ("llama-3.2-1b", {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128,
                      "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                      "vocab_size": 8000}),
    ("qwen2.5-0.5b", {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128,
                      "num_attention_heads": 2, "num_key_value_heads": 1,
                      "vocab_size": 6000}),
)
GPU_CASES = (("gpt2", 8, 1024), ("llama-3.2-1b", 4, 2048), ("qwen2.5-0.5b", 8, 2048),
             ("llama-3-8b", 1, 8192))


def cpu_table() -> None:
    from tilefit.bench.step import measure_step
    from tilefit.estimator.workload_estimate import estimate_workload
    from tilefit.models import load_workload
    from tilefit.recipe import Recipe

    print(f"{'model (1 layer)':16} {'loss':7} {'measured B':>12} {'predicted B':>12} {'error':>8}")
    for name, changes in SMALL:
        work = load_workload(name, seq_len=64).with_config(**changes)
        for fused in (False, True):
            recipe = Recipe(batch_size=2, precision="fp32", optimizer="adamw", fused_ce=fused)
            pred = estimate_workload(work, recipe, "cpu").peak_memory_bytes
            real = measure_step(work, recipe, "cpu", steps=1, warmup=2).peak_memory_bytes
            print(f"{name:16} {'fused' if fused else 'eager':7} {real:12d} {pred:12d} "
                  f"{pred / real - 1:+8.3%}")


def gpu_table(gpu: str) -> None:
    from tilefit.estimator.workload_estimate import estimate_workload
    from tilefit.models import load_workload
    from tilefit.recipe import Recipe

    print(f"\n{gpu}, bf16-mixed, AdamW(fused=True), clipped at 1.0:")
    print(f"{'model':14} {'batch x seq':>12} {'logits fp32':>12} {'peak eager':>11} "
          f"{'peak fused':>11} {'saved':>7} {'step eager':>11} {'step fused':>11}")
    for name, batch, seq in GPU_CASES:
        work = load_workload(name, seq_len=seq)
        est = [estimate_workload(work, Recipe(batch_size=batch, precision="bf16-mixed",
                                              optimizer="adamw-fused", max_grad_norm=1.0,
                                              fused_ce=f), gpu) for f in (False, True)]
        logits = batch * seq * int(work.config["vocab_size"]) * 4
        saved = est[0].peak_memory_bytes - est[1].peak_memory_bytes
        print(f"{name:14} {f'{batch} x {seq}':>12} {logits / GIB:10.2f} G "
              f"{est[0].peak_memory_bytes / GIB:9.2f} G {est[1].peak_memory_bytes / GIB:9.2f} G "
              f"{saved / GIB:5.2f} G {est[0].step_time_s * 1e3:8.1f} ms "
              f"{est[1].step_time_s * 1e3:8.1f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="h100")
    args = parser.parse_args()
    cpu_table()
    gpu_table(args.gpu)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
