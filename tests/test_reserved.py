"""The caching allocator's replay in the estimate: the reserved peak beside the allocated one,
PYTORCH_CUDA_ALLOC_CONF from the recipe or the environment, and "fits" decided by the replay
(its release of cached segments and retry included)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from typer.testing import CliRunner

import tilefit
from tilefit.alloc_conf import parse_alloc_conf
from tilefit.cli.app import app
from tilefit.errors import TilefitError
from tilefit.estimator import estimate_trace, overhead_bytes
from tilefit.estimator.allocator_replay import events_of, replay
from tilefit.recipe import Recipe

TINY = "tests.fixtures.tiny_models:mlp"


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
                               torch.nn.Linear(4096, 1024))


def _loss(m: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
    return m(b).sum()


def _trace(alloc_conf: str | None = None) -> tilefit.Trace:
    return tilefit.trace(_mlp, torch.zeros(512, 1024), loss_fn=_loss, gpu="a100-80gb",
                         recipe=Recipe(precision="fp32", alloc_conf=alloc_conf))


def test_the_estimate_replays_the_step_through_the_allocator() -> None:
    tr = _trace()
    a100 = tilefit.get_device("a100-80gb")
    est = estimate_trace(tr, a100)
    r = est.reserved
    assert r is not None and r.fits and est.fits
    # the same replay, by hand: PyTorch's defaults, the line = memory - context - workspace
    limit = a100.memory_bytes - overhead_bytes(a100)
    rep = replay(events_of(tr), parse_alloc_conf(""), limit)
    assert (r.peak_reserved_bytes, r.limit_bytes) == (rep.peak_reserved_bytes, limit)
    # reserved holds every live block, and whole cached blocks beside them
    assert r.peak_reserved_bytes >= r.peak_allocated_bytes >= est.peak_memory_bytes
    assert r.fragmentation_bytes == r.peak_reserved_bytes - r.peak_allocated_bytes >= 0
    assert r.allocated_at_peak_bytes <= r.peak_allocated_bytes
    d = est.to_dict(include_ops=False)
    assert d["peak_reserved_bytes"] == r.peak_reserved_bytes
    assert d["reserved"]["segments"] == r.segments
    json.dumps(d)


def test_the_recipe_s_setting_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    a100 = tilefit.get_device("a100-80gb")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    from_env = estimate_trace(_trace(), a100).reserved
    from_recipe = estimate_trace(_trace("max_split_size_mb:64"), a100).reserved
    assert from_env is not None and from_env.alloc_conf == "expandable_segments:True"
    assert from_recipe is not None and from_recipe.alloc_conf == "max_split_size_mb:64"
    # expandable segments: one growing segment per pool and stream (two pools here)
    assert from_env.segments <= 2


def test_fits_is_the_replay_s_verdict_at_the_line() -> None:
    tr = _trace()
    a100 = tilefit.get_device("a100-80gb")
    big = estimate_trace(tr, a100).reserved
    assert big is not None
    over = overhead_bytes(a100)
    for limit in (big.peak_allocated_bytes - 512, big.peak_allocated_bytes,
                  big.peak_reserved_bytes - 1, big.peak_reserved_bytes):
        small = dataclasses.replace(a100, memory_bytes=limit + over)
        est = estimate_trace(tr, small)
        rep = replay(events_of(tr), parse_alloc_conf(""), limit)
        assert est.reserved is not None and est.fits == rep.fits == est.reserved.fits, limit
        # the segments at the peak, counted on the way and listed when asked (a second
        # replay where the cache was released) agree
        assert rep.n_segments == len(rep.segments) == est.reserved.segments
    # under the blocks in use at the peak nothing can fit
    under = dataclasses.replace(a100, memory_bytes=big.peak_allocated_bytes - 512 + over)
    assert not estimate_trace(tr, under).fits


def test_the_cpu_has_no_reserved_model() -> None:
    tr = tilefit.trace(_mlp, torch.zeros(4, 1024), loss_fn=_loss, gpu="cpu",
                       recipe=Recipe(precision="fp32"))
    est = estimate_trace(tr, tilefit.get_device("cpu"))
    assert est.reserved is None and est.to_dict(include_ops=False)["peak_reserved_bytes"] is None
    # and the notes say so, where a GPU's estimate does not
    assert any("no reserved-memory figure on a CPU target" in w for w in est.warnings)
    on_gpu = estimate_trace(tilefit.trace(_mlp, torch.zeros(4, 1024), loss_fn=_loss,
                                          gpu="a100-80gb", recipe=Recipe(precision="fp32")),
                            tilefit.get_device("a100-80gb"))
    assert not any("reserved-memory figure" in w for w in on_gpu.warnings)


def test_a_bad_alloc_conf_is_a_clear_error() -> None:
    with pytest.raises(TilefitError, match="did you mean expandable_segments"):
        Recipe(alloc_conf="expandable:True")
    result = CliRunner().invoke(app, ["estimate", TINY, "--input-shape", "32",
                                      "--alloc-conf", "max_split_size_mb:abc"])
    assert result.exit_code == 2, result.output
    assert "max_split_size_mb" in result.output


def _fragmenting_loss(m: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
    # a 12 MiB temporary (its own 12 MiB segment: 10 MiB and up are not pooled), freed, then a
    # 14 MiB one the cached 12 MiB block cannot hold: a second segment, 26 MiB reserved for
    # 14 MiB live. With expandable segments both land in one segment mapped in 20 MiB pages.
    first = torch.ones(3 * 2**20, device=b.device)  # 12 MiB of fp32
    s = first.sum()
    del first
    second = torch.ones(7 * 2**19, device=b.device)  # 14 MiB
    return m(b).sum() + s + second.sum()


def test_fragmentation_is_a_finding_with_the_replayed_saving() -> None:
    from tilefit.alloc_conf import parse_alloc_conf

    def build() -> torch.nn.Module:
        return torch.nn.Linear(8, 8)

    batch = torch.zeros(4, 8)
    result = tilefit.audit(build, batch, loss_fn=_fragmenting_loss, gpu="a100-80gb",
                           recipe=Recipe(precision="fp32", optimizer="sgd"))
    (f,) = [f for f in result.findings if f.rule == "allocator-fragmentation"]
    tr = tilefit.trace(build, batch, loss_fn=_fragmenting_loss, gpu="a100-80gb",
                       recipe=Recipe(precision="fp32", optimizer="sgd"))
    events = events_of(tr)
    default = replay(events, parse_alloc_conf(""))
    expandable = replay(events, parse_alloc_conf("expandable_segments:True"))
    # by hand: the small pool's one 2 MiB segment (the weights, the batch, the gradients)
    # + the 12 MiB and 14 MiB segments = 28 MiB; expandable: 2 MiB + one large segment
    # mapped in 20 MiB pages (the 14 MiB request reuses the 12 MiB freed at its start) = 22
    assert default.segment_sizes == (2 * 2**20, 12 * 2**20, 14 * 2**20)
    assert (default.peak_reserved_bytes, expandable.peak_reserved_bytes) == (
        28 * 2**20, 22 * 2**20)
    assert (f.peak_memory_before_bytes, f.peak_memory_after_bytes) == (
        default.peak_reserved_bytes, expandable.peak_reserved_bytes)
    assert f.memory_saved_bytes > 0 and f.recommended
    assert f.suggested == "expandable_segments:True" and "PYTORCH_CUDA_ALLOC_CONF" in f.fix
    assert f.step_time_after_s == f.step_time_before_s  # the allocator costs no kernel time


def test_a_spec_file_s_measured_context_moves_the_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The CUDA context is a machine's own (254-1341 MiB published, lazy or eager module
    loading): a spec file's cuda_context_bytes replaces tilefit's 512 MiB, and the line the
    replay runs against moves with it, byte for byte."""
    from tilefit.estimator import cublas_workspace_bytes

    a100 = tilefit.get_device("a100-80gb")
    assert a100.cuda_context_bytes == 512 * 2**20
    spec = tmp_path / "mine.toml"
    spec.write_text('base = "a100-80gb"\ncuda_context_bytes = 1406140416\n')  # 1341 MiB
    mine = tilefit.get_device(str(spec))
    assert overhead_bytes(mine) == 1406140416 + cublas_workspace_bytes(a100) == \
        overhead_bytes(a100) + (1341 - 512) * 2**20
    tr = _trace()
    need = estimate_trace(tr, a100).reserved.peak_reserved_bytes  # type: ignore[union-attr]
    # a device with exactly the bytes the step needs above its own context fits; the same
    # memory with the larger context does not
    exact = dataclasses.replace(mine, memory_bytes=need + overhead_bytes(mine))
    assert estimate_trace(tr, exact).fits
    short = dataclasses.replace(exact, cuda_context_bytes=exact.cuda_context_bytes + 2**21)
    assert not estimate_trace(tr, short).fits
    bad = tmp_path / "bad.toml"
    bad.write_text('base = "a100-80gb"\ncuda_context_bytes = -1\n')
    with pytest.raises(TilefitError, match="cuda_context_bytes must be >= 0"):
        tilefit.get_device(str(bad))
