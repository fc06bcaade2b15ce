"""The audit of a step that does not fit says first what does: the planner's recipe for the
same global batch (issue 25, item 1)."""

from __future__ import annotations

import dataclasses
import os

import pytest

from tilefit.recipe import Recipe

GIB = 2**30


@pytest.fixture(scope="module", autouse=True)
def one_trace_per_step():  # type: ignore[no-untyped-def]
    """The estimates that size the squeezed GPU and the audits below ask for some of the same
    steps (model, recipe, GPU); a trace depends on nothing else, so each is traced once for
    the file (tilefit.tracing.workload_traces, as tests/test_plan.py does)."""
    from tilefit.tracing.workload_traces import shared_traces

    with shared_traces():
        yield


@pytest.fixture(scope="module")
def tiny_gpt2():  # type: ignore[no-untyped-def]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tilefit.models import load_workload

    return load_workload("gpt2", seq_len=128).with_config(num_hidden_layers=1)


@pytest.fixture(scope="module")
def squeezed(tiny_gpt2):  # type: ignore[no-untyped-def]
    """An A100 with just enough memory for micro-batch 8 of the step, not for 32: the
    recipe at micro-batch 32 does not fit, micro-batch 8 x 4 does."""
    from tilefit.estimator import overhead_bytes
    from tilefit.estimator.workload_estimate import estimate_workload
    from tilefit.hardware import get_device

    a100 = get_device("a100-80gb")
    small, large = (estimate_workload(tiny_gpt2, Recipe.for_model(
        tiny_gpt2, batch_size=b, precision="bf16-mixed"), a100) for b in (8, 32))
    # between what micro-batch 8 reserves and what micro-batch 32's tensors alone need (the
    # allocator's release and retry cannot make room for more than the tensors)
    assert large.peak_memory_bytes > small.peak_reserved_bytes * 1.1
    memory = overhead_bytes(a100) + (small.peak_reserved_bytes + large.peak_memory_bytes) // 2
    return dataclasses.replace(a100, memory_bytes=memory)


def test_a_step_that_does_not_fit_gets_the_plans_recipe_first(tiny_gpt2, squeezed) -> None:  # type: ignore[no-untyped-def]
    from tilefit import audit, plan
    from tilefit.tracing.workload_traces import shared_traces

    recipe = Recipe.for_model(tiny_gpt2, batch_size=32, precision="bf16-mixed")
    # one scope: the second call below reuses the audit's traces of the same steps (a trace
    # depends only on its model, recipe and GPU) and decides again from them
    with shared_traces():
        result = audit(tiny_gpt2, recipe=recipe, gpu=squeezed)
        # the same recipe `tilefit plan` chooses for the same global batch (a second call)
        chosen = plan(tiny_gpt2, global_batch=32, gpu=squeezed, recipe=recipe).best
    assert not result.estimate.fits
    first = result.findings[0]
    assert first.rule == "way-forward" and first.recommended and first.method == "plan"
    assert chosen is not None and chosen.fits
    assert chosen.micro_batch * chosen.accumulation_steps == 32
    assert chosen.changes  # something had to change for it to fit
    assert first.suggested == (f"{chosen.recipe_label()}, micro-batch {chosen.micro_batch} x "
                               f"{chosen.accumulation_steps} accumulation steps")
    assert first.step_time_after_s == pytest.approx(chosen.predicted_step_time_s)
    assert first.peak_memory_after_bytes == chosen.predicted_peak_memory_bytes
    assert chosen.memory_bytes <= squeezed.memory_bytes
    # the biggest consumer is named with its size, read off the estimate's breakdown
    cats = result.estimate.memory_breakdown
    top = max(cats, key=lambda c: cats[c])
    assert f"{cats[top] / GIB:.1f} GiB" in first.reason
    assert result.plan is not None and result.plan.best is not None
    assert result.plan.best.micro_batch == chosen.micro_batch
    d = result.to_dict()
    assert d["way_forward"]["best"]["micro_batch"] == chosen.micro_batch
    assert "hf_training_arguments" in d["way_forward"]["configs"]


def test_a_step_that_fits_has_no_way_forward(tiny_gpt2) -> None:  # type: ignore[no-untyped-def]
    from tilefit import audit

    result = audit(tiny_gpt2, recipe=Recipe.for_model(tiny_gpt2, batch_size=8),
                   gpu="a100-80gb")
    assert result.estimate.fits and result.plan is None
    assert all(f.rule != "way-forward" for f in result.findings)


def test_the_label_names_what_sets_a_plan_row_apart() -> None:
    # found by benchmarks/bench_way_forward.py: gpt2-medium on an RTX 4090 or a T4 at
    # micro-batch 8 needs 26.7 GiB as the Trainer runs it, and the planner's row at the same
    # micro-batch, precision and optimizer fits (14.1 GiB) because it is torch.compile'd; a
    # label that omits it tells the user their own recipe fits
    from tilefit.planner.rows import PlanRow

    def row(**kw: object) -> PlanRow:
        recipe = Recipe(batch_size=8, precision="fp16-mixed", optimizer="adamw-fused",
                        attention="sdpa", **kw)  # type: ignore[arg-type]
        return PlanRow(recipe=recipe, predicted_peak_memory_bytes=1,
                       predicted_step_time_s=1.0, samples_per_s=8.0, tokens_per_s=None,
                       mfu=0.1, budget_bytes=2)

    assert row().recipe_label() == "fp16-mixed adamw-fused"
    assert row(fused_ce=True).recipe_label() == "fp16-mixed adamw-fused fused-ce"
    assert row(compile=True).recipe_label() == "fp16-mixed adamw-fused compiled"
    assert row(compile="reduce-overhead", grad_checkpointing=True).recipe_label() == \
        "fp16-mixed adamw-fused compiled reduce-overhead ckpt"
