"""A fake or meta model's floating tensors cast to another dtype, in place."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tilefit.compat.bitsandbytes import is_quantized_param
from tilefit.compat.modules import buffer_slots, parameter_slots


def cast_floating(model: nn.Module, dtype: torch.dtype, *, frozen_only: bool = False) -> None:
    """model.to(dtype), in place, for a fake (or meta) model: Module._apply swaps tensors,
    which fake parameters refuse ("Cannot swap ... weakref", torch 2.13), so new parameters
    are put in place instead; tied weights stay tied. ``frozen_only``: only the parameters
    without requires_grad (a LoRA base model loaded in 16 bits), no buffers. bitsandbytes'
    weights not yet quantized keep their class and dtype (the quantizer's input)."""
    done: dict[int, Any] = {}
    for mod in model.modules():
        params = parameter_slots(mod)
        for name, p in list(params.items()):
            if p is None or not p.is_floating_point() or (frozen_only and p.requires_grad) \
                    or is_quantized_param(p):
                continue
            if id(p) not in done:
                done[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
            params[name] = done[id(p)]
        if frozen_only:
            continue
        buffers = buffer_slots(mod)
        for name, b in list(buffers.items()):
            if b is None or not b.is_floating_point():
                continue
            if id(b) not in done:
                done[id(b)] = b.to(dtype)
            buffers[name] = done[id(b)]
