"""Tracing a named model: a catalog name, config.json or factory, built by tilefit at the
recipe's batch size (tilefit.models.Workload), LoRA adapters and the fused loss included."""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from tilefit.errors import TilefitError
from tilefit.recipe import Recipe
from tilefit.tracing.records import Trace
from tilefit.tracing.step import resolve_target, trace_module

if TYPE_CHECKING:
    from tilefit.hardware import Device
    from tilefit.models import Workload


def trace_workload(workload: str | Workload, recipe: Recipe, gpu: str | Device) -> Trace:
    """One training step of ``workload`` under ``recipe`` (its batch size, its adapters and
    loss) on ``gpu``."""
    from tilefit.models import load_workload

    work = load_workload(workload) if isinstance(workload, str) else workload
    recipe = recipe.on(resolve_target(gpu)[1])
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
