"""bitsandbytes on fake tensors: its import, its quantized parameters made fake, and the
quantization state beside them.

bitsandbytes' ``Params4bit`` and ``Int8Params`` are ``torch.Tensor._make_subclass`` wrappers,
which a FakeTensor cannot back ("Creating a new Tensor subclass Params4bit but the raw Tensor
object is already associated to a python object of type FakeTensor", bitsandbytes 0.50.2).
So the fake model's quantized weight is the fake tensor bitsandbytes' own quantizer returns
(``functional.quantize_4bit``: packed uint8 ``((n*k+1)//2, 1)`` and a ``QuantState``;
``functional.int8_vectorwise_quant``: int8 ``(n, k)`` and its fp32 row scales), held as a
frozen parameter carrying the attributes bitsandbytes' layers read (``quant_state``,
``CB``/``SCB``); ``Linear4bit.forward`` and ``Linear8bitLt.forward`` then run as written and
their custom ops (``torch.ops.bitsandbytes.*``) run on bitsandbytes' own fake
implementations (``bitsandbytes/_ops.py``, ``register_fake``).
"""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tilefit.compat.fake import FakeTensorMode
from tilefit.errors import TilefitError
from tilefit.quiet_imports import quiet_imports

__all__ = [
    "BNB_PIP",
    "fake_quantized",
    "is_quantized_param",
    "logical_numel",
    "quant_state_tensors",
    "quiet_paged_fallback",
    "require_bitsandbytes",
]

BNB_PIP = "pip install torch==2.13.0 'tilefit[quant]'"


def require_bitsandbytes(what: str) -> Any:
    """The bitsandbytes module (imported with its import-time log lines silenced), or a
    TilefitError naming ``what`` needed it and the command that installs it."""
    try:
        with quiet_imports():
            return importlib.import_module("bitsandbytes")
    except ImportError:
        raise TilefitError(
            f"{what} is traced with the bitsandbytes library, which is not installed",
            expected="bitsandbytes importable (tilefit's optional extra 'quant')",
            given="import bitsandbytes failed", fix=BNB_PIP) from None


def _bnb_params() -> tuple[type, ...]:
    if "bitsandbytes" not in sys.modules:  # nothing quantized without it imported
        return ()
    nn_mod = importlib.import_module("bitsandbytes.nn")
    return (nn_mod.Params4bit, nn_mod.Int8Params)


def is_quantized_param(p: torch.Tensor) -> bool:
    """A bitsandbytes parameter not yet quantized (a meta model's Params4bit or Int8Params)."""
    kinds = _bnb_params()
    return bool(kinds) and isinstance(p, kinds)


def _warm_constant_maps(bnb: Any) -> None:
    """bitsandbytes builds its 8-bit dynamic map (double quantization's code) on first use
    with ``.tolist()``, which a fake tensor cannot answer: build it once on the real CPU (a
    256-value call) so the fake quantization finds it cached."""
    bnb.functional.quantize_blockwise(torch.zeros(256))


def fake_quantized(p: torch.Tensor, mode: FakeTensorMode) -> nn.Parameter:
    """The fake weight bitsandbytes' quantizer makes of ``p`` (a Params4bit or Int8Params of
    the meta model): frozen, with the attributes its layer reads. Its QuantState holds its
    own copies of the 4-bit code and of double quantization's dynamic map, as a real load's
    does (``quantize_blockwise`` copies the cached map: docs/references.md, section 33)."""
    bnb = require_bitsandbytes("a quantized base")
    if isinstance(p, bnb.nn.Params4bit):
        _warm_constant_maps(bnb)
        with mode:
            dense = torch.empty(tuple(p.shape), dtype=p.dtype)
            packed, state = bnb.functional.quantize_4bit(
                dense, blocksize=p.blocksize, compress_statistics=p.compress_statistics,
                quant_type=p.quant_type, quant_storage=p.quant_storage)
        out = nn.Parameter(packed, requires_grad=False)
        out.quant_state = state
        for name in ("blocksize", "compress_statistics", "quant_type", "quant_storage"):
            setattr(out, name, getattr(p, name))
        out.bnb_quantized = True
        return out
    with mode:  # Int8Params: Int8Params._quantize casts to fp16 and quantizes each row
        dense = torch.empty(tuple(p.shape), dtype=torch.float16)
        cb, scb, _ = bnb.functional.int8_vectorwise_quant(dense)
    out = nn.Parameter(cb, requires_grad=False)
    out.CB, out.SCB, out.has_fp16_weights = cb, scb, False
    return out


def quant_state_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    """The tensors a quantized model holds beside its parameters: each 4-bit weight's
    QuantState (absmax, its code, with double quantization the offset and the second
    level's absmax and code) and each int8 weight's row scales (SCB)."""
    for p in model.parameters():
        state = getattr(p, "quant_state", None)
        if state is not None:
            yield from _state_tensors(state)
        scb = getattr(p, "SCB", None)
        if isinstance(scb, torch.Tensor):
            yield scb
    for module in model.modules():  # Linear8bitLt moves CB/SCB to its state on first use
        scb = getattr(getattr(module, "state", None), "SCB", None)
        if isinstance(scb, torch.Tensor):
            yield scb


def _state_tensors(state: Any) -> Iterator[torch.Tensor]:
    for name in ("absmax", "code", "offset"):
        t = getattr(state, name, None)
        if isinstance(t, torch.Tensor):
            yield t
    nested = getattr(state, "state2", None)
    if nested is not None:
        yield from _state_tensors(nested)


def logical_numel(p: torch.Tensor) -> int:
    """The weights a parameter stands for: a packed 4-bit weight holds two per element."""
    state = getattr(p, "quant_state", None)
    return math.prod(state.shape) if state is not None else p.numel()


def quiet_paged_fallback(opt: Any) -> None:
    """A paged optimizer on the CPU (tilefit's fake tensors) falls back to ordinary buffers
    and warns once per optimizer (its private ``_cpu_paged_warned``): tilefit states what
    paging means in the trace's notes instead."""
    opt._cpu_paged_warned = True
