"""torchao's float8 training, traced on fake tensors (precision fp8-mixed).

The model's nn.Linear layers are swapped for torchao's own Float8Linear by torchao's own
``convert_to_float8_training`` (docs/references.md, section 21): its dynamic tensorwise
scaling runs as it does on a GPU (abs, max, the scale, mul, clamp and the cast to fp8 of the
input and the weight in the forward; of the gradient, the weight and the input again in the
backward: e4m3 for inputs and weights, e5m2 for gradients), and its autograd function saves
the high-precision input and weight for backward, never an fp8 copy. On a CPU torchao's
``_scaled_mm`` runs inside its tensor subclass, below the recorder, which therefore sees an
``aten.mm`` of two Float8TrainingTensors: ``float8_payload`` (tilefit.compat.torchao) gives
the recorder their fp8 data, so the GEMM is recorded in fp8 (1-byte operands) as
``_scaled_mm`` runs it on the GPU.

Layers whose dimensions are not multiples of 16 are left in bf16, as torchao's documented
module filter and accelerate's filter do: ``_scaled_mm`` refuses them on a GPU.
"""

from __future__ import annotations

from types import MethodType
from typing import Any

import torch
from torch import nn

from tilefit.compat.torchao import float8_linear_module, torchao_float8

# torch._scaled_mm needs every GEMM dimension divisible by 16 (docs/references.md, section 21)
FLOAT8_ALIGN = 16


def float8_eligible(module: nn.Module) -> bool:
    """An nn.Linear whose in and out features are multiples of 16: the layers torchao's
    documented filter converts."""
    return isinstance(module, nn.Linear) and module.in_features % FLOAT8_ALIGN == 0 \
        and module.out_features % FLOAT8_ALIGN == 0


def convert_linears(model: nn.Module, autocast_dtype: torch.dtype
                    ) -> tuple[nn.Module, tuple[str, ...]]:
    """The model with its eligible nn.Linear layers swapped for torchao's Float8Linear (in
    place; a model that is itself an nn.Linear is replaced), with torchao's default recipe
    (tensorwise dynamic scaling), and notes for the trace: how many layers run in fp8, the
    layers left in high precision by name."""
    ao = torchao_float8()
    skipped = [name for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and not float8_eligible(m)]
    model = ao.convert_to_float8_training(model, module_filter_fn=lambda m, _fqn: (
        not isinstance(m, nn.Linear) or float8_eligible(m)))
    linear_cls = float8_linear_module()
    converted = 0
    for m in model.modules():
        if isinstance(m, linear_cls.Float8Linear):
            m.forward = MethodType(_autocast_forward(linear_cls, autocast_dtype), m)
            converted += 1
    notes = [f"fp8: {converted} nn.Linear layer(s) run their GEMMs in fp8 (torchao float8, "
             "tensorwise scaling)" if converted else
             "fp8: no layer runs in fp8: torchao converts nn.Linear layers only (Hugging "
             "Face GPT-2's Conv1D is not one), so the step is bf16 autocast's"]
    if skipped:
        shown = ", ".join(skipped[:4]) + (f" and {len(skipped) - 4} more" if len(skipped) > 4
                                          else "")
        notes.append(f"fp8: {len(skipped)} nn.Linear layer(s) stay bf16, their dimensions "
                     f"not multiples of {FLOAT8_ALIGN} (torch._scaled_mm refuses them): "
                     f"{shown}")
    return model, tuple(notes)


def _autocast_forward(linear_cls: Any, autocast_dtype: torch.dtype) -> Any:
    """Float8Linear.forward as it runs under CUDA autocast: torchao casts the input to the
    autocast dtype when ``torch.is_autocast_enabled()``, which tilefit's emulated CUDA
    autocast (tracing.autocast) does not set; the rest is torchao's own autograd function."""
    matmul = linear_cls.matmul_with_hp_or_float8_args

    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        out = matmul.apply(x.to(autocast_dtype), self.weight.t(), self.linear_mm_config,
                           self.config)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out  # type: ignore[no-any-return]

    return forward
