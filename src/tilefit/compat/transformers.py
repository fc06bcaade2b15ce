"""transformers' private and version-dependent APIs: where Hugging Face code would take a
different path on fake tensors than on a GPU, its attention and checkpointing switches.

transformers' masking_utils treats FakeTensors as "tracing" (utils.import_utils.is_tracing) and
then builds an explicit causal mask instead of passing is_causal=True to SDPA, which on a GPU
run lets PyTorch pick the flash kernel. With no padding mask and a full-length query (every
training step without padding), a GPU run skips the mask; this patch makes the fake run
decide the same way from shapes alone, and defers to transformers for every other case.

Likewise, without a KV cache (training, and always with gradient checkpointing) transformers
looks for packed sequences in position_ids by reading their values; on fake tensors it cannot,
and assumes packing. The trace assumes unpacked sequences (position ids 0..S-1 per row), which
is what the synthetic batches hold and what an ordinary padded or unpadded batch holds.

``set_attention`` and ``enable_checkpointing`` switch a model's attention implementation
and its own gradient checkpointing (``config._attn_implementation`` where the model has no
setter; ``_gradient_checkpointing_func`` for a compiled step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from tilefit.compat import probes
from tilefit.compat.compile import checkpoint_region_tagger
from tilefit.compat.fake import FakeTensor, holds_fake
from tilefit.errors import TilefitError


def is_fake(x: Any) -> bool:
    """A fake tensor, also behind AOTAutograd's functionalization (a compiled trace)."""
    return isinstance(x, FakeTensor) or holds_fake(x)


# what the mask rule's patch reads of transformers' function (transformers 5.25)
_MASK_RULE_PARAMETERS = ("padding_mask", "q_length", "kv_length", "local_attention_size")


def _mask_rule(mu: Any) -> Callable[..., bool] | None:
    """transformers' ``_ignore_causal_mask_sdpa`` where it is found with the parameters the
    patch reads (the first three in that order, and ``local_attention_size``); else None."""
    original = getattr(mu, "_ignore_causal_mask_sdpa", None)
    if original is None:
        return None
    try:
        names = list(inspect.signature(original).parameters)
    except (TypeError, ValueError):
        return None
    if names[:3] != list(_MASK_RULE_PARAMETERS[:3]) or _MASK_RULE_PARAMETERS[3] not in names:
        return None
    return original  # type: ignore[no-any-return]


@contextlib.contextmanager
def gpu_mask_semantics(known_ones: Callable[[Any], bool] | None = None,
                       model: Any = None) -> Iterator[None]:
    """transformers' mask rules as a real run decides them: no mask for a square causal step
    without padding (SDPA's is_causal), ``known_ones(mask)`` telling which fake masks hold
    only ones (a real run reads their values); no packed-sequence search on fake ids.
    ``model``: the traced model; where it is a transformers model and the rule is not found,
    the trace notes it (tilefit.compat.probes)."""
    try:
        mu = importlib.import_module("transformers.masking_utils")
    except ImportError:
        yield
        return
    hf = isinstance(model, nn.Module) and any(
        type(m).__module__.startswith("transformers.") for m in model.modules())
    if hf:
        probes.read("transformers")
    original = _mask_rule(mu)
    if original is None:
        if hf:
            probes.went_blind("transformers", "its causal-mask rule (masking_utils."
                              "_ignore_causal_mask_sdpa, not found with the parameters "
                              f"{', '.join(_MASK_RULE_PARAMETERS)}): attention is traced with "
                              "the mask transformers builds on fake tensors, where a GPU run "
                              "may pass is_causal and use another attention kernel")
        yield
        return
    rule = inspect.signature(original)

    def ignore_causal_mask_sdpa(padding_mask: Any, q_length: int, kv_length: int,
                                *args: Any, **kwargs: Any) -> bool:
        local = rule.bind_partial(padding_mask, q_length, kv_length, *args,
                          **kwargs).arguments.get("local_attention_size")
        if known_ones is not None and known_ones(padding_mask):
            padding_mask = None  # a mask the model made of ones: a real run reads it so
        if (padding_mask is None and (q_length == 1 or kv_length == q_length)
                and (local is None or kv_length < local)):
            return True
        return bool(original(padding_mask, q_length, kv_length, *args, **kwargs))

    find_packed = getattr(mu, "find_packed_sequence_indices", None)

    def find_packed_sequence_indices(position_ids: Any) -> Any:
        if is_fake(position_ids):
            return None
        return find_packed(position_ids) if find_packed is not None else None

    mu._ignore_causal_mask_sdpa = ignore_causal_mask_sdpa
    if find_packed is not None:
        mu.find_packed_sequence_indices = find_packed_sequence_indices
    try:
        yield
    finally:
        mu._ignore_causal_mask_sdpa = original
        if find_packed is not None:
            mu.find_packed_sequence_indices = find_packed


def use_checkpoint_function(model: Any, function: Any) -> None:
    """Every module Hugging Face's ``gradient_checkpointing_enable`` armed calls ``function``
    in place of torch.utils.checkpoint (transformers' ``GradientCheckpointingLayer`` calls
    ``self._gradient_checkpointing_func(forward, *args)``)."""
    armed = 0
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) and \
                hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = function
            armed += 1
    if armed == 0:
        probes.went_blind("transformers", "which layers gradient_checkpointing_enable armed "
                          "(no module has _gradient_checkpointing_func): the compiled step is "
                          "traced without the partitioner's recompute of checkpointed layers")


def refuses_sdpa(model_class: type) -> bool:
    """True when the transformers class refuses SDPA (its ``_supports_sdpa`` is False: Gemma
    2, BLOOM, Mamba): attention "auto" then builds it eager."""
    return getattr(model_class, "_supports_sdpa", True) is False


def check_attention(model_class: type, attention: str) -> None:
    """A TilefitError when ``attention`` is "sdpa" and the transformers class refuses SDPA
    (its ``_supports_sdpa`` is False: Gemma 2, BLOOM, Mamba); transformers itself would
    raise a ValueError from deep inside the build."""
    if attention != "sdpa" or not refuses_sdpa(model_class):
        return
    import transformers

    name = model_class.__name__
    raise TilefitError(
        f"{name} does not support attention 'sdpa' (PyTorch's scaled_dot_product_attention) "
        f"in transformers {transformers.__version__}",
        expected=f"attention 'auto' or 'eager' for {name}",
        given="attention='sdpa'",
        fix="pass Recipe(attention='auto') (transformers chooses, eager for this model), or "
        "Recipe(attention='eager')")


def set_attention(model: nn.Module, attention: str) -> None:
    """The model's attention implementation ("auto": the model's own choice)."""
    if attention == "auto":
        return
    check_attention(type(model), attention)
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


def enable_checkpointing(model: nn.Module, context_fn: Callable[[], Any] | None, *,
                         compiled: bool = False) -> None:
    """Hugging Face's own checkpointing (its choice of layers), non-reentrant; ``compiled``:
    as torch.compile runs it, each checkpointed call tagged for the partitioner to recompute
    (tilefit.compat.compile.checkpoint_region_tagger) instead of torch.utils.checkpoint's
    saved-tensor hooks."""
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise TilefitError(
            "grad_checkpointing=True needs a model with gradient_checkpointing_enable()",
            expected="a Hugging Face model, or torch.utils.checkpoint inside your forward "
            "(then leave grad_checkpointing=False: the trace follows your code)",
            given=type(model).__name__,
            fix="call torch.utils.checkpoint.checkpoint in your model's forward")
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if context_fn is not None and not compiled:
        kwargs["context_fn"] = context_fn
    enable(gradient_checkpointing_kwargs=kwargs)
    if compiled:
        use_checkpoint_function(model, checkpoint_region_tagger())


def hugging_face_module(model: Any) -> Any:
    """The transformers model ``model`` is (a PreTrainedModel, or a zero-argument factory
    returning one, built on the meta device to read its config), or None."""
    if callable(model) and not hasattr(model, "forward"):  # a factory: what does it build?
        try:
            with torch.device("meta"):
                model = model()
        except Exception:  # a factory that cannot build on meta: the trace will say why
            return None
    transformers = sys.modules.get("transformers")  # not imported: not one of its models
    if transformers is None:
        return None
    from tilefit.quiet_imports import quiet_imports

    with quiet_imports():  # PreTrainedModel's lazy import loads the quantizers (torchao's)
        pretrained = transformers.PreTrainedModel
    return model if isinstance(model, pretrained) else None


def tensors_have_data() -> bool:
    """False inside a FakeTensorMode or under the meta device, where weights hold no values.

    Read from the active dispatch modes and the default device, without creating a tensor (a
    probe tensor would show up in a tracer's record of the build).
    """
    from tilefit.compat.fake import fake_mode_active

    if fake_mode_active():
        return False
    return torch.get_default_device().type != "meta"


@contextlib.contextmanager
def skip_init_without_data() -> Iterator[None]:
    """Skip weight initialisation when tensors are fake or meta (nothing to initialise).

    Needed, not only faster: ``torch.nn.init.trunc_normal_`` (ViT, ...) branches on
    ``mask.any()``, a data-dependent value a FakeTensor cannot give. Weight tying still runs
    (GPT-2's lm_head shares wte), since it is ``tie_weights``, not ``initialize_weights``.
    With real tensors nothing is skipped: real runs get the model's own initialisation.
    """
    if tensors_have_data():
        yield
        return
    from transformers import PreTrainedModel

    try:  # transformers >= 5: the torch init functions and modules it patches itself
        from transformers.initialization import TORCH_INIT_FUNCTIONS, TORCH_MODULES_TO_PATCH
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights

        with no_init_weights():
            yield
        return

    def _noop(*args: Any, **kwargs: Any) -> Any:
        return args[0] if args else None

    originals: list[tuple[Any, str, Any]] = []
    for module_name in TORCH_MODULES_TO_PATCH:
        module = sys.modules.get(module_name)
        for func_name in TORCH_INIT_FUNCTIONS:
            if module is not None and hasattr(module, func_name):
                originals.append((module, func_name, getattr(module, func_name)))
                setattr(module, func_name, _noop)
    originals.append(
        (PreTrainedModel, "initialize_weights", PreTrainedModel.__dict__["initialize_weights"])
    )
    PreTrainedModel.initialize_weights = _noop  # type: ignore[method-assign]
    try:
        yield
    finally:
        for owner, attr, original in reversed(originals):
            setattr(owner, attr, original)


def decode_special_floats(config: dict[str, Any]) -> dict[str, Any]:
    """A config.json's dict with the floats JSON cannot hold read back: transformers'
    save_pretrained writes inf and nan as ``{"__float__": "Infinity"}`` (Mamba 2's
    ``time_step_limit`` is ``(0.0, inf)``), and its from_json_file decodes them
    (PreTrainedConfig._decode_special_floats, private)."""
    from transformers import PretrainedConfig

    return dict(PretrainedConfig._decode_special_floats(config))


# transformers' kernels with a PyTorch fallback (integrations/hub_kernels.py
# use_kernel_func_from_hub_with_fallback): the wrapper a modeling module calls keeps, in its
# closure, the package it looked for, whether it found it and the reference PyTorch function
# (docs/references.md, section 41)
_FALLBACK_CELLS = ("func_name", "package", "is_new_implementation", "torch_function")


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """One of transformers' optional kernels as a traced step called it."""

    name: str  # transformers' name for it (mamba_inner_fn, chunk_gated_delta_rule, ...)
    package: str  # the package it comes from (mamba_ssm, causal_conv1d, fla)
    installed: bool  # the package is importable here (its kernel was traced as the fallback)


def _closure(fn: Any) -> dict[str, Any]:
    """A function's closure cells by name ({} for anything else)."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or cells is None:
        return {}
    return {n: c.cell_contents for n, c in zip(code.co_freevars, cells, strict=True)}


def _unwrap_hub_layer(fn: Any) -> Any:
    """With the ``kernels`` package installed (a dependency of transformers from 5.25),
    transformers' ``use_kernel_forward_from_hub`` turns the wrapper function into an instance
    of an ``nn.Module`` class made for it (kernels' ``_create_func_module``), whose forward
    calls the function from its closure (``func``): that function; else ``fn`` itself."""
    if isinstance(fn, nn.Module):
        inner = _closure(type(fn).forward).get("func")
        if callable(inner):
            return inner
    return fn


def _kernel_wrapper(fn: Any) -> tuple[KernelCall, Callable[..., Any]] | None:
    """Where ``fn`` is transformers' kernel wrapper (a function, or the module the ``kernels``
    package makes of it): what it calls and its reference PyTorch function; else None."""
    fn = _unwrap_hub_layer(fn)
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or cells is None or not set(_FALLBACK_CELLS) <= set(code.co_freevars):
        return None
    found = {n: c.cell_contents for n, c in zip(code.co_freevars, cells, strict=True)
             if n in _FALLBACK_CELLS}
    call = KernelCall(str(found["func_name"]), str(found["package"]),
                      bool(found["is_new_implementation"]))
    return call, found["torch_function"]


def kernel_distribution(package: str) -> str:
    """The pip distribution of a kernel package (transformers' own name for it where it has
    one, else the import name with hyphens: mamba_ssm -> mamba-ssm)."""
    from transformers.integrations import hub_kernels

    named = getattr(hub_kernels, "_PACKAGE_TO_DISTRIBUTION", {})
    return named.get(package, package.replace("_", "-"))


# the decorator a modeling module imports to wrap its optional kernels
_FALLBACK_DECORATOR = "use_kernel_func_from_hub_with_fallback"


def _probe_kernel_wrappers(mod: Any, found: int) -> None:
    """A transformers modeling module read for kernel wrappers: blind where it imports
    transformers' fallback decorator but no wrapper of it was recognised."""
    if not mod.__name__.startswith("transformers."):
        return
    probes.read("transformers")
    if found == 0 and hasattr(mod, _FALLBACK_DECORATOR):
        probes.went_blind("transformers", f"the optional kernels of {mod.__name__} (no "
                          f"wrapper made by {_FALLBACK_DECORATOR} was recognised): its code "
                          "is traced as it runs on fake tensors, and no note says which "
                          "kernels a GPU machine would run instead")


@contextlib.contextmanager
def reference_kernels(model: nn.Module, on_call: Callable[[KernelCall], None]
                      ) -> Iterator[None]:
    """While the step runs, each of transformers' optional kernels in the model's modeling
    modules (mamba-ssm's, causal-conv1d's, flash-linear-attention's) runs transformers'
    reference PyTorch code, the only code that runs on fake tensors (the packages' CUDA and
    Triton kernels have no fake implementation), ``on_call`` told of each call first; the
    modules' own functions are put back after."""
    modules = {sys.modules.get(type(m).__module__) for m in model.modules()}
    patched: list[tuple[Any, str, Any]] = []

    def recording(call: KernelCall, reference: Callable[..., Any]) -> Callable[..., Any]:
        named = set(inspect.signature(reference).parameters)

        def run(*args: Any, **kwargs: Any) -> Any:
            on_call(call)  # the keywords the reference takes, as transformers' wrapper passes
            return reference(*args, **{k: v for k, v in kwargs.items() if k in named})
        run._tilefit_kernel = (call, reference)  # type: ignore[attr-defined]
        return run

    for mod in modules - {None}:
        found = 0
        for attr, fn in list(vars(mod).items()):
            # an enclosing step's own wrapper (a process forked inside one) is wrapped anew
            wrapper = getattr(fn, "_tilefit_kernel", None) or _kernel_wrapper(fn)
            if wrapper is not None:
                patched.append((mod, attr, fn))
                setattr(mod, attr, recording(*wrapper))
                found += 1
        _probe_kernel_wrappers(mod, found)
    try:
        yield
    finally:
        for mod, attr, fn in patched:
            setattr(mod, attr, fn)
