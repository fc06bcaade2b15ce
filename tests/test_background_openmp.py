"""A forked trace that opens an OpenMP parallel region outside torch (bitsandbytes' CPU
quantize, as building a QLoRA model does) after the parent ran one with two threads: GNU
OpenMP's team does not survive the fork, and without one thread in the child it hung at the
region's barrier (seen: `tilefit plan llama-3-8b --allow-quantize` with OMP_NUM_THREADS=2
waited on its forked confirmation forever)."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import torch
import bitsandbytes.functional as F
from tilefit.tracing.background import Background

def quantized():
    F.quantize_4bit(torch.randn(2048, 2048), quant_type="nf4")
    return "done"

torch.set_num_threads(2)
F.quantize_4bit(torch.randn(2048, 2048), quant_type="nf4")  # the parent's two-thread team
print(Background(quantized).result())
"""


def test_a_forked_trace_runs_openmp_outside_torch() -> None:
    pytest.importorskip("bitsandbytes")
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=120, env={"OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin",
                                           "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "done"
