"""Published timm training throughput of convolutional models against tilefit (issue 27, 4).

Reads ``benchmarks/conv_corpus/published.jsonl`` (rows copied from timm's
``results/benchmark-train-amp-*-rtx3090.csv``: samples/s of a training step under AMP fp16,
SGD, cross-entropy, on one RTX 3090, PyTorch 1.12 / CUDA 11.3) and
``benchmarks/conv_corpus/configs.json`` (the transformers configuration that stands in for
each timm model, and where the two differ). Each row's step is traced at its batch and image
size and costed on the catalog's rtx-3090; printed: the published and predicted step time,
the signed error (predicted - published) / published, then the median and the worst
absolute error. Nothing is fitted on these rows.

tilefit's trace has no memory format: a row measured channels-last (nhwc) and one measured
in NCHW get the same prediction (see docs/references.md, section 37).

    PYTHONPATH=src python benchmarks/bench_conv_published.py [--only ID ...] [--label after]

Run it with PYTHONPATH pointing at another checkout's src/ to cost the same rows with that
checkout's model (the "before" figures of benchmarks/results_conv_published.txt come from
the main branch this way).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "benchmarks" / "conv_corpus"


def load_rows(only: list[str] | None) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in
            (CORPUS / "published.jsonl").read_text(encoding="utf-8").splitlines()
            if line.strip()]
    return [r for r in rows if not only or r["id"] in only]


def write_config(name: str, spec: dict[str, Any], folder: Path) -> Path:
    """The transformers config.json of ``name`` (built by its config class, so every
    default is transformers' own)."""
    import transformers

    cls = getattr(transformers, spec["config_class"])
    config = cls(architectures=spec["architectures"], **spec["kwargs"])
    path = folder / f"{name}.json"
    config.to_json_file(str(path))
    return path


def predict(row: dict[str, Any], config_path: Path) -> float:
    """tilefit's predicted step time of the row, in seconds."""
    import tilefit
    from tilefit.models.sources import load_workload

    workload = load_workload(str(config_path), image_size=row["image_size"])
    recipe = tilefit.Recipe(batch_size=row["batch"], precision=f"{row['amp']}-mixed",
                            optimizer="sgd", zero_grad_to_none=False)
    est = tilefit.estimate(workload, row["batch"], recipe=recipe, gpu=row["gpu"])
    return float(est.step_time_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", help="row ids to run")
    ap.add_argument("--label", default="", help="a name for this run's costing")
    args = ap.parse_args()
    specs = json.loads((CORPUS / "configs.json").read_text(encoding="utf-8"))
    rows = load_rows(args.only)
    cache: dict[tuple[str, str, int, int], float] = {}
    errors: dict[str, float] = {}
    print(f"costing: {args.label or 'this checkout'}")
    print(f"{'row':26s} {'config':18s} {'batch':>5s} {'published':>10s} {'predicted':>10s} "
          f"{'error':>8s}")
    with tempfile.TemporaryDirectory() as tmp:
        for row in rows:
            key = (row["config"], row["gpu"], row["batch"], row["image_size"])
            if key not in cache:
                t0 = time.perf_counter()
                path = write_config(row["config"], specs[row["config"]], Path(tmp))
                cache[key] = predict(row, path)
                print(f"  (traced {row['config']} in {time.perf_counter() - t0:.0f} s)")
            published = row["batch"] / row["samples_per_s"]
            predicted = cache[key]
            err = (predicted - published) / published
            errors[row["id"]] = err
            print(f"{row['id']:26s} {row['config']:18s} {row['batch']:5d} "
                  f"{published * 1e3:8.1f}ms {predicted * 1e3:8.1f}ms {err:+8.1%}")
    depthwise = [r["id"] for r in rows if specs[r["config"]]["depthwise"]]
    summarize("all rows", list(errors.values()))
    summarize("depthwise-heavy rows (ConvNeXt, MobileNetV2, EfficientNet)",
              [errors[i] for i in depthwise if i in errors])


def summarize(name: str, errors: list[float]) -> None:
    if errors:
        worst = max(errors, key=abs)
        print(f"{name}: step time |error| median {statistics.median(abs(e) for e in errors):.1%}"
              f", worst {worst:+.1%} over {len(errors)} rows")


if __name__ == "__main__":
    main()
