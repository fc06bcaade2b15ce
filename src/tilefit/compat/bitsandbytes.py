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

import contextlib
import copy
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
    "quant_states_lifted",
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


# the tensors a QuantState holds, in the order _state_tensors yields them
_STATE_FIELDS = ("absmax", "code", "offset")


def _state_tensors(state: Any) -> Iterator[torch.Tensor]:
    for name in _STATE_FIELDS:
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


# the buffers a 4-bit layer's QuantState tensors are lifted into while a step is captured
LIFTED_PREFIX = "_tilefit_quant_state_"
def _state_over(state: Any, tensors: Iterator[torch.Tensor]) -> Any:
    """A copy of ``state`` (and of its nested state) holding the next of ``tensors`` where
    it holds one, in _state_tensors' order."""
    out = copy.copy(state)
    for name in _STATE_FIELDS:
        if isinstance(getattr(state, name, None), torch.Tensor):
            setattr(out, name, next(tensors))
    if getattr(state, "state2", None) is not None:
        out.state2 = _state_over(state.state2, tensors)
    return out


@contextlib.contextmanager
def quant_states_lifted(model: nn.Module) -> Iterator[None]:
    """Each 4-bit layer's QuantState tensors as inputs of a step AOTAutograd captures, as
    Dynamo lifts them under torch.compile (bitsandbytes >= 0.46 compiles Linear4bit in one
    graph with PyTorch >= 2.8: docs/references.md, section 33).

    AOTAutograd swaps a module's parameters and buffers for traced stand-ins, so the weight
    Linear4bit.forward sees has lost the ``quant_state`` attribute; bitsandbytes' own
    recovery (``fix_4bit_weight_quant_state_from_module``) would re-wrap it as a Params4bit,
    which a traced tensor cannot back, and the QuantState's tensors would be constants of the
    graph. Here they are the layer's buffers for the capture (the same storages: nothing is
    copied) and that recovery gives the stand-in a QuantState over their stand-ins. The
    model is as it was afterwards."""
    layers = [(m, m.weight.quant_state) for m in model.modules()
              if isinstance(getattr(m, "weight", None), torch.Tensor)
              and getattr(m.weight, "quant_state", None) is not None]
    if not layers:
        yield
        return
    modules = importlib.import_module("bitsandbytes.nn.modules")
    recover = modules.fix_4bit_weight_quant_state_from_module
    states = {id(m): state for m, state in layers}

    def lifted(module: nn.Module) -> None:
        state = states.get(id(module))
        if state is None or getattr(module.weight, "quant_state", None) is not None:
            recover(module)
            return
        n = sum(1 for _ in _state_tensors(state))
        lifted_tensors = (getattr(module, f"{LIFTED_PREFIX}{i}") for i in range(n))
        module.weight.quant_state = _state_over(state, lifted_tensors)

    for m, state in layers:
        for i, t in enumerate(_state_tensors(state)):
            m.register_buffer(f"{LIFTED_PREFIX}{i}", t, persistent=False)
    modules.fix_4bit_weight_quant_state_from_module = lifted
    try:
        yield
    finally:
        modules.fix_4bit_weight_quant_state_from_module = recover
        for m, _ in layers:
            for name in [n for n in m._buffers if n.startswith(LIFTED_PREFIX)]:
                del m._buffers[name]
