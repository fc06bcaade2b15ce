"""``tilefit.plan``: the public entry point of the planner, in the recipe's terms.

The user's ``Recipe`` says what every plan keeps (the optimizer, the loop's clipping and loss
read, the fused loss, torch.compile and its mode, the GPUs and engine); ``PlanSearch`` says
what the search may do beyond it. The search itself is tilefit.planner.run.search_plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tilefit.errors import TilefitError
from tilefit.old_keywords import refuses_old_keywords
from tilefit.recipe import DEFAULT_GPU, Lora, Recipe, is_named_model

if TYPE_CHECKING:
    from tilefit.hardware import Device
    from tilefit.planner.run import Plan

# The share of the GPU's memory a plan may use. All of it by default: a row fits when the
# caching allocator's predicted reserved peak (its replay: the tensors and the fragmentation
# of this step, tilefit.estimator.reserved) is under the device's memory less the CUDA
# context and cuBLAS workspace; a smaller share keeps headroom for what the traced step does
# not show (longer sequences later in training, other processes on the GPU).
DEFAULT_MEMORY_FRACTION = 1.0


@dataclass(frozen=True)
class PlanSearch:
    """What the planner may search beyond the user's recipe, and how."""

    memory_fraction: float = DEFAULT_MEMORY_FRACTION  # share of GPU memory a plan may use
    objective: str = "throughput"  # or "memory" (tilefit.planner.rank)
    allow_optimizer_change: bool = False  # also rank other optimizers (another algorithm)
    allow_lora: bool = False  # also rank LoRA fine-tuning (peft adapters, frozen base)
    confirm: bool = True  # trace the chosen plan in full
    layer_lever: bool | None = None  # trace deep models at two layer counts (None: auto)
    pcie_bytes_per_s: float | None = None  # the host link for CPU offload (None: PCIe 4 x16)
    host_bandwidth_bytes_per_s: float | None = None  # CPU memory bandwidth for offload
    # also rank QLoRA: LoRA adapters on an nf4 base (bitsandbytes' 4-bit layers, Recipe.quantize)
    allow_quantize: bool = False
    lora: Lora | None = None  # the LoRA rows' adapters (None: Lora()); implies allow_lora
    # the training machine's RAM per node, which each plan's CPU memory must fit
    # (tilefit.planner.host); None: the GPU spec file's [host] memory_bytes, else this machine's
    host_memory_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.lora is not None:
            object.__setattr__(self, "allow_lora", True)
        host = self.host_memory_bytes
        if host is not None and (isinstance(host, bool) or not isinstance(host, int)
                                 or host <= 0):
            raise TilefitError("the host memory must be a positive number of bytes",
                               expected="an int of bytes, e.g. 64 * 2**30",
                               given=f"PlanSearch(host_memory_bytes={host!r})",
                               fix="pass PlanSearch(host_memory_bytes=64 * 2**30) for a 64 GiB "
                               "machine, or None for this machine's RAM")


# what the planner chooses itself: a recipe's own values of these are not kept
SEARCHED: tuple[str, ...] = ("batch_size", "accumulation_steps", "precision",
                             "grad_checkpointing", "attention")


@refuses_old_keywords
def plan(model: Any, batch: Any = None, *, global_batch: int,
         gpu: str | Device = DEFAULT_GPU, recipe: Recipe | None = None,
         search: PlanSearch | None = None, seq_len: int | None = None) -> Plan:
    """Search training recipes for ``model`` on ``gpu`` at a fixed ``global_batch``.

    ``model``: a catalog name, a config.json path, ``package.module:function`` or a
    Workload, or a Hugging Face module (or factory) with an example ``batch`` (planned as
    its config). ``recipe`` (default ``Recipe.for_model(model)``): what every plan keeps —
    the optimizer, clipping, the loop's loss read, the fused loss, ``compile`` (its mode
    included) and ``parallel`` (``world_size`` > 1: plans for that many GPUs, each
    engine or the one named); the micro-batch, accumulation, precision, checkpointing and
    attention are the planner's to choose. ``search``: what else it may search
    (PlanSearch). 0.1.0's keywords are refused with their new spelling
    (tilefit.old_keywords)."""
    from tilefit.models.module import module_workload
    from tilefit.planner.run import search_plan
    from tilefit.tracing.workload_traces import shared_traces

    recipe = recipe or Recipe.for_model(model)
    if not is_named_model(model):
        found = module_workload(model, batch)
        if found is None:
            raise TilefitError(
                "plan rebuilds the model at every batch size it tries, which it can do for "
                "a named model or a Hugging Face module", expected="a catalog name, a "
                "config.json, package.module:function, or a transformers model with an "
                "example batch (a dict with input_ids or pixel_values)",
                given=type(model).__name__, fix="pass the model's config.json, or a "
                "package.module:function factory with load_workload(..., input_shape=...)")
        model = found[0]
    if recipe.lora is not None:
        raise TilefitError("plan ranks LoRA among other recipes; it does not keep one",
                           expected="search=PlanSearch(allow_lora=True)",
                           given="recipe=Recipe(lora=...)", fix="pass plan(..., search="
                           "PlanSearch(allow_lora=True, lora=Lora(rank=...)))")
    with shared_traces():  # the one-GPU and multi-GPU sweeps and the confirmation share
        return search_plan(model, gpu=gpu, global_batch=global_batch, seq_len=seq_len,
                           recipe=recipe, search=search or PlanSearch())


def searched_fields_note(recipe: Recipe) -> str | None:
    """A note when the user's recipe set what the planner chooses itself."""
    default = Recipe()
    set_ = [name for name in SEARCHED if getattr(recipe, name) != getattr(default, name)]
    if not set_:
        return None
    return (f"the recipe's {', '.join(set_)} are the planner's to choose: each plan has its "
            "own (estimate or audit a recipe to keep them)")
