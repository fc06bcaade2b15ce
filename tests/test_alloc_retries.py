"""A step that fits only because the caching allocator releases its cache and retries
(PyTorch's ``memory_stats()['num_alloc_retries']``): counted as PyTorch counts it, reported by
the estimate, found by the audit, and ranked after the plans that fit without it."""

from __future__ import annotations

import dataclasses
import os

import pytest

from tilefit.alloc_conf import parse_alloc_conf
from tilefit.estimator.allocator_replay import (
    AllocEvent,
    events_of,
    repeated_step,
    replay,
)

MIB, KIB = 2**20, 2**10


def _alloc(uid: int, nbytes: int) -> AllocEvent:
    return AllocEvent("alloc", uid, nbytes, uid)


def _free(uid: int, nbytes: int) -> AllocEvent:
    return AllocEvent("free", uid, nbytes, uid)


# ---- the count, read off CUDACachingAllocator.cpp ------------------------------------------
def test_a_retry_is_counted_where_pytorch_counts_it() -> None:
    # malloc: alloc_block(isRetry=false); release_available_cached_blocks && alloc_block(
    # false); release_cached_blocks && alloc_block(true), which adds 1 to num_alloc_retries
    # before its cudaMalloc, whether or not that then succeeds.
    # A cached 30 MiB segment and a 600 KiB request against a 31 MiB line: the small pool's
    # 2 MiB segment fails, the cache goes, the retry succeeds: one retry, at event 2.
    released = replay([_alloc(0, 30 * MIB), _free(0, 30 * MIB), _alloc(1, 600 * KIB)],
                      limit_bytes=31 * MIB)
    assert released.fits and released.retry_at == (1,)
    # the 30 MiB still in use: nothing to release, the retry is made and fails (counted)
    held = replay([_alloc(0, 30 * MIB), _alloc(1, 600 * KIB)], limit_bytes=31 * MIB)
    assert not held.fits and held.retry_at == (1,)
    # under max_split_size_mb the oversize block's release (release_available_cached_blocks)
    # makes room: its alloc_block is not a retry
    cfg = parse_alloc_conf("max_split_size_mb:20")
    oversize = replay([_alloc(0, 30 * MIB), _alloc(1, 70 * MIB), _free(0, 30 * MIB),
                       _free(1, 70 * MIB), _alloc(2, 45 * MIB)], cfg, limit_bytes=120 * MIB)
    assert oversize.fits and oversize.released_bytes == 70 * MIB and oversize.retry_at == ()
    # no line, no failed cudaMalloc, no retry
    assert replay([_alloc(0, 30 * MIB), _free(0, 30 * MIB), _alloc(1, 600 * KIB)]).retry_at == ()


def test_releases_that_recur_in_every_step() -> None:
    # each step: a 30 MiB temporary, then a 600 KiB one, against a 31 MiB line. Step 0: the
    # 600 KiB request needs a 2 MiB small segment (32 MiB): the cached 30 MiB segment goes,
    # retry (op 1). Step 1 (op 2 on): the 30 MiB request finds only the cached 2 MiB small
    # segment, releases it, retry (op 2); the 600 KiB one releases the 30 MiB again (op 3).
    # A third step starts where the second ended: the same two releases.
    events = [_alloc(0, 30 * MIB), AllocEvent("free", 0, 30 * MIB, 1),
              AllocEvent("alloc", 1, 600 * KIB, 1), AllocEvent("free", 1, 600 * KIB, 2),
              AllocEvent("alloc", 2, 30 * MIB, 2), AllocEvent("free", 2, 30 * MIB, 3),
              AllocEvent("alloc", 3, 600 * KIB, 3), AllocEvent("free", 3, 600 * KIB, 4)]
    traced = replay(events, limit_bytes=31 * MIB)
    assert traced.fits and traced.retry_at == (1, 2, 3)
    # the free of op 1's block at index 2 ends step 0: the third step starts at op 2's alloc
    again = repeated_step(events, 2)
    assert again is not None and [e.kind for e in again] == ["alloc", "free"] * 2
    assert replay(events, limit_bytes=31 * MIB, steady_at=2).next_step_retries == 2
    # room for both: no release, no third step asked
    assert replay(events, limit_bytes=32 * MIB, steady_at=2).next_step_retries is None
    assert traced.next_step_retries is None  # not asked


# ---- a traced step on a GPU whose memory falls between the two ------------------------------
@pytest.fixture(scope="module")
def squeezed_step():  # type: ignore[no-untyped-def]
    """A one-layer GPT-2 step traced for an A100, and an A100 whose memory is 2 MiB short of
    what the caching allocator reserves for the step with no line to meet."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tilefit.estimator import overhead_bytes
    from tilefit.estimator.allocator_replay import events_of
    from tilefit.hardware import get_device
    from tilefit.models import load_workload
    from tilefit.recipe import Recipe
    from tilefit.tracing.workload_traces import trace_workload

    work = load_workload("gpt2", seq_len=128).with_config(num_hidden_layers=1)
    a100 = get_device("a100-80gb")
    tr = trace_workload(work, Recipe.for_model(work, batch_size=8), a100)
    unlimited = replay(events_of(tr)).peak_reserved_bytes
    squeezed = dataclasses.replace(
        a100, memory_bytes=overhead_bytes(a100) + unlimited - 2 * MIB)
    return work, tr, unlimited, squeezed


def test_a_third_step_of_a_periodic_trace_is_the_steady_state(squeezed_step) -> None:  # type: ignore[no-untyped-def]
    # the second step replayed once more from where it left the allocator: without a line
    # it creates no segment and ends with the same live bytes (the step is periodic), and
    # the gradients it hands over are freed where the first step's were
    from tilefit.alloc_conf import AllocatorConfig
    from tilefit.estimator.allocator import Allocator
    from tilefit.estimator.allocator_replay import _run

    _work, tr, _unlimited, _squeezed = squeezed_step
    events = events_of(tr)
    steady_at = next(i for i, op in enumerate(tr.ops) if op.step >= 1)
    again = repeated_step(events, steady_at)
    assert again is not None and len(again) < len(events)
    two, three = Allocator(AllocatorConfig()), Allocator(AllocatorConfig())
    _run(events, two)
    _run([*events, *again], three)
    assert (three.segments_created, three.reserved, three.allocated) == \
        (two.segments_created, two.reserved, two.allocated)


def test_a_release_in_the_second_step_only_is_not_a_cost_per_step(squeezed_step) -> None:  # type: ignore[no-untyped-def]
    from tilefit.estimator import estimate_trace
    from tilefit.report.terminal import reserved_line

    _work, tr, unlimited, squeezed = squeezed_step
    roomy = estimate_trace(tr, dataclasses.replace(squeezed,
                                                   memory_bytes=squeezed.memory_bytes + 2 * MIB))
    assert roomy.reserved is not None and roomy.reserved.peak_reserved_bytes == unlimited
    assert (roomy.reserved.alloc_retries, roomy.reserved.steady_alloc_retries) == (0, 0)
    est = estimate_trace(tr, squeezed)
    r = est.reserved
    assert r is not None and est.fits and r.fits
    # 2 MiB under the unreleased peak the allocator must release: the steady step holds the
    # optimizer state through its forward where the first does not, so its peak and the
    # release are there; a third step, from the compact cache the release left, needs none
    assert r.alloc_retries >= 1 and r.released_bytes > 0
    assert r.peak_reserved_bytes <= r.limit_bytes < unlimited
    assert r.steady_alloc_retries == 0 and not r.fits_by_releasing
    assert est.to_dict()["reserved"]["alloc_retries"] == r.alloc_retries
    assert not any("num_alloc_retries" in n for n in r.notes)
    assert "not in the steady state after" in reserved_line(est)
    assert "release" not in reserved_line(roomy)


def test_the_audit_names_releases_that_recur_and_what_expandable_segments_do(squeezed_step) -> None:  # type: ignore[no-untyped-def]
    # the rule's branch for a step whose releases recur (as test_releases_that_recur_in_
    # every_step's do): the squeezed step's estimate with two retries a step in the steady
    # state; the what-if itself replays the real trace under expandable segments
    from tilefit.advise.rules_allocator import fragmentation_findings
    from tilefit.advise.whatif import WhatIf
    from tilefit.estimator import estimate_trace
    from tilefit.recipe import Recipe

    work, tr, _unlimited, squeezed = squeezed_step
    est = estimate_trace(tr, squeezed)
    assert est.reserved is not None
    recurring = dataclasses.replace(est, reserved=dataclasses.replace(
        est.reserved, steady_alloc_retries=2))
    whatif = WhatIf(work, Recipe.for_model(work, batch_size=8), squeezed, tr, recurring)
    (finding,) = fragmentation_findings(whatif)
    assert "releasing its cache (2 retries in every step" in finding.title
    after = estimate_trace(dataclasses.replace(tr, alloc_conf="expandable_segments:True"),
                           squeezed)
    assert after.reserved is not None
    assert finding.peak_memory_after_bytes == after.reserved.peak_reserved_bytes
    # one growing segment per pool reserves more than the released cache leaves, yet stays
    # under the line with no release: recommended for that, not for bytes saved
    assert after.reserved.fits and after.reserved.alloc_retries == 0
    assert after.reserved.peak_reserved_bytes > est.reserved.peak_reserved_bytes
    assert "ends the releases" in finding.title and finding.recommended
    # the same step as replayed (its one release in the second step only): the finding is
    # its fragmentation share's (above 5%), and expandable segments save nothing there
    (plain,) = fragmentation_findings(WhatIf(work, Recipe.for_model(work, batch_size=8),
                                             squeezed, tr, est))
    assert "beyond the tensors' peak" in plain.title and not plain.recommended


# ---- the plan's choice ---------------------------------------------------------------------
class _Confirming:
    """The planner's state as policy.choose uses it: full traces of rows (here their
    figures given), the notes, the device and budget for the nothing-fits reason."""

    def __init__(self, confirmed: dict[int, object]) -> None:
        from tilefit.hardware import get_device

        self.confirmed, self.notes = confirmed, []
        self.device, self.world_size, self.budget, self.global_batch = \
            get_device("a100-80gb"), 1, 10 * 2**30, 8

    def confirm(self, row):  # type: ignore[no-untyped-def]
        from tilefit.planner.result import Confirmation

        done = self.confirmed[row.micro_batch]
        return done, Confirmation(1, 1, 1.0, 1.0)


def _row(micro_batch: int, samples_per_s: float, retries: int = 0):  # type: ignore[no-untyped-def]
    from tilefit.planner.rows import PlanRow
    from tilefit.recipe import Recipe

    return PlanRow(recipe=Recipe(batch_size=micro_batch, accumulation_steps=8 // micro_batch),
                   predicted_peak_memory_bytes=2**30, predicted_step_time_s=8 / samples_per_s,
                   samples_per_s=samples_per_s, tokens_per_s=None, mfu=0.5,
                   budget_bytes=10 * 2**30, steady_alloc_retries=retries)


def test_a_plan_whose_releases_recur_is_chosen_only_when_none_fits_without() -> None:
    from tilefit.planner import policy

    fast, slow = _row(8, 100.0), _row(4, 80.0)
    state = _Confirming({8: _row(8, 100.0, retries=2), 4: _row(4, 80.0)})
    best, _, _, rows = policy.choose(state, [fast, slow], "throughput", False,  # type: ignore[arg-type]
                                     confirm=True)
    assert best is not None and (best.micro_batch, best.steady_alloc_retries) == (4, 0)
    assert [(r.micro_batch, r.steady_alloc_retries) for r in rows] == [(4, 0), (8, 2)]
    assert any("releasing its cache (2 retries in every step" in n for n in state.notes)
    # every confirmed plan releases: the fastest is kept, first in the table
    state = _Confirming({8: _row(8, 100.0, retries=2), 4: _row(4, 80.0, retries=1)})
    best, _, _, rows = policy.choose(state, [fast, slow], "throughput", False,  # type: ignore[arg-type]
                                     confirm=True)
    assert best is not None and best.micro_batch == 8 and rows[0] is best


def test_a_plan_at_the_line_keeps_a_choice_whose_release_is_one_time() -> None:
    # the roomy A100's choice for a one-layer GPT-2, replanned on an A100 2 MiB short of
    # what that step reserves with no line: its full trace releases the cache in the second
    # step and not after, so it stays the choice, and the confirmation says so. Global batch
    # 2 (micro-batches 1 and 2) keeps the plans few; 8 gives the same choice and the same
    # one-time release with twice the rows to trace
    import tilefit
    from tilefit.estimator import overhead_bytes
    from tilefit.hardware import get_device
    from tilefit.models import load_workload
    from tilefit.report.plan import best_rows
    from tilefit.tracing.workload_traces import shared_traces, trace_workload

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = load_workload("gpt2", seq_len=128).with_config(num_hidden_layers=1)
    a100 = get_device("a100-80gb")
    with shared_traces():
        roomy = tilefit.plan(work, gpu=a100, global_batch=2)
        assert roomy.best is not None and roomy.confirmation is not None
        assert roomy.confirmation.alloc_retries == 0
        tr = trace_workload(work, roomy.best.recipe, a100)
        need = replay(events_of(tr)).peak_reserved_bytes
        squeezed = dataclasses.replace(a100, memory_bytes=overhead_bytes(a100) + need - 2 * MIB)
        tight = tilefit.plan(work, gpu=squeezed, global_batch=2)
    assert tight.best is not None and tight.best.recipe == roomy.best.recipe
    check = tight.confirmation
    assert check is not None and check.alloc_retries >= 1 and check.steady_alloc_retries == 0
    assert tight.best.steady_alloc_retries == 0
    assert check.to_dict()["alloc_retries"] == check.alloc_retries
    text = dict(best_rows(tight, tight.best))["confirmed"]
    assert "none in the steady state after" in text
