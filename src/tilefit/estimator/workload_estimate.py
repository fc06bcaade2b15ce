"""Estimating a tilefit Workload (catalog model, config.json, or factory) under a Recipe."""

from __future__ import annotations

from tilefit.estimator import Estimate, estimate_recipe
from tilefit.hardware import Device, get_device
from tilefit.models import Workload
from tilefit.recipe import Recipe

__all__ = ["estimate_workload"]


def estimate_workload(workload: Workload, recipe: Recipe, device: str | Device) -> Estimate:
    """The estimate of one training step of ``workload`` under ``recipe`` (its compile,
    parallelism and adapters included: tilefit.estimator.estimate_recipe)."""
    return estimate_recipe(workload, None, recipe, get_device(device))
