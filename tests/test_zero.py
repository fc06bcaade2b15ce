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
from tilefit.estimator.zero import (
    ZeroConfig,
    ZeroInputs,
    zero_collectives,
    zero_memory,
    zero_points,
)
from tilefit.estimator.zero_step import zero_inputs
from tilefit.hardware import get_device
from tilefit.recipe import Parallelism, Recipe

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
    # (zero_points counts it as a gradient at backward's peak)
    assert zero_memory(BF16_ADAM, 1, 8).buffer_bytes == 500_000_000 * 2
    assert zero_memory(BF16_ADAM, 2, 8).buffer_bytes == (500_000_000 + LARGEST) * 2
    overlap = ZeroConfig(overlap_comm=True)
    assert zero_memory(BF16_ADAM, 1, 8, config=overlap).buffer_bytes == 2 * 500_000_000 * 2
    # stage 3: the bucket, and 5e7 prefetched parameters (stage3_prefetch_bucket_size)
    assert zero_memory(BF16_ADAM, 3, 8).buffer_bytes == (500_000_000 + 50_000_000) * 2


# benchmarks/bench_zero_cpu.py's MLP 256-1024-1024-256, fp32, AdamW, 2 ranks, buckets 1e5:
# the parameters in DeepSpeed's flattening order (weight, bias of each Linear)
BENCH_SIZES = (256 * 1024, 1024, 1024 * 1024, 1024, 1024 * 256, 256)
BENCH = ZeroInputs(params=sum(BENCH_SIZES), weight_bytes=4, optimizer_bytes_per_param=8,
                   largest_layer_params=1024 * 1024, param_sizes=BENCH_SIZES)
BENCH_CONFIG = ZeroConfig(reduce_bucket_size=100_000, allgather_bucket_size=100_000,
                          stage3_prefetch_bucket_size=100_000)


def test_grads_in_partition_holds_whole_parameters() -> None:
    # Psi = 1,575,168, P = 787,584 per rank. Rank 0's partition [0, 787,584) reaches into
    # the first weight, its bias and the 1024x1024 weight (which ends at 1,311,744): all
    # three whole, 1,311,744 elements; rank 1's from that weight on: 1,312,000.
    assert BENCH.params == 1_575_168
    assert BENCH.overlap_params(2) == 1_048_576 + 1024 + 262_144 + 256
    # one rank holds everything; without sizes the bound is P + L
    assert BENCH.overlap_params(1) == BENCH.params
    no_sizes = ZeroInputs(params=1000, weight_bytes=2, optimizer_bytes_per_param=8,
                          largest_layer_params=100)
    assert no_sizes.overlap_params(4) == 250 + 100
    assert BENCH.second_largest_params == 262_144


def test_zero_points_are_deepspeeds_buffers_by_phase() -> None:
    # what DeepSpeed 0.19.8's engine held on rank 1 of 2 at each peak, by allocation site
    # (docs/references.md, section 24, item 4), in bytes; P = 787,584
    psi, p, w, b = 1_575_168, 787_584, 4, 100_000
    master, adam = 4 * p, 8 * p  # fp32 partition (stage_1_and_2.py:560), Adam's moments
    in_partition = w * 1_312_000  # grads_in_partition (stage_1_and_2.py:2192)
    bwd, step = zero_points(BENCH, 1, 2, config=BENCH_CONFIG)
    # stage 1 backward: flat parameters, every 16-bit gradient, grads_in_partition, bucket
    assert bwd == {"parameters": w * psi, "gradients": w * psi,
                   "optimizer_state": master + adam + in_partition, "communication": w * b}
    # the step: the fp32 gradient partition (stage_1_and_2.py:3117) instead, no bucket
    assert step == {"parameters": w * psi, "gradients": 0,
                    "optimizer_state": master + 4 * p + adam, "communication": 0}
    bwd, _ = zero_points(BENCH, 2, 2, config=BENCH_CONFIG)
    # stage 2: the 1024x1024 gradient autograd just made, and the 256x1024 one waiting
    # un-copied (larger than the bucket)
    assert bwd["gradients"] == w * (1_048_576 + 262_144)
    assert bwd["optimizer_state"] == master + adam + in_partition
    # before backward makes a gradient: no bucket, no grads_in_partition (as at gpt2's and
    # llama's peak, the forward/backward turn)
    bwd, _ = zero_points(BENCH, 1, 2, config=BENCH_CONFIG, grads_made=0)
    assert bwd == {"parameters": w * psi, "gradients": 0,
                   "optimizer_state": master + adam, "communication": 0}
    # stage 2 copies from the second gradient on (the last parameter's, 256 elements, first)
    assert zero_points(BENCH, 2, 2, config=BENCH_CONFIG, grads_made=w * 256)[0][
        "optimizer_state"] == master + adam
    # stage 3, when backward has made the last weight's and the 1024x1024 weight's
    # gradients (and two biases'): its partition (utils.py:221), fp32 master
    # (stage3.py:1172), grad partitions (stage3.py:791), Adam; gathered since forward
    # (reused within stage3_max_reuse_distance) all but the last Linear, released after its
    # backward: 1,311,744 elements; the 1024x1024 gradient in flight; the bucket
    # (stage3.py:782)
    made = w * (262_144 + 256 + 1024 + 1_048_576)
    bwd, step = zero_points(BENCH, 3, 2, config=BENCH_CONFIG, grads_made=made)
    assert bwd == {"parameters": w * p, "gradients": 0, "optimizer_state": 16 * p,
                   "communication": w * (1_311_744 + 1_048_576 + b)}
    # the step: another fp32 copy of the gradient partition (stage3.py:2686), the bucket
    assert step == {"parameters": w * p, "gradients": 0, "optimizer_state": 20 * p,
                    "communication": w * b}
    # in DeepSpeed's bf16 mode the gradient partition is bf16 (engine.py:1806-1807: the
    # gradient-accumulation dtype defaults to the model's), 2 P, and the step's copy fp32
    half = ZeroInputs(params=BENCH.params, weight_bytes=2, optimizer_bytes_per_param=8,
                      largest_layer_params=BENCH.largest_layer_params, param_sizes=BENCH_SIZES)
    bwd, step = zero_points(half, 3, 2, config=BENCH_CONFIG)
    assert bwd["optimizer_state"] == master + 2 * p + adam
    assert step["optimizer_state"] == master + 2 * p + adam + 4 * p
    # a model past stage3_max_reuse_distance / 2 gathers only its last R / 2 elements at the
    # forward/backward turn, and prefetches L2 (whole, beyond the bucket) past them
    short = ZeroConfig(reduce_bucket_size=b, stage3_prefetch_bucket_size=b,
                       stage3_max_reuse_distance=2_400_000)
    bwd, _ = zero_points(BENCH, 3, 2, config=short, grads_made=0)
    assert bwd["communication"] == w * (1_200_000 + b + 262_144)


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


def zero_estimate(strategy: str | None, world_size: int = 8, offload: bool = False) -> object:
    parallel = Parallelism(world_size=world_size, strategy=strategy, offload=offload)
    return estimate(mlp, torch.randn(4, 32), loss_fn=mean_loss,
                    recipe=Recipe(precision="bf16-true", parallel=parallel), gpu="h100-sxm")


@pytest.fixture(scope="module")
def one_and_zero2() -> tuple[object, object]:
    return zero_estimate(None, 1), zero_estimate("zero2")


def test_estimate_zero2_on_a_tiny_model(one_and_zero2: tuple[object, object]) -> None:
    one, z = one_and_zero2
    # pure bf16 AdamW holds two bf16 moments per parameter (+ a few step counters);
    # DeepSpeed's optimizer steps the fp32 partition, so they count as fp32 (8 bytes)
    from tilefit.tracing import trace

    tr = trace(mlp, torch.randn(4, 32), loss_fn=mean_loss, recipe=Recipe(precision="bf16-true"),
               gpu=get_device("h100-sxm"))
    inp = zero_inputs(tr)
    assert inp.params == MLP_PARAMS and inp.weight_bytes == 2
    assert inp.largest_layer_params == 32 * 64  # the first Linear's weight
    assert abs(inp.optimizer_bytes_per_param - 8) <= 32 / MLP_PARAMS
    k = 4 + 4 + inp.optimizer_bytes_per_param
    b = z.memory_breakdown
    assert b["parameters"] == 2 * MLP_PARAMS
    # backward's peak: the largest layer's 16-bit gradient, just made
    assert b["gradients"] == 2 * 32 * 64
    # the optimizer partition less its fp32 gradients (P = 346), and grads_in_partition:
    # rank 5's [1730, 2076) reaches into the first weight and its bias, 2048 + 64 elements
    assert b["optimizer_state"] == int(k * MLP_PARAMS / 8) - 4 * 346 + 2 * (2048 + 64)
    # DeepSpeed's default gradient bucket
    assert b["communication"] == 500_000_000 * 2
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
    # the bucket, and at most the whole model gathered (it is all reused within
    # stage3_max_reuse_distance) and the largest layer's gradient in flight
    extra = b["communication"] - 500_000_000 * 2
    assert 2 * 32 * 64 <= extra <= 2 * MLP_PARAMS + 2 * 32 * 64
    assert z3.time_by_phase_s["optimizer"] == 0.0  # the step runs on the CPU


def test_zero_module_rows_add_up_to_the_modelled_step(
        one_and_zero2: tuple[object, object]) -> None:
    # the "time by module" shares are row / step time: under ZeRO the rows are one rank's,
    # the optimizer's over 1/8 of the parameters, the exposed collectives a row of their own
    from tilefit.estimator.result import EXPOSED_COMMUNICATION
    from tilefit.estimator.zero_step import OFFLOAD_ROW

    one, z = one_and_zero2
    rows = {m.module: m for m in z.modules}
    one_rows = {m.module: m for m in one.modules}
    assert math.isclose(sum(m.time_s for m in z.modules), z.step_time_s, rel_tol=1e-9)
    step = "(loop: optimizer step)"
    assert math.isclose(rows[step].time_s, one_rows[step].time_s / 8, rel_tol=1e-9)
    assert rows[step].flops == round(one_rows[step].flops / 8)
    layer = next(k for k in one_rows if not k.startswith("("))
    assert rows[layer] == one_rows[layer]  # the layers' forward and backward as traced
    assert math.isclose(rows[EXPOSED_COMMUNICATION].time_s, z.parallel.exposed_communication_s)
    off = zero_estimate("zero2", offload=True)
    offload_s = off.parallel.details["offload_time_s"]
    cpu = {m.module: m for m in off.modules}
    assert offload_s > 0 and cpu[OFFLOAD_ROW].time_s == offload_s
    assert cpu[step].time_s == 0.0  # the step runs on the CPU
    assert math.isclose(sum(m.time_s for m in off.modules), off.step_time_s, rel_tol=1e-9)


def test_bad_strategies_and_offload_without_zero_are_errors() -> None:
    with pytest.raises(TilefitError, match="zero2"):
        zero_estimate("zero4")
    with pytest.raises(TilefitError, match="DeepSpeed ZeRO only"):
        zero_estimate("ddp", offload=True)


def test_cli_strategy_zero2_json() -> None:
    out = CliRunner().invoke(app, ["estimate", "tests.fixtures.tiny_models:mlp",
                                   "--input-shape", "32", "--gpu", "h100-sxm", "--gpus", "8",
                                   "--strategy", "zero2", "--precision", "bf16-true", "--json",
                                   "--no-ops"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["parallel"]["modelled"] is True and data["parallel"]["strategy"] == "zero2"
    assert data["memory_breakdown"]["communication"] == 500_000_000 * 2  # bf16
    bad = CliRunner().invoke(app, ["estimate", "tests.fixtures.tiny_models:mlp",
                                   "--input-shape", "32", "--gpu", "h100-sxm", "--gpus", "8",
                                   "--strategy", "fsdp2", "--offload"])
    assert bad.exit_code == 2 and "--strategy zero2 --offload" in bad.output


def test_micro_breakdowns_sweep_is_breakdown_at() -> None:
    # the one-sweep timeline by category the ZeRO peak walks equals Trace.breakdown_at at
    # every forward/backward point
    from tilefit.estimator.zero_step import _micro_breakdowns
    from tilefit.tracing import trace

    tr = trace(mlp, torch.randn(4, 32), loss_fn=mean_loss, recipe=Recipe(precision="bf16-true"),
               gpu=get_device("h100-sxm"))
    points = _micro_breakdowns(tr, True)
    assert len(points) > 10
    for j, at in points:
        assert at == tr.breakdown_at(j, rounded=True)


def test_the_summary_explains_a_scaling_efficiency_over_100_percent(
        one_and_zero2: tuple[object, object]) -> None:
    # ZeRO steps 1/N of the optimizer on each GPU where the one-GPU baseline steps it all, so
    # the efficiency can pass 100%; the summary says why whenever it does, and only then
    from dataclasses import replace

    from tilefit.report.terminal import parallel_rows

    _, z = one_and_zero2
    for eff in (1.03, 0.97):
        p = z.parallel
        est = replace(z, parallel=replace(p, one_gpu_step_time_s=eff * p.step_time_s))
        row = dict(parallel_rows(est))["all GPUs"]
        assert f"scaling efficiency {eff:.0%}" in row
        assert ("each GPU steps 1/N of the optimizer" in row) == (eff > 1)
