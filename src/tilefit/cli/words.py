"""The library's words in the command line's (issue 44, item 6): the library's errors name
Recipe fields and Python calls (``Recipe(batch_size=8)``, ``Lora(rank=16)``), which is what a
Python user writes; the CLI prints each such call as the flags that say it (``--batch 8``,
``--lora-rank 16``), from the options the commands declare (cli/recipe_options.py)."""

from __future__ import annotations

import ast
import re
from typing import Any

from tilefit.cli import model_options as mo
from tilefit.cli.estimate import OFFLOAD_OPTION
from tilefit.cli.recipe_options import RENAMED, SHARED

# a call of a recipe part, with keyword arguments only: Recipe(batch_size=8, ...)
_VALUE = r"(?:\([^()]*\)|[^,()]+(?:\([^()]*\))?)"  # a literal, a tuple, a call's
_CALL = re.compile(rf"\b(Recipe|Lora|Parallelism)\(((?:[a-z_]+={_VALUE},?\s*)+)\)")
_LORA = {"rank": mo.LORA_RANK_OPTION, "alpha": mo.LORA_ALPHA_OPTION,
         "dropout": mo.LORA_DROPOUT_OPTION, "targets": mo.LORA_TARGETS_OPTION,
         "dora": mo.DORA_OPTION, "modules_to_save": mo.MODULES_TO_SAVE_OPTION}
_PARALLEL = {"world_size": mo.GPUS_OPTION, "strategy": mo.STRATEGY_OPTION,
             "offload": OFFLOAD_OPTION}


def _options(part: str) -> dict[str, Any]:
    if part == "Lora":
        return _LORA
    if part == "Parallelism":
        return _PARALLEL
    # each option under its Recipe field's name (compile_ is mo.recipe's keyword for compile)
    fields = {**RENAMED, "compile_": "compile"}
    return {fields.get(name, name): option for name, _, option in SHARED}


def _flag(option: Any, value: Any) -> str | None:
    """``option`` set to ``value`` as the command line writes it; None where it cannot."""
    decl = option.param_decls[0]
    on, _, off = decl.partition("/")
    if value is None:  # compile=None: no torch.compile
        return f"drop {on}"
    if isinstance(value, bool):
        return on if value else (off or f"drop {on}")
    if isinstance(value, tuple | list):
        value = ",".join(map(str, value))
    return f"{on} {value}"


def _call_flags(part: str, arguments: str) -> str | None:
    """The flags of ``part(arguments)``; None where one argument has no flag."""
    try:
        call = ast.parse(f"f({arguments})", mode="eval").body
        assert isinstance(call, ast.Call)
        values = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    except (SyntaxError, ValueError, AssertionError):
        return None
    options = _options(part)
    flags = [_flag(options[k], v) if k in options else None for k, v in values.items()]
    return " ".join(f for f in flags if f) if all(flags) else None


def cli_words(text: str) -> str:
    """``text`` with each Recipe(...), Lora(...) or Parallelism(...) call that the command
    line can say written as its flags; the rest as it is."""
    def replace(match: re.Match[str]) -> str:
        flags = _call_flags(match.group(1), match.group(2))
        return flags if flags is not None else match.group(0)
    return _CALL.sub(replace, text)
