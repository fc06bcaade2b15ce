"""The fake model, batch, optimizer and scaler state one trace runs: fake copies of the
user's tensors (nothing real is copied), the model's precision, attention, checkpointing,
fp8 linears and data-parallel wrapper set as the recipe says."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tilefit.compat.bitsandbytes import fake_quantized, is_quantized_param
from tilefit.compat.fake import (
    DataDependentOutputException,
    FakeTensorMode,
    deepcopy_keeps_mode,
    fake_sparse_like,
    tree_map,
)
from tilefit.compat.transformers import (
    enable_checkpointing,
    set_attention,
    skip_init_without_data,
)
from tilefit.errors import TilefitError
from tilefit.models.cast import cast_floating
from tilefit.tracing.build_values import BuildValues, reads_a_value
from tilefit.tracing.compiled import CompiledStep
from tilefit.tracing.distributed import wrap_model
from tilefit.tracing.errors import USER_CODE_ERRORS
from tilefit.tracing.float8 import convert_linears
from tilefit.tracing.optimizers import make_optimizer
from tilefit.tracing.recorder import Recorder
from tilefit.tracing.request import ModelSpec, TraceRequest
from tilefit.tracing.scaler import ScalerState, scaler_state

__all__ = ["Prepared", "build_model", "cast_floating", "fake_batch", "fake_copy", "prepare"]

def _fake_like(t: torch.Tensor, mode: FakeTensorMode, dtype: torch.dtype | None = None
               ) -> torch.Tensor:
    with mode:
        return torch.empty_strided(tuple(t.shape), tuple(t.stride()),
                                   dtype=dtype or t.dtype, device="cpu")


def fake_copy(model: nn.Module, mode: FakeTensorMode) -> nn.Module:
    """A copy of the user's module whose parameters and buffers are fake CPU tensors; the
    user's module, its weights and its device are untouched (nothing real is copied)."""
    memo: dict[int, Any] = {}
    for p in model.parameters(recurse=True):
        if id(p) in memo:
            continue
        if is_quantized_param(p):  # bitsandbytes' weights, quantized as its layers load them
            memo[id(p)] = fake_quantized(p, mode)
        else:
            memo[id(p)] = nn.Parameter(_fake_like(p, mode), requires_grad=p.requires_grad)
    for b in model.buffers(recurse=True):
        if id(b) not in memo:
            memo[id(b)] = _fake_like(b, mode)
    return copy.deepcopy(model, memo)


def fake_batch(batch: Any, mode: FakeTensorMode, float_dtype: torch.dtype | None) -> Any:
    def conv(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.layout == torch.sparse_coo:
            # a sparse batch (a graph's COO adjacency): its indices and values as fakes
            return fake_sparse_like(x, mode)
        if isinstance(x, torch.Tensor):
            dt = float_dtype if (float_dtype is not None and x.is_floating_point()) else None
            return _fake_like(x.contiguous() if x.device.type != "meta" else x, mode, dt)
        return x
    return tree_map(conv, batch)


@dataclass(frozen=True)
class Prepared:
    """The fake model, batch and optimizer one trace runs."""

    model: nn.Module
    batch: Any
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    scaler_state: ScalerState | None
    compiled: CompiledStep | None = None  # the captured loss computation (compile=True)
    notes: tuple[str, ...] = ()  # what wrapping the model in a data-parallel engine noted


def build_model(model: ModelSpec, mode: FakeTensorMode, meta: bool = False
                ) -> tuple[nn.Module, tuple[str, ...]]:
    """The fake model (the factory's product built under the fake mode, or a fake copy)
    and what its build assumed. ``meta``: a factory's model on the meta device (FSDP2
    shards it, then materialises it)."""
    if isinstance(model, nn.Module):
        return fake_copy(model, mode), ()
    notes: tuple[str, ...] = ()
    if meta:
        with torch.device("meta"):
            built = model()
    else:
        with deepcopy_keeps_mode():  # layers made with copy.deepcopy stay the mode's
            built, notes = _build_fake(model, mode)
    if not isinstance(built, nn.Module):
        raise TilefitError("the model factory did not return an nn.Module",
                           expected="a zero-argument callable returning torch.nn.Module",
                           given=type(built).__name__, fix="return the module")
    return built, notes


def _build_fake(factory: Any, mode: FakeTensorMode) -> tuple[Any, tuple[str, ...]]:
    """The factory's product on fake tensors, without weight initialisation (no values to
    initialise; torch.nn.init.trunc_normal_ reads one: ViT, DINOv2). An ``__init__`` that
    reads a tensor it made on an explicit device (ConvNeXt's drop-path rates,
    ``torch.linspace(..., device="cpu").tolist()``) cannot run under the fake mode; it is
    built on the meta device, where such a tensor keeps its values, and copied to fakes.
    One that reads a value of its own weights (torch's orthogonal() parametrization checks
    whether the weight is orthogonal already) is built on fake tensors again with each
    such read answered (tracing.build_values), and the trace says so."""
    try:
        with mode, skip_init_without_data():
            return factory(), ()
    except DataDependentOutputException:
        pass
    try:
        with torch.device("meta"), skip_init_without_data():
            built = factory()
    except RuntimeError as exc:
        if not reads_a_value(exc):
            raise
        answers = BuildValues()
        with mode, answers, skip_init_without_data():
            return factory(), answers.notes()
    return (fake_copy(built, mode) if isinstance(built, nn.Module) else built), ()


def prepare(model: ModelSpec, batch: Any, request: TraceRequest, recorder: Recorder,
            mode: FakeTensorMode, mesh: Any = None) -> Prepared:
    """The fake model (as the recipe sets it up, wrapped in its data-parallel engine), the
    fake batch, the optimizer and GradScaler's state."""
    recipe, parallel = request.recipe, request.parallel
    fmodel, notes = build_model(model, mode,
                                meta=parallel is not None and parallel.strategy == "fsdp2")
    with mode:
        set_attention(fmodel, recipe.attention)
        if request.pure_half is not None:
            cast_floating(fmodel, request.pure_half)
        if recipe.spec.float8_linears and request.low_dtype is not None:
            fmodel, fp8_notes = convert_linears(fmodel, request.low_dtype)
            notes += fp8_notes
        if recipe.grad_checkpointing:
            # the recompute runs under the forward's autocast state, which
            # torch.utils.checkpoint restores, and the target's kernels, which the dispatcher
            # holds for the whole step (tracing.autocast): no context of its own
            enable_checkpointing(fmodel, None, compiled=request.compiled)
        fmodel.train()
    if parallel is not None:
        fmodel, wrap_notes = wrap_model(fmodel, parallel, mesh, mode, recorder,
                                        param_dtype=request.low_dtype)
        notes += wrap_notes
    with mode:
        fbatch = fake_batch(batch, mode, request.pure_half)
        params = [p for p in fmodel.parameters() if p.requires_grad]
        if not params:
            raise TilefitError("the model has no trainable parameters",
                               expected="at least one parameter with requires_grad=True",
                               given="none", fix="unfreeze the parameters to train")
        opt = _optimizer(recipe.optimizer, params, request.target.foreach)
        state = scaler_state() if recipe.spec.grad_scaler else None
    return Prepared(fmodel, fbatch, params, opt, state, notes=notes)


def _optimizer(spec: Any, params: list[nn.Parameter], foreach: bool) -> torch.optim.Optimizer:
    try:
        return make_optimizer(spec, params, foreach=foreach)
    except USER_CODE_ERRORS as exc:
        raise TilefitError(
            f"the optimizer could not be created: {type(exc).__name__}: {exc}",
            expected="a name (adamw, sgd, ...) or a factory params -> Optimizer",
            given=repr(spec), fix="call the factory once on "
            "model.parameters() to see the full error") from None
