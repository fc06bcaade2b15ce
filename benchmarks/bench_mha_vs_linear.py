"""Issue 46's example: four attention blocks written with nn.MultiheadAttention against the
same four written with nn.Linear and F.scaled_dot_product_attention (width 1024, 16 heads,
batch 16 x 512), predicted on every GPU of the catalog in fp16 and bf16 autocast.

Printed per GPU and precision: each model's step time and peak memory, their ratio, and the
time of their GEMMs and attention kernels alone, which a GPU runs alike for both (the rest
is MultiheadAttention's own work: F.multi_head_attention_forward's contiguous copy of the
packed projection, the three select_backward gradients it adds up, the output permute's
copy, which run on a GPU too).

    python benchmarks/bench_mha_vs_linear.py [--gpus a100-80gb,h100]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, HEADS, BLOCKS, BATCH, SEQ = 1024, 16, 4, 16, 512


class WithMHA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
                                    for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x, x, x, need_weights=False)[0]
        return x


class WithLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.ModuleList(nn.Linear(WIDTH, 3 * WIDTH) for _ in range(BLOCKS))
        self.out = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        for qkv, out in zip(self.qkv, self.out, strict=True):
            q, k, v = qkv(x).view(b, s, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v)
            x = x + out(a.transpose(1, 2).reshape(b, s, d))
        return x


def _kernels_s(est: object) -> float:
    return sum(c.time_s * c.repeats for c in est.ops  # type: ignore[attr-defined]
               if c.record.kind in ("gemm", "attention"))


def main() -> None:
    from tilefit import Recipe, estimate
    from tilefit.hardware.catalog import CATALOG

    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", default=",".join(d.name for d in CATALOG if d.kind == "cuda"))
    args = ap.parse_args()
    x = torch.randn(BATCH, SEQ, WIDTH)
    print(f"# torch threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}")
    print(f"{'gpu':18} {'precision':10} {'MHA ms':>8} {'Linear ms':>9} {'ratio':>6} "
          f"{'MHA MiB':>8} {'Lin MiB':>8} {'ratio':>6} {'kernels ratio':>13}")
    for gpu in args.gpus.split(","):
        for precision in ("fp16-mixed", "bf16-mixed"):
            try:
                mha, lin = (estimate(m(), x, gpu=gpu, loss_fn=lambda m, b: m(b).float().mean(),
                                     recipe=Recipe(precision=precision, batch_size=BATCH))
                            for m in (WithMHA, WithLinear))
            except Exception as exc:  # a precision the GPU lacks
                print(f"{gpu:18} {precision:10} skipped: {str(exc).splitlines()[0][:60]}")
                continue
            print(f"{gpu:18} {precision:10} {mha.step_time_s * 1e3:8.2f} "
                  f"{lin.step_time_s * 1e3:9.2f} {mha.step_time_s / lin.step_time_s:6.3f} "
                  f"{mha.peak_memory_bytes / 2**20:8.0f} {lin.peak_memory_bytes / 2**20:8.0f} "
                  f"{mha.peak_memory_bytes / lin.peak_memory_bytes:6.3f} "
                  f"{_kernels_s(mha) / _kernels_s(lin):13.4f}")


if __name__ == "__main__":
    main()
