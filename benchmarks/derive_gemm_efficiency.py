"""The catalog's large-GEMM efficiencies, derived from the published "maximum achievable matmul
FLOPs" (Bekman's MAMF table: docs/references.md, sections 6 and 13; benchmarks/gpu_corpus,
gemm.jsonl, ids mamf-*-bf16) under tilefit's own GEMM model.

For each of A100 SXM, A100 PCIe, H100 SXM and B200 it solves (bisection) for the
Device.gemm_efficiency at which ``tilefit.gemm.analyze_gemm`` predicts exactly the published
best TFLOP/s at the shape the table names, and prints it beside the value the catalog ships
(the gemm_efficiency of a100-80gb, a100-pcie-80gb, h100-sxm and b200 in
src/tilefit/hardware/catalog.toml). The model's
other terms (tile and wave quantization, the output tiles' stores:
docs/references.md, section 28) sit between the efficiency and the measured figure, so the
efficiency is a property of the model as much as of the GPU: when the model changes, rerun
this and update the catalog.

    PYTHONPATH=src python benchmarks/derive_gemm_efficiency.py
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from tilefit.gemm import analyze_gemm
from tilefit.hardware import get_device
from tilefit.hardware.catalog import catalog_entry

CORPUS = Path(__file__).resolve().parent / "gpu_corpus" / "gemm.jsonl"
# record -> the catalog entry whose gemm_efficiency it sets
SOURCES = {"mamf-a100-80gb-bf16": "a100-80gb", "mamf-a100-pcie-80gb-bf16": "a100-pcie-80gb",
           "mamf-h100-sxm-bf16": "h100-sxm", "mamf-b200-bf16": "b200"}


def solve(rec: dict) -> float:
    """The gemm_efficiency at which the model predicts the record's TFLOP/s (to 1e-6)."""
    dev = dataclasses.replace(get_device(rec["gpu"]), profile=None)
    lo, hi = 0.05, 1.0
    while hi - lo > 1e-6:
        mid = (lo + hi) / 2
        d = dataclasses.replace(dev, gemm_efficiency=mid)
        got = analyze_gemm(rec["m"], rec["n"], rec["k"], rec["dtype"], d).predicted_tflops
        lo, hi = (mid, hi) if got < rec["measured"]["tflops"] else (lo, mid)
    return (lo + hi) / 2


def main() -> int:
    records = [json.loads(line) for line in CORPUS.read_text(encoding="utf-8").splitlines()
               if line.strip()]
    print(f"{'record':24} {'shape (m x n x k)':22} {'TFLOP/s':>8} {'solved':>7} "
          f"{'catalog':>8}  entry")
    for rec in records:
        if rec["id"] not in SOURCES:
            continue
        name = SOURCES[rec["id"]]
        shipped = catalog_entry(name).gemm_efficiency
        shape = f"{rec['m']} x {rec['n']} x {rec['k']}"
        print(f"{rec['id']:24} {shape:22} {rec['measured']['tflops']:8.1f} "
              f"{solve(rec):7.3f} {shipped:8.3f}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
