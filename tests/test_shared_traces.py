"""One call of audit or plan traces each distinct step once (tracing.workload_traces.shared_traces,
issue 25 item 5): the count of traces drops, the figures do not change."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from tilefit.recipe import Recipe


@pytest.fixture(scope="module")
def tiny_gpt2():  # type: ignore[no-untyped-def]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tilefit.models import load_workload

    return load_workload("gpt2", seq_len=32).with_config(num_hidden_layers=1)


@pytest.fixture
def traces(monkeypatch):  # type: ignore[no-untyped-def]
    """The recipes of the steps actually traced (tracing.workload_traces calls trace_module once
    per traced step)."""
    import tilefit.tracing.workload_traces as tw

    seen: list[Recipe] = []
    real = tw.trace_module

    def counting(model, batch, recipe, gpu, **kw):  # type: ignore[no-untyped-def]
        seen.append(recipe)
        return real(model, batch, recipe, gpu, **kw)

    monkeypatch.setattr(tw, "trace_module", counting)
    return seen


def _estimate(tr) -> str:  # type: ignore[no-untyped-def]
    from tilefit.estimator import estimate_trace
    from tilefit.hardware import get_device

    est = estimate_trace(tr, get_device("a100-80gb"))
    return json.dumps(est.to_dict(), sort_keys=True, default=str)


def test_a_scope_traces_each_step_once(tiny_gpt2, traces) -> None:  # type: ignore[no-untyped-def]
    from tilefit.tracing.workload_traces import shared_traces, trace_workload

    r8 = Recipe.for_model(tiny_gpt2, batch_size=8, precision="bf16-mixed")
    r9 = dataclasses.replace(r8, batch_size=9)
    with shared_traces():
        first = trace_workload(tiny_gpt2, r8, "a100-80gb")
        again = trace_workload(tiny_gpt2, r8, "a100-80gb")  # the same step: shared
        with shared_traces():  # a scope inside (audit's way forward runs a plan) shares
            inner = trace_workload(tiny_gpt2, r8, "a100-80gb")
        other = trace_workload(tiny_gpt2, r9, "a100-80gb")  # another batch: traced
        wider = trace_workload(tiny_gpt2.with_config(num_hidden_layers=2), r8, "a100-80gb")
    assert again is first and inner is first and other is not first and wider is not first
    assert len(traces) == 3  # 5 asked, 3 distinct
    # outside a scope every call traces, and the scope's traces are gone once it ends
    fresh = trace_workload(tiny_gpt2, r8, "a100-80gb")
    with shared_traces():
        later = trace_workload(tiny_gpt2, r8, "a100-80gb")
    assert len(traces) == 5 and fresh is not first and later is not first
    # a shared trace costs exactly as a fresh trace of the same step does
    assert _estimate(first) == _estimate(fresh) == _estimate(later)
    assert first.n_events == fresh.n_events and first.param_count == fresh.param_count
