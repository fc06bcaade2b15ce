"""LoRA as the peft library runs it: ``peft.get_peft_model(model, LoraConfig(...))`` with the
config the plan emits (tilefit.planner.configs.peft_config), on a 16-bit frozen base.

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

if TYPE_CHECKING:
    import torch

    from tilefit.models import Workload
    from tilefit.recipe import Recipe


def require_peft() -> Any:
    """The peft module, or a TilefitError saying how to install it."""
    try:
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


def get_peft_model(model: torch.nn.Module, task: str) -> torch.nn.Module:
    """``peft.get_peft_model`` with ``LoraConfig(**peft_config(task))``: every base parameter
    frozen, LoRA adapters on the linear layers peft's "all-linear" picks."""
    from tilefit.planner.configs import peft_config

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

    from tilefit.compat.transformers import quiet_transformers
    from tilefit.tracing.fakes import cast_floating

    with quiet_transformers(), torch.device("meta"):
        model = get_peft_model(work.build(attention), work.task)
    cast_floating(model, base_dtype, frozen_only=True)
    return model
