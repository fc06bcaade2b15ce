"""``from_pretrained`` under the simulated GPU: the model built from its config alone.

A script's ``AutoModelForCausalLM.from_pretrained("gpt2", dtype=torch.bfloat16)`` (or a model
class's) gets the same architecture, built with ``from_config`` on fake tensors: no weight is
read or downloaded, as tilefit builds every named model. The config is tilefit's catalog
entry for a catalog name or its Hub id, a local folder's config.json, or the Hub's config.json
alone (the Hugging Face cache, then the Hub: one small file; tilefit.models.hub). What
from_pretrained would do beyond the architecture: ``dtype`` / ``torch_dtype`` (the weights'
dtype), ``attn_implementation``, ``device_map`` (a GPU placement: the weights end on the
GPU), ``quantization_config`` (a BitsAndBytesConfig: its linear layers swapped for
bitsandbytes' as transformers' quantizer swaps them, each weight quantized by bitsandbytes'
own quantizer on fake tensors, on the GPU, as a real load quantizes it there)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tilefit.compat.simulated_cuda import patched
from tilefit.errors import TilefitError

# a model built on the meta device -> its fake copy, on the simulated GPU
LoadOnGpu = Callable[[nn.Module], nn.Module]


def _config(name: str, kwargs: dict[str, Any]) -> Any:
    """The transformers config of ``name``, from tilefit's catalog, a local folder or the
    Hub's config.json."""
    from transformers import AutoConfig

    from tilefit.models import catalog, hub
    from tilefit.models.hf import make_config

    if Path(name).is_dir():
        return AutoConfig.from_pretrained(name)
    if catalog.resolve_name(name) is not None:  # built as tilefit builds its catalog models
        return make_config(catalog.catalog_entry(name))
    if hub.is_hub_id(name):
        path = hub.config_file(name, kwargs.get("revision"))
        return AutoConfig.from_pretrained(str(path.parent))
    raise TilefitError(f"from_pretrained({name!r}): no config for it",
                       expected="a catalog model (tilefit models), a Hub id, or a local "
                       "folder with a config.json", given=repr(name),
                       fix="check the name, or pass the folder of its config.json")


def _dtype(kwargs: dict[str, Any], config: Any) -> torch.dtype:
    """The weights' dtype: the ``dtype`` (or ``torch_dtype``) asked for; "auto", transformers'
    default, is the config's own dtype, else fp32 (the checkpoint's dtype, which tilefit
    does not read, is fp32 where the config names none)."""
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    if dtype is None or dtype == "auto":
        dtype = getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise TilefitError("from_pretrained's dtype is not one tilefit can simulate",
                           expected='a torch.dtype, its name ("bfloat16") or "auto"',
                           given=repr(kwargs.get("dtype", kwargs.get("torch_dtype"))),
                           fix="pass dtype=torch.bfloat16 (or leave it out: the config's)")
    return dtype


def _bnb_config(value: Any, cuda: bool) -> Any:
    """The script's quantization_config as transformers' BitsAndBytesConfig."""
    from transformers import BitsAndBytesConfig

    if isinstance(value, dict) and value.get("quant_method", "bitsandbytes") == "bitsandbytes":
        value = BitsAndBytesConfig.from_dict(value)
    if not isinstance(value, BitsAndBytesConfig):
        method = value.get("quant_method") if isinstance(value, dict) else type(value).__name__
        raise TilefitError(
            "from_pretrained's quantization_config is simulated for bitsandbytes only",
            expected="a BitsAndBytesConfig", given=str(method),
            fix="quantize with BitsAndBytesConfig(load_in_4bit=True, ...), or predict the "
                "unquantized model")
    if value.load_in_8bit and cuda:
        raise TilefitError(
            "an 8-bit base (load_in_8bit) is not simulated on a GPU: LLM.int8()'s GPU path "
            "splits out the outlier columns, whose number depends on the weights' and "
            "activations' values, which fake tensors do not have",
            expected="BitsAndBytesConfig(load_in_4bit=True, ...) on a GPU; load_in_8bit with "
                     "simulate(..., gpu='cpu')", given="load_in_8bit=True",
            fix="simulate the 4-bit base (load_in_4bit=True), or simulate(..., gpu='cpu')")
    return value


def _outside_the_simulation(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` run on a thread of its own, where none of the simulation's modes is
    active (torch's mode stacks are per thread): bitsandbytes' parameters are made on the
    meta device, as from_pretrained makes them, and cannot wrap a fake tensor."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(build())
        except BaseException as exc:  # re-raised on the simulation's thread
            out.append(exc)

    thread = threading.Thread(target=run, name="tilefit-meta-build")
    thread.start()
    thread.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]  # type: ignore[no-any-return]


def _from_config(cls: Any, config: Any, build: dict[str, Any]) -> Any:
    return (cls.from_config(config, **build) if hasattr(cls, "_model_mapping")
            else cls._from_config(config, **build))


def _build(cls: Any, name: Any, kwargs: dict[str, Any], load: LoadOnGpu, cuda: bool) -> Any:
    """The model of ``name`` as ``cls.from_pretrained`` would build it, without weights."""
    config = name if not isinstance(name, (str, Path)) else _config(str(name), kwargs)
    build: dict[str, Any] = {"dtype": _dtype(kwargs, config)}  # its fp32-kept modules kept
    if kwargs.get("attn_implementation") is not None:
        build["attn_implementation"] = kwargs["attn_implementation"]
    if kwargs.get("quantization_config") is not None:
        # quantized as the weights load onto the GPU (bitsandbytes places them itself,
        # whatever device_map says)
        from tilefit.models.quantize import quantized_on_meta

        bnb = _bnb_config(kwargs["quantization_config"], cuda)
        meta = _outside_the_simulation(lambda: quantized_on_meta(
            lambda: _from_config(cls, config, build), bnb, build["dtype"]))
        return load(meta).train(False)
    model = _from_config(cls, config, build)
    if kwargs.get("device_map") not in (None, "cpu"):
        model = model.to("cuda")
    return model.train(False)  # from_pretrained returns the model in eval mode


@contextlib.contextmanager
def pretrained_from_config(built: list[str], load: LoadOnGpu, cuda: bool) -> Iterator[None]:
    """transformers' from_pretrained (a model class's and the Auto classes') builds from the
    config, for the block; ``built`` collects the names asked for; ``load`` makes a meta
    model's fake copy on the GPU (a quantized base)."""
    from tilefit.quiet_imports import quiet_imports

    try:
        with quiet_imports():  # transformers imports torchao, whose import logs its kernels
            # every Auto class is made with its own copy of from_pretrained (transformers'
            # auto_class_update): import them all first, then answer each class's own
            import transformers.models.auto.modeling_auto  # noqa: F401
            from transformers import PreTrainedModel
            from transformers.models.auto.auto_factory import _BaseAutoModelClass
    except ImportError:
        yield
        return

    def from_pretrained(cls: Any, name: Any, *args: Any, **kwargs: Any) -> Any:
        built.append(str(name))
        return _build(cls, name, kwargs, load, cuda)

    answer = classmethod(from_pretrained)
    owners = [c for c in (PreTrainedModel, _BaseAutoModelClass, *_subclasses(_BaseAutoModelClass))
              if "from_pretrained" in c.__dict__]
    with contextlib.ExitStack() as stack:
        for owner in owners:
            stack.enter_context(patched(owner, {"from_pretrained": answer}))
        yield


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out
