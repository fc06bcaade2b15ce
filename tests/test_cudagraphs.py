"""compile_mode="reduce-overhead": the compiled graphs replayed as CUDA graphs
(tilefit.estimator.cudagraphs; docs/references.md, section 22), checked by hand on a tiny MLP.

Linear(8, 16) -> GELU -> Linear(16, 4) on a batch of 32 (fp32, SGD) on an A100: a step of a
few microseconds of GPU work and tens of host operations, so host-bound. Under CUDA graphs the
host replays two graphs per micro-batch (the forward and the backward of the loss) and issues
the rest (the optimizer step, zero_grad) as in eager mode; the device runs the same kernels.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from tilefit.advise import audit
from tilefit.advise.rules_host import GRAPH_FIX
from tilefit.cli.app import app
from tilefit.errors import TilefitError
from tilefit.estimator import Estimate, estimate_trace
from tilefit.estimator.multitensor import kernel_launches
from tilefit.hardware import Device, get_device
from tilefit.hardware.host import GRAPH_REPLAY_S, HostModel
from tilefit.recipe import Compile, Recipe
from tilefit.tracing import trace
from tilefit.tracing.records import Trace

B, IN, HID, OUT, F32 = 32, 8, 16, 4, 4
RO = "reduce-overhead"


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HID), nn.GELU(), nn.Linear(HID, OUT))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def _trace(accumulation: int = 1, mode: str = RO) -> Trace:
    return trace(_mlp, torch.randn(B, IN), loss_fn=_loss,
                 recipe=Recipe(precision="fp32", optimizer="sgd", accumulation_steps=accumulation,
                               compile=Compile(mode=mode)),
                 gpu="a100-80gb")


@pytest.fixture(scope="module")
def graphed() -> Trace:
    return _trace()


def _on(host: HostModel) -> Device:
    return dataclasses.replace(get_device("a100-80gb"), host=host)


ZERO_HOST = HostModel(forward_op_s=0.0, backward_op_s=0.0, optimizer_op_s=0.0,
                      optimizer_tensor_s=0.0, launch_s=0.0, graph_replay_s=0.0)


@pytest.mark.parametrize("accumulation", [1, 3])
def test_the_host_replays_two_graphs_per_micro_batch(accumulation: int) -> None:
    """Only the replay costs anything: a forward and a backward graph per micro-batch, so
    2 x accumulation replays of 100 us each."""
    tr = _trace(accumulation)
    est = estimate_trace(tr, _on(dataclasses.replace(ZERO_HOST, graph_replay_s=100e-6)))
    assert est.host_time_s == pytest.approx(2 * accumulation * 100e-6, rel=1e-12)


def test_outside_the_graphs_the_host_issues_ops_as_in_eager_mode(graphed: Trace) -> None:
    """With a free replay, the host's time is the eager remainder: each op outside the
    graphs at its issuer's per-op cost plus its launches (the SGD step, AOTAutograd's runtime
    wrapper), and no compiled op costs anything."""
    host = HostModel(forward_op_s=7e-6, backward_op_s=5e-6, optimizer_op_s=11e-6,
                     optimizer_tensor_s=0.0, launch_s=3e-6, graph_replay_s=0.0)
    dev = _on(host)
    outside = [o for o in graphed.ops_of_step(1) if not o.compiled]
    # the SGD step, and AOTAutograd's runtime around the graphs (detaching saved views)
    assert any(o.phase == "optimizer" for o in outside)
    by_hand = sum(host.issue_s(o.phase) + (0 if o.kind == "view" else
                                           kernel_launches(o, dev)) * host.launch_s
                  for o in outside)
    assert estimate_trace(graphed, dev).host_time_s == pytest.approx(by_hand, rel=1e-12)


def test_a_host_bound_step_is_replays_plus_the_eager_remainder(graphed: Trace) -> None:
    """The shipped host model: reduce-overhead's host time is the default mode's minus the
    compiled kernels' launches plus two replays of 169 us; the device's work is unchanged."""
    dev = get_device("a100-80gb")
    default = estimate_trace(dataclasses.replace(graphed, compile_mode="default"), dev)
    graphs = estimate_trace(graphed, dev)
    launches = sum(1 for o in graphed.ops_of_step(1) if o.compiled and (
        o.kernel is not None or (not o.fused and o.kind != "view")))
    assert pytest.approx(169e-6) == GRAPH_REPLAY_S
    assert graphs.host_time_s == pytest.approx(
        default.host_time_s - launches * dev.host.launch_s + 2 * GRAPH_REPLAY_S, rel=1e-9)
    assert graphs.device_time_s == pytest.approx(default.device_time_s, rel=1e-12)
    assert graphs.host_bound_fraction > 0.5  # microseconds of GPU work


def _live(tr: Trace, keep: object, at: int) -> int:
    """Live rounded bytes after event ``at`` - 1, counted storage by storage."""
    return sum(tr.target.round(s.nbytes) for s in tr.storages if keep(s)  # type: ignore[operator]
               and s.alloc_at + 1 <= at and (s.free_at is None or s.free_at + 1 > at))


def test_the_pool_is_held_through_the_step(graphed: Trace) -> None:
    """A second count of the memory model: the pool's peak (what compiled ops allocate,
    live at once) plus the pool's copy of the batch (32 x 8 x 4 B = 1024 B), plus the most
    the eager side holds at any moment."""
    compiled_at = {i for i, o in enumerate(graphed.ops) if o.compiled}

    def pool(s: object) -> bool:
        return s.alloc_at in compiled_at  # type: ignore[attr-defined]

    def eager(s: object) -> bool:
        return not pool(s)

    events = range(graphed.n_events + 2)
    pool_peak = max(_live(graphed, pool, t) for t in events)
    eager_peak = max(_live(graphed, eager, t) for t in events)
    batch_copy = B * IN * F32
    est = estimate_trace(graphed, get_device("a100-80gb"))
    assert est.peak_memory_bytes == pool_peak + batch_copy + eager_peak
    assert sum(est.memory_breakdown.values()) == est.peak_memory_bytes
    default = estimate_trace(dataclasses.replace(graphed, compile_mode="default"),
                             get_device("a100-80gb"))
    assert est.peak_memory_bytes >= default.peak_memory_bytes
    assert any("reduce-overhead" in w for w in est.warnings)


def test_modes_are_checked() -> None:
    with pytest.raises(TilefitError, match=r"unknown torch\.compile mode"):
        Recipe(compile="max-autotune")
    with pytest.raises(TilefitError, match="CUDA") as e:
        trace(_mlp, torch.randn(B, IN), loss_fn=_loss,
              recipe=Recipe(precision="fp32", optimizer="sgd", compile=Compile(mode=RO)), gpu="cpu")
    assert "estimate(..., gpu='h100')" in str(e.value)
    assert Recipe(compile=True).compile_mode == "default"  # compile=True means "default"


def _host_finding(result: object) -> object:
    (f,) = [f for f in result.findings if f.rule == "host-bound"]  # type: ignore[attr-defined]
    return f


def test_the_host_finding_is_a_reduce_overhead_re_estimate() -> None:
    """A compiled, host-bound step audited in the default mode: the finding's 'after' is the
    same trace estimated with compile_mode="reduce-overhead"."""
    result = audit(_mlp(), torch.randn(B, IN), loss_fn=_loss,
                   recipe=Recipe(precision="fp32", optimizer="sgd", compile=True), gpu="a100-80gb")
    est: Estimate = result.estimate
    assert est.host_bound_fraction > 0.1
    tr = _trace(mode="default")
    after = estimate_trace(dataclasses.replace(tr, compile_mode=RO), get_device("a100-80gb"))
    f = _host_finding(result)
    assert f.step_time_after_s == pytest.approx(after.step_time_s, rel=1e-9)  # type: ignore
    assert f.peak_memory_after_bytes == after.peak_memory_bytes  # type: ignore[attr-defined]
    assert f.fix == GRAPH_FIX and 'mode="reduce-overhead"' in GRAPH_FIX  # type: ignore


MODEL = "tests.fixtures.tiny_models:mlp"


def test_cli_compile_mode() -> None:
    runner = CliRunner()
    ok = runner.invoke(app, ["estimate", MODEL, "--input-shape", "32", "--batch", "8",
                             "--gpu", "a100-80gb", "--compile", "--compile-mode", RO,
                             "--json", "--no-ops"])
    assert ok.exit_code == 0, ok.output
    assert '"compile_mode": "reduce-overhead"' in ok.output
    assert '"cudagraph_pool"' in ok.output
    cpu = runner.invoke(app, ["estimate", MODEL, "--input-shape", "32", "--gpu", "cpu",
                              "--compile", "--compile-mode", RO])
    assert cpu.exit_code == 2 and "CUDA" in cpu.output
    no_compile = runner.invoke(app, ["estimate", MODEL, "--input-shape", "32", "--gpu",
                                     "a100-80gb", "--compile-mode", RO])
    assert no_compile.exit_code == 2 and "--compile" in no_compile.output
