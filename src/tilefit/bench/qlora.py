"""A real QLoRA model on this machine, as transformers, bitsandbytes and peft build it, for
checking tilefit's QLoRA predictions against real steps (tests/test_quantize.py,
benchmarks/bench_qlora_compile_cpu.py): a Llama-like config saved with random weights,
loaded in nf4 by ``from_pretrained`` (bitsandbytes' CPU backend quantizes it), prepared by
``peft.prepare_model_for_kbit_training`` and given LoRA r=16, alpha=32 on every linear layer
(tilefit's ``Lora()``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["quant_state_tensors", "real_qlora_model"]


def real_qlora_model(config: dict[str, Any], where: Path,
                     compute_dtype: torch.dtype) -> nn.Module:
    """The QLoRA model of ``config`` (a Llama config.json's fields, ``model_type`` and
    ``architectures`` included), its random weights saved under ``where`` first (seed 0),
    double-quantized nf4 computing in ``compute_dtype``, in training mode."""
    import peft
    from transformers import (
        AutoModelForCausalLM,
        BitsAndBytesConfig,
        LlamaConfig,
        LlamaForCausalLM,
    )

    torch.manual_seed(0)
    fields = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
    LlamaForCausalLM(LlamaConfig(**fields)).save_pretrained(where / "weights")
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                               bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=compute_dtype)
    model = AutoModelForCausalLM.from_pretrained(where / "weights", device_map={"": "cpu"},
                                                 quantization_config=quant)
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
        task_type="CAUSAL_LM"))
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
