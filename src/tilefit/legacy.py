"""The keyword arguments tilefit's functions took before ``recipe=`` and ``gpu=``: still
accepted for one release, each with a DeprecationWarning that names its new spelling.

``tilefit.estimate(model, batch, optimizer="sgd", device="h100")`` is
``tilefit.estimate(model, batch, recipe=Recipe(optimizer="sgd"), gpu="h100")``. A call
that uses them keeps the defaults the function had (fp32 and plain PyTorch's loop for trace and
estimate, on the CPU), so its numbers do not move while users migrate. ``read_options`` does
the same for a function's options object (``tune(max_batch=64)`` is
``tune(search=TuneSearch(max_batch=64))``): each old keyword a field of the same name.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tilefit.errors import TilefitError
from tilefit.recipe import Compile, Lora, Parallelism, Recipe

# old keyword -> the Recipe field of the same meaning
RECIPE_FIELDS: tuple[str, ...] = ("batch_size", "precision", "optimizer", "grad_checkpointing",
                                  "accumulation_steps", "attention", "max_grad_norm",
                                  "loss_sync", "fused_ce")
COMPILE_FIELDS: dict[str, str] = {"compile": "", "compile_mode": "mode",
                                  "graph_breaks": "graph_breaks"}
PARALLEL_FIELDS: dict[str, str] = {"world_size": "world_size", "strategy": "strategy",
                                   "offload": "offload", "zero_config": "zero"}


@dataclass(frozen=True)
class Legacy:
    """A call's old keywords read: the recipe they describe (None: none given) and the
    keywords that are not the recipe's (``device`` and each function's own)."""

    recipe: Recipe | None
    rest: dict[str, Any] = field(default_factory=dict)


def legacy_gpu(function: str, gpu: Any, old: Legacy, legacy_given: bool, default: str) -> Any:
    """The target of a call: ``gpu``, else its old spelling ``device=``, else the CPU for a
    call in the old keywords (their default) or ``default``; both spellings are an error."""
    if gpu is None:
        return old.rest.get("device", "cpu" if legacy_given else default)
    if "device" in old.rest:
        raise TypeError(f"{function}() got both gpu= and its old spelling device=")
    return gpu


def read_legacy(function: str, recipe: Recipe | None, legacy: dict[str, Any],
                base: dict[str, Any], *, own: dict[str, str] | None = None) -> Legacy:
    """The recipe of ``legacy`` keywords on top of ``base`` (the function's old defaults),
    warning once for the call; ``own``: the old keywords the function maps itself (returned
    in ``rest``), each with its new spelling. An unknown keyword is a TypeError, as
    Python's own; recipe fields given both ways are an error."""
    own = own or {}
    unknown = sorted(set(legacy) - {*RECIPE_FIELDS, *COMPILE_FIELDS, *PARALLEL_FIELDS,
                                     "peft", "device", *own})
    if unknown:
        raise TypeError(f"{function}() got unexpected keyword arguments {unknown}")
    if not legacy:
        return Legacy(recipe)
    _warn(function, legacy, own)
    rest = {k: legacy[k] for k in legacy if k == "device" or k in own}
    recipe_keys = set(legacy) - set(rest)
    if not recipe_keys:
        return Legacy(recipe, rest)
    if recipe is not None:
        raise TilefitError(
            f"{function}() got recipe= and the old keywords {sorted(recipe_keys)}",
            expected="recipe=Recipe(...) alone", given="both",
            fix="set those fields on the Recipe instead")
    return Legacy(_recipe_of(legacy, base), rest)


Options = TypeVar("Options")


def read_options(function: str, name: str, options: Options | None, legacy: dict[str, Any],
                 kind: type[Options]) -> Options:
    """The options object ``name`` (a frozen dataclass of type ``kind``) of a call: the one
    given, or one of the ``legacy`` keywords of the same names (each a field), warning once
    for the call. An unknown keyword is a TypeError, as Python's own; the object and old
    keywords both given are an error."""
    fields_ = {f.name for f in dataclasses.fields(kind)}  # type: ignore[arg-type]
    unknown = sorted(set(legacy) - fields_)
    if unknown:
        raise TypeError(f"{function}() got unexpected keyword arguments {unknown}")
    if not legacy:
        return kind() if options is None else options
    _warn(function, legacy, {k: f"{name}={kind.__name__}({k}=...)" for k in legacy})
    if options is not None:
        raise TilefitError(
            f"{function}() got {name}= and the old keywords {sorted(legacy)}",
            expected=f"{name}={kind.__name__}(...) alone", given="both",
            fix=f"set those fields on the {kind.__name__} instead")
    return kind(**legacy)


def _recipe_of(legacy: dict[str, Any], base: dict[str, Any]) -> Recipe:
    fields_ = {**base, **{k: legacy[k] for k in RECIPE_FIELDS if k in legacy}}
    if legacy.get("compile"):
        fields_["compile"] = Compile(legacy.get("compile_mode", "default"),
                                     bool(legacy.get("graph_breaks", False)))
    else:
        for key in ("compile_mode", "graph_breaks"):
            if legacy.get(key) not in (None, False, "default"):
                # the error Compile gives for a mode without compile=True
                raise TilefitError(f"{key}={legacy[key]!r} is an option of torch.compile",
                                   expected=f"compile=True with {key}", given="compile=False",
                                   fix="pass Recipe(compile=Compile(...))")
    parallel = {new: legacy[old] for old, new in PARALLEL_FIELDS.items() if old in legacy}
    if parallel:
        fields_["parallel"] = Parallelism(**parallel)
    if legacy.get("peft"):
        fields_["lora"] = Lora()
    return Recipe(**fields_)


def _spelling(key: str, value: Any, own: dict[str, str]) -> str:
    if key in own:
        return own[key]
    if key == "device":
        return f"gpu={getattr(value, 'name', value)!r}"
    if key in COMPILE_FIELDS:
        return f"recipe=Recipe(compile=Compile({COMPILE_FIELDS[key] or 'mode'}=...))"
    if key in PARALLEL_FIELDS:
        return f"recipe=Recipe(parallel=Parallelism({PARALLEL_FIELDS[key]}=...))"
    if key == "peft":
        return "recipe=Recipe(lora=Lora())"
    return f"recipe=Recipe({key}={value!r})"


def _warn(function: str, legacy: dict[str, Any], own: dict[str, str]) -> None:
    moves = "; ".join(f"{k}= -> {_spelling(k, v, own)}" for k, v in legacy.items())
    warnings.warn(f"tilefit.{function}(): these keywords are deprecated and will be removed "
                  f"in tilefit 0.3: {moves}", DeprecationWarning, stacklevel=4)
