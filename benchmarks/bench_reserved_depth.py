"""The caching allocator's reserved peak of a deep model, from traces at a few layers.

The planner (and the audit's layer lever) trace a deep model at two shallow depths and
extrapolate to the full one. The allocated peak extrapolates in the layer count; what the
allocator reserves beyond it does not. For each case below the step is traced at the two
depths the planner uses and at full depth (the replay of the full trace is the reference),
and three rules for the full depth's reserved peak are compared, each on the full trace's
allocated peak (so that only the rule differs):

- bytes: the allocated peak plus the bytes reserved beyond it at the deepest shallow depth;
- max share: the allocated peak times (1 + the larger share of the two shallow replays)
  (the audit's layer lever);
- share at depth: the share extrapolated in the layer count, held inside the two shallow
  shares (the planner's sweep along the layers).

Since session 16 tilefit takes "bytes" for adapters on a frozen base (LoRA: no
per-parameter optimizer state fragments with every layer) and the share otherwise
(planner.search.reserved_of, advise.lever._reserved): the "tilefit" line.

Cases whose full trace does not fit the GPU (the replay stops at the failed request) are
left out: no reference. Nothing is fitted.

    OMP_NUM_THREADS=1 python benchmarks/bench_reserved_depth.py
"""

from __future__ import annotations

import os
import sys
import time

# (gpu, model, strategy or None, micro-batch, LoRA, the two shallow depths)
CASES = (
    ("rtx-4090", "llama-3-8b", None, 2, True, (1, 2)),
    ("rtx-4090", "llama-3-8b", None, 1, True, (1, 2)),
    ("a100-80gb", "llama-2-7b", None, 4, True, (1, 2)),
    ("a100-80gb", "llama-3.2-1b", None, 4, False, (1, 2)),
    ("h100", "llama-3.2-1b", None, 8, False, (1, 2)),
    ("rtx-4090", "qwen2.5-0.5b", None, 4, False, (1, 2)),
    ("rtx-4090", "llama-3-8b", "fsdp2", 1, True, (2, 3)),
    ("rtx-4090", "llama-3.2-1b", "fsdp2", 2, False, (2, 3)),
)
SEQ = 2048


def replay(gpu: str, model: str, strategy: str | None, micro: int, lora: bool,
           layers: int | None) -> tuple[int, int]:
    """(allocated peak, reserved peak) of the checkpointed bf16-mixed step."""
    from tilefit.estimator import estimate_recipe
    from tilefit.hardware import get_device
    from tilefit.models import load_workload
    from tilefit.recipe import Lora, Parallelism, Recipe

    dev = get_device(gpu)
    work = load_workload(model, seq_len=SEQ)
    if layers is not None:
        work = work.with_config(num_hidden_layers=layers)
    par = Parallelism() if strategy is None else Parallelism(2, strategy)
    recipe = Recipe.for_model(work, batch_size=micro, precision="bf16-mixed",
                              grad_checkpointing=True, attention="sdpa",
                              lora=Lora() if lora else None, parallel=par).on(dev)
    est = estimate_recipe(work, None, recipe, dev)
    assert est.reserved is not None
    return est.peak_memory_bytes, est.reserved.peak_reserved_bytes


def main() -> int:
    gib = 2**30
    print(f"load average {os.getloadavg()[0]:.2f} at the start; OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS')}; seq {SEQ}, bf16-mixed, checkpointed")
    errors: dict[str, list[float]] = {"bytes": [], "max share": [], "share at depth": [],
                                      "tilefit (planner)": []}
    for gpu, model, strategy, micro, lora, depths in CASES:
        t0 = time.perf_counter()
        (a0, r0), (a1, r1) = (replay(gpu, model, strategy, micro, lora, k) for k in depths)
        full_a, full_r = replay(gpu, model, strategy, micro, lora, None)
        name = (f"{model} {strategy or '1 GPU'} {gpu} mb{micro}"
                + (" LoRA" if lora else ""))
        if full_r < full_a:
            print(f"{name}: the full step does not fit the GPU (left out)")
            continue
        s0, s1 = r0 / a0 - 1, r1 / a1 - 1
        from tilefit.models import load_workload

        full_layers = load_workload(model, seq_len=SEQ).config["num_hidden_layers"]
        slope = (s1 - s0) / (depths[1] - depths[0])
        at_depth = min(max(s1 + slope * (full_layers - depths[1]), min(s0, s1)), max(s0, s1))
        rules = {"bytes": full_a + (r1 - a1), "max share": full_a * (1 + max(s0, s1)),
                 "share at depth": full_a * (1 + at_depth)}
        errors["tilefit (planner)"].append(
            (rules["bytes"] if lora else rules["share at depth"]) / full_r - 1)
        cells = []
        for rule, value in rules.items():
            errors[rule].append(value / full_r - 1)
            cells.append(f"{rule} {value / gib:6.2f} ({value / full_r - 1:+6.1%})")
        print(f"{name}: beyond the peak at {depths[0]}/{depths[1]} layers "
              f"{(r0 - a0) / gib:.2f}/{(r1 - a1) / gib:.2f} GiB ({s0:.1%}/{s1:.1%}); full "
              f"{full_a / gib:.2f} allocated, {full_r / gib:.2f} reserved "
              f"({(full_r - full_a) / gib:.2f} GiB, {full_r / full_a - 1:.1%}); "
              + "; ".join(cells) + f" [{time.perf_counter() - t0:.0f} s]", flush=True)
    for rule, errs in errors.items():
        if errs:
            mean = sum(abs(e) for e in errs) / len(errs)
            print(f"{rule}: mean |error| {mean:.1%}, worst {max(errs, key=abs):+.1%} over "
                  f"{len(errs)} cases")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
