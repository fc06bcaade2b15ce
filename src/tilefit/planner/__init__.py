"""tilefit plan: search training recipes with the estimator, before the first run.

Modules: space (micro-batches and recipes), sample (what a trace yields), affine (the sweep
model), search (tracing a recipe into rows; the ZeRO-Offload model is
tilefit.estimator.offload), multigpu (sharded fallback), rank (the choice, pure), state (the
search's state), policy (what is traced, in what order, and the choice confirmed), notes (the
prose), checks (the input), result (Plan and what it holds), configs (what to paste), plan
(the entry point).
"""

from tilefit.planner.result import Confirmation, Plan  # noqa: I001 (plan, the function, last)
from tilefit.planner.rows import PlanRow
from tilefit.planner.api import PlanSearch, plan

__all__ = ["Confirmation", "Plan", "PlanRow", "PlanSearch", "plan"]
