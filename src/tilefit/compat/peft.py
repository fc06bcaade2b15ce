"""peft's private rules that tilefit asks before it builds adapters (peft 0.21).

``peft.tuners.tuners_utils._check_lora_target_modules_mamba``: LoRA on the modules named
``out_proj`` or ``conv1d`` of a Mamba-based model (its model types: mamba, mamba2,
falcon_mamba, falcon_h1, nemotron_h) is refused, because mamba-ssm's fused kernels read those
weights directly (docs/references.md, section 41).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tilefit.compat import probes

# what cannot be checked where peft's rule is missing
BLIND_RULE = ("its rule refusing LoRA targets on Mamba-based models "
              "(tuners_utils._check_lora_target_modules_mamba)")


def refused_targets(config: Any, model: nn.Module, names: list[str]) -> list[str] | None:
    """The module names among ``names`` that peft refuses as LoRA targets of ``model`` under
    ``config`` (a peft.LoraConfig); None where this peft has no such rule (the probe is
    blind: tilefit.compat.probes)."""
    probes.read("peft")
    try:
        from peft.tuners.tuners_utils import _check_lora_target_modules_mamba
    except ImportError:  # another peft: no rule known
        probes.went_blind("peft", BLIND_RULE)
        return None
    refused = []
    for name in names:
        try:
            _check_lora_target_modules_mamba(config, model, name)
        except ValueError:
            refused.append(name)
    return refused
