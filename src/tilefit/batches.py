"""What a hardware-friendly batch size is, for every part of tilefit that proposes one."""

from __future__ import annotations

# Hardware-friendly micro-batches: multiples of 8 keep the batch dimension of the GEMMs
# Tensor-Core aligned for fp16/bf16 (NVIDIA "Matrix Multiplication Background" guide: dims
# multiples of 8 for fp16), and powers of two are what the Hugging Face single-GPU guide
# recommends for the batch size (docs/references.md, section 8).
FRIENDLY_MULTIPLE = 8
# A batch that is neither is proposed only when it is predicted at least this much faster
# per sample than the friendly alternative: a real gain, beyond the cost model's own error.
REAL_GAIN = 0.05


def divisors(n: int) -> list[int]:
    """Every divisor of ``n``, ascending: the micro-batches, GPU counts and node counts that
    split ``n`` exactly."""
    return [d for d in range(1, n + 1) if n % d == 0]


def is_friendly(batch: int) -> bool:
    return batch % FRIENDLY_MULTIPLE == 0 or (batch & (batch - 1)) == 0
