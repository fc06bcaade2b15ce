"""Parameter counts, computed by building the model on the meta device (no memory, no init)."""

from __future__ import annotations

from tilefit.models.workload import Workload


def count_parameters(workload: Workload) -> int:
    """Distinct parameters of the built model (tied weights counted once, as PyTorch does).

    The model is built under ``torch.device("meta")``: shapes only, nothing allocated, so a 70B
    count takes well under a second.
    """
    import torch

    with torch.device("meta"):
        model = workload.build(attention="sdpa")
    return sum(p.numel() for p in model.parameters())
