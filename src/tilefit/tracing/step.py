"""Run one real training step of the user's code, twice, on fake tensors, and record it."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from tilefit.errors import TilefitError
from tilefit.hardware import Device, get_device
from tilefit.tracing.attention import AttentionRouter
from tilefit.tracing.autocast import CudaAutocast
from tilefit.tracing.hf_compat import gpu_mask_semantics, quiet_transformers
from tilefit.tracing.optimizers import (
    OPTIMIZER_NAMES,
    OptimizerSpec,
    make_optimizer,
    optimizer_state_tensors,
)
from tilefit.tracing.recorder import Recorder
from tilefit.tracing.records import MICRO_PHASES, Trace
from tilefit.tracing.target import Target
from tilefit.tracing.torch_compat import FAKE_ERRORS, FakeTensorMode, ModulePath, new_fake_mode

PRECISIONS = ("fp32", "tf32", "fp16-mixed", "bf16-mixed", "bf16")
ATTENTIONS = ("auto", "eager", "sdpa")
LossFn = Callable[[nn.Module, Any], torch.Tensor]
ModelSpec = nn.Module | Callable[[], nn.Module]

# torch.amp.GradScaler's defaults (torch/amp/grad_scaler.py): init_scale 2**16,
# growth_factor 2.0, backoff_factor 0.5, growth_interval 2000.
SCALER_INIT, SCALER_GROWTH, SCALER_BACKOFF, SCALER_INTERVAL = 2.0**16, 2.0, 0.5, 2000


def resolve_target(device: str | Device) -> tuple[Target, Device | None]:
    """The target semantics for ``device``; "cpu" needs no Device to trace."""
    if isinstance(device, str) and device.strip().lower() == "cpu":
        return Target("cpu", None, 1, foreach=False), None
    dev = get_device(device)
    return Target.from_device(dev), dev


def check_options(precision: str, optimizer: OptimizerSpec, attention: str,
                  accumulation_steps: int, device: Device | None) -> None:
    if precision not in PRECISIONS:
        raise TilefitError(f"unknown precision {precision!r}",
                           expected="one of " + ", ".join(PRECISIONS), given=repr(precision),
                           fix="bf16-mixed is the usual choice on Ampere and later GPUs")
    if isinstance(optimizer, str) and optimizer.lower() not in OPTIMIZER_NAMES:
        raise TilefitError(f"unknown optimizer {optimizer!r}",
                           expected="one of " + ", ".join(OPTIMIZER_NAMES),
                           given=repr(optimizer), fix="pass one of the names above")
    if attention not in ATTENTIONS:
        raise TilefitError(f"unknown attention implementation {attention!r}",
                           expected="one of " + ", ".join(ATTENTIONS), given=repr(attention),
                           fix="use sdpa (PyTorch's fused kernels) unless you need eager")
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) \
            or accumulation_steps < 1:
        raise TilefitError("accumulation_steps must be a whole number >= 1",
                           expected="1, 2, 4, ...", given=repr(accumulation_steps),
                           fix="pass the number of micro-batches per optimizer step")
    if device is not None:
        needs = {"bf16-mixed": "bf16", "bf16": "bf16", "fp16-mixed": "fp16", "tf32": "tf32"}
        want = needs.get(precision)
        if want and not device.supports(want):
            alt = "fp16-mixed" if device.supports("fp16") else "fp32"
            raise TilefitError(
                f"{device.display_name} has no {want} math, so precision {precision} cannot run",
                expected="a precision the GPU supports", given=precision,
                fix=f"use precision {alt} on this GPU")


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
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(_fake_like(p, mode), requires_grad=p.requires_grad)
    for b in model.buffers(recurse=True):
        if id(b) not in memo:
            memo[id(b)] = _fake_like(b, mode)
    return copy.deepcopy(model, memo)


def cast_floating(model: nn.Module, dtype: torch.dtype, *, frozen_only: bool = False) -> None:
    """model.to(dtype), in place, for a fake (or meta) model: Module._apply swaps tensors,
    which fake parameters refuse ("Cannot swap ... weakref", torch 2.13), so new parameters
    are put in place instead; tied weights stay tied. ``frozen_only``: only the parameters
    without requires_grad (a LoRA base model loaded in 16 bits), no buffers."""
    done: dict[int, Any] = {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is None or not p.is_floating_point() or (frozen_only and p.requires_grad):
                continue
            if id(p) not in done:
                done[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
            mod._parameters[name] = done[id(p)]
        if frozen_only:
            continue
        for name, b in list(mod._buffers.items()):
            if b is None or not b.is_floating_point():
                continue
            if id(b) not in done:
                done[id(b)] = b.to(dtype)
            mod._buffers[name] = done[id(b)]


def fake_batch(batch: Any, mode: FakeTensorMode, float_dtype: torch.dtype | None) -> Any:
    def conv(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            dt = float_dtype if (float_dtype is not None and x.is_floating_point()) else None
            return _fake_like(x.contiguous() if x.device.type != "meta" else x, mode, dt)
        return x
    return tree_map(conv, batch)


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    if not isinstance(batch, dict):
        raise TilefitError(
            "no loss_fn given and the batch is not a dict",
            expected="a dict batch for a model that returns .loss (Hugging Face), or loss_fn",
            given=type(batch).__name__,
            fix="pass loss_fn=lambda model, batch: your_loss(model(batch))")
    out = model(**batch)
    loss = getattr(out, "loss", None)
    if loss is None:
        raise TilefitError(
            "the model's output has no .loss",
            expected="labels in the batch so the model computes its loss, or a loss_fn",
            given=f"output of type {type(out).__name__} without loss",
            fix="add labels to the batch, or pass loss_fn=lambda model, batch: ...")
    return loss


def _set_attention(model: nn.Module, attention: str) -> None:
    if attention == "auto":
        return
    setter = getattr(model, "set_attn_implementation", None)
    config = getattr(model, "config", None)
    if setter is not None:
        setter(attention)
    elif config is not None and hasattr(config, "_attn_implementation"):
        config._attn_implementation = attention
    else:
        raise TilefitError(
            f"attention={attention!r} needs a Hugging Face model",
            expected="a transformers PreTrainedModel, or attention='auto' for plain modules",
            given=type(model).__name__,
            fix="pass attention='auto'; a plain module's own code decides its attention")


def _enable_checkpointing(model: nn.Module, context_fn: Callable[[], Any] | None) -> None:
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise TilefitError(
            "grad_checkpointing=True needs a model with gradient_checkpointing_enable()",
            expected="a Hugging Face model, or torch.utils.checkpoint inside your forward "
            "(then leave grad_checkpointing=False: the trace follows your code)",
            given=type(model).__name__,
            fix="call torch.utils.checkpoint.checkpoint in your model's forward")
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if context_fn is not None:
        kwargs["context_fn"] = context_fn
    enable(gradient_checkpointing_kwargs=kwargs)


def _recompute_contexts(target: Target, recorder: Recorder, low: torch.dtype | None
                        ) -> Callable[[], tuple[Any, Any]] | None:
    """torch.utils.checkpoint's context_fn: the recomputed forward runs inside the autograd
    engine, where torch-function modes are not active, so the CUDA autocast policy and the
    attention routing are entered again around it."""
    if target.kind != "cuda":
        return None

    def recompute() -> CudaAutocast:
        mode = CudaAutocast(low, AttentionRouter(target, recorder))
        mode.enabled = True
        return mode

    return lambda: (contextlib.nullcontext(), recompute())


def _samples_and_tokens(batch: Any) -> tuple[int, int | None]:
    if isinstance(batch, dict) and isinstance(batch.get("input_ids"), torch.Tensor):
        ids = batch["input_ids"]
        return int(ids.shape[0]), int(ids.numel())
    leaves = [x for x in torch.utils._pytree.tree_leaves(batch) if isinstance(x, torch.Tensor)]
    if not leaves or leaves[0].dim() == 0:
        return 1, None
    return int(leaves[0].shape[0]), None


USER_CODE_ERRORS = (RuntimeError, ValueError, TypeError, IndexError, KeyError, AttributeError,
                    AssertionError, NotImplementedError)


@contextlib.contextmanager
def _explain_fake_errors(recorder: Recorder) -> Iterator[None]:
    """Errors raised inside the user's step become a TilefitError naming the op and module."""
    try:
        yield
    except TilefitError:
        raise
    except FAKE_ERRORS as exc:
        func = getattr(exc, "func", None)
        op = str(func) if func is not None else type(exc).__name__
        name = recorder.failing_module if recorder.phase in MICRO_PHASES else ""
        where = (f"module {name!r}" if name else
                 f"the {recorder.phase} step" if recorder.phase not in MICRO_PHASES else
                 "code outside any module (the loss function?)")
        raise TilefitError(
            f"the model cannot run on fake tensors: {op} in {where} needs real values or a "
            "real kernel",
            expected="a training step whose control flow does not depend on tensor values "
            "(no .item(), .tolist(), nonzero() or data-dependent branches) and ops with "
            "fake/meta implementations",
            given=f"{type(exc).__name__} from {op} in {where}",
            fix="move the value-dependent code out of the step (e.g. compute it once before "
            "training), or register a fake implementation for the custom op with "
            "torch.library.register_fake",
        ) from None
    except USER_CODE_ERRORS as exc:
        name = recorder.failing_module if recorder.phase in MICRO_PHASES else ""
        where = (f"module {name!r}" if name else
                 f"the {recorder.phase} step" if recorder.phase not in MICRO_PHASES else
                 "code outside any module (the loss function?)")
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise TilefitError(
            f"one training step of the model failed in {where}: {type(exc).__name__}: {first}",
            expected="a model whose forward, loss and backward run on the given batch",
            given=f"{type(exc).__name__} in {where} ({recorder.phase})",
            fix="check the batch shape (--batch, --seq, --input-shape) against the model, and "
            "run the model once on a real batch of that shape to see the full error",
        ) from None


def trace(
    model: ModelSpec,
    batch: Any,
    *,
    loss_fn: LossFn | None = None,
    optimizer: OptimizerSpec = "adamw",
    precision: str = "fp32",
    grad_checkpointing: bool = False,
    accumulation_steps: int = 1,
    attention: str = "auto",
    device: str | Device = "cpu",
    replay_steady_step: bool = True,
) -> Trace:
    """Trace two training steps (the first creates optimizer state lazily; the second is the
    steady state) of ``model`` on ``batch`` as ``device`` would run them, on fake tensors.

    The steady step's forward and backward are the first step's again (same ops, same
    tensors; only the optimizer state around them differs), so by default they are replayed
    from the first step's records rather than run twice; its optimizer step always runs.
    ``replay_steady_step=False`` runs both steps in full (a check of that assumption for
    models whose second forward differs, such as lazy modules)."""
    with quiet_transformers():
        return _trace(model, batch, loss_fn=loss_fn, optimizer=optimizer, precision=precision,
                      grad_checkpointing=grad_checkpointing,
                      accumulation_steps=accumulation_steps, attention=attention,
                      device=device, replay_steady_step=replay_steady_step)


def _trace(model: ModelSpec, batch: Any, *, loss_fn: LossFn | None, optimizer: OptimizerSpec,
           precision: str, grad_checkpointing: bool, accumulation_steps: int, attention: str,
           device: str | Device, replay_steady_step: bool) -> Trace:
    target, dev = resolve_target(device)
    check_options(precision, optimizer, attention, accumulation_steps, dev)
    loss_fn = loss_fn or default_loss
    mode = new_fake_mode()
    pure_bf16 = precision == "bf16"
    low = {"fp16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(precision)
    tracker = ModulePath()
    recorder = Recorder(tracker, "")
    try:
        with mode:
            fmodel = model() if not isinstance(model, nn.Module) else None
        if fmodel is None:
            fmodel = fake_copy(model, mode)  # type: ignore[arg-type]
        elif not isinstance(fmodel, nn.Module):
            raise TilefitError("the model factory did not return an nn.Module",
                               expected="a zero-argument callable returning torch.nn.Module",
                               given=type(fmodel).__name__, fix="return the module")
        with mode:
            _set_attention(fmodel, attention)
            if pure_bf16:
                cast_floating(fmodel, torch.bfloat16)
            if grad_checkpointing:
                _enable_checkpointing(fmodel, _recompute_contexts(target, recorder, low))
            fmodel.train()
            fbatch = fake_batch(batch, mode, torch.bfloat16 if pure_bf16 else None)
            params = [p for p in fmodel.parameters() if p.requires_grad]
            if not params:
                raise TilefitError("the model has no trainable parameters",
                                   expected="at least one parameter with requires_grad=True",
                                   given="none", fix="unfreeze the parameters to train")
            try:
                opt = make_optimizer(optimizer, params, foreach=target.foreach)
            except USER_CODE_ERRORS as exc:
                raise TilefitError(
                    f"the optimizer could not be created: {type(exc).__name__}: {exc}",
                    expected="a name (adamw, sgd, ...) or a factory params -> Optimizer",
                    given=repr(optimizer), fix="call the factory once on model.parameters() "
                    "to see the full error") from None
            scaler_state = None
            if precision == "fp16-mixed":
                scaler_state = (torch.full((1,), SCALER_INIT), torch.zeros(1, dtype=torch.int32),
                                torch.zeros(1))
    except TilefitError:
        raise
    except FAKE_ERRORS as exc:
        raise TilefitError(f"the model could not be built on fake tensors: {exc}",
                           expected="a model whose construction needs no real tensor values",
                           given=type(exc).__name__,
                           fix="build the model on the meta device and pass the module") from None
    except USER_CODE_ERRORS as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise TilefitError(f"the model could not be built: {type(exc).__name__}: {first}",
                           expected="a model (or factory) that builds without real data",
                           given=type(exc).__name__,
                           fix="build it once in plain PyTorch to see the full error") from None

    recorder.set_root(type(fmodel).__name__)
    router = AttentionRouter(target, recorder) if target.kind == "cuda" else None
    autocast: CudaAutocast | _CpuAutocast | None = None
    if target.kind == "cuda":
        autocast = CudaAutocast(low, router)  # casts under mixed precision, routes SDPA always
    elif low is not None:
        autocast = _CpuAutocast(low)
    traced_micro = min(accumulation_steps, 2)
    with mode:
        recorder.register_existing(list(fmodel.parameters()) + list(fmodel.buffers()),
                                   "parameters")
        recorder.register_existing(fbatch, "inputs")
        if scaler_state is not None:
            recorder.register_existing(scaler_state, "optimizer_state")
        with contextlib.ExitStack() as stack:
            stack.enter_context(tracker)
            stack.enter_context(recorder)
            if autocast is not None:
                stack.enter_context(autocast)
            stack.enter_context(gpu_mask_semantics())
            stack.enter_context(_explain_fake_errors(recorder))
            marks: dict[str, int] = {}
            for step in (0, 1):
                recorder.step = step
                if step == 1 and replay_steady_step:
                    pending = recorder.replay(marks["f"], marks["o"], step=1)
                    with recorder.paused():  # the replayed backward made these gradients
                        for p in params:
                            p.grad = torch.zeros_like(p)
                else:
                    marks["f"] = recorder.events
                    for micro in range(traced_micro):
                        recorder.micro = micro
                        _micro_step(fmodel, fbatch, loss_fn, recorder, autocast,
                                    accumulation_steps, scaler_state)
                        recorder.label([p.grad for p in params if p.grad is not None],
                                       "gradients")
                    recorder.micro = 0
                    pending = []
                marks["o"] = recorder.events
                _optimizer_step(opt, params, recorder, scaler_state)
                marks["z"] = recorder.events
                recorder.phase = "zero_grad"
                opt.zero_grad(set_to_none=True)
                if step == 1 and pending:
                    recorder.settle(pending, o0=marks["o0"], z0=marks["z0"],
                                    o1=marks["o"], z1=marks["z"], end=recorder.events)
                if step == 0:
                    marks["o0"], marks["z0"] = marks["o"], marks["z"]
    samples, tokens = _samples_and_tokens(fbatch)
    warnings = []
    if recorder.stand_in_reads:
        warnings.append(f"the optimizer read {recorder.stand_in_reads} value(s) from tensors "
                        "(.item()); on fake tensors 1 stood in for each (they scale the "
                        "update; no shape depends on them)")
    if router is not None and router.choices.get("math"):
        warnings.append(f"attention ran the math kernel {router.choices['math']} time(s) per "
                        "step: it materialises the S x S scores (fp32 or unsupported head dim "
                        "or mask)")
    return Trace(
        target=target, precision=precision,
        optimizer=optimizer if isinstance(optimizer, str) else getattr(
            optimizer, "__name__", "custom"),
        attention=attention, grad_checkpointing=grad_checkpointing,
        accumulation_steps=accumulation_steps, traced_micro_steps=traced_micro,
        ops=tuple(recorder.ops), storages=recorder.storages(), n_events=recorder.events,
        param_count=sum(p.numel() for p in fmodel.parameters()),
        trainable_param_count=sum(p.numel() for p in params),
        samples_per_micro_batch=samples, tokens_per_micro_batch=tokens,
        warnings=tuple(warnings),
    )


def _optimizer_step(opt: torch.optim.Optimizer, params: list[nn.Parameter],
                    recorder: Recorder, scaler_state: Any) -> None:
    grads = [p.grad for p in params if p.grad is not None]
    if scaler_state is not None:
        recorder.phase = "scaler"
        scale, _, found_inf = scaler_state
        torch._amp_foreach_non_finite_check_and_unscale_(
            grads, found_inf, scale.double().reciprocal().float())
    recorder.phase = "optimizer"
    opt.step()
    recorder.label(optimizer_state_tensors(opt), "optimizer_state")
    if scaler_state is not None:
        recorder.phase = "scaler"
        scale, growth, found_inf = scaler_state
        torch._amp_update_scale_(scale, growth, found_inf, SCALER_GROWTH, SCALER_BACKOFF,
                                 SCALER_INTERVAL)


def _micro_step(model: nn.Module, batch: Any, loss_fn: LossFn, recorder: Recorder,
                autocast: Any, accumulation_steps: int, scaler_state: Any) -> None:
    recorder.phase = "forward"
    if autocast is not None:
        autocast.begin_forward()
    loss = loss_fn(model, batch)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TilefitError("loss_fn must return a scalar tensor",
                           expected="a tensor with one element",
                           given=type(loss).__name__ if not isinstance(loss, torch.Tensor)
                           else f"a tensor of shape {tuple(loss.shape)}",
                           fix="reduce the loss, e.g. loss.mean()")
    if accumulation_steps > 1:
        loss = loss / accumulation_steps
    if scaler_state is not None:
        loss = loss * scaler_state[0]
    if autocast is not None:
        autocast.end_forward()
    recorder.phase = "backward"
    loss.backward()
    del loss
    if autocast is not None:
        autocast.end_backward()


class _CpuAutocast:
    """torch.autocast("cpu"): a CPU target follows CPU autocast's own policy."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._ctx: Any = None

    def __enter__(self) -> _CpuAutocast:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None

    def begin_forward(self) -> None:
        self._ctx = torch.autocast("cpu", dtype=self.dtype)
        self._ctx.__enter__()

    def end_forward(self) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None

    def end_backward(self) -> None:
        pass
