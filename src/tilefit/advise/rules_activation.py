"""Activations a Hugging Face config can swap for one fused kernel with the same math.

transformers' ``gelu_new`` (GPT-2's), ``gelu_fast``, ``gelu_accurate`` and
``gelu_python_tanh`` compute the tanh approximation of GELU in Python, one elementwise
kernel per operation in forward and more in backward; ``gelu_pytorch_tanh`` calls
``torch.nn.functional.gelu(approximate="tanh")``, one kernel each way, the same function up to
rounding. ``gelu_python`` is the exact (erf) GELU that ``gelu`` computes in one kernel
(docs/references.md, section 36). The gain is a re-trace of the model built with the config
changed; under torch.compile Inductor fuses the ops anyway, so no finding there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tilefit.advise.findings import MIN_RECOMMENDED_SPEEDUP, Change, Finding, effect, severity_of
from tilefit.advise.rules_dims import module_map
from tilefit.advise.whatif import WhatIf
from tilefit.errors import TilefitError

if TYPE_CHECKING:
    from tilefit.estimator import Estimate, OpCost
    from tilefit.models import Workload

RULE = "fused-activation"
GIB = 2**30
# transformers.activations.ACT2CLS name -> the one-kernel activation with the same function,
# up to rounding (docs/references.md, section 36)
FUSED_SAME_MATH = {"gelu_new": "gelu_pytorch_tanh", "gelu_fast": "gelu_pytorch_tanh",
                   "gelu_accurate": "gelu_pytorch_tanh",
                   "gelu_python_tanh": "gelu_pytorch_tanh", "gelu_python": "gelu"}
MAX_MODULES = 6


def config_activation(config: dict[str, object]) -> tuple[str, str] | None:
    """(field, activation) of the first activation field of a transformers config dict
    (``activation_function``, ``hidden_act``, ...) that FUSED_SAME_MATH can swap."""
    for key, value in config.items():
        if "act" in key and isinstance(value, str) and value in FUSED_SAME_MATH:
            return key, value
    return None


def _as_built(work: Workload) -> dict[str, object]:
    """The config as transformers builds the model from it (its class's defaults included)."""
    from tilefit.models.hf import make_config

    assert work.config is not None
    return make_config(work.config).to_dict()


def _activation_ops(whatif: WhatIf, name: str) -> list[OpCost]:
    """The steady step's ops inside the model's modules of the activation's class."""
    from transformers.activations import ACT2CLS

    entry = ACT2CLS[name]
    cls = entry[0] if isinstance(entry, tuple) else entry
    paths = {path for path, mod in module_map(whatif).items() if isinstance(mod, cls)}
    return [c for c in whatif.estimate.ops if c.record.module in paths]


def activation_findings(whatif: WhatIf) -> list[Finding]:
    work = whatif.workload
    if work is None or work.config is None or not whatif.can_retrace or whatif.recipe.compile:
        return []  # compiled: Inductor already fuses the activation's ops (rules_compile)
    found = config_activation(_as_built(work))
    if found is None:
        return []
    key, name = found
    fused = FUSED_SAME_MATH[name]
    what = f"the step with {key}={fused!r}"
    try:
        takes = _as_built(work.with_config(**{key: fused})).get(key) == fused
    except TilefitError as err:
        whatif.skipped(RULE, what, err)
        return []
    if not takes:  # T5 derives dense_act_fn from feed_forward_proj: the field is not set
        whatif.skipped(RULE, what, f"the {work.model_type} config derives {key} from other "
                       "fields")
        return []
    change = Change(config=((key, fused),))
    after = whatif.try_apply(RULE, what, change)
    if after is None:
        return []
    return [_finding(whatif, key, name, fused, after, change)]


def _finding(whatif: WhatIf, key: str, name: str, fused: str, after: Estimate,
             change: Change) -> Finding:
    est = whatif.estimate
    ops = _activation_ops(whatif, name)
    total = sum(c.time_s * c.repeats for c in est.ops)
    share = sum(c.time_s * c.repeats for c in ops) / total if total > 0 else 0.0
    modules = tuple(dict.fromkeys(c.record.module for c in ops))
    per_layer = sum(1 for c in ops if modules and c.record.module == modules[0]
                    and c.record.phase == "forward")
    speedup = est.step_time_s / after.step_time_s
    ok = speedup >= MIN_RECOMMENDED_SPEEDUP and after.fits
    kernels = f"{per_layer} kernels per layer in forward, " if per_layer else ""
    call = ('torch.nn.functional.gelu(approximate="tanh")' if fused == "gelu_pytorch_tanh"
            else "torch.nn.functional.gelu")
    return Finding(
        rule=RULE, severity=severity_of(speedup) if ok else "info",
        title=f"the {name} activation runs unfused ({kernels}{share:.0%} of the GPU's "
        f"time); {fused} is one kernel with the same math",
        modules=modules[:MAX_MODULES], dimension=key, current=name, suggested=fused,
        fix=f'config.{key} = "{fused}" before the model is built (or '
        f'AutoModel.from_pretrained(..., {key}="{fused}")): the same function up to '
        "rounding, so pretrained weights need no change",
        reason=f"transformers' {name} is a chain of elementwise ops, each a kernel that "
        f"reads and writes the whole activation, and its backward more; {fused} calls "
        f"{call}, one kernel each way. Step {est.step_time_s * 1e3:.2f} -> "
        f"{after.step_time_s * 1e3:.2f} ms, peak {est.peak_memory_bytes / GIB:.2f} -> "
        f"{after.peak_memory_bytes / GIB:.2f} GiB (re-traced with {key}={fused!r}); "
        "torch.compile would fuse it too.",
        **effect(est, after), method="retrace", recommended=ok, change=change)
