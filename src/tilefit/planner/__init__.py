"""tilefit plan: search training recipes with the estimator, before the first run.

Modules: space (micro-batches and recipes), sample (what a trace yields), affine (the sweep
model), search (tracing a recipe into rows), offload (ZeRO-Offload model), multigpu (sharded
fallback), rank (the choice), configs (what to paste), plan (the entry point).
"""

from tilefit.planner.plan import Confirmation, Plan  # noqa: I001 (plan, the function, last)
from tilefit.planner.rows import PlanRow
from tilefit.planner.api import PlanSearch, plan

__all__ = ["Confirmation", "Plan", "PlanRow", "PlanSearch", "plan"]
