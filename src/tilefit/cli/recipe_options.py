"""The command-line options that name a model and describe its training recipe, declared once
and shared by every command that takes a recipe (`estimate`, `audit`, `plan`, `tune`,
`noise-scale`, `bench step`; issue 44, item 1).

``takes_recipe_options`` gives a command every option of ``SHARED`` before its own: typer
reads the command's signature, so the options are put in it, and the command receives their
values as one ``RecipeFlags``. An option whose name is a Recipe field is handed to the Recipe
as it is (``Recipe.for_model`` with the flags given on top, the same call Python users make),
so a new Recipe field needs its field, one entry here (and in ``FIELD_OPTIONS``), and the
code that traces or costs it. A command that cannot honour an option names it in
``excluded`` with the reason: given, it is refused with that reason (the option is left out
of the help); where the command declares an option of the same name itself (plan's --gpus
and --strategy bound its search, tune's --gpu is the live device), its own stands instead.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tilefit.cli import model_options as mo

if TYPE_CHECKING:
    from tilefit.models import Workload
    from tilefit.recipe import Lora, Recipe

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
    ("graph_breaks", bool, mo.GRAPH_BREAKS_OPTION),
    ("alloc_conf", str | None, mo.ALLOC_CONF_OPTION),
    ("gpus", int, mo.GPUS_OPTION),
    ("strategy", str | None, mo.STRATEGY_OPTION),
    ("offload", bool, mo.OFFLOAD_OPTION),
)
# each Recipe field and the options that set it (tests/test_cli_recipe_options.py walks
# dataclasses.fields(Recipe) against this table and SHARED)
FIELD_OPTIONS: dict[str, tuple[str, ...]] = {
    "batch_size": ("batch",), "precision": ("precision",), "optimizer": ("optimizer",),
    "grad_checkpointing": ("grad_checkpointing",), "accumulation_steps": ("accumulation",),
    "attention": ("attention",), "max_grad_norm": ("max_grad_norm",),
    "loss_sync": ("loss_sync",), "fused_ce": ("fused_ce",),
    "compile": ("compile_", "compile_mode", "graph_breaks"),
    "parallel": ("gpus", "strategy", "offload"),
    "lora": ("lora", "lora_rank", "lora_alpha", "lora_targets", "lora_dropout", "dora",
             "modules_to_save"),
    "quantize": ("quantize",), "double_quant": ("double_quant",),
    "quant_compute_dtype": ("quant_compute_dtype",), "prepare_kbit": ("prepare_kbit",),
    "alloc_conf": ("alloc_conf",), "routing": ("routing",)}
# the Recipe fields no option sets, and why
NOT_OPTIONS: dict[str, str] = {
    "zero_grad_to_none": "how the user's loop clears gradients; the CLI runs the usual "
    "zero_grad() (set_to_none=True), Python callers set it",
    "use_cache": "the model config's KV cache switch, set by Recipe.for_model from the "
    "model's framework",
    "notes": "what the Recipe says about how it read its fields, not an input"}
# the options that name the model and its input (mo.load's), and LoRA's (mo.lora_of's)
WORKLOAD = ("model", "seq", "input_shape", "task", "target_seq", "image_size", "revision")
LORA = FIELD_OPTIONS["lora"]
# options whose Recipe field (or mo.recipe keyword) has another name
RENAMED = {"batch": "batch_size", "accumulation": "accumulation_steps"}


@dataclass(frozen=True)
class RecipeFlags:
    """The values of the shared options a command takes, as the user gave them (None: not
    given)."""

    values: Mapping[str, Any]

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def workload(self) -> Workload:
        return mo.load(*(self.values.get(name) for name in WORKLOAD))  # type: ignore[no-any-return]

    def lora(self) -> Lora | None:
        """The Lora of --lora and its settings (None: none asked for)."""
        return mo.lora_of(*(self.values.get(name, False) if name in ("lora", "dora")
                            else self.values.get(name) for name in LORA))

    def recipe(self, work: Workload, **extra: Any) -> Recipe:
        """The Recipe of these flags for ``work`` (``extra``: what a command sets itself, as
        mo.recipe's keywords)."""
        given = {RENAMED.get(name, name): value for name, value in self.values.items()
                 if name not in (*WORKLOAD, *LORA, "gpu")}
        return mo.recipe(work, **{**given, "lora": self.lora(), **extra})


def takes_recipe_options(command_name: str, *, excluded: Mapping[str, str] | None = None,
                         defaults: Mapping[str, Any] | None = None
                         ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``command(flags: RecipeFlags, *own)`` as the typer command ``tilefit command_name``
    taking SHARED's options before its own; ``excluded``: option -> why the command does not
    take it (refused when given, or the command's own option of that name in its place);
    ``defaults``: option -> the command's default for it."""
    excluded, defaults = excluded or {}, defaults or {}
    unknown = sorted({*excluded, *defaults} - {name for name, _, _ in SHARED})
    if unknown:  # a typo would leave a shared option taken that was meant to be refused
        raise TypeError(f"tilefit {command_name}: {unknown} are not shared recipe options")

    def wrap(command: Callable[..., Any]) -> Callable[..., Any]:
        own = {p.name: p for p in inspect.signature(command, eval_str=True).parameters.values()
               if p.name != "flags"}
        params = [_parameter(name, annotation, option, own, excluded, defaults)
                  for name, annotation, option in SHARED]
        params += [p for p in own.values() if p.name not in excluded]
        refused = {name for name in excluded if name not in own}
        taken = {name for name, _, _ in SHARED} - set(excluded)

        @functools.wraps(command)
        def run(**kwargs: Any) -> Any:
            _refuse(command_name, {k: kwargs.pop(k) for k in refused}, excluded)
            flags = RecipeFlags({k: kwargs.pop(k) for k in taken})
            return command(flags, **kwargs)

        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params]
        run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in params}
        del run.__wrapped__  # typer reads the signature above, not the command's
        return run

    return wrap


def _parameter(name: str, annotation: Any, option: Any, own: Mapping[str, inspect.Parameter],
               excluded: Mapping[str, str], defaults: Mapping[str, Any]) -> inspect.Parameter:
    """The command's parameter for shared option ``name``: the shared declaration (with the
    command's default), its own of that name, or a hidden one that is None unless given."""
    if name in excluded and name in own:
        return own[name]
    if name in excluded or name in defaults:
        option = copy.copy(option)
        option.default = defaults.get(name)
        option.hidden = name in excluded
        annotation = annotation if name in defaults else annotation | None
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option,
                             annotation=annotation)


def _refuse(command_name: str, given: Mapping[str, Any], excluded: Mapping[str, str]) -> None:
    """A clear error for the first option the command does not take that was given."""
    from tilefit.cli.common import user_errors
    from tilefit.errors import TilefitError

    for name, value in given.items():
        if value is None or value is False:
            continue
        flag = dict(SHARED_FLAGS)[name]
        with user_errors():
            raise TilefitError(f"tilefit {command_name} does not take {flag}: "
                               f"{excluded[name]}", expected=f"the options tilefit {command_name} "
                               "takes", given=flag if value is True else f"{flag} {value}",
                               fix=f"drop {flag}")


# each shared option's flag as the command line writes it (--grad-checkpointing)
SHARED_FLAGS: tuple[tuple[str, str], ...] = tuple(
    (name, option.param_decls[0].split("/")[0] if option.param_decls else name)
    for name, _, option in SHARED)
