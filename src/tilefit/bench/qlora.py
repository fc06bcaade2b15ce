"""A real QLoRA model on this machine, as transformers, bitsandbytes and peft build it, for
checking tilefit's QLoRA predictions against real steps (tests/test_quantize.py,
benchmarks/bench_qlora_compile_cpu.py, ``tilefit bench step --quantize``): a model saved with
random weights, loaded quantized by ``from_pretrained`` (bitsandbytes quantizes it as it
loads: its CPU backend on a CPU), prepared by ``peft.prepare_model_for_kbit_training`` and
given LoRA as the recipe says (``real_qlora_model``: a Llama-like config in nf4 with
tilefit's ``Lora()``, r=16, alpha=32 on every linear layer)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tilefit.recipe import Lora

if TYPE_CHECKING:
    from tilefit.models import Workload
    from tilefit.recipe import Recipe

__all__ = ["load_qlora", "qlora_of_workload", "quant_state_tensors", "real_qlora_model"]


def real_qlora_model(config: dict[str, Any], where: Path,
                     compute_dtype: torch.dtype) -> nn.Module:
    """The QLoRA model of ``config`` (a Llama config.json's fields, ``model_type`` and
    ``architectures`` included), its random weights saved under ``where`` first (seed 0),
    double-quantized nf4 computing in ``compute_dtype``, in training mode, on the CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tilefit.dtypes import parse_dtype
    from tilefit.recipe import Recipe

    torch.manual_seed(0)
    fields = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
    LlamaForCausalLM(LlamaConfig(**fields)).save_pretrained(where / "weights")
    recipe = Recipe(precision="fp32", quantize="nf4", lora=Lora(),
                    quant_compute_dtype=parse_dtype(str(compute_dtype)).name)
    return load_qlora(LlamaForCausalLM, where / "weights", recipe, "cpu", "causal-lm")


def qlora_of_workload(work: Workload, recipe: Recipe, where: Path, device: str) -> nn.Module:
    """The workload's model as QLoRA trains it, for real on ``device``: its random weights
    (seed 0) saved under ``where``, loaded back by ``from_pretrained`` with the recipe's
    BitsAndBytesConfig (bitsandbytes quantizes them as it loads), peft's preparation where
    the recipe runs it, and the recipe's LoRA: what the tracer's model
    (tilefit.models.quantize) stands for."""
    from tilefit.quiet_imports import quiet_transformers

    torch.manual_seed(0)
    model = work.build(recipe.attention)
    attention = getattr(model.config, "_attn_implementation", None)
    with quiet_transformers():  # its "Writing model shards" bar
        model.save_pretrained(where)
    cls = type(model)
    del model
    return load_qlora(cls, where, recipe, device, work.task, attention)


def load_qlora(cls: Any, path: Path, recipe: Recipe, device: str, task: str,
               attention: str | None = None) -> nn.Module:
    """``cls.from_pretrained(path)`` quantized by bitsandbytes as the recipe says (its
    BitsAndBytesConfig: tilefit.models.quantize.bnb_config), loaded in the compute dtype,
    ``peft.prepare_model_for_kbit_training`` where the recipe runs it (no checkpointing:
    bench step and the tracer enable it themselves) and peft's LoRA as ``recipe.lora`` says
    (tilefit.models.lora.peft_config), in training mode."""
    import peft

    from tilefit.models.lora import get_peft_model
    from tilefit.models.quantize import bnb_config, compute_dtype
    from tilefit.quiet_imports import quiet_transformers

    extra = {} if attention is None else {"attn_implementation": attention}
    with quiet_transformers():
        model = cls.from_pretrained(path, device_map={"": device},
                                    quantization_config=bnb_config(recipe),
                                    dtype=compute_dtype(recipe), **extra)
    if recipe.prepare_kbit:
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model = get_peft_model(model, task, recipe.lora)
    model.train()
    return model


def quant_state_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors each Linear4bit's QuantState holds (absmax, code, offset, the nested
    state's), collected by walking bitsandbytes' QuantState module by module, apart from
    tilefit's own accounting (compat.bitsandbytes): a real step's memory counters see
    tensors only as parameters, buffers, gradients, optimizer state or what they are
    handed."""
    out = []
    for module in model.modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        while state is not None:
            out += [t for t in (state.absmax, state.code, state.offset) if t is not None]
            state = state.state2
    return out
