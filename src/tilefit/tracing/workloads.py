"""Tracing a named model: a catalog name, config.json or factory, built by tilefit at the
recipe's batch size (tilefit.models.Workload), LoRA adapters and the fused loss included.

``shared_traces()`` scopes one call of audit or plan: inside it each distinct (workload,
recipe, device) is traced once and its Trace (frozen) handed to every later asker (a plan's
one-GPU and multi-GPU sweeps share their 16-bit points; an audit's way forward runs a plan).
Nothing outlives the scope."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Hashable, Iterator
from contextvars import ContextVar
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from tilefit.errors import TilefitError
from tilefit.recipe import Recipe
from tilefit.tracing.records import Trace
from tilefit.tracing.step import resolve_target, trace_module

if TYPE_CHECKING:
    from tilefit.hardware import Device
    from tilefit.models import Workload


# the traces of the innermost shared_traces() scope, by (workload, recipe, device)
_SHARED: ContextVar[dict[Hashable, Trace] | None] = ContextVar("tilefit_shared_traces",
                                                               default=None)


@contextlib.contextmanager
def shared_traces() -> Iterator[None]:
    """Within: trace_workload traces each (workload, recipe, device) once. A scope inside
    another shares the outer one's traces; they are dropped when the outermost ends."""
    if _SHARED.get() is not None:
        yield
        return
    token = _SHARED.set({})
    try:
        yield
    finally:
        _SHARED.reset(token)


def trace_workload(workload: str | Workload, recipe: Recipe, gpu: str | Device) -> Trace:
    """One training step of ``workload`` under ``recipe`` (its batch size, its adapters and
    loss) on ``gpu``; inside ``shared_traces()``, the scope's trace of the same step if it
    has one."""
    from tilefit.models import load_workload

    work = load_workload(workload) if isinstance(workload, str) else workload
    device = resolve_target(gpu)[1]
    recipe = recipe.on(device)
    shared = _SHARED.get()
    try:
        key: Hashable = (work, recipe, device)
        hash(key)
    except TypeError:  # an unhashable part (a user's optimizer factory object): not shared
        shared = None
    if shared is None:
        return _trace_workload(work, recipe, gpu)
    if key not in shared:
        shared[key] = _trace_workload(work, recipe, gpu)
    return shared[key]


def _trace_workload(work: Workload, recipe: Recipe, gpu: str | Device) -> Trace:
    """trace_workload's step, traced (``recipe`` already on the device)."""
    build_attention = recipe.attention  # auto: transformers' choice for the architecture
    if work.is_factory and recipe.attention != "auto":
        raise TilefitError(
            f"--attention {recipe.attention} applies to Hugging Face models",
            expected="auto for a plain nn.Module factory (its own code chooses)",
            given=recipe.attention, fix="drop --attention")
    model: Any = functools.partial(work.build, build_attention)
    if recipe.quantize is not None:  # QLoRA: bitsandbytes' layers under peft's adapters
        from tilefit.models.quantize import build_quantized_model, check_target

        check_lora(work)
        check_target(recipe, resolve_target(gpu)[0].kind == "cuda")
        model = build_quantized_model(work, build_attention, recipe)
    elif recipe.lora is not None:  # peft's LoRA, built on the meta device (models.lora says why)
        from tilefit.models.lora import build_lora_model, lora_base_dtype

        check_lora(work)
        model = build_lora_model(work, build_attention, lora_base_dtype(recipe), recipe.lora)
    # the workload's model already has its attention implementation built in
    tr = trace_module(model, work.make_batch(recipe.batch_size, device="meta"),
                      replace(recipe, attention="auto"), gpu,
                      loss_fn=work.loss_for(recipe.fused_ce))
    if recipe.quantize is None:
        return tr
    from tilefit.models.quantize import quantize_notes

    return replace(tr, warnings=tr.warnings + quantize_notes(recipe))


def check_lora(workload: Workload) -> None:
    """LoRA wraps a Hugging Face model's linear layers; a plain nn.Module factory is an
    error."""
    if workload.is_factory:
        raise TilefitError(
            "LoRA (peft) applies to Hugging Face models",
            expected="a catalog model or a config.json", given=workload.name,
            fix="drop --lora, or wrap the model with peft.get_peft_model in your own factory")
