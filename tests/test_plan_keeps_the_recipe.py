"""`plan` keeps everything the user said (issue 44, item 2): every Recipe field the search
does not vary is carried into every row it traces, and a mixture of experts is planned
with the user's routing."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from tilefit.planner.state import SEARCHED_FIELDS, PlanState
from tilefit.recipe import Compile, Recipe

# a value other than the default for each field the search does not vary; a new Recipe
# field must be added here or to SEARCHED_FIELDS (the test below fails until it is)
NOT_DEFAULT = {"max_grad_norm": 0.5, "loss_sync": True, "zero_grad_to_none": False,
               "fused_ce": True, "compile": Compile(mode="reduce-overhead"),
               "alloc_conf": "expandable_segments:True", "routing": "skewed:0.5",
               "use_cache": False, "double_quant": False, "quant_compute_dtype": "fp16",
               "prepare_kbit": False}


def test_every_field_not_searched_is_carried() -> None:
    fields = {f.name for f in dataclasses.fields(Recipe)}
    assert fields - SEARCHED_FIELDS == set(NOT_DEFAULT), \
        "a Recipe field is neither searched by the planner nor carried from the user's recipe"
    spec = Recipe(precision="bf16-mixed", optimizer="adamw-fused", grad_checkpointing=True)
    for name, value in NOT_DEFAULT.items():  # one at a time (fused_ce and compile exclude)
        state = SimpleNamespace(user=Recipe(**{name: value}), sdpa_refused=False)
        traced = PlanState.with_user(state, spec)  # type: ignore[arg-type]
        assert getattr(traced, name) == value, name
        for searched in ("precision", "optimizer", "grad_checkpointing"):  # the search's own
            assert getattr(traced, searched) == getattr(spec, searched)
