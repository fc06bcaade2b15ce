"""The host model: its fit from measured samples, its use per op, and its spec-file table,
checked by hand arithmetic (no timing here: bench_host_overhead.py measures)."""

from __future__ import annotations

import pytest

from tilefit.calibrate.host import HostSample, fit_host
from tilefit.errors import TilefitError
from tilefit.hardware import get_device
from tilefit.hardware.host import HostModel


def _sample(name: str, fwd: int, bwd: int, opt: int, tensors: int) -> HostSample:
    # times made from known costs: forward 10 us/op, backward 4 us/op,
    # optimizer 2 us/op + 1 us/tensor
    times = {"forward": fwd * 10e-6, "backward": bwd * 4e-6,
             "optimizer": opt * 2e-6 + tensors * 1e-6}
    return HostSample(name, times, {"forward": fwd, "backward": bwd, "optimizer": opt},
                      tensors)


def test_the_fit_recovers_the_costs_the_times_were_made_from() -> None:
    samples = [_sample("a", 100, 200, 50, 20), _sample("b", 150, 300, 60, 40),
               _sample("c", 120, 250, 90, 30)]
    host = fit_host(samples, launch_s=3e-6)
    assert host.forward_op_s == pytest.approx(10e-6)
    assert host.backward_op_s == pytest.approx(4e-6)
    assert host.optimizer_op_s == pytest.approx(2e-6)
    assert host.optimizer_tensor_s == pytest.approx(1e-6)
    assert host.launch_s == 3e-6


def test_host_cost_per_op_by_issuer() -> None:
    from tilefit.estimator.steptime import host_time_s
    from tilefit.tracing.records import OpRecord

    host = HostModel(forward_op_s=10e-6, backward_op_s=4e-6, optimizer_op_s=2e-6,
                     optimizer_tensor_s=0.0, launch_s=3e-6)

    def op(phase: str, kind: str) -> OpRecord:
        return OpRecord(op="aten.x", phase=phase, module="", input_shapes=(), output_shapes=(),
                        dtype="float32", flops=0, bytes=0, kind=kind, step=1, micro=0)

    gpu = get_device("a100-80gb")
    assert host_time_s(op("forward", "memory"), host, gpu) == pytest.approx(13e-6)
    assert host_time_s(op("forward", "view"), host, gpu) == pytest.approx(10e-6)  # no launch
    assert host_time_s(op("recompute", "gemm"), host, gpu) == pytest.approx(7e-6)
    assert host_time_s(op("clip_grad", "memory"), host, gpu) == pytest.approx(5e-6)


def test_negative_costs_are_rejected() -> None:
    with pytest.raises(ValueError, match="launch_s"):
        HostModel(1e-6, 1e-6, 1e-6, 0.0, -1e-6)


def test_a_spec_file_can_set_the_host(tmp_path) -> None:
    spec = tmp_path / "gpu.toml"
    spec.write_text('base = "a100-80gb"\nname = "my-a100"\n[host]\nforward_op_s = 5e-6\n')
    dev = get_device(str(spec))
    assert dev.host.forward_op_s == 5e-6
    assert dev.host.backward_op_s == get_device("a100-80gb").host.backward_op_s
    spec.write_text('base = "a100-80gb"\nname = "bad"\n[host]\nforward_s = 5e-6\n')
    with pytest.raises(TilefitError, match=r"\[host\]"):
        get_device(str(spec))
