"""A plan's confirming trace started on another core (PlanState.prefetch_confirmation, issue
25 item 5) is the very step ``confirm`` traces: the same (workload, recipe), so the shared
traces hand the child's trace to ``confirm`` and the confirmation is the serial one."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

from tilefit.planner.rows import PlanRow
from tilefit.recipe import Parallelism, Recipe

pytest.importorskip("transformers")

FULL = 5  # deeper than LAYER_LEVER_MIN_LAYERS: the sweeps trace fewer layers, confirm all


@pytest.fixture(scope="module")
def work() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tilefit.models import load_workload

    return load_workload("gpt2", seq_len=16).with_config(num_hidden_layers=FULL, n_embd=64,
                                                         n_head=2)


def _row(strategy: str | None = None, world: int = 1, offload: bool = False) -> PlanRow:
    recipe = Recipe(batch_size=2, accumulation_steps=2, precision="bf16-true",
                    optimizer="adamw-fused", attention="sdpa")
    return PlanRow(recipe=recipe, predicted_peak_memory_bytes=1, predicted_step_time_s=1.0,
                   samples_per_s=4.0 * world, tokens_per_s=None, mfu=0.0,
                   budget_bytes=70 * 2**30, offload=offload, world_size=world,
                   strategy=strategy)


def _state(work: Any, world: int) -> Any:
    from tilefit.estimator.offload import OffloadLink
    from tilefit.hardware import get_device
    from tilefit.planner.search import depth_of
    from tilefit.planner.state import PlanState

    return PlanState(work, get_device("a100-80gb"), 4 * world, 70 * 2**30, "adamw-fused",
                     depth_of(work), OffloadLink(), world_size=world)


ROWS = {"one GPU, ZeRO-Offload": (_row(offload=True), Parallelism()),
        "fsdp2 on 2 GPUs": (_row("fsdp2", 2), Parallelism(2, "fsdp2")),
        # DeepSpeed ZeRO is modelled on the one-GPU step
        "zero3 offload on 2 GPUs": (_row("zero3", 2, offload=True), Parallelism())}


@pytest.mark.parametrize("name", list(ROWS))
def test_the_confirmation_step_is_the_step_confirm_traces(
        work: Any, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from tilefit.planner import search

    row, parallel = ROWS[name]
    state = _state(work, row.world_size)
    asked: list[tuple[Any, Recipe]] = []
    real = search.trace_workload

    def recording(w: Any, r: Recipe, gpu: Any) -> Any:
        asked.append((w, r))
        return real(w, r, gpu)

    monkeypatch.setattr(search, "trace_workload", recording)
    state.confirm(row)
    step = state.confirm_step(row)
    assert asked == [step]
    # the full depth (not the sweep's), the row's micro-batch and accumulation, its engine
    w, r = step
    assert w.config["n_layer"] == FULL and w == work
    assert (r.batch_size, r.accumulation_steps, r.parallel) == (2, 2, parallel)


@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="background traces fork: Linux only")
def test_a_prefetched_confirmation_is_collected_not_retraced(
        work: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from tilefit.tracing import background, workloads

    monkeypatch.setenv(background.JOBS_ENV, "2")
    row = _row("fsdp2", 2)
    serial = _state(work, 2).confirm(row)
    state = _state(work, 2)
    with workloads.shared_traces():
        assert state.prefetch_confirmation(row)
        # the child is forked: a trace in this process from here on would fail the test

        def no_trace(*a: Any) -> Any:
            raise AssertionError("the confirmation was traced again in-process")

        monkeypatch.setattr(workloads, "_trace_workload", no_trace)
        assert state.confirm(row) == serial
