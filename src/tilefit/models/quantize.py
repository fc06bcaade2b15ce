"""A quantized base as QLoRA loads it: transformers' bitsandbytes quantizer swaps every
linear layer but the output head for bitsandbytes' own ``Linear4bit`` (nf4, fp4) or
``Linear8bitLt`` (int8), peft's ``prepare_model_for_kbit_training`` casts what stays
unquantized to fp32 and freezes it, and peft's LoRA adapters wrap the quantized layers.

Built on the meta device, as tilefit.models.lora builds LoRA; the weights are quantized when
the tracer makes its fake copy (tilefit.compat.bitsandbytes.fake_quantized: bitsandbytes'
quantizer on fake tensors), so the trace holds the packed weights and their quant state.

The defaults are QLoRA's (Dettmers et al. 2023; docs/references.md, section 33): blocks
of 64 weights with double quantization (``bnb_4bit_use_double_quant=True``), the compute
dtype the recipe's own 16-bit autocast dtype (bf16 or fp16; fp32 without autocast) where
transformers' BitsAndBytesConfig defaults ``bnb_4bit_compute_dtype`` to fp32, and peft's
preparation. The recipe says otherwise as the user's script does (``Recipe.double_quant``,
``quant_compute_dtype``, ``prepare_kbit``); the base is loaded in the compute dtype
(``from_pretrained(..., dtype=<compute dtype>)``, as QLoRA's scripts pass it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tilefit.compat.bitsandbytes import require_bitsandbytes
from tilefit.errors import TilefitError

if TYPE_CHECKING:
    import torch

    from tilefit.models import Workload
    from tilefit.recipe import Recipe

def compute_dtype(recipe: Recipe) -> torch.dtype:
    """The dtype bitsandbytes' layers compute in: the recipe's quant_compute_dtype, else its
    16-bit dtype, else fp32."""
    from tilefit.dtypes import torch_dtype

    return torch_dtype(  # type: ignore[no-any-return]
        recipe.quant_compute_dtype or recipe.spec.half_dtype or "fp32")


def bnb_config_kwargs(recipe: Recipe) -> dict[str, Any]:
    """transformers' BitsAndBytesConfig(**this) for the recipe's quantized base: what the
    tracer loads and what the plan's configs paste. Torch-free."""
    from tilefit.dtypes import parse_dtype

    if recipe.quantize == "int8":
        return {"load_in_8bit": True}
    dtype = recipe.quant_compute_dtype or recipe.spec.half_dtype or "fp32"
    return {"load_in_4bit": True, "bnb_4bit_quant_type": recipe.quantize,
            "bnb_4bit_use_double_quant": recipe.double_quant,
            "bnb_4bit_compute_dtype": parse_dtype(dtype).torch_name}


def bnb_config(recipe: Recipe) -> Any:
    """transformers' BitsAndBytesConfig for the recipe's quantized base."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(**bnb_config_kwargs(recipe))


def check_target(recipe: Recipe, cuda: bool) -> None:
    """What bitsandbytes runs that tilefit can trace for this target."""
    if recipe.quantize == "int8" and cuda:
        raise TilefitError(
            "an int8 base is predicted on the CPU only: bitsandbytes picks LLM.int8()'s "
            "training path by the tensors' device (MatMul8bitLt on CUDA, a dequantize-and-"
            "matmul MatMul8bitFp on the CPU) and tilefit's fake tensors live on the CPU, so "
            "a GPU trace would show the CPU's kernels", expected="Recipe(quantize='nf4') or "
            "Recipe(quantize='fp4') on a GPU, Recipe(quantize='int8') with "
            "estimate(..., gpu='cpu')", given="Recipe(quantize='int8') on a GPU",
            fix="pass Recipe(quantize='nf4') (QLoRA's 4-bit base)")


def quantize_notes(recipe: Recipe) -> tuple[str, ...]:
    if recipe.quantize is None:
        return ()
    rest = ("the rest fp32 (peft's prepare_model_for_kbit_training)" if recipe.prepare_kbit
            else f"the rest {'in the compute dtype' if recipe.quantize != 'int8' else 'as built'}"
                 " (no prepare_model_for_kbit_training)")
    if recipe.quantize == "int8":
        return ("int8 base: bitsandbytes' Linear8bitLt (LLM.int8(), outlier threshold 0) on "
                f"every linear layer but the output head; {rest}",)
    dtype = str(compute_dtype(recipe)).removeprefix("torch.")
    source = ("quant_compute_dtype" if recipe.quant_compute_dtype else
              "the recipe's dtype; BitsAndBytesConfig's default bnb_4bit_compute_dtype is fp32")
    return (f"{recipe.quantize} base: bitsandbytes' Linear4bit on every linear layer but the "
            "output head, blocks of 64 "
            f"{'with' if recipe.double_quant else 'without'} double quantization, computing "
            f"in {dtype} ({source}); {rest}",)


def quantized_on_meta(build: Callable[[], torch.nn.Module], config: Any,
                      weight_dtype: torch.dtype) -> torch.nn.Module:
    """The model ``build`` makes, on the meta device, as transformers' from_pretrained
    prepares it for ``config`` (a BitsAndBytesConfig): its linear layers swapped for
    bitsandbytes' (not yet quantized), holding the ``weight_dtype`` weights the quantizer is
    given, and marked loaded in 4 or 8 bits. Under no fake mode (bitsandbytes' parameters
    cannot wrap a fake tensor: tilefit.compat.bitsandbytes)."""
    import torch

    from tilefit.quiet_imports import quiet_imports, quiet_transformers

    with quiet_imports():  # transformers' quantizers import torchao where installed
        from transformers.quantizers import AutoHfQuantizer
    bnb = require_bitsandbytes("a quantized base")  # first: quietly imported
    quantizer = AutoHfQuantizer.from_config(config, pre_quantized=False)
    with quiet_transformers(), torch.device("meta"):
        model = build()
        quantizer.preprocess_model(model, device_map={"": "cpu"})
        for module in model.modules():  # the 16-bit weights the quantizer is given
            if isinstance(module, bnb.nn.Linear4bit):
                module.weight.data = module.weight.data.to(weight_dtype)
        model.hf_quantizer = quantizer  # as from_pretrained leaves it (the Trainer reads it)
        quantizer.postprocess_model(model)  # is_loaded_in_4bit / 8bit, as from_pretrained
    return model


def build_quantized_model(work: Workload, attention: str, recipe: Recipe) -> torch.nn.Module:
    """The workload's model as QLoRA trains it, on the meta device: bitsandbytes' layers
    (not yet quantized), peft's fp32 casts, peft's LoRA adapters."""
    import torch

    from tilefit.models.cast import cast_floating
    from tilefit.models.lora import get_peft_model, require_peft
    from tilefit.quiet_imports import quiet_transformers

    bnb = require_bitsandbytes(f"Recipe(quantize={recipe.quantize!r})")  # first: quietly imported
    peft = require_peft()
    dtype = compute_dtype(recipe)
    model = quantized_on_meta(lambda: work.build(attention), bnb_config(recipe), dtype)
    with quiet_transformers(), torch.device("meta"):
        if recipe.prepare_kbit:
            # checkpointing is the tracer's (non-reentrant, which needs no input hook)
            model = peft.prepare_model_for_kbit_training(model,
                                                         use_gradient_checkpointing=False)
        for module in model.modules():
            # Linear4bit.forward casts its bias to the compute dtype in place on its first
            # call (bias.data = ...); every later step holds it so. Done here, as after that
            # call: torch.compile's capture cannot trace the in-place swap
            if isinstance(module, bnb.nn.Linear4bit) and module.bias is not None:
                module.bias.data = module.bias.data.to(dtype)
        model = get_peft_model(model, work.task, recipe.lora)
        if not recipe.prepare_kbit:  # the frozen rest as loaded, with dtype=<compute dtype>
            cast_floating(model, dtype, frozen_only=True)
        return model
