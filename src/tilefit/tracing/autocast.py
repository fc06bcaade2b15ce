"""CUDA autocast's cast policy, applied on a machine without CUDA.

torch.autocast("cuda") refuses to run without a CUDA device, and CPU autocast has a different
policy (its op lists differ: softmax, layer_norm and the losses are not kept in fp32 there).
This TorchFunctionMode applies CUDA's policy at the torch-function level, above autograd, so
the casts are recorded by autograd exactly as they are on a GPU.

The op lists are CUDA's, from ATen/autocast_mode.h (AT_FORALL_LOWER_PRECISION_FP,
AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_PROMOTE, in the header shipped with
torch). As in ATen's cached_cast, casts of leaf tensors that require grad (the weights) are
cached while the forward runs, so each weight is cast once per forward.

``CpuAutocast`` is torch.autocast("cpu") for a CPU target; ``autocast_for`` picks the
target's, ``recompute_contexts`` enters CUDA's again around a checkpointed recompute.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tilefit.compat.amp import watching_autocast
from tilefit.compat.fake import is_view, tree_map
from tilefit.tracing.attention import AttentionRouter
from tilefit.tracing.target import Target

if TYPE_CHECKING:
    from tilefit.tracing.recorder import Recorder

T = torch.Tensor


def _fns(*names: str, module: Any = torch, methods: bool = True) -> set[Callable[..., Any]]:
    out: set[Callable[..., Any]] = set()
    for n in names:
        if hasattr(module, n):
            out.add(getattr(module, n))
        if methods and hasattr(T, n):
            out.add(getattr(T, n))
    return out


LOWER_PRECISION: set[Callable[..., Any]] = (
    _fns("matmul", "mm", "mv", "bmm", "baddbmm", "addmm", "addbmm", "addmv", "addr", "einsum",
         "chain_matmul", "prelu", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
         "conv_transpose2d", "conv_transpose3d", "convolution", "_convolution", "lstm_cell",
         "gru_cell", "rnn_tanh_cell", "rnn_relu_cell")
    | {T.__matmul__, T.__rmatmul__, F.linear, F.prelu, F.scaled_dot_product_attention,
       F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
       torch.linalg.multi_dot, torch.linalg.vecdot}
)  # fmt: skip

FP32: set[Callable[..., Any]] = (
    _fns("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
         "reciprocal", "rsqrt", "sinh", "tan", "pow", "logsumexp", "dist", "cdist", "renorm",
         "layer_norm", "group_norm", "rms_norm", "cosine_similarity", "pdist")
    | {T.__pow__, T.__rpow__, F.softplus, F.layer_norm, F.group_norm, F.cosine_similarity,
       F.poisson_nll_loss, F.cosine_embedding_loss, F.nll_loss, F.hinge_embedding_loss,
       F.kl_div, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.mse_loss, F.margin_ranking_loss,
       F.multilabel_margin_loss, F.soft_margin_loss, F.triplet_margin_loss, F.multi_margin_loss,
       F.binary_cross_entropy_with_logits, F.interpolate, F.upsample}
    | ({F.rms_norm} if hasattr(F, "rms_norm") else set())
)  # fmt: skip

FP32_SET_OPT_DTYPE: set[Callable[..., Any]] = (
    _fns("prod", "softmax", "log_softmax", "cumprod", "cumsum", "sum")
    | {F.softmax, F.log_softmax, torch.linalg.vector_norm, torch.linalg.matrix_norm}
)

PROMOTE: set[Callable[..., Any]] = _fns(
    "addcdiv", "addcmul", "atan2", "cross", "dot", "vdot", "tensordot", "scatter_add",
    "index_put",
) | {F.bilinear, F.grid_sample}

_LOW = (torch.float16, torch.bfloat16)
_NO_RESULT = object()
_CE_SIG = inspect.signature(F.cross_entropy)
_DROPOUT_SIG = inspect.signature(F.dropout)


def cuda_dropout(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """F.dropout as CUDA runs it: ATen's dropout takes the fused kernel for a CUDA input with
    0 < p < 1 (is_fused_kernel_acceptable in ATen's Dropout.cpp): native_dropout, which
    returns the output and a bool mask that its backward keeps. The CPU decomposes it into
    bernoulli_, div_ and mul, keeping a mask in the input's dtype. _NO_RESULT when the
    fused kernel does not apply (eval, p of 0 or 1, in place, empty)."""
    bound = _DROPOUT_SIG.bind(*args, **kwargs)
    bound.apply_defaults()
    x, p = bound.arguments["input"], bound.arguments["p"]
    if not bound.arguments["training"] or bound.arguments["inplace"] or not 0 < p < 1 \
            or not isinstance(x, T) or x.numel() == 0:
        return _NO_RESULT
    return torch.native_dropout(x, p, True)[0]


# the CudaAutocast modes entered, innermost last: the one a torch.autocast(enabled=False)
# in the traced code turns off
_ACTIVE: list[CudaAutocast] = []
_WATCH: list[Any] = []  # the watch on torch.autocast while any mode is entered


def _autocast_entered(ctx: Any, enabled: bool) -> None:
    """Code that turns autocast off for its own computation (transformers' rotary
    embeddings, peft's LoRA on expert parameters) names its tensors' device, which a fake
    tensor gives as the CPU: on the target's GPU that context turns CUDA autocast off, so it
    turns the emulated policy off until it is left."""
    if _ACTIVE and not enabled:
        mode = _ACTIVE[-1]
        ctx._tilefit_restore = (mode, mode.enabled)
        mode.enabled = False


def _autocast_left(ctx: Any) -> None:
    restore = getattr(ctx, "_tilefit_restore", None)
    if restore is not None:
        restore[0].enabled = restore[1]
        del ctx._tilefit_restore


class CudaAutocast(TorchFunctionMode):
    """Apply CUDA autocast's policy with ``dtype`` (fp16 or bf16; None: no casting) while
    ``enabled``, and send SDPA calls to ``router`` (the target's attention kernel choice).
    A torch.autocast(enabled=False) context the traced code enters turns it off until left
    (``_autocast_entered``)."""

    def __enter__(self) -> CudaAutocast:
        if not _ACTIVE:  # the first mode entered watches torch.autocast for all of them
            _WATCH.append(watching_autocast(_autocast_entered, _autocast_left))
            _WATCH[-1].__enter__()
        _ACTIVE.append(self)
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        del _ACTIVE[len(_ACTIVE) - 1 - _ACTIVE[::-1].index(self)]  # its innermost entry
        if not _ACTIVE and _WATCH:
            _WATCH.pop().__exit__(None, None, None)

    def __init__(self, dtype: torch.dtype | None,
                 router: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any] | None = None
                 ) -> None:
        super().__init__()
        self.dtype = dtype
        self.router = router
        self.enabled = False
        self.cache_weights = False
        self._cache: dict[int, tuple[T, T]] = {}

    def clear_cache(self) -> None:
        self._cache.clear()

    def begin_forward(self) -> None:
        self.enabled = True
        self.cache_weights = True

    def end_forward(self) -> None:
        # Leaving torch.autocast clears the weight-cast cache. Autocast stays on for the
        # recomputed forward of checkpointed blocks during backward (torch.utils.checkpoint
        # re-enters autocast with the forward's state), without the cache.
        self.cache_weights = False
        self.clear_cache()

    def end_backward(self) -> None:
        self.enabled = False

    def _cast(self, x: Any, to: torch.dtype) -> Any:
        if not isinstance(x, T) or not x.is_floating_point() or x.dtype in (to, torch.float64):
            return x
        # ATen's cached_cast: a leaf that requires grad and is not a view (a weight.t() view
        # is cast afresh each time)
        cacheable = self.cache_weights and x.is_leaf and x.requires_grad and not is_view(x)
        if cacheable:
            hit = self._cache.get(id(x))
            if hit is not None and hit[0] is x:
                return hit[1]
        y = x.to(to)
        if cacheable:
            self._cache[id(x)] = (x, y)
        return y

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        # autocast's kernels are the functional overloads': an out= call runs as written
        if self.enabled and self.dtype is not None and kwargs.get("out") is None:
            out = self._apply_policy(func, args, kwargs)
            if out is not None:
                args, kwargs, result = out
                if result is not _NO_RESULT:
                    return result
        if self.router is not None and func is F.scaled_dot_product_attention:
            return self.router(func, args, kwargs)
        if self.router is not None and func is F.dropout:  # the CUDA target's kernel
            result = cuda_dropout(args, kwargs)
            if result is not _NO_RESULT:
                return result
        return func(*args, **kwargs)

    def _apply_policy(self, func: Callable[..., Any], args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], Any] | None:
        """New (args, kwargs, result-or-_NO_RESULT) under the cast policy, or None."""
        if func in LOWER_PRECISION:
            args, kwargs = tree_map(lambda x: self._cast(x, self.dtype), (args, kwargs))
        elif func in FP32_SET_OPT_DTYPE:
            first = args[0] if args else None
            if (isinstance(first, T) and first.dtype in _LOW and kwargs.get("dtype") is None
                    and not _positional_dtype(func, args)):
                kwargs = {**kwargs, "dtype": torch.float32}
        elif func in FP32:
            args, kwargs = tree_map(lambda x: self._cast(x, torch.float32), (args, kwargs))
        elif func in PROMOTE:
            tensors = [a for a in (*args, *kwargs.values())
                       if isinstance(a, T) and a.is_floating_point()]
            if tensors:
                widest = tensors[0].dtype
                for t in tensors[1:]:
                    widest = torch.promote_types(widest, t.dtype)
                args, kwargs = tree_map(lambda x: self._cast(x, widest), (args, kwargs))
        elif func is F.cross_entropy:
            # cross_entropy = nll_loss(log_softmax(x)): CUDA autocast runs log_softmax with
            # dtype=float32 (fp32 log-probs, no fp32 copy of the input) and nll_loss in fp32.
            bound = _CE_SIG.bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            if isinstance(a["input"], T) and a["input"].dtype in _LOW:
                plain = a["size_average"] is None and a["reduce"] is None
                if a["label_smoothing"] == 0.0 and plain:
                    x = a["input"]
                    logp = F.log_softmax(x, dim=1 if x.dim() > 1 else 0, dtype=torch.float32)
                    weight = self._cast(a["weight"], torch.float32)
                    return args, kwargs, F.nll_loss(logp, a["target"], weight=weight,
                                                    ignore_index=a["ignore_index"],
                                                    reduction=a["reduction"])
                args, kwargs = tree_map(lambda x: self._cast(x, torch.float32), (args, kwargs))
        else:
            return None
        return args, kwargs, _NO_RESULT


def _positional_dtype(func: Callable[..., Any], args: tuple[Any, ...]) -> bool:
    return any(isinstance(a, torch.dtype) for a in args[1:])


def recompute_contexts(target: Target, recorder: Recorder, low: torch.dtype | None
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


def autocast_for(target: Target, low: torch.dtype | None,
                 router: AttentionRouter | None) -> CudaAutocast | CpuAutocast | None:
    """The CUDA target casts under mixed precision and routes SDPA always; the CPU target
    follows CPU autocast's policy under mixed precision."""
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
