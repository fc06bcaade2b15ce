"""GPT-2 small on an A100 (bf16-mixed, batch 8 x 1024, the audit's defaults): the predicted
torch.compile speed-up and what each part of the step contributes to it, beside a published
speed-up for a GPT-2-class model (issue 13's target).

Published: nanoGPT's README (karpathy/nanoGPT, Dec 2022): "cutting down iteration time from
~250ms / iter to 135ms / iter" with torch.compile, GPT-2 124M on A100s (nanoGPT's own model,
batch 12 x 1024, a PyTorch 2.0 nightly): 1.85x. Not the same model code, batch or PyTorch:
a check of the order of the gain, not a fit (docs/references.md, section 19).

    python benchmarks/bench_compile_gpt2.py [--gpu a100-80gb] [--batch 8]
"""

from __future__ import annotations

import argparse
import os
import re
from collections import defaultdict

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PUBLISHED_SPEEDUP = 250 / 135  # nanoGPT README


def by_part(est: object) -> dict[str, float]:
    """GPU seconds per part of the step: GEMMs, attention, fusible ops, the optimizer."""
    out: dict[str, float] = defaultdict(float)
    for c in est.ops:  # type: ignore[attr-defined]
        r = c.record
        if r.phase not in ("forward", "backward", "loss_check"):
            part = "optimizer, clipping (eager)"
        elif r.kind in ("gemm", "conv"):
            part = "GEMMs"
        elif r.kind == "attention":
            part = "fused attention"
        else:
            part = "elementwise, norms, softmax, copies"
        out[part] += c.time_s * c.repeats
    return out


def fusible_by_module(est: object) -> dict[str, float]:
    """GPU seconds of the fusible ops per module, layers folded (h.3.mlp -> h.*.mlp)."""
    out: dict[str, float] = defaultdict(float)
    for c in est.ops:  # type: ignore[attr-defined]
        r = c.record
        if r.phase in ("forward", "backward", "loss_check") and r.kind not in (
                "gemm", "conv", "attention", "view"):
            out[re.sub(r"\.\d+\.", ".*.", r.module) or "(outside modules)"] += \
                c.time_s * c.repeats
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="a100-80gb")
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    from dataclasses import replace

    from tilefit.estimator.workloads import estimate_workload
    from tilefit.models import load_workload
    from tilefit.vocab import Recipe

    work = load_workload("gpt2", seq_len=1024)
    recipe = Recipe(batch_size=args.batch, precision="bf16-mixed", optimizer="adamw-fused",
                    max_grad_norm=1.0, loss_sync=True)
    eager = estimate_workload(work, recipe, args.gpu)
    compiled = estimate_workload(work, replace(recipe, compile=True), args.gpu)
    print(f"gpt2, {args.gpu}, bf16-mixed, batch {args.batch} x 1024, AdamW(fused=True), "
          "clipped at 1.0 (the Trainer's defaults)")
    print(f"{'part of the step (GPU time)':38} {'eager ms':>9} {'compiled ms':>12} "
          f"{'saved ms':>9} {'share of saving':>16}")
    e, c = by_part(eager), by_part(compiled)
    saved_total = eager.step_time_s - compiled.step_time_s
    for part in sorted(set(e) | set(c), key=lambda p: -e.get(p, 0.0)):
        saved = e.get(part, 0.0) - c.get(part, 0.0)
        print(f"{part:38} {e.get(part, 0.0) * 1e3:9.2f} {c.get(part, 0.0) * 1e3:12.2f} "
              f"{saved * 1e3:9.2f} {saved / saved_total:16.0%}")
    print(f"{'step (host and GPU timelines)':38} {eager.step_time_s * 1e3:9.2f} "
          f"{compiled.step_time_s * 1e3:12.2f} {saved_total * 1e3:9.2f}")
    print(f"peak memory: eager {eager.peak_memory_bytes / 2**30:.2f} GiB, compiled "
          f"{compiled.peak_memory_bytes / 2**30:.2f} GiB")
    fe, fc = fusible_by_module(eager), fusible_by_module(compiled)
    print(f"\n{'fusible ops by module':38} {'eager ms':>9} {'compiled ms':>12} {'saved ms':>9}")
    for mod in sorted(fe, key=lambda m: -(fe[m] - fc.get(m, 0.0)))[:8]:
        print(f"{mod:38} {fe[mod] * 1e3:9.2f} {fc.get(mod, 0.0) * 1e3:12.2f} "
              f"{(fe[mod] - fc.get(mod, 0.0)) * 1e3:9.2f}")
    speedup = eager.step_time_s / compiled.step_time_s
    print(f"predicted speed-up {speedup:.2f}x; published (nanoGPT README, GPT-2 124M on "
          f"A100s): {PUBLISHED_SPEEDUP:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
