"""The command-line options that name a model and describe its training recipe, declared once
and shared by the commands that take them (`tilefit estimate`, `tilefit audit`; issue 44,
item 1).

``takes_recipe_options`` gives a command every option of ``SHARED`` after its own first
parameters: typer reads the command's signature, so the options are appended to it, and the
command receives their values as one ``RecipeFlags``. An option whose name is a Recipe field
is handed to the Recipe as it is (``Recipe.for_model`` with the flags given on top, the same
call Python users make), so a new Recipe field needs its field, one entry here, and the code
that traces or costs it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tilefit.cli import model_options as mo

if TYPE_CHECKING:
    from tilefit.models import Workload
    from tilefit.recipe import Recipe

# (parameter name, annotation, typer declaration), in the order --help lists them
SHARED: tuple[tuple[str, Any, Any], ...] = (
    ("model", str, mo.MODEL_ARG),
    ("gpu", str, mo.GPU_OPTION),
    ("batch", int, mo.BATCH_OPTION),
    ("seq", int | None, mo.SEQ_OPTION),
    ("precision", str | None, mo.PRECISION_OPTION),
    ("optimizer", str | None, mo.OPTIMIZER_OPTION),
    ("grad_checkpointing", bool, mo.CHECKPOINTING_OPTION),
    ("accumulation", int, mo.ACCUMULATION_OPTION),
    ("attention", str, mo.ATTENTION_OPTION),
    ("input_shape", str | None, mo.INPUT_SHAPE_OPTION),
    ("task", str | None, mo.TASK_OPTION),
    ("target_seq", int | None, mo.TARGET_SEQ_OPTION),
    ("image_size", int | None, mo.IMAGE_SIZE_OPTION),
    ("revision", str | None, mo.REVISION_OPTION),
    ("max_grad_norm", str | None, mo.MAX_GRAD_NORM_OPTION),
    ("loss_sync", bool | None, mo.LOSS_SYNC_OPTION),
    ("fused_ce", bool, mo.FUSED_CE_OPTION),
    ("lora", bool, mo.LORA_OPTION),
    ("quantize", str | None, mo.QUANTIZE_OPTION),
    ("double_quant", bool | None, mo.DOUBLE_QUANT_OPTION),
    ("quant_compute_dtype", str | None, mo.QUANT_COMPUTE_DTYPE_OPTION),
    ("prepare_kbit", bool | None, mo.PREPARE_KBIT_OPTION),
    ("lora_rank", int | None, mo.LORA_RANK_OPTION),
    ("lora_alpha", float | None, mo.LORA_ALPHA_OPTION),
    ("lora_targets", str | None, mo.LORA_TARGETS_OPTION),
    ("lora_dropout", float | None, mo.LORA_DROPOUT_OPTION),
    ("dora", bool, mo.DORA_OPTION),
    ("modules_to_save", str | None, mo.MODULES_TO_SAVE_OPTION),
    ("routing", str | None, mo.ROUTING_OPTION),
    ("compile_", bool, mo.COMPILE_OPTION),
    ("compile_mode", str, mo.COMPILE_MODE_OPTION),
    ("alloc_conf", str | None, mo.ALLOC_CONF_OPTION),
)
# the options that name the model and its input (mo.load's), and LoRA's (mo.lora_of's)
WORKLOAD = ("model", "seq", "input_shape", "task", "target_seq", "image_size", "revision")
LORA = ("lora", "lora_rank", "lora_alpha", "lora_targets", "lora_dropout", "dora",
         "modules_to_save")
# options whose Recipe field (or mo.recipe keyword) has another name
RENAMED = {"batch": "batch_size", "accumulation": "accumulation_steps"}


@dataclass(frozen=True)
class RecipeFlags:
    """The values of the shared options, as the user gave them (None: not given)."""

    values: Mapping[str, Any]

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def workload(self) -> Workload:
        return mo.load(*(self.values[name] for name in WORKLOAD))  # type: ignore[no-any-return]

    def recipe(self, work: Workload, **extra: Any) -> Recipe:
        """The Recipe of these flags for ``work`` (``extra``: a command's own, such as
        --gpus and --strategy: mo.recipe's keywords)."""
        given = {RENAMED.get(name, name): value for name, value in self.values.items()
                 if name not in (*WORKLOAD, *LORA, "gpu")}
        lora = mo.lora_of(*(self.values[name] for name in LORA))
        return mo.recipe(work, lora=lora, **given, **extra)


def takes_recipe_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``command(flags: RecipeFlags, *own)`` as a typer command taking SHARED's options
    before its own."""
    own = [p for p in inspect.signature(command, eval_str=True).parameters.values()
           if p.name != "flags"]
    shared = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                annotation=annotation) for name, annotation, option in SHARED]
    names = {name for name, _, _ in SHARED}

    @functools.wraps(command)
    def run(**kwargs: Any) -> Any:
        flags = RecipeFlags({k: v for k, v in kwargs.items() if k in names})
        return command(flags, **{k: v for k, v in kwargs.items() if k not in names})

    params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in (*shared, *own)]
    run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in params}
    del run.__wrapped__  # typer reads the signature above, not the command's
    return run
