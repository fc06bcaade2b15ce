"""LoRA as the peft library runs it: ``peft.get_peft_model(model, LoraConfig(...))`` with the
config the plan emits (``peft_config``), on a 16-bit frozen base.

peft is an optional dependency (the "peft" extra): only ``--allow-peft`` (plan) and ``--lora``
(estimate) need it.

The model is built on the meta device and handed to the tracer as a module (which makes its
fake copy), not built by a factory under the tracer's FakeTensorMode: peft moves each new
adapter to its base layer's device with ``Module.to``, and Module._apply swaps the tensors of
fake parameters, which torch refuses for parameters created under a FakeTensorMode ("Cannot
swap t1 because it has weakref associated with it", torch 2.13). Meta parameters are moved
with set_data instead, and peft's LoRA init (kaiming_uniform_, zeros_) is a no-op on them.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from tilefit.errors import TilefitError

# LoRA rank 16, alpha 32: a common choice between peft's default (r=8) and QLoRA's r=64
# (Dettmers et al. 2023); the adapter memory is tiny at any of them.
LORA_RANK = 16
LORA_ALPHA = 32
# tilefit's task (tilefit.models.hf.TASKS) -> peft's TaskType: the PeftModel class that wraps
# the model. None: the plain PeftModel (peft has no masked-LM or image task type).
PEFT_TASK_TYPES: dict[str, str | None] = {"causal-lm": "CAUSAL_LM", "seq-cls": "SEQ_CLS",
                                           "masked-lm": None, "image-cls": None,
                                           "seq2seq-lm": "SEQ_2_SEQ_LM", "speech-seq2seq": None,
                                           "ctc": None}

if TYPE_CHECKING:
    import torch

    from tilefit.models import Workload
    from tilefit.recipe import Recipe


def require_peft() -> Any:
    """The peft module, or a TilefitError saying how to install it."""
    from tilefit.quiet_imports import quiet_imports

    try:
        with quiet_imports():  # peft imports bitsandbytes where installed, which logs
            import peft
    except ImportError:
        raise TilefitError(
            "LoRA (estimate's --lora, plan's --allow-peft) is traced with the peft library, "
            "which is not installed",
            expected="peft importable (an optional dependency of tilefit)",
            given="import peft failed",
            fix="pip install peft (or pip install 'tilefit[peft]'), or leave out --lora / "
            "--allow-peft",
        ) from None
    return peft


def peft_config(task: str) -> dict[str, Any]:
    """peft.LoraConfig(**this) then peft.get_peft_model(model, config), the base model loaded
    with torch_dtype=torch.bfloat16: what the plan traced (build_lora_model builds the
    traced model from this same dict). "all-linear" leaves out the output head; a
    classifier head is trained in full (SEQ_CLS: peft's modules_to_save; image-cls: named
    here, as peft's image classification guide does)."""
    out: dict[str, Any] = {"r": LORA_RANK, "lora_alpha": LORA_ALPHA, "lora_dropout": 0.0,
                           "target_modules": "all-linear",
                           "task_type": PEFT_TASK_TYPES.get(task)}
    if task == "image-cls":
        out["modules_to_save"] = ["classifier"]
    return out


def get_peft_model(model: torch.nn.Module, task: str) -> torch.nn.Module:
    """``peft.get_peft_model`` with ``LoraConfig(**peft_config(task))``: every base parameter
    frozen, LoRA adapters on the linear layers peft's "all-linear" picks."""
    peft = require_peft()
    config = peft.LoraConfig(**peft_config(task))
    with warnings.catch_warnings():
        # GPT-2's Conv1D: peft sets fan_in_fan_out itself and says so; the deprecation of
        # is_gradient_checkpointing is transformers' notice to peft, not to the user.
        warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*", category=UserWarning)
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                category=FutureWarning)
        return peft.get_peft_model(model, config)


def lora_base_dtype(recipe: Recipe) -> torch.dtype:
    """The frozen base's dtype under ``recipe``: its 16-bit compute dtype (LoRA fine-tuning
    loads the base with torch_dtype=bfloat16 and trains under autocast), or fp32 for a
    recipe without one (no autocast: a 16-bit base could not take fp32 activations). The
    adapters stay fp32 either way."""
    from tilefit.dtypes import torch_dtype

    return torch_dtype(recipe.spec.half_dtype or "fp32")  # type: ignore[no-any-return]


def build_lora_model(work: Workload, attention: str, base_dtype: torch.dtype
                     ) -> torch.nn.Module:
    """The workload's model with peft's LoRA adapters, on the meta device, the frozen base
    in ``base_dtype`` (LoRA fine-tuning loads it with from_pretrained(torch_dtype=bfloat16))
    and the adapters in fp32 (peft's autocast_adapter_dtype keeps them there)."""
    import torch

    from tilefit.models.cast import cast_floating
    from tilefit.quiet_imports import quiet_transformers

    with quiet_transformers(), torch.device("meta"):
        model = get_peft_model(work.build(attention), work.task)
    cast_floating(model, base_dtype, frozen_only=True)
    return model
