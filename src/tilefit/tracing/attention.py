"""Which SDPA kernel a CUDA target would run, and routing the call to a kernel with the
same memory behaviour on the CPU.

PyTorch picks, in order, flash, memory-efficient, then math (aten/src/ATen/native/
transformers/cuda/sdp_utils.cpp, `select_sdp_backend`): flash needs sm80+, fp16/bf16, a head
dim that is a multiple of 8 and at most 256, and no attention mask; memory-efficient needs
sm50+ (bf16: sm80+), a head dim that is a multiple of 8 (fp16/bf16) or 4 (fp32), and accepts
masks; math is the fallback. Flash and memory-efficient keep no S x S score matrix: they save
the output and a log-sum-exp row per query (and the dropout RNG state, not a mask), which is
exactly what PyTorch's CPU flash kernel saves, so that kernel stands in for them in the trace.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from tilefit.tracing.target import Target


def _sdpa_params(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
                 is_causal: bool = False, scale: float | None = None,
                 enable_gqa: bool = False) -> None:
    """F.scaled_dot_product_attention's signature (a builtin, so inspect cannot read it)."""


_SDPA_SIG = inspect.signature(_sdpa_params)
FLASH_MAX_HEAD_DIM = 256


def choose_backend(target: Target, q: torch.Tensor, k: torch.Tensor,
                   attn_mask: torch.Tensor | None) -> str:
    """"flash", "efficient" or "math", as PyTorch would choose on the CUDA target."""
    d = q.shape[-1]
    half = q.dtype in (torch.float16, torch.bfloat16)
    if (target.sm >= 80 and half and d % 8 == 0 and d <= FLASH_MAX_HEAD_DIM
            and attn_mask is None and k.shape[-1] == d):
        return "flash"
    if q.dtype == torch.bfloat16 and target.sm < 80:
        return "math"
    if target.sm >= 50 and d % (8 if half else 4) == 0:
        return "efficient"
    return "math"


class AttentionRouter:
    """Runs scaled_dot_product_attention as the target would, telling the recorder which
    backend ran. Called for every SDPA call by its kernel in the dispatcher
    (tracing.target_kernels) with ``run``, the op's composite: its backend is chosen by
    torch's sdpa_kernel flags."""

    def __init__(self, target: Target, recorder: Any, force_math: bool = False) -> None:
        self.target = target
        self.recorder = recorder
        self.force_math = force_math
        self.choices: dict[str, int] = {}

    def __call__(self, run: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
        bound = _SDPA_SIG.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        q, k, mask = a["query"], a["key"], a["attn_mask"]
        backend = "math" if self.force_math else choose_backend(self.target, q, k, mask)
        self.choices[backend] = self.choices.get(backend, 0) + 1
        if backend == "math":
            with self.recorder.attention_backend("math"), sdpa_kernel([SDPBackend.MATH]):
                return run(*args, **kwargs)
        fused = {**a, "dropout_p": 0.0}
        if not fused["enable_gqa"]:
            del fused["enable_gqa"]  # torch < 2.5 has no enable_gqa
        try:
            with self.recorder.attention_backend(backend), \
                    sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return run(**fused)
        except RuntimeError:
            # the CPU stand-in rejects this input: fall back to the math decomposition
            with self.recorder.attention_backend("math"), sdpa_kernel([SDPBackend.MATH]):
                return run(*args, **kwargs)
