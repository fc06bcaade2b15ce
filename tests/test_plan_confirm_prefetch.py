"""A plan's confirming trace started on another core (PlanState.prefetch_confirmation, issue
25 item 5) is the very step ``confirm`` traces: the same (workload, recipe), so the shared
traces hand the child's trace to ``confirm`` and the confirmation is the serial one."""

from __future__ import annotations

import dataclasses
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
    from tilefit.tracing import background, workload_traces

    monkeypatch.setenv(background.JOBS_ENV, "2")
    row = _row("fsdp2", 2)
    serial = _state(work, 2).confirm(row)
    state = _state(work, 2)
    with workload_traces.shared_traces():
        assert state.prefetch_confirmation(row)
        # the child is forked: a trace in this process from here on would fail the test

        def no_trace(*a: Any) -> Any:
            raise AssertionError("the confirmation was traced again in-process")

        monkeypatch.setattr(workload_traces, "_trace_workload", no_trace)
        assert state.confirm(row) == serial


@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="background traces fork: Linux only")
def test_a_queued_prefetch_starts_on_the_core_the_next_collection_frees(
        work: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """One background slot (TILEFIT_JOBS=2): a step queued while it is busy is started in a
    child as soon as the busy one is collected, and collected in turn, not traced here."""
    from tilefit.tracing import background, workload_traces

    monkeypatch.setenv(background.JOBS_ENV, "2")
    first = (work, Recipe(batch_size=1, precision="bf16-true"))
    second = (work, Recipe(batch_size=2, precision="bf16-true"))
    serial = workload_traces.trace_workload(*second, "a100-80gb")
    with workload_traces.shared_traces():
        assert workload_traces.prefetch([first], "a100-80gb")
        assert not workload_traces.prefetch([second], "a100-80gb", queue=True)  # no free core
        workload_traces.trace_workload(*first, "a100-80gb")  # collected: the queued one starts

        def no_trace(*a: Any) -> Any:
            raise AssertionError("the queued step was traced in-process")

        monkeypatch.setattr(workload_traces, "_trace_workload", no_trace)
        assert workload_traces.trace_workload(*second, "a100-80gb") == serial


def test_a_queued_step_asked_for_before_it_started_is_traced_here(
        work: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from tilefit.tracing import background, workload_traces

    monkeypatch.setenv(background.JOBS_ENV, "1")  # no background slot: it stays queued
    step = (work, Recipe(batch_size=1, precision="bf16-true"))
    with workload_traces.shared_traces():
        assert not workload_traces.prefetch([step], "a100-80gb", queue=True)
        traced = workload_traces.trace_workload(*step, "a100-80gb")
    assert traced == workload_traces.trace_workload(*step, "a100-80gb")


def _rows_of(strategy: str, fits: list[bool], speed: float) -> list[PlanRow]:
    return [dataclasses.replace(_row(strategy, 2), samples_per_s=speed + i,
                                predicted_peak_memory_bytes=1 if fit else 10**12)
            for i, fit in enumerate(fits)]


@pytest.mark.parametrize("replica_state", [100 * 2**30, 10 * 2**30])
def test_the_fallback_is_confirmed_early_only_when_no_traced_row_can_still_outrank_it(
        replica_state: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """search_rows tells ``traced_done`` the traced engines' rows before ZeRO is modelled,
    when DDP (searched last) cannot fit: its ranks hold the whole model state, over the
    budget. The best of those rows is then the best of all (a modelled ZeRO row, even a
    faster one, ranks after a traced row that fits); with DDP still able to fit, nobody is
    told early."""
    from tilefit.planner import multiplan
    from tilefit.planner.search import Depth

    fsdp2 = _rows_of("fsdp2", [False, True], 10.0)
    zero = _rows_of("zero3", [True, True], 50.0)  # faster, but a modelled lower bound
    ddp = _rows_of("ddp", [False], 1.0)
    monkeypatch.setattr(multiplan, "_traced_rows", lambda *a: (
        fsdp2 if a[-1].strategy == "fsdp2" else ddp, 1))
    monkeypatch.setattr(multiplan, "_zero_rows", lambda *a: (zero, 1))
    told: list[list[PlanRow]] = []
    space_ = multiplan.MultiSpace(2, ("fsdp2", "zero3", "ddp"), (), Depth(None, 1, (1,)),
                                  replica_state_bytes=replica_state, shown=3,
                                  traced_done=told.append)
    rows, _ = multiplan.search_rows(None, None, 8, 70 * 2**30, "adamw", space_,
                                    lambda r: r, [], [])
    if replica_state > 70 * 2**30:
        assert told == [fsdp2]
        assert multiplan.best_fitting(told[0]) is multiplan.best_fitting(rows) is fsdp2[1]
    else:
        assert told == []
