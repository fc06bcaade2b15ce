"""tilefit: predict and fix what makes single-GPU training slow or run out of memory.

The GEMM analysis and the device catalog import no torch; the functions that trace or run a
model (estimate, trace, audit, plan, tune) import it on first use.

One description of a training step, ``tilefit.Recipe``, is what trace, estimate, audit and
plan take (``recipe=``), with the GPU to predict for (``gpu=``)::

    import tilefit
    recipe = tilefit.Recipe.for_model("gpt2", batch_size=8, grad_checkpointing=True)
    tilefit.estimate("gpt2", recipe=recipe, gpu="h100").step_time_s
"""

from __future__ import annotations

from typing import Any

from tilefit.html_repr import install as _install_html

__version__ = "0.1.0"

# name -> (module, attribute); resolved lazily so `import tilefit` stays torch-free.
_LAZY = {
    "Device": ("tilefit.hardware", "Device"),
    "get_device": ("tilefit.hardware", "get_device"),
    "list_devices": ("tilefit.hardware", "list_devices"),
    "analyze_gemm": ("tilefit.gemm", "analyze_gemm"),
    "analyze_linear": ("tilefit.linear", "analyze_linear"),
    "TilefitError": ("tilefit.errors", "TilefitError"),
    "Recipe": ("tilefit.recipe", "Recipe"),
    "Compile": ("tilefit.recipe", "Compile"),
    "Parallelism": ("tilefit.recipe", "Parallelism"),
    "Lora": ("tilefit.recipe", "Lora"),
    "ZeroConfig": ("tilefit.recipe", "ZeroConfig"),
    "PlanSearch": ("tilefit.planner", "PlanSearch"),
    "trace": ("tilefit.tracing", "trace"),
    "Trace": ("tilefit.tracing", "Trace"),
    "estimate": ("tilefit.estimator", "estimate"),
    "estimate_trace": ("tilefit.estimator", "estimate_trace"),
    "Estimate": ("tilefit.estimator", "Estimate"),
    "load_workload": ("tilefit.models", "load_workload"),
    "Workload": ("tilefit.models", "Workload"),
    "audit": ("tilefit.advise", "audit"),
    "Audit": ("tilefit.advise", "Audit"),
    "plan": ("tilefit.planner", "plan"),
    "Plan": ("tilefit.planner", "Plan"),
    "tune": ("tilefit.tuning", "tune"),
    "TuneResult": ("tilefit.tuning", "TuneResult"),
    "TuneSearch": ("tilefit.tuning", "TuneSearch"),
    "noise_scale": ("tilefit.tuning", "noise_scale"),
    "NoiseScale": ("tilefit.tuning", "NoiseScale"),
    "NoiseMeasure": ("tilefit.tuning", "NoiseMeasure"),
    "simulate": ("tilefit.simulation", "simulate"),
    "Simulation": ("tilefit.simulation", "Simulation"),
}

__all__ = ["__version__", *_LAZY]


def _render_html(result: object) -> str:
    """A result's notebook view (``_repr_html_``), rendered by report/ on first use."""
    from tilefit.report.notebook import render

    return render(result)


_install_html(_render_html)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'tilefit' has no attribute {name!r}")
