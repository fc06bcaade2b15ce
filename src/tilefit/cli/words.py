"""The library's words in the command line's (issue 44, item 6): the library's errors name
Recipe fields and Python calls (``Recipe(batch_size=8)``, ``Lora(rank=16)``,
``load_workload(..., seq_len=1024)``, ``estimate(..., gpu='h100')``), which is what a Python
user writes; the CLI prints each such call as the flags that say it (``--batch 8``,
``--lora-rank 16``, ``--seq 1024``, ``--gpu h100``).

``KEYWORDS`` is the one table: each Python name the library's errors call, and for each of
its keywords the parameter of the command that takes it. The flags themselves are read off
that command's declared options, so a call is printed as flags only where the command that
raised the error has every one of them; elsewhere it stays in Python.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from typing import Any

from tilefit.cli.recipe_options import LORA, RENAMED, SHARED, WORKLOAD

# Recipe's fields under their option's parameter (compile_ is the parameter of compile;
# lora=True is --lora, Lora's own fields are Lora's)
_LORA_FIELDS = {name.removeprefix("lora_"): name for name in LORA if name != "lora"}
_RECIPE = {RENAMED.get(name, name): name for name, _, _ in SHARED
           if name not in (*WORKLOAD, *_LORA_FIELDS.values(), "gpu")} | {"compile": "compile_"}
# load_workload's keywords whose option is named otherwise
_WORKLOAD_RENAMED = {"seq": "seq_len", "target_seq": "target_seq_len"}
_GPU = {"gpu": "gpu"}

# Python's name -> {its keyword -> the command's parameter}
KEYWORDS: Mapping[str, Mapping[str, str]] = {
    "Recipe": _RECIPE,
    "Lora": _LORA_FIELDS,
    "Parallelism": {"world_size": "gpus", "strategy": "strategy", "offload": "offload"},
    "Compile": {"mode": "compile_mode", "graph_breaks": "graph_breaks"},
    "load_workload": {_WORKLOAD_RENAMED.get(name, name): name for name in WORKLOAD
                      if name != "model"},
    "estimate": _GPU, "trace": _GPU, "audit": _GPU,
    "tune": {"optimizer": "optimizer", "precision": "precision"},
    "analyze_gemm": {"dtype": "dtype"},
    "analyze_linear": {"dtype": "dtype", "batches": "batch"},
    "on_nodes": {"gpus": "gpus", "nodes": "nodes", "network": "network"},
    "get_network": {"spec": "network"},
    "plan": {**_GPU, "global_batch": "global_batch", "seq_len": "seq"},
    "simulate": {**_GPU, "gpus": "gpus"},
    "PlanSearch": {"memory_fraction": "memory_fraction", "objective": "objective",
                   "allow_optimizer_change": "allow_optimizer_change",
                   "allow_lora": "allow_peft", "allow_quantize": "allow_quantize",
                   "host_memory_bytes": "host_memory"},
    "TuneSearch": {"max_batch": "max_batch", "margin": "margin", "objective": "objective",
                   "noise_scale": "noise_scale", "global_batch": "global_batch",
                   "memory_limit_bytes": "memory_limit"},
}
# a part whose call, nested in a Recipe, is itself a flag: Recipe(lora=Lora(rank=8))
_IMPLIED = {"Lora": "lora", "Compile": "compile_"}
# options whose None the command line spells as a value, not by leaving the option out
_NONE = {"max_grad_norm": "none"}
_CALL = re.compile(r"\b(?:tilefit\.)?(" + "|".join(KEYWORDS) + r")\(")


def commands() -> list[Any]:
    """Every command of the app, subcommands included (typer's click commands)."""
    import typer.main

    from tilefit.cli.app import app

    found: list[Any] = []
    stack: list[Any] = list(getattr(typer.main.get_command(app), "commands", {}).values())
    while stack:
        command = stack.pop(0)
        stack.extend(getattr(command, "commands", {}).values())
        found.append(command)
    return found


def options_of(command: Any) -> dict[str, Any]:
    """``command``'s options by parameter name, less the hidden ones it refuses (a shared
    recipe option it cannot honour: recipe_options' excluded)."""
    return {p.name: p for p in command.params
            if p.param_type_name == "option" and p.name and not getattr(p, "hidden", False)}


def all_options() -> dict[str, Any]:
    """Every command's options by parameter name (the first command's where two share one)."""
    found: dict[str, Any] = {}
    for command in commands():
        for name, option in options_of(command).items():
            found.setdefault(name, option)
    return found


def current_command() -> Any:
    """The command running now (typer's click context); None outside one."""
    try:
        from typer._click.globals import get_current_context
    except ImportError:  # another typer: every command's flags are looked at
        return None
    context = get_current_context(silent=True)
    return None if context is None else context.command


def _flag(option: Any, value: Any) -> str:
    """``option`` set to ``value`` as the command line writes it."""
    on = option.opts[0]
    if value is Ellipsis:  # Lora(targets=...): the option, its value left to say
        return on if getattr(option, "is_flag", False) else \
            f"{on} {option.name.split('_')[-1].upper()}"
    if value is None:  # compile=None: no torch.compile
        return f"{on} {_NONE[option.name]}" if option.name in _NONE else f"drop {on}"
    if isinstance(value, bool):
        off = option.secondary_opts[0] if option.secondary_opts else f"drop {on}"
        return on if value else off
    if isinstance(value, tuple | list):
        value = ",".join(map(str, value))
    return f"{on} {value}"


def _flags(call: ast.Call, options: Mapping[str, Any], *, nested: bool = False
           ) -> list[str] | None:
    """The flags that say ``call`` (``nested``: a keyword's value, as Recipe's lora=Lora());
    None where one of its arguments has none."""
    name = call.func.id if isinstance(call.func, ast.Name) else None
    keywords = KEYWORDS.get(name or "")
    if keywords is None or any(
            not (isinstance(a, ast.Constant) and a.value is Ellipsis) for a in call.args):
        return None
    flags: list[str] = []
    for keyword in call.keywords:
        parameter = keywords.get(keyword.arg or "")
        if isinstance(keyword.value, ast.Call):  # Recipe(lora=Lora(...)), Compile(...)
            inner = _flags(keyword.value, options, nested=True)
            if inner is None:
                return None
            flags.extend(inner)
            continue
        if parameter is None or parameter not in options:
            return None
        try:
            value = _value(keyword.value)
        except ValueError:
            return None
        if (keyword.arg or "").endswith("_bytes") and isinstance(value, int):
            value = f"{value / 2**30:g}GiB"  # the command line reads a size with its unit
        flags.append(_flag(options[parameter], value))
    implied = _IMPLIED.get(name or "")
    if nested and implied is not None and implied in options:
        flags.insert(0, options[implied].opts[0])
    return flags


def _value(node: ast.expr) -> Any:
    """A literal, or a product or power of numbers (16 * 2**30); ValueError otherwise."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult | ast.Pow):
        left, right = _value(node.left), _value(node.right)
        if isinstance(left, int) and isinstance(right, int) and not isinstance(left, bool):
            return left * right if isinstance(node.op, ast.Mult) else left**right
        raise ValueError("not a number")
    return ast.literal_eval(node)


def _closing(text: str, start: int) -> int:
    """The index after the parenthesis that closes the one before ``start``; -1: none."""
    depth, quote = 1, ""
    for i in range(start, len(text)):
        c = text[i]
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
            if depth == 0:
                return i + 1
    return -1


def cli_words(text: str, command: Any = None) -> str:
    """``text`` with each call of KEYWORDS that ``command`` (a click command; default: any
    command) can say written as its flags; the rest as it is."""
    options = all_options() if command is None else options_of(command)
    out: list[str] = []
    at = 0
    for match in _CALL.finditer(text):
        if match.start() < at:
            continue
        end = _closing(text, match.end())
        if end < 0:
            continue
        try:
            call = ast.parse(match.group(1) + text[match.end() - 1:end], mode="eval").body
        except SyntaxError:
            continue
        flags = _flags(call, options) if isinstance(call, ast.Call) else None
        if flags:
            out.extend((text[at:match.start()], " ".join(flags)))
            at = end
    return "".join(out) + text[at:]
