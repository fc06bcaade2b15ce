"""The keyword arguments of tilefit 0.1.0's public functions, each refused with its new
spelling.

``tilefit.estimate(model, batch, optimizer="sgd", device="h100")`` is now
``tilefit.estimate(model, batch, recipe=Recipe(optimizer="sgd"), gpu="h100")``. A call in
the old keywords raises a one-line TypeError before anything is traced. It is not translated:
those calls defaulted to fp32 on the CPU, and the new ones to the GPU's own precision on
DEFAULT_GPU, so a translation would have moved their numbers without a word.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

# old keyword -> its new spelling ({} the value given)
RECIPE: dict[str, str] = {
    **{k: f"recipe=Recipe({k}={{}})" for k in (
        "batch_size", "precision", "optimizer", "grad_checkpointing", "accumulation_steps",
        "attention", "max_grad_norm", "loss_sync", "fused_ce", "compile")},
    "compile_mode": "recipe=Recipe(compile=Compile(mode={}))",
    "graph_breaks": "recipe=Recipe(compile=Compile(graph_breaks={}))",
    **{k: f"recipe=Recipe(parallel=Parallelism({k}={{}}))" for k in (
        "world_size", "strategy", "offload")},
    "zero_config": "recipe=Recipe(parallel=Parallelism(zero={}))",
    "peft": "recipe=Recipe(lora=Lora())",
    "device": "gpu={}"}
MODEL: dict[str, str] = {k: f"tilefit.load_workload(model, {k}={{}}) as the model"
                         for k in ("input_shape", "task")}
PLAN_SEARCH: dict[str, str] = {
    **{k: f"search=PlanSearch({k}={{}})" for k in (
        "memory_fraction", "objective", "allow_optimizer_change", "confirm", "layer_lever",
        "pcie_bytes_per_s", "host_bandwidth_bytes_per_s")},
    "allow_peft": "search=PlanSearch(allow_lora={})"}
TUNE_SEARCH: dict[str, str] = {k: f"search=TuneSearch({k}={{}})" for k in (
    "global_batch", "max_batch", "memory_limit_bytes", "margin", "steps_per_trial",
    "predicted_max_batch", "predict", "measure_throughput", "keep_modes", "objective",
    "noise_scale", "on_trial", "on_outlook", "routing")}
NOISE_MEASURE: dict[str, str] = {k: f"measure=NoiseMeasure({k}={{}})" for k in (
    "batch_sizes", "measurements", "confidence", "checkpoint", "keep_modes")}
# function -> its old keywords and their new spellings
OLD_KEYWORDS: dict[str, dict[str, str]] = {
    "trace": RECIPE, "estimate": RECIPE, "audit": {**RECIPE, **MODEL},
    "plan": {**RECIPE, **MODEL, **PLAN_SEARCH}, "tune": TUNE_SEARCH,
    "noise_scale": NOISE_MEASURE}

P = ParamSpec("P")
R = TypeVar("R")


def refuses_old_keywords(function: Callable[P, R]) -> Callable[P, R]:
    """``function`` (one of OLD_KEYWORDS), raising a TypeError that names the new spelling
    of each old keyword it is called with, before it runs."""
    old = OLD_KEYWORDS[function.__name__]

    @functools.wraps(function)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        given = {k: v for k, v in kwargs.items() if k in old}
        if given:
            raise TypeError(old_keywords_message(function.__name__, given))
        return function(*args, **kwargs)

    return checked


def old_keywords_message(function: str, given: dict[str, Any]) -> str:
    """One line: the old keywords ``given`` to ``function`` and what to write instead."""
    old = OLD_KEYWORDS[function]
    names = ", ".join(f"{k}=" for k in given)
    write = "; ".join(old[k].format(_shown(v)) for k, v in given.items())
    return f"tilefit.{function}() no longer takes {names}: write {write}"


def _shown(value: Any) -> str:
    simple = isinstance(value, str | int | float | bool | tuple) or value is None
    text = repr(value) if simple else "..."
    return text if len(text) <= 40 else "..."
