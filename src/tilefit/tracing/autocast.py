"""CUDA autocast's cast policy, applied on a machine without CUDA, where ATen applies it: in
the dispatcher.

A step is traced on fake CPU tensors. ``torch.autocast("cuda")`` does nothing without CUDA,
and CPU autocast has another policy (its op lists differ: softmax, layer_norm and the losses
are not kept in fp32 there). So for a CUDA target, CPU autocast runs with CUDA's lists: for
the trace, each overload CUDA autocast lists (tracing.autocast_lists, from ATen's
autocast_mode.h) gets a kernel at the AutocastCPU dispatch key that does what ATen's CUDA
kernel does (cast its eligible arguments, then run the op below the autocast key), and each
overload only CPU autocast lists passes through. Because the policy sits in the dispatcher,
every op gets it whatever Python function calls it: torch.nn's composites
(``F.multi_head_attention_forward``), the user's functions, autograd Functions, hooks, and a
checkpointed recompute, which torch.utils.checkpoint runs under the autocast state of the
forward. As in ATen's cached_cast, each fp32 leaf that requires grad (a weight) is cast to
the low dtype once until the outermost autocast context is left.

Code that enters ``torch.autocast`` itself keeps its meaning: a context naming the tensors'
device (the CPU, for a fake tensor) is CPU autocast, which now has CUDA's policy; a context
naming "cuda" is mirrored on the CPU (on a CPU build it is disabled, as transformers' rotary
embeddings and peft disable it for their own computation). While the step's forward runs,
CUDA autocast's own flags are set too, so that ``torch.is_autocast_enabled()`` and
``torch.get_autocast_dtype("cuda")`` answer as on the GPU.

``CpuAutocast`` is torch.autocast("cpu") for a CPU target; ``autocast_for`` picks the
target's (docs/references.md, section 46).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tilefit.compat import dispatch
from tilefit.compat.amp import requested, watching_autocast
from tilefit.compat.fake import is_view
from tilefit.tracing import autocast_lists as lists
from tilefit.tracing.attention import AttentionRouter
from tilefit.tracing.target import Target
from tilefit.tracing.target_kernels import register_target_kernels

T = torch.Tensor
KEY = "AutocastCPU"
_LOW = (torch.float16, torch.bfloat16)


def _eligible(x: Any) -> bool:
    """ATen's is_eligible: a floating tensor that is not double (on the autocast device)."""
    return isinstance(x, T) and x.is_floating_point() and x.dtype != torch.float64


class CastCache:
    """ATen's cached_cast: casts of fp32 leaves that require grad (the weights) to the low
    dtype, kept until the outermost autocast context is left."""

    def __init__(self) -> None:
        self._casts: dict[int, tuple[T, T]] = {}

    def clear(self) -> None:
        self._casts.clear()

    def cast(self, x: Any, to: torch.dtype) -> Any:
        """``x`` in ``to`` where it is eligible (lists and tuples element-wise)."""
        if isinstance(x, (list, tuple)):
            return type(x)(self.cast(v, to) for v in x)
        if not _eligible(x) or x.dtype == to:
            return x
        cacheable = (to == torch.get_autocast_dtype("cpu") and x.dtype == torch.float32
                     and x.requires_grad and x.is_leaf and not is_view(x)
                     and torch.is_autocast_cache_enabled())
        if not cacheable:
            return x.to(to)
        hit = self._casts.get(id(x))
        if hit is not None and hit[0] is x:
            return hit[1]
        # ATen makes a cached cast with grad mode on, also inside no_grad (a reentrant
        # checkpoint's forward): the cast requires grad wherever the cache serves it
        with torch.enable_grad():
            y = x.to(to)
        self._casts[id(x)] = (x, y)
        return y

    def cast_all(self, args: tuple[Any, ...], kwargs: dict[str, Any], to: torch.dtype
                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (tuple(self.cast(a, to) for a in args),
                {k: self.cast(v, to) for k, v in kwargs.items()})


def _below(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``op`` below the autocast key, as ATen's autocast kernels redispatch."""
    with dispatch.excluding(KEY):
        return op(*args, **kwargs)


def _lower_precision(op: Any, cache: CastCache) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = cache.cast_all(args, kwargs, torch.get_autocast_dtype("cpu"))
        return _below(op, args, kwargs)
    return kernel


def _fp32(op: Any, cache: CastCache) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = cache.cast_all(args, kwargs, torch.float32)
        return _below(op, args, kwargs)
    return kernel


def _fp32_set_opt_dtype(op: Any) -> Callable[..., Any]:
    """Run in fp32 through the op's own dtype argument where the caller set none."""
    positional, _ = dispatch.schema_names(op)
    at = positional.index("dtype") if "dtype" in positional else None

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if args and _eligible(args[0]):
            if at is None:
                if kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
            elif len(args) <= at or args[at] is None:
                args = (*args[:at], torch.float32, *args[at + 1:])
        return _below(op, args, kwargs)
    return kernel


def _fp32_append_dtype(op: Any, with_dtype: Any) -> Callable[..., Any]:
    """norm's overloads without a dtype run as their dtype-taking sibling in fp32."""
    def kernel(*args: Any, **kwargs: Any) -> Any:
        if args and _eligible(args[0]):
            return _below(with_dtype, args, {**kwargs, "dtype": torch.float32})
        return _below(op, args, kwargs)
    return kernel


def _promote(op: Any, cache: CastCache) -> Callable[..., Any]:
    """The widest of the low dtype and the eligible arguments' (ATen's prioritize)."""
    def kernel(*args: Any, **kwargs: Any) -> Any:
        low = torch.get_autocast_dtype("cpu")
        to = low
        for t in _tensors((*args, *kwargs.values())):
            if not _eligible(t):
                continue
            if t.dtype == torch.float32 or to == torch.float32:
                to = torch.float32
            elif not t.dtype == to == low:
                raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
        args, kwargs = cache.cast_all(args, kwargs, to)
        return _below(op, args, kwargs)
    return kernel


def _tensors(values: tuple[Any, ...]) -> Iterator[T]:
    for v in values:
        if isinstance(v, T):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _tensors(tuple(v))


def _banned(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(lists.BANNED_MESSAGE)


def _cudnn_rnn(op: Any, cache: CastCache) -> Callable[..., Any]:
    """ATen's cuDNN RNN autocast kernel (AutocastRNN.cpp, registered apart from the lists):
    the weights cast to fp16 into one flat buffer (autograd sees the casts and the copy),
    the input and the states cast to fp16: fp16 whatever the autocast dtype."""
    def kernel(x: Any, weight: list[Any], stride0: int, weight_buf: Any, hx: Any, cx: Any,
               *rest: Any) -> Any:
        half = torch.float16
        if weight and _eligible(weight[0]) and weight[0].dtype != half:
            flat = torch.cat([w.to(half).reshape(-1) for w in weight])
            weight = [v.view(w.shape) for v, w in zip(
                flat.split([w.numel() for w in weight]), weight, strict=True)]
            weight_buf = flat.detach()  # _cudnn_rnn takes no gradient for the buffer
        args = (cache.cast(x, half), weight, stride0, weight_buf, cache.cast(hx, half),
                cache.cast(cx, half), *rest)
        return _below(op, args, {})
    return kernel


def register_cuda_policy(regs: dispatch.Registrations, cache: CastCache) -> None:
    """CUDA autocast's policy on the AutocastCPU key: its lists' kernels, and every other
    overload CPU autocast has a kernel for passing through."""
    makers: list[tuple[tuple[str, ...], Callable[[Any], Callable[..., Any]]]] = [
        (lists.LOWER_PRECISION_FP, lambda op: _lower_precision(op, cache)),
        (lists.FP32, lambda op: _fp32(op, cache)),
        (lists.FP32_SET_OPT_DTYPE, _fp32_set_opt_dtype),
        (lists.PROMOTE, lambda op: _promote(op, cache)),
        (lists.BANNED, lambda op: _banned),
    ]
    for names, make in makers:
        for name in names:
            op = dispatch.op_overload(name)
            if op is not None:
                regs.impl(name, make(op), KEY)
    regs.impl(lists.CUDNN_RNN, _cudnn_rnn(dispatch.op_overload(lists.CUDNN_RNN), cache), KEY)
    for name, sibling in lists.FP32_APPEND_DTYPE.items():
        op, with_dtype = dispatch.op_overload(name), dispatch.op_overload(sibling)
        if op is not None and with_dtype is not None:
            regs.impl(name, _fp32_append_dtype(op, with_dtype), KEY)
    for name in dispatch.ops_with_kernel(KEY) - lists.listed():
        regs.fallthrough(name, KEY)


class CudaAutocast:
    """CUDA's autocast with ``dtype`` (fp16 or bf16; None: no casting) and the CUDA target's
    kernels (``router``'s attention, tracing.target_kernels), for a traced step: entered
    around the whole step (the policy and kernels registered), its forward between
    ``begin_forward`` and ``end_forward`` under autocast."""

    def __init__(self, dtype: torch.dtype | None, router: AttentionRouter | None = None
                 ) -> None:
        self.dtype = dtype
        self.router = router
        self.cache = CastCache()
        self._stack: contextlib.ExitStack | None = None
        self._depth = 0  # entered again by a compiled step's capture
        self._nesting = 0  # torch.autocast contexts entered and not left
        self._forward: contextlib.ExitStack | None = None

    def __enter__(self) -> CudaAutocast:
        self._depth += 1
        if self._depth == 1:
            with contextlib.ExitStack() as stack:
                regs = stack.enter_context(dispatch.registered())
                # always: code under test may enter autocast itself in an fp32 step
                register_cuda_policy(regs, self.cache)
                if self.router is not None:
                    register_target_kernels(regs, self.router)
                stack.enter_context(watching_autocast(self._entered, self._left))
                self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0 and self._stack is not None:
            self.end_forward()
            self._stack.close()
            self._stack = None
            self.cache.clear()

    def begin_forward(self) -> None:
        """The step's forward runs under autocast from here (CUDA's flags set too)."""
        if self.dtype is None or self._forward is not None:
            return
        stack = contextlib.ExitStack()
        stack.enter_context(_cuda_flags(self.dtype))
        stack.enter_context(torch.autocast("cpu", dtype=self.dtype))
        self._forward = stack

    def end_forward(self) -> None:
        if self._forward is not None:
            self._forward.close()
            self._forward = None

    def end_backward(self) -> None:
        """Nothing to do: the backward runs outside autocast, as the loop calls it."""

    def _entered(self, ctx: Any, enabled: bool) -> None:
        self._nesting += 1
        if getattr(ctx, "device", None) == "cuda":
            # a context naming CUDA: what it asked for is mirrored on the CPU's autocast
            on, asked = requested(ctx)
            dtype = asked if asked in _LOW else self.dtype or torch.float16
            mirror = torch.autocast("cpu", dtype=dtype, enabled=on)
            mirror.__enter__()
            ctx._tilefit_mirror = mirror

    def _left(self, ctx: Any) -> None:
        mirror = ctx.__dict__.pop("_tilefit_mirror", None)
        if mirror is not None:
            mirror.__exit__(None, None, None)
        self._nesting -= 1
        if self._nesting == 0:  # ATen clears its cast cache as the outermost one is left
            self.cache.clear()


@contextlib.contextmanager
def _cuda_flags(dtype: torch.dtype) -> Iterator[None]:
    """CUDA autocast's flags as a GPU run's forward has them (thread-local state only: no
    CUDA tensor exists, so no CUDA kernel runs)."""
    enabled, was = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", was)


def autocast_for(target: Target, low: torch.dtype | None,
                 router: AttentionRouter | None) -> CudaAutocast | CpuAutocast | None:
    """The CUDA target casts under mixed precision and runs its own kernels always; the CPU
    target follows CPU autocast's policy under mixed precision."""
    if target.kind == "cuda":
        return CudaAutocast(low, router)
    return CpuAutocast(low) if low is not None else None


class CpuAutocast:
    """torch.autocast("cpu"): a CPU target follows CPU autocast's own policy."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._ctx: Any = None

    def __enter__(self) -> CpuAutocast:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end_forward()

    def begin_forward(self) -> None:
        self._ctx = torch.autocast("cpu", dtype=self.dtype)
        self._ctx.__enter__()

    def end_forward(self) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None

    def end_backward(self) -> None:
        pass
