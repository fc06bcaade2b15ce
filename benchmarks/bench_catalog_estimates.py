"""Every catalog model's predicted step on an A100 80GB (bf16-mixed and fp32, batch 4,
sequence 512 or the model's own shorter one): step time and peak memory, one row each.
Predictions only, deterministic: run it under two versions of tilefit and diff the rows to
see which predictions a change moved.

    python benchmarks/bench_catalog_estimates.py > after.txt
    python benchmarks/bench_catalog_estimates.py --loop framework > after_hf.txt

``--loop framework``: each model under the loop its framework runs (Recipe.for_model: the
Hugging Face Trainer's defaults for a transformers model), as the CLI predicts it; default:
a plain Recipe.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

BATCH, SEQ, GPU = 4, 512, "a100-80gb"


def main() -> None:
    import argparse

    from tilefit.estimator.workload_estimate import estimate_workload
    from tilefit.models import catalog, load_workload
    from tilefit.recipe import Recipe

    parser = argparse.ArgumentParser()
    parser.add_argument("--loop", choices=("plain", "framework"), default="plain")
    loop = parser.parse_args().loop
    print(f"# {GPU}, batch {BATCH}, seq {SEQ} (or the model's own limit), {loop} loop: "
          "predicted step ms, peak MiB")
    for name in catalog.catalog_names():
        for precision in ("bf16-mixed", "fp32"):
            try:
                work = load_workload(name, seq_len=SEQ)
                recipe = (Recipe.for_model(work, batch_size=BATCH, precision=precision)
                          if loop == "framework" else Recipe(BATCH, precision=precision))
                est = estimate_workload(work, recipe, GPU)
                row = f"{est.step_time_s * 1e3:10.3f} ms {est.peak_memory_bytes / 2**20:10.1f} MiB"
            except Exception as exc:  # a model that does not fit or cannot be traced
                row = f"error: {str(exc).splitlines()[0][:70]}"
            print(f"{name:24} {precision:10} {row}", flush=True)


if __name__ == "__main__":
    main()
