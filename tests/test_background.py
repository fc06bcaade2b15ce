"""Traces on another core (tracing.background, tracing.workload_traces.prefetch, issue 25 item 5):
a prefetched step comes back from a forked child equal to the same step traced here, a child
that fails leaves the step to be traced in-process, and nothing outlives its scope."""

from __future__ import annotations

import os
import sys
import time

import pytest

from tilefit.errors import TilefitError
from tilefit.recipe import Recipe
from tilefit.tracing import background

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="background traces fork: Linux only")


@pytest.fixture
def two_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(background.JOBS_ENV, "2")


@pytest.fixture(scope="module")
def tiny_gpt2():  # type: ignore[no-untyped-def]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tilefit.models import load_workload

    return load_workload("gpt2", seq_len=32).with_config(num_hidden_layers=1)


def test_jobs_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(background.JOBS_ENV, "1")
    assert background.jobs() == 1 and background.background_slots() == 0
    monkeypatch.setenv(background.JOBS_ENV, "3")
    assert background.background_slots() == 2  # the other two of three processes
    monkeypatch.delenv(background.JOBS_ENV)
    assert background.jobs() == background.usable_cores() == len(os.sched_getaffinity(0))
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(background.JOBS_ENV, bad)
        with pytest.raises(TilefitError, match="TILEFIT_JOBS") as err:
            background.jobs()
        assert err.value.given == repr(bad)


def test_a_prefetched_step_equals_the_step_traced_here(tiny_gpt2, two_jobs) -> None:  # type: ignore[no-untyped-def]
    from tilefit.tracing.workload_traces import _SHARED, prefetch, shared_traces, trace_workload

    recipe = Recipe.for_model(tiny_gpt2, batch_size=4, precision="bf16-mixed")
    here = trace_workload(tiny_gpt2, recipe, "a100-80gb")  # no scope: traced in-process
    with shared_traces():
        assert prefetch([(tiny_gpt2, recipe)], "a100-80gb")
        pending = list(_SHARED.get().values())  # type: ignore[union-attr]
        assert [type(p.child) for p in pending] == [background.Background]
        assert not prefetch([(tiny_gpt2, recipe)], "a100-80gb")  # already there
        there = trace_workload(tiny_gpt2, recipe, "a100-80gb")
        assert trace_workload(tiny_gpt2, recipe, "a100-80gb") is there  # collected once
    assert there == here and there is not here
    assert not prefetch([(tiny_gpt2, recipe)], "a100-80gb")  # outside a scope: nothing starts


def test_steps_prefetched_together_come_back_each_as_traced_here(tiny_gpt2, two_jobs) -> None:  # type: ignore[no-untyped-def]
    from tilefit.tracing.workload_traces import _SHARED, prefetch, shared_traces, trace_workload

    deeper = tiny_gpt2.with_config(num_hidden_layers=2)
    recipe = Recipe.for_model(tiny_gpt2, batch_size=2)
    with shared_traces():
        assert prefetch([(tiny_gpt2, recipe), (deeper, recipe)], "a100-80gb")
        (one, two) = _SHARED.get().values()  # type: ignore[union-attr]
        assert one.child is two.child and (one.index, two.index) == (0, 1)
        # the one child is busy: no second starts on a 2-job machine
        assert not prefetch([(tiny_gpt2, Recipe.for_model(tiny_gpt2, batch_size=5))],
                            "a100-80gb")
        got = [trace_workload(w, recipe, "a100-80gb") for w in (deeper, tiny_gpt2)]
    assert got == [trace_workload(w, recipe, "a100-80gb") for w in (deeper, tiny_gpt2)]


def test_no_background_trace_with_one_job(tiny_gpt2, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from tilefit.tracing.workload_traces import prefetch, shared_traces

    monkeypatch.setenv(background.JOBS_ENV, "1")
    with shared_traces():
        assert not prefetch([(tiny_gpt2, Recipe.for_model(tiny_gpt2))], "a100-80gb")


def test_a_failed_child_leaves_the_step_to_this_process(tiny_gpt2, two_jobs, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import tilefit.tracing.workload_traces as tw

    parent = os.getpid()
    real = tw._trace_workload

    def fails_in_the_child(*args, **kw):  # type: ignore[no-untyped-def]
        if os.getpid() != parent:
            raise RuntimeError("a child's failure")
        return real(*args, **kw)

    monkeypatch.setattr(tw, "_trace_workload", fails_in_the_child)
    recipe = Recipe.for_model(tiny_gpt2, batch_size=2)
    with tw.shared_traces():
        assert tw.prefetch([(tiny_gpt2, recipe)], "a100-80gb")
        traced = tw.trace_workload(tiny_gpt2, recipe, "a100-80gb")
    from tilefit.hardware import get_device

    assert traced == real(tiny_gpt2, recipe.on(get_device("a100-80gb")), "a100-80gb")


def test_an_error_in_the_step_is_raised_here_as_in_a_serial_run(tiny_gpt2, two_jobs) -> None:  # type: ignore[no-untyped-def]
    from tilefit.tracing.workload_traces import prefetch, shared_traces, trace_workload

    factory = tiny_gpt2.with_config(num_attention_heads=5)  # 768 not divisible by 5
    recipe = Recipe.for_model(factory)
    with pytest.raises(Exception) as serial:
        trace_workload(factory, recipe, "a100-80gb")
    with shared_traces():
        assert prefetch([(factory, recipe)], "a100-80gb")
        with pytest.raises(type(serial.value)) as parallel:
            trace_workload(factory, recipe, "a100-80gb")
    assert str(parallel.value) == str(serial.value)


def test_a_scope_that_ends_stops_its_children(tiny_gpt2, two_jobs) -> None:  # type: ignore[no-untyped-def]
    from tilefit.tracing.workload_traces import _SHARED, prefetch, shared_traces

    with shared_traces():
        assert prefetch([(tiny_gpt2, Recipe.for_model(tiny_gpt2, batch_size=3))], "a100-80gb")
        (found,) = _SHARED.get().values()  # type: ignore[union-attr]
        child = found.child
    assert not child._process.is_alive() and not child.running


def test_a_child_sends_its_result_or_nothing(two_jobs) -> None:
    slow = background.Background(lambda: time.sleep(60))
    assert slow.running and slow._process.is_alive()
    slow.cancel()
    assert not slow._process.is_alive() and not slow.running
    assert slow.result() is None
    quick = background.Background(lambda: "done")
    assert quick.result() == "done"
    broken = background.Background(lambda: 1 / 0)
    assert broken.result() is None
    unpicklable = background.Background(lambda: (lambda: None))
    assert unpicklable.result() is None
