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

import difflib
import warnings
from typing import TYPE_CHECKING, Any

from tilefit.errors import TilefitError
from tilefit.recipe import ALL_LINEAR, Lora, Recipe

# LoRA rank 16, alpha 32 (tilefit.recipe.Lora's defaults): a common choice between peft's
# default (r=8) and QLoRA's r=64 (Dettmers et al. 2023); the adapter memory is tiny at any.
LORA_RANK = Lora().rank
LORA_ALPHA = Lora().alpha
# tilefit's task (tilefit.models.hf.TASKS) -> peft's TaskType: the PeftModel class that wraps
# the model. None: the plain PeftModel (peft has no masked-LM or image task type).
PEFT_TASK_TYPES: dict[str, str | None] = {"causal-lm": "CAUSAL_LM", "seq-cls": "SEQ_CLS",
                                           "masked-lm": None, "image-cls": None,
                                           "seq2seq-lm": "SEQ_2_SEQ_LM", "speech-seq2seq": None,
                                           "ctc": None}

if TYPE_CHECKING:
    import torch
    from torch import nn

    from tilefit.models import Workload


def require_peft(without: str = "Recipe(lora=None)") -> Any:
    """The peft module, or a TilefitError saying how to install it (``without``: how the
    caller goes without LoRA, in Python words)."""
    from tilefit.quiet_imports import quiet_imports

    try:
        with quiet_imports():  # peft imports bitsandbytes where installed, which logs
            import peft
    except ImportError:
        raise TilefitError(
            "LoRA is traced with the peft library, which is not installed",
            expected="peft importable (an optional dependency of tilefit)",
            given="import peft failed",
            fix=f"pip install peft (or pip install 'tilefit[peft]'), or {without}",
        ) from None
    return peft


def peft_config(task: str, lora: Lora | None = None) -> dict[str, Any]:
    """peft.LoraConfig(**this) then peft.get_peft_model(model, config), the base model loaded
    with torch_dtype=torch.bfloat16: what the plan traced (build_lora_model builds the
    traced model from this same dict), ``lora``'s values one-to-one (default: Lora()).
    "all-linear" leaves out the output head; a classifier head is trained in full (SEQ_CLS:
    peft's modules_to_save; image-cls: named here, as peft's image classification guide
    does, unless ``lora`` names the modules to save)."""
    lora = lora or Lora()
    targets = lora.targets if lora.targets == ALL_LINEAR else list(lora.targets)
    out: dict[str, Any] = {"r": lora.rank, "lora_alpha": lora.alpha,
                           "lora_dropout": lora.dropout, "target_modules": targets,
                           "task_type": PEFT_TASK_TYPES.get(task)}
    if lora.dora:
        out["use_dora"] = True
    if lora.modules_to_save is not None:
        out["modules_to_save"] = list(lora.modules_to_save)
    elif task == "image-cls":
        out["modules_to_save"] = ["classifier"]
    return out


def get_peft_model(model: nn.Module, task: str, lora: Lora | None = None) -> nn.Module:
    """``peft.get_peft_model`` with ``LoraConfig(**peft_config(task, lora))``: every base
    parameter frozen, LoRA adapters on the layers ``lora.targets`` names (peft's
    "all-linear": every linear layer but the output head)."""
    peft = require_peft()
    config = peft.LoraConfig(**peft_config(task, lora))
    check_targets(model, config)
    asked = repr(config.target_modules)  # peft expands "all-linear" in place
    linear = linear_names(model)  # before peft wraps any of them
    with warnings.catch_warnings():
        # GPT-2's Conv1D: peft sets fan_in_fan_out itself and says so; the deprecation of
        # is_gradient_checkpointing is transformers' notice to peft, not to the user.
        warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*", category=UserWarning)
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                category=FutureWarning)
        try:
            return peft.get_peft_model(model, config)  # type: ignore[no-any-return]
        except ValueError as err:  # a target peft cannot wrap (a module of no LoRA layer)
            raise _refused(model, config, linear, asked, str(err).splitlines()[0]) from None


def linear_names(model: nn.Module) -> list[str]:
    """The short names (last part of the path) of the model's linear layers, once each, in
    order: what --lora-targets can name (nn.Linear and transformers' Conv1D, which peft's
    LoRA wraps)."""
    import torch
    from transformers.pytorch_utils import Conv1D

    names: dict[str, None] = {}
    for path, module in model.named_modules():
        if path and isinstance(module, (torch.nn.Linear, Conv1D)):
            names.setdefault(path.rsplit(".", 1)[-1], None)
    return list(names)


def check_targets(model: nn.Module, config: Any) -> None:
    """Each module name of target_modules and modules_to_save matches a module of
    ``model`` as peft matches them (the name, or a path ending in "." + the name)."""
    paths = [path for path, _ in model.named_modules() if path]
    for field, names in (("targets", config.target_modules),
                         ("modules_to_save", config.modules_to_save)):
        if names is None or isinstance(names, str):  # "all-linear" (or peft's regex form)
            continue
        for name in sorted(names):
            if not any(p == name or p.endswith("." + name) for p in paths):
                raise _bad_target(linear_names(model), field, name, f"Lora({field}=...) names "
                                  f"{name!r}, which is no module of this model")


def _refused(model: nn.Module, config: Any, linear: list[str], asked: str, problem: str
             ) -> TilefitError:
    """peft refused the targets: name the linear layers it accepts on this model (a
    Mamba-based model's out_proj and conv1d it refuses: compat.peft)."""
    from tilefit.compat import probes
    from tilefit.compat.peft import BLIND_RULE, refused_targets

    refused = refused_targets(config, model, linear)
    if refused is None:  # this peft's rule is unknown: say so beside the plain error
        return _bad_target(linear, "targets", asked,
                           f"{problem} ({probes.Blind('peft', BLIND_RULE).note})")
    if not refused:
        return _bad_target(linear, "targets", asked, problem)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    heads = {p.rsplit(".", 1)[-1] for p, m in model.named_modules() if p and m is head}
    accepted = [n for n in linear if n not in refused and n not in heads]
    return TilefitError(problem, expected="LoRA targets peft accepts on this model: "
                        + ", ".join(accepted), given=asked,
                        fix=f"pass Lora(targets={tuple(accepted)!r})")


def _bad_target(linear: list[str], field: str, given: str, problem: str) -> TilefitError:
    """A target that matches no module, or that peft cannot wrap: the model's linear layers
    (``linear``, linear_names) and the closest of them (``field``: Lora's targets or
    modules_to_save)."""
    close = difflib.get_close_matches(given, linear, n=1)
    fix = f"pass Lora({field}={tuple(close or linear[:2])!r})"
    return TilefitError(problem, expected="module names of this model; its linear layers: "
                        + ", ".join(linear), given=given,
                        fix=fix + (" (or Lora(targets='all-linear'))" if field == "targets"
                                   else ""))


def lora_base_dtype(recipe: Recipe) -> torch.dtype:
    """The frozen base's dtype under ``recipe``: its 16-bit compute dtype (LoRA fine-tuning
    loads the base with torch_dtype=bfloat16 and trains under autocast), or fp32 for a
    recipe without one (no autocast: a 16-bit base could not take fp32 activations). The
    adapters stay fp32 either way."""
    from tilefit.dtypes import torch_dtype

    return torch_dtype(recipe.spec.half_dtype or "fp32")  # type: ignore[no-any-return]


def build_lora_model(work: Workload, attention: str, base_dtype: torch.dtype,
                     lora: Lora | None = None) -> torch.nn.Module:
    """The workload's model with peft's LoRA adapters as ``lora`` says (default: Lora()),
    on the meta device, the frozen base in ``base_dtype`` (LoRA fine-tuning loads it with
    from_pretrained(torch_dtype=bfloat16)) and the adapters in fp32 (peft's
    autocast_adapter_dtype keeps them there)."""
    import torch

    from tilefit.models.cast import cast_floating
    from tilefit.quiet_imports import quiet_transformers

    with quiet_transformers(), torch.device("meta"):
        model = get_peft_model(work.build(attention), work.task, lora)
    cast_floating(model, base_dtype, frozen_only=True)
    return model
