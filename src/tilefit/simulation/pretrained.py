"""``from_pretrained`` under the simulated GPU: the model built from its config alone.

A script's ``AutoModelForCausalLM.from_pretrained("gpt2", dtype=torch.bfloat16)`` (or a model
class's) gets the same architecture, built with ``from_config`` on fake tensors: no weight is
read or downloaded, as tilefit builds every named model. The config is tilefit's catalog
entry for a catalog name or its Hub id, a local folder's config.json, or the Hub's config.json
alone (the Hugging Face cache, then the Hub: one small file; tilefit.models.hub). What
from_pretrained would do beyond the architecture: ``dtype`` / ``torch_dtype`` (the weights'
dtype), ``attn_implementation``, ``device_map`` (a GPU placement: the weights end on the
GPU). ``quantization_config`` (bitsandbytes) is refused with a clear error: not simulated yet
from a script (``tilefit estimate MODEL --quantize nf4`` predicts it)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tilefit.compat.simulated_cuda import patched
from tilefit.errors import TilefitError

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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


def _dtype(kwargs: dict[str, Any]) -> torch.dtype | None:
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    if isinstance(dtype, str):
        return _DTYPES.get(dtype)
    return dtype if isinstance(dtype, torch.dtype) else None


def _build(cls: Any, name: Any, kwargs: dict[str, Any]) -> Any:
    """The model of ``name`` as ``cls.from_pretrained`` would build it, without weights."""
    if kwargs.get("quantization_config") is not None:
        raise TilefitError(
            "from_pretrained with a quantization_config is not simulated yet",
            expected="from_pretrained without quantization_config under tilefit run",
            given=f"from_pretrained({name!r}, quantization_config=...)",
            fix="predict the quantized step with tilefit estimate MODEL --lora --quantize "
                "nf4 (Recipe(quantize='nf4', lora=Lora()))")
    config = name if not isinstance(name, (str, Path)) else _config(str(name), kwargs)
    build: dict[str, Any] = {}
    if kwargs.get("attn_implementation") is not None:
        build["attn_implementation"] = kwargs["attn_implementation"]
    dtype = _dtype(kwargs)
    if dtype is not None:  # as from_pretrained casts (its fp32-kept modules kept)
        build["dtype"] = dtype
    model = (cls.from_config(config, **build) if hasattr(cls, "_model_mapping")
             else cls._from_config(config, **build))
    if kwargs.get("device_map") not in (None, "cpu"):
        model = model.to("cuda")
    return model.train(False)  # from_pretrained returns the model in eval mode


@contextlib.contextmanager
def pretrained_from_config(built: list[str]) -> Iterator[None]:
    """transformers' from_pretrained (a model class's and the Auto classes') builds from the
    config, for the block; ``built`` collects the names asked for."""
    try:
        from transformers import PreTrainedModel
        from transformers.models.auto.auto_factory import _BaseAutoModelClass
    except ImportError:
        yield
        return

    def from_pretrained(cls: Any, name: Any, *args: Any, **kwargs: Any) -> Any:
        built.append(str(name))
        return _build(cls, name, kwargs)

    # every Auto class is made with its own copy of from_pretrained (transformers'
    # auto_class_update): import them all first, then answer each class's own
    import transformers.models.auto.modeling_auto  # noqa: F401

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
