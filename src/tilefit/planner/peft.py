"""LoRA as the planner models it: frozen base weights plus trainable low-rank adapters.

The tracer has no PEFT support, so the adapters are added by hand in a factory around the
workload's build, the way the peft library's LoraConfig(target_modules="all-linear") does:
every linear layer but the output head gets y = W x + (alpha / r) B(A x), with A (r x in) and
B (out x r) trainable and W frozen (requires_grad False: no weight gradient, no optimizer
state). Dropout on the adapter input is off (peft's default lora_dropout=0.0).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Rank 16, alpha 32: a common choice between peft's default (r=8) and QLoRA's r=64 (Dettmers
# et al. 2023); the adapter memory is tiny at any of them.
LORA_RANK = 16
LORA_ALPHA = 32


def _lora_class() -> type:
    import torch

    class LoRALinear(torch.nn.Module):
        def __init__(self, base: torch.nn.Module, in_features: int, out_features: int,
                     rank: int, alpha: float) -> None:
            super().__init__()
            self.base = base
            self.lora_A = torch.nn.Linear(in_features, rank, bias=False)
            self.lora_B = torch.nn.Linear(rank, out_features, bias=False)
            self.scale = alpha / rank

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + self.lora_B(self.lora_A(x)) * self.scale

    return LoRALinear


def add_lora(model: torch.nn.Module, rank: int = LORA_RANK, alpha: float = LORA_ALPHA
             ) -> torch.nn.Module:
    """Freeze every parameter and wrap each linear layer (but the output head) with LoRA."""
    import torch
    from transformers.pytorch_utils import Conv1D

    lora = _lora_class()
    for p in model.parameters():
        p.requires_grad_(False)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    targets = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if child is head:
                continue
            if isinstance(child, torch.nn.Linear):
                targets.append((parent, name, child, child.in_features, child.out_features))
            elif isinstance(child, Conv1D):  # GPT-2: weight is (in, out)
                n_in, n_out = child.weight.shape
                targets.append((parent, name, child, int(n_in), int(n_out)))
    for parent, name, child, n_in, n_out in targets:
        setattr(parent, name, lora(child, n_in, n_out, rank, alpha))
    return model
