"""Fake tensors, dispatch modes, aten schemas, pytrees and storage identity.

Tested on torch 2.4-2.13 APIs: FakeTensorMode and its exceptions, the dispatch mode stack,
torch.utils._pytree, and the flop formula registry of torch.utils.flop_counter.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
    unset_fake_temporarily,
)
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten
from torch.utils.flop_counter import flop_registry

__all__ = [
    "FAKE_ERRORS",
    "DataDependentOutputException",
    "FakeTensor",
    "FakeTensorMode",
    "TorchDispatchMode",
    "as_kernels_return",
    "deepcopy_keeps_mode",
    "fake_mode_active",
    "fake_sparse_like",
    "flop_formula",
    "holds_fake",
    "is_view",
    "mend_addmm_out_dtype",
    "missing_fake_op",
    "new_fake_mode",
    "outside_dispatch_modes",
    "sparse_parts",
    "start_autograd_engine_before_fakes",
    "storage_key",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_unflatten",
    "uncached",
    "unset_fake_temporarily",
    "write_only_args",
    "written_args",
]

# Exceptions a fake-tensor run raises for code that needs real values or real kernels.
FAKE_ERRORS: tuple[type[BaseException], ...] = (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
)


def new_fake_mode() -> FakeTensorMode:
    # allow_non_fake_inputs lets module-level constants (real CPU tensors a model keeps as
    # plain attributes) mix with fake tensors, as they would on a device.
    mend_addmm_out_dtype()
    start_autograd_engine_before_fakes()
    return FakeTensorMode(allow_non_fake_inputs=True)


_ENGINE_STARTED: list[bool] = []  # once per process


def start_autograd_engine_before_fakes() -> None:
    """Run one empty CPU backward before the first fake mode, so forked background traces
    (tilefit.tracing.background) can run a backward. Autograd's engine starts its device
    threads once, at the first backward: one per device of every non-CPU device guard then
    registered, and from then on marks each forked child as unable to run a backward
    ("Unable to handle autograd's threading in combination with fork-based
    multiprocessing"). On a CUDA build with no GPU (torch 2.11's PyPI wheel on a CPU
    machine) the CUDA guard counts no device until FakeTensorMode's entry replaces it with a
    no-op guard counting one (torch._C._ensureCUDADeviceGuardSet), so a first backward after
    it starts a CUDA thread that a CPU-only build (torch 2.13+cpu) never starts; a first
    backward before it starts none. Run when this module is imported (tilefit's first fake
    mode comes later; a FakeTensorMode the caller entered may not) and again by
    ``new_fake_mode``; skipped while a dispatch mode is active (it would record the
    warm-up). Where a GPU is present the threads start at the first backward either way."""
    if _ENGINE_STARTED or _get_current_dispatch_mode_stack():
        return
    _ENGINE_STARTED.append(True)
    with torch.inference_mode(False), torch.enable_grad():
        x = torch.zeros((), device="cpu", requires_grad=True)
        (x * 1).backward()


_ADDMM_MENDED: list[bool] = []  # checked (and on torch 2.11, mended) once per process


def mend_addmm_out_dtype() -> None:
    """Make ``addmm(..., out_dtype=)`` (the overloads ``addmm.dtype`` and ``addmm.dtype_out``:
    a 16-bit GEMM accumulating into fp32, the fused loss's weight gradient) run on fake
    tensors. torch 2.11 registers its plain addmm decomposition for the whole addmm packet,
    these two overloads included, and uses it as their Meta kernel: it takes out_dtype for
    beta and fails ("unsupported operand type(s) for *: 'torch.dtype' and 'FakeTensor'").
    torch 2.13 registers addmm's decomposition for default and out only, and a separate
    addmm_dtype for these two, so nothing is done there. Where the bug is present the two
    broken entries leave torch's decomposition table (a fake run would prefer them) and the
    overloads get fake kernels with the shape and dtype of 2.13's decomposition: a contiguous
    (rows of mat1, columns of mat2) tensor of out_dtype, or ``out`` resized to it."""
    if _ADDMM_MENDED:
        return
    _ADDMM_MENDED.append(True)
    from torch._decomp import decomposition_table

    aten = torch.ops.aten
    if decomposition_table.get(aten.addmm.dtype) is not decomposition_table.get(
            aten.addmm.default):
        return

    def addmm_dtype(self: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor,
                    out_dtype: torch.dtype, beta: float = 1, alpha: float = 1) -> torch.Tensor:
        return mat1.new_empty((mat1.shape[0], mat2.shape[1]), dtype=out_dtype)

    def addmm_dtype_out(self: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor,
                        out_dtype: torch.dtype, beta: float = 1, alpha: float = 1, *,
                        out: torch.Tensor) -> torch.Tensor:
        return out.resize_((mat1.shape[0], mat2.shape[1]))

    for overload, fake in ((aten.addmm.dtype, addmm_dtype),
                           (aten.addmm.dtype_out, addmm_dtype_out)):
        decomposition_table.pop(overload, None)
        torch.library.register_fake(overload, fake, allow_override=True)


def fake_mode_active() -> bool:
    """Whether a FakeTensorMode is on the dispatch mode stack now (read without creating a
    tensor: a probe tensor would show up in a tracer's record)."""
    return any(isinstance(mode, FakeTensorMode) for mode in _get_current_dispatch_mode_stack())


@contextlib.contextmanager
def uncached(op: Any) -> Iterator[None]:
    """Fake tensors run the aten overload ``op``'s kernel at every call in the block, never
    answering from FakeTensorMode's dispatch cache. That cache keeps each op's output shapes
    per argument shapes in one table for the process (``FakeTensorMode.cache``, keyed by a
    ``_DispatchCacheKey`` whose first value is the op), whichever kernel was registered when
    an entry was made and whatever the grad mode: a kernel registered for a block
    (tracing.cpu_kernels) whose output depends on grad mode needs both out of its way. The
    op's entries are dropped as the block begins and ends, and inside it
    ``FakeTensorMode._validate_cache_key`` refuses the op (``_BypassDispatchCache``: torch
    then dispatches each call afresh)."""
    from torch._subclasses.fake_tensor import _BypassDispatchCache

    original = getattr(FakeTensorMode, "_validate_cache_key", None)

    def validate(self: FakeTensorMode, func: Any, *args: Any, **kwargs: Any) -> Any:
        if func is op:
            raise _BypassDispatchCache("tilefit: kernel registered for a block")
        return original(self, func, *args, **kwargs)  # type: ignore[misc]

    _forget_cached(op)
    if original is not None:
        FakeTensorMode._validate_cache_key = validate  # type: ignore[method-assign]
    try:
        yield
    finally:
        if original is not None:
            FakeTensorMode._validate_cache_key = original  # type: ignore[method-assign]
        _forget_cached(op)


def _forget_cached(op: Any) -> None:
    cache = FakeTensorMode.cache
    for key in [key for key in cache if key.key and key.key[0] is op]:
        del cache[key]


def holds_fake(x: object) -> bool:
    """Whether ``x`` is AOTAutograd's functionalization wrapper (a FunctionalTensor) around a
    fake tensor (torch._subclasses.fake_tensor.is_fake looks inside); a bare FakeTensor is
    the caller's own isinstance check. Only a FunctionalTensor is looked into: Dynamo,
    listing a model's graph breaks, sees no FunctionalTensor and never reaches is_fake, a
    function it refuses to trace."""
    from torch._subclasses.fake_tensor import is_fake
    from torch._subclasses.functional_tensor import FunctionalTensor

    return isinstance(x, FunctionalTensor) and bool(is_fake(x))


def is_view(t: torch.Tensor) -> bool:
    """Whether ``t`` is a view of another tensor's storage (Tensor._is_view)."""
    return bool(t._is_view())


def saved_tensors_hooks_active() -> bool:
    """Whether autograd's saved tensors go through pack hooks here (inside a
    ``torch.autograd.graph.saved_tensors_hooks`` context, such as a non-reentrant
    ``torch.utils.checkpoint`` forward, which drops what is saved until the recompute)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def storage_key(storage: Any) -> int:
    """An UntypedStorage's identity: its StorageImpl pointer (the private ``_cdata``), the
    same for every view and Python wrapper of one storage."""
    return int(storage._cdata)


def flop_formula(func: Any) -> Callable[..., int] | None:
    """torch.utils.flop_counter's formula for an aten overload, or None."""
    packet = getattr(func, "overloadpacket", func)
    return flop_registry.get(packet)


def written_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The arguments an aten op writes in place (``Tensor(a!)`` in its schema), by position
    or keyword: what an in-place op that returns nothing (``_foreach_add_``,
    ``_fused_adamw_``) still writes."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if value is not None:
            out.append(value)
    return out


def write_only_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The arguments an op writes without reading: its schema's ``out`` arguments
    (``fsdp.split_with_sizes_copy(..., out=[...])``), less any tensor also passed as an input
    it reads (``torch.addmm(c, a, b, out=c)`` reads ``c``)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    outs: list[Any] = []
    read_ids: set[int] = set()
    for i, arg in enumerate(schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if value is None:
            continue
        leaves = list(value) if isinstance(value, (list, tuple)) else [value]
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        if arg.is_out:
            outs.extend(tensors)
        else:
            read_ids.update(id(t) for t in tensors)
    return [t for t in outs if id(t) not in read_ids]


_CTC_FAKES: list[bool] = []  # registered once per process


def register_ctc_fakes() -> None:
    """Fake kernels for ``aten._ctc_loss`` and its backward with the lengths as int lists.
    torch tags the loss dynamic_output_shape (its Tensor-lengths overload reads their
    values), so a fake run refuses it, and the backward has no meta kernel. With int lengths
    the shapes are known, those of torch's CPU and CUDA kernels (aten/src/ATen/native/
    LossCTC.cpp, cuda/LossCTC.cu): the negative log-likelihood (batch,), log_alpha (batch,
    frames, 2 x longest target + 1), the gradient contiguous, shaped as the log-probabilities."""
    if _CTC_FAKES:
        return

    def forward(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: list[int],
                target_lengths: list[int], blank: int = 0, zero_infinity: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        batch = int(log_probs.shape[1])
        longest = max((int(n) for n in target_lengths), default=0)
        return (log_probs.new_empty((batch,)),
                log_probs.new_empty((batch, int(log_probs.shape[0]), 2 * longest + 1)))

    def backward(grad: torch.Tensor, log_probs: torch.Tensor, *args: Any, **kwargs: Any
                 ) -> torch.Tensor:
        return torch.empty_like(log_probs, memory_format=torch.contiguous_format)

    # aten::_ctc_loss has a Meta kernel (the int-lengths overload) that the fake mode never
    # reaches for a dynamic_output_shape op; register_fake refuses an op with a Meta kernel
    # unless allow_override=True, its default from torch 2.13 (False in torch 2.11)
    torch.library.register_fake("aten::_ctc_loss", forward, allow_override=True)
    torch.library.register_fake("aten::_ctc_loss_backward", backward, allow_override=True)
    _CTC_FAKES.append(True)


def as_kernels_return(func: Any, out: Any) -> Any:
    """``out`` with the strides PyTorch's CPU and CUDA kernels give it where its fake (meta)
    implementation differs (docs/references.md, section 39). ``native_layer_norm_backward``:
    both kernels allocate the input gradient contiguous (``empty_like(X,
    LEGACY_CONTIGUOUS_MEMORY_FORMAT)`` in aten/src/ATen/native/layer_norm.cpp and
    cuda/layer_norm_kernel.cu), where the fake one follows a non-contiguous output gradient's
    strides, so a later reshape copied on fake tensors what it views on a device (Swin)."""
    if func is torch.ops.aten.native_layer_norm_backward.default and out[0] is not None \
            and not out[0].is_contiguous():
        return (torch.empty_like(out[0], memory_format=torch.contiguous_format), *out[1:])
    return out


def sparse_parts(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse COO tensor's indices and values (Tensor._indices / _values): the storages it
    holds, having none of its own."""
    return t._indices(), t._values()


def fake_sparse_like(t: torch.Tensor, mode: FakeTensorMode) -> torch.Tensor:
    """A fake sparse COO tensor of ``t``'s size with as many stored elements (the fake
    mode's own copy of a sparse tensor keeps none: its memory would be lost)."""
    with unset_fake_temporarily():  # the real tensor's parts (inside the mode they are fakes)
        indices, values = sparse_parts(t)
        coalesced = t.is_coalesced()
    with mode:
        return torch.sparse_coo_tensor(
            torch.empty(tuple(indices.shape), dtype=indices.dtype),
            torch.empty(tuple(values.shape), dtype=values.dtype), tuple(t.shape),
            is_coalesced=coalesced, check_invariants=False)


@contextlib.contextmanager
def deepcopy_keeps_mode() -> Iterator[None]:
    """While active, ``copy.deepcopy`` of a fake tensor keeps its FakeTensorMode instead of
    copying it with the tensor's ``__dict__`` (Tensor.__deepcopy__ deep-copies the dict,
    and the fake mode is in it). A copy that belonged to a copied mode is a foreign input to
    the real one, which fakes it anew at each op: a layer made with copy.deepcopy, as
    nn.TransformerEncoder makes its layers, would get a weight-sized new tensor at each
    ``weight.t()``."""
    had = "__deepcopy__" in vars(FakeTensorMode)
    previous = vars(FakeTensorMode).get("__deepcopy__")
    FakeTensorMode.__deepcopy__ = lambda self, memo: self  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if had:
            FakeTensorMode.__deepcopy__ = previous  # type: ignore[attr-defined]
        else:
            del FakeTensorMode.__deepcopy__  # type: ignore[attr-defined]


start_autograd_engine_before_fakes()


# torch.library.custom_op's error for an op without a fake implementation (torch 2.11-2.13:
# torch/_library/custom_ops.py's fake_impl); an op of a C++ extension without a Meta kernel
# raises UnsupportedOperatorException instead, its op in .func
_NO_FAKE_IMPL = re.compile(r"no fake impl registered for <CustomOpDef\((?P<op>[\w.:]+)\)>")


def missing_fake_op(exc: BaseException) -> str | None:
    """The op an error says has no fake implementation (a custom or extension op run on
    fake tensors), else None."""
    if isinstance(exc, UnsupportedOperatorException):
        func = getattr(exc, "func", None)
        return str(func) if func is not None else None
    match = _NO_FAKE_IMPL.search(str(exc)) if isinstance(exc, RuntimeError) else None
    return match.group("op") if match else None


@contextlib.contextmanager
def outside_dispatch_modes() -> Iterator[None]:
    """No dispatch mode active for the block (the fake mode and any recorder above it
    popped), then all put back: for work the modes must not see (a compiled graph's
    capture), which enters the modes it needs itself."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield
