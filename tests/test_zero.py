"""DeepSpeed ZeRO, modelled: the per-GPU figures against DeepSpeed's own estimators and the
ZeRO paper, by hand; estimate(strategy="zero2") on a tiny model; the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from tilefit import estimate
from tilefit.cli.app import app
from tilefit.errors import TilefitError
from tilefit.estimator.collectives import collective_time_s
from tilefit.estimator.zero import ZeroConfig, ZeroInputs, zero_collectives, zero_memory
from tilefit.estimator.zero_step import zero_inputs
from tilefit.hardware import get_device

PSI = 1_000_000_000
LARGEST = 10_000_000
# bf16 weights, AdamW: two fp32 moments (8 bytes), as DeepSpeed's estimators assume
BF16_ADAM = ZeroInputs(params=PSI, weight_bytes=2, optimizer_bytes_per_param=8,
                       largest_layer_params=LARGEST)


def test_zero2_is_deepspeeds_estimate_zero2_model_states_mem_needs() -> None:
    # DeepSpeed 0.19.8, stage_1_and_2.py: gpu_mem = 2 Psi + int(18 Psi / total_gpus);
    # cpu_mem = Psi * 4 * gpus_per_node * 1.5; with cpu_offload gpu_mem = 2 Psi and
    # cpu_mem = Psi * max(4 * total_gpus, 16) * 1.5. Here Psi = 1e9 on 8 GPUs.
    m = zero_memory(BF16_ADAM, 2, 8)
    assert m.model_states_bytes == 2_000_000_000 + 2_250_000_000
    assert m.host_bytes == 1_000_000_000 * 4 * 8 * 1.5
    off = zero_memory(BF16_ADAM, 2, 8, offload=True)
    assert off.model_states_bytes == 2_000_000_000
    assert off.host_bytes == 1_000_000_000 * 32 * 1.5  # max(4 x 8, 16) = 32


def test_zero3_is_deepspeeds_estimate_zero3_model_states_mem_needs() -> None:
    # stage3.py: largest_layer_memory = 4 L; gpu_mem = 4 L + int(18 Psi / total_gpus);
    # zero_init: cpu_mem = L * 4 * gpus_per_node * 1.5; cpu_offload without parameter
    # offload: gpu_mem = 4 L + int(2 Psi / total_gpus), cpu_mem = Psi * 16 / nodes * 1.5
    m = zero_memory(BF16_ADAM, 3, 8)
    assert m.model_states_bytes == 40_000_000 + 2_250_000_000
    assert m.host_bytes == 10_000_000 * 4 * 8 * 1.5
    off = zero_memory(BF16_ADAM, 3, 8, offload=True)
    assert off.model_states_bytes == 40_000_000 + 250_000_000
    assert off.host_bytes == 1_000_000_000 * 16 * 1.5
    # 16 GPUs on nodes of 8: two nodes share the offloaded state
    assert zero_memory(BF16_ADAM, 3, 16, offload=True).host_bytes == 1e9 * 16 / 2 * 1.5


def test_stages_1_and_2_are_the_zero_papers_figure_1() -> None:
    # Rajbhandari et al. 2020, Figure 1: 7.5B parameters, 64 GPUs, K = 12: P_os 31.4 GB,
    # P_os+g 16.6 GB. The paper's K counts no fp32 gradients; DeepSpeed keeps 4 bytes of
    # them in the partition, so K = 12 is 4 bytes of optimizer state here.
    paper = ZeroInputs(params=7_500_000_000, weight_bytes=2, optimizer_bytes_per_param=4,
                       largest_layer_params=0)
    assert round(zero_memory(paper, 1, 64).model_states_bytes / 1e9, 1) == 31.4
    assert round(zero_memory(paper, 2, 64).model_states_bytes / 1e9, 1) == 16.6


def test_buffers_are_deepspeeds_default_buckets() -> None:
    # reduce_bucket_size 5e8 elements in bf16; overlap_comm doubles it at stages 1-2;
    # stage 2 also holds the largest layer's whole gradient before it enters the bucket
    assert zero_memory(BF16_ADAM, 1, 8).buffer_bytes == 500_000_000 * 2
    assert zero_memory(BF16_ADAM, 2, 8).buffer_bytes == (500_000_000 + LARGEST) * 2
    overlap = ZeroConfig(overlap_comm=True)
    assert zero_memory(BF16_ADAM, 1, 8, config=overlap).buffer_bytes == 2 * 500_000_000 * 2
    # stage 3: the bucket, and 5e7 prefetched parameters (stage3_prefetch_bucket_size)
    assert zero_memory(BF16_ADAM, 3, 8).buffer_bytes == (500_000_000 + 50_000_000) * 2


def test_collectives_per_stage() -> None:
    psi = 1_200_000_000  # 2.4 GB of bf16 gradients: three 5e8-element buckets
    inp = ZeroInputs(params=psi, weight_bytes=2, optimizer_bytes_per_param=8,
                     largest_layer_params=0)
    one, two = zero_collectives(inp, 1, 4), zero_collectives(inp, 2, 4)
    assert [(c.phase, c.name, c.nbytes, c.count, c.repeats) for c in two] == [
        ("backward", "reduce_scatter", 800_000_000, 3, 4),  # every micro-batch
        ("optimizer", "all_gather", 800_000_000, 3, 1)]
    assert one[0].repeats == 1  # stage 1 reduces once per optimizer step
    three = zero_collectives(inp, 3, 2)
    # 2.4 GB in 5e7-element (100 MB) prefetch buckets: 24 all-gathers each way
    assert [(c.phase, c.name, c.count, c.repeats) for c in three] == [
        ("forward", "all_gather", 24, 2), ("backward", "all_gather", 24, 2),
        ("backward", "reduce_scatter", 3, 2)]


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10))


MLP_PARAMS = 32 * 64 + 64 + 64 * 10 + 10  # 2762


def mean_loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).mean()


def zero_estimate(strategy: str | None, world_size: int = 8, **kw: object) -> object:
    return estimate(mlp, torch.randn(4, 32), loss_fn=mean_loss, device="h100-sxm",
                    precision="bf16", world_size=world_size, strategy=strategy, **kw)


@pytest.fixture(scope="module")
def one_and_zero2() -> tuple[object, object]:
    return zero_estimate(None, 1), zero_estimate("zero2")


def test_estimate_zero2_on_a_tiny_model(one_and_zero2: tuple[object, object]) -> None:
    one, z = one_and_zero2
    # pure bf16 AdamW holds two bf16 moments per parameter (+ a few step counters)
    from tilefit.tracing import trace

    tr = trace(mlp, torch.randn(4, 32), loss_fn=mean_loss, device=get_device("h100-sxm"),
               precision="bf16")
    inp = zero_inputs(tr)
    assert inp.params == MLP_PARAMS and inp.weight_bytes == 2
    assert inp.largest_layer_params == 32 * 64  # the first Linear's weight
    assert abs(inp.optimizer_bytes_per_param - 4) <= 16 / MLP_PARAMS
    k = 4 + 4 + inp.optimizer_bytes_per_param
    b = z.memory_breakdown
    assert b["parameters"] == 2 * MLP_PARAMS
    assert b["gradients"] == int(2 * MLP_PARAMS / 8)
    assert b["optimizer_state"] == int(k * MLP_PARAMS / 8)
    # DeepSpeed's default gradient bucket, and the largest layer's gradient
    assert b["communication"] == (500_000_000 + 32 * 64) * 2
    # the rest (activations, temporaries, inputs) comes from the one-GPU trace: never more
    # than its peak less its weights
    assert z.peak_memory_bytes == sum(b.values())
    rest = sum(b[c] for c in ("activations", "temporaries", "inputs"))
    assert 0 < rest <= one.peak_memory_bytes - one.memory_breakdown["parameters"]
    p = z.parallel
    assert p.modelled and p.strategy == "zero2" and p.world_size == 8
    assert any("modelled, not traced" in w for w in z.warnings)
    # one reduce-scatter in backward, one all-gather after the step, of 2 Psi bytes each
    h100 = get_device("h100-sxm")
    expected = collective_time_s("reduce_scatter", 2 * MLP_PARAMS, 8, h100) + \
        collective_time_s("all_gather", 2 * MLP_PARAMS, 8, h100)
    assert math.isclose(p.communication_time_s, expected)
    assert p.to_dict()["details"]["memory"]["stage"] == 2


def test_zero3_and_offload_on_a_tiny_model() -> None:
    z3 = zero_estimate("zero3", offload=True)
    b = z3.memory_breakdown
    assert b["parameters"] == int(2 * MLP_PARAMS / 8) and b["optimizer_state"] == 0
    # the largest layer gathered whole (weights and gradients) + the bucket + prefetch
    prefetch = MLP_PARAMS - 32 * 64
    assert b["communication"] == 2 * 2 * 32 * 64 + (500_000_000 + prefetch) * 2
    assert z3.time_by_phase_s["optimizer"] == 0.0  # the step runs on the CPU


def test_bad_strategies_and_offload_without_zero_are_errors() -> None:
    with pytest.raises(TilefitError, match="zero2"):
        zero_estimate("zero4")
    with pytest.raises(TilefitError, match="DeepSpeed ZeRO only"):
        zero_estimate("ddp", offload=True)


def test_cli_strategy_zero2_json() -> None:
    out = CliRunner().invoke(app, ["estimate", "tests.fixtures.tiny_models:mlp",
                                   "--input-shape", "32", "--gpu", "h100-sxm", "--gpus", "8",
                                   "--strategy", "zero2", "--precision", "bf16", "--json",
                                   "--no-ops"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["parallel"]["modelled"] is True and data["parallel"]["strategy"] == "zero2"
    assert data["memory_breakdown"]["communication"] == (500_000_000 + 32 * 64) * 2  # bf16
    bad = CliRunner().invoke(app, ["estimate", "tests.fixtures.tiny_models:mlp",
                                   "--input-shape", "32", "--gpu", "h100-sxm", "--gpus", "8",
                                   "--strategy", "fsdp2", "--offload"])
    assert bad.exit_code == 2 and "--strategy zero2 --offload" in bad.output
