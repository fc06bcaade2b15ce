"""The planner stops tracing a recipe whose model state alone is over the budget, and skips
the recipes that keep the same state (planner.search.sweep, planner.state.PlanState.add)."""

from __future__ import annotations

import dataclasses
import os

import pytest

from tilefit.hardware import get_device
from tilefit.planner.run import budget_of
from tilefit.planner.search import Depth, row_from, state_over, sweep
from tilefit.recipe import Recipe


@pytest.fixture(scope="module", autouse=True)
def one_trace_per_step():  # type: ignore[no-untyped-def]
    from tilefit.tracing.workloads import shared_traces

    with shared_traces():
        yield


@pytest.fixture(scope="module")
def tiny_gpt2():  # type: ignore[no-untyped-def]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tilefit.models import load_workload

    return load_workload("gpt2", seq_len=32).with_config(num_hidden_layers=1)


def _state_by_hand(workload) -> int:  # type: ignore[no-untyped-def]
    """fp32 weights, fp32 gradients and AdamW's two fp32 moments, each tensor rounded up to
    the caching allocator's 512 bytes, plus the fused AdamW's one-element fp32 step tensor
    per parameter (one 512-byte block each)."""
    import torch

    with torch.device("meta"):
        params = list(workload.build(attention="auto").parameters())
    return sum(4 * (-(-p.numel() * 4 // 512) * 512) + 512 for p in params)


def test_the_state_bound_is_the_models_state_by_hand(tiny_gpt2) -> None:  # type: ignore[no-untyped-def]
    spec = Recipe(precision="bf16-mixed", optimizer="adamw-fused", attention="sdpa")
    model = sweep(tiny_gpt2, spec, [1, 8], Depth(None, 1, (1,)), get_device("a100-80gb"))
    hand = _state_by_hand(tiny_gpt2)
    assert state_over(model, Depth(None, 1, (1,)), hand - 1) == hand
    assert state_over(model, Depth(None, 1, (1,)), hand) is None  # not over: equal


def test_a_plan_stops_where_the_state_is_over_and_loses_no_fitting_row(tiny_gpt2) -> None:  # type: ignore[no-untyped-def]
    from tilefit.planner import plan

    a100 = get_device("a100-80gb")
    state = _state_by_hand(tiny_gpt2)
    over = budget_of(a100, 1.0)[1]
    tiny = dataclasses.replace(a100, memory_bytes=int(0.8 * state) + over)
    budget = budget_of(tiny, 1.0)[0]
    p = plan(tiny_gpt2, gpu=tiny, global_batch=8, memory_fraction=1.0)
    assert p.best is not None and p.best.fits and p.best.offload
    # the user's AdamW in fp32 weights: one recipe traced, at its smallest micro-batch only
    kept = [r for r in p.rows if not r.offload and r.optimizer == "adamw-fused"]
    assert {r.micro_batch for r in kept} == {1} and len(kept) == 1
    note = next(n for n in p.notes if n.startswith("model state alone over"))
    assert f"fp32 weights, adamw-fused: {state / 2**30:.1f} GiB" in note
    untraced = [Recipe(precision="bf16-mixed", optimizer="adamw-fused", attention="sdpa",
                       grad_checkpointing=True),
                Recipe(precision="bf16-mixed", optimizer="adamw-fused", attention="eager"),
                Recipe(precision="tf32", optimizer="adamw-fused", attention="sdpa")]
    # ... and the fused loss (with and without checkpointing) and torch.compile: the same state
    assert f"{len(untraced) + 3} more that keep the same state were not traced" in note
    # a second method: the recipes left out, swept in full, fit at no micro-batch
    for spec in untraced:
        model = sweep(tiny_gpt2, spec, [1, 8], Depth(None, 1, (1,)), tiny)
        for b in (1, 2, 4, 8):
            row = row_from(spec, model, b, 8, Depth(None, 1, (1,)), tiny, budget, 32,
                           "adamw-fused")
            assert not row.fits and row.memory_bytes > state
