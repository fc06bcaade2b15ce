"""Multi-GPU traces (DDP, FSDP2 under the fake process group) and the collectives' cost,
checked against hand arithmetic."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import tilefit
from tilefit.cli.app import app
from tilefit.compat.distributed import (
    fake_process_group,
    local_tensor,
    process_group_initialized,
    process_group_size,
    storage_resizes,
)
from tilefit.errors import TilefitError
from tilefit.estimator.collectives import (
    bus_bandwidth_bytes_per_s,
    check_world_size,
    collective_time_s,
    communication,
)
from tilefit.estimator.cost import COST_FUNCTIONS
from tilefit.estimator.result import OpCost
from tilefit.hardware import get_device
from tilefit.recipe import Parallelism, Recipe
from tilefit.tracing.distributed import find_layer_list, parallel_spec
from tilefit.tracing.records import Collective, OpRecord
from tilefit.vocab import CATEGORIES, OP_KINDS

F32 = 4


class Block(nn.Module):
    """Linear(6, 10) then Linear(10, 6): dimensions that 4 ranks do not divide."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 10)
        self.down = nn.Linear(10, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).sum()


def _trace(world_size: int, strategy: str, precision: str = "fp32",
           gpu: str = "cpu") -> tilefit.Trace:
    parallel = Parallelism(world_size=world_size, strategy=strategy)
    return tilefit.trace(Net, torch.empty(4, 6, device="meta"), loss_fn=_loss, gpu=gpu,
                         recipe=Recipe(precision=precision, optimizer="adamw", parallel=parallel))


def _shard(d0: int, rest: int, n: int) -> int:
    """Elements of one FSDP2 shard: dim 0 padded to a multiple of n, split n ways."""
    return math.ceil(d0 / n) * rest


def test_vocabulary_has_the_collective_kind_and_its_cost() -> None:
    assert "collective" in OP_KINDS and "collective" in COST_FUNCTIONS
    assert "communication" in CATEGORIES


def test_fsdp2_shards_parameters_and_all_gathers_each_block_by_hand() -> None:
    n = 4
    tr = _trace(n, "fsdp2")
    block = _shard(10, 6, n) + _shard(10, 1, n) + _shard(6, 10, n) + _shard(6, 1, n)  # 43
    head = _shard(3, 6, n) + _shard(3, 1, n)  # 7
    params = sum(s.nbytes for s in tr.storages if s.category == "parameters")
    assert params == (2 * block + head) * F32 == 372
    forward = [o.collective for o in tr.ops_of_step(1)
               if o.kind == "collective" and o.phase == "forward"]
    assert sorted(c.nbytes for c in forward if c) == [head * n * F32, block * n * F32,
                                                       block * n * F32]
    assert all(c is not None and c.name == "all_gather" and c.group_size == n for c in forward)
    scatter = [o.collective for o in tr.ops_of_step(1) if o.collective is not None
               and o.collective.name == "reduce_scatter"]
    assert sorted(c.nbytes for c in scatter) == [head * n * F32, block * n * F32,
                                                  block * n * F32]
    assert tr.world_size == n and tr.strategy == "fsdp2"


def test_fsdp2_mixed_precision_gathers_16_bit_and_reduces_fp32_by_hand() -> None:
    """bf16-mixed: FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) gathers
    2-byte parameters and reduce-scatters 4-byte gradients; the fp32 shards stay as they
    are; autocast casts no weight the policy already cast."""
    n, bf16 = 4, 2
    tr = _trace(n, "fsdp2", precision="bf16-mixed")
    block = _shard(10, 6, n) + _shard(10, 1, n) + _shard(6, 10, n) + _shard(6, 1, n)
    head = _shard(3, 6, n) + _shard(3, 1, n)
    assert sum(s.nbytes for s in tr.storages if s.category == "parameters") == 372
    ops = tr.ops_of_step(1)
    gathers = [o.collective.nbytes for o in ops if o.collective is not None
               and o.collective.name == "all_gather" and o.phase == "forward"]
    assert sorted(gathers) == [head * n * bf16, block * n * bf16, block * n * bf16]
    scatter = [o.collective.nbytes for o in ops if o.collective is not None
               and o.collective.name == "reduce_scatter"]
    assert sorted(scatter) == [head * n * F32, block * n * F32, block * n * F32]
    weights = {(10, 6), (6, 10), (3, 6)}
    assert not [o for o in ops if o.op.startswith("aten._to_copy") and o.phase == "forward"
                and tuple(o.input_shapes[0]) in weights]


def test_fsdp2_reduce_scatter_holds_nccls_footprint_on_a_gpu_and_gloos_copy_on_a_cpu() -> None:
    """A GPU target's reduce-scatter allocates NCCL's footprint: one fp32 input of the padded
    unsharded block per block (bf16 gradients cast in), nothing more. A CPU target's backend
    is gloo, whose reduce-scatter clones that whole input
    (ProcessGroupGloo::reduce_scatter_tensor_coalesced): one more input-sized fp32 buffer per
    block, what the CPU benchmark's real runs hold (docs/references.md, section 23)."""
    n = 4
    block = _shard(10, 6, n) + _shard(10, 1, n) + _shard(6, 10, n) + _shard(6, 1, n)  # 43

    def inputs(tr: tilefit.Trace) -> int:
        return sum(1 for o in tr.ops_of_step(1) for b in o.alloc_bytes if b == block * n * F32)

    gpu = _trace(n, "fsdp2", precision="bf16-mixed", gpu="h100")
    assert inputs(gpu) == 2  # 688 bytes: 172 fp32 elements, one input per block
    cpu = _trace(n, "fsdp2", precision="bf16-mixed")
    assert inputs(cpu) == 4  # and gloo's clone of each


def test_ddp_all_reduces_one_bucket_of_all_gradients_by_hand() -> None:
    tr = _trace(2, "ddp")
    grads = (2 * (60 + 10 + 60 + 6) + 18 + 3) * F32  # 1,172 bytes: one bucket (< 1 MiB)
    collectives = [o.collective for o in tr.ops_of_step(1) if o.collective is not None]
    assert [c for c in collectives if c.name == "all_reduce"] == [
        Collective("all_reduce", grads, 2)]
    # the bucket rebuild in the second forward: two broadcasts of int32 bucket indices
    assert [c.name for c in collectives if c.name != "all_reduce"] == ["broadcast"] * 2
    buckets = [s.nbytes for s in tr.storages if s.category == "communication"
               and s.nbytes >= grads]
    assert buckets == [grads, grads]  # the first bucket, then the rebuilt one


def test_one_gpu_is_todays_trace() -> None:
    tr = tilefit.trace(Net, torch.empty(4, 6, device="meta"), loss_fn=_loss, gpu="cpu")
    assert tr.strategy is None and tr.world_size == 1
    assert "communication" not in tr.breakdown_at(tr.peak()[1])
    assert parallel_spec(1, None) is None
    assert parallel_spec(2, None) is not None and parallel_spec(2, None).strategy == "fsdp2"


def test_nccl_ring_formulas_by_hand() -> None:
    h100 = get_device("h100")
    busbw = 450e9 * 0.80  # NVLink 4 one way, NCCL's share
    assert bus_bandwidth_bytes_per_s(h100, 8) == pytest.approx(busbw)
    assert collective_time_s("all_reduce", 10**9, 8, h100) == pytest.approx(
        15e-6 + 2 * 7 / 8 * 1e9 / busbw)
    assert collective_time_s("all_gather", 10**9, 8, h100) == pytest.approx(
        15e-6 + 7 / 8 * 1e9 / busbw)
    assert collective_time_s("reduce_scatter", 10**9, 2, h100) == pytest.approx(
        15e-6 + 1 / 2 * 1e9 / busbw)
    assert collective_time_s("broadcast", 10**9, 4, h100) == pytest.approx(15e-6 + 1e9 / busbw)
    assert collective_time_s("all_reduce", 10**9, 1, h100) == 0.0
    # two nodes: the 400 Gb/s NIC per GPU bounds the ring
    assert collective_time_s("all_reduce", 10**9, 16, h100) == pytest.approx(
        30e-6 + 2 * 15 / 16 * 1e9 / (50e9 * 0.80))


def _op(phase: str, kind: str, name: str = "aten.mm.default") -> OpRecord:
    return OpRecord(op=name, phase=phase, module="", input_shapes=(), output_shapes=(),
                    dtype="float32", flops=0, bytes=0, kind=kind, step=1, micro=0)


def test_overlap_hides_communication_behind_the_phase_compute() -> None:
    costs = [OpCost(_op("forward", "collective"), 2.0, 1), OpCost(_op("forward", "gemm"), 5.0, 1),
             OpCost(_op("forward", "collective"), 2.0, 1),
             OpCost(_op("backward", "gemm"), 1.0, 1),
             OpCost(_op("backward", "collective"), 3.0, 1),
             OpCost(_op("optimizer", "collective"), 0.5, 1)]
    comm = communication(costs)
    assert comm.time_s == pytest.approx(7.5)
    # forward: 4 of communication behind 5 of compute, but the first all-gather (2) has
    # nothing before it; backward: the last collective (3) follows all compute,
    # max(3 - 1, 3) = 3; optimizer: all of it
    assert comm.exposed_by_phase_s == pytest.approx({"forward": 2.0, "backward": 3.0,
                                                     "optimizer": 0.5})
    assert comm.exposed_s == pytest.approx(5.5)


def test_estimate_reports_the_job() -> None:
    est = tilefit.estimate(Net, torch.empty(4, 6, device="meta"), loss_fn=_loss,
                           recipe=Recipe(precision="bf16-mixed",
                                         parallel=Parallelism(world_size=4, strategy="fsdp2")),
                           gpu="h100")
    p = est.parallel
    assert p is not None and p.world_size == 4 and p.link == "NVLink 4"
    assert 0 < p.exposed_communication_s <= p.communication_time_s
    assert p.samples_per_s_total == pytest.approx(4 * est.samples_per_s)
    assert est.memory_breakdown["communication"] >= 0
    assert est.to_dict(include_ops=False)["parallel"]["world_size"] == 4


def test_bad_input() -> None:
    with pytest.raises(TilefitError, match="unknown data-parallel strategy"):
        parallel_spec(2, "zero4")
    with pytest.raises(TilefitError, match="zero3 is modelled, not traced"):
        parallel_spec(2, "zero3")
    with pytest.raises(TilefitError, match="whole number"):
        parallel_spec(0, "ddp")
    with pytest.raises(TilefitError,
                       match=r"Parallelism\(world_size=8\) or Parallelism\(world_size=16\)"):
        check_world_size(get_device("h100"), 12)
    with pytest.raises(TilefitError, match="no network figure"):
        check_world_size(get_device("t4"), 16)
    check_world_size(get_device("h100"), 16)  # two whole nodes


def test_fsdp2_without_a_layer_list_wraps_the_root_with_a_note() -> None:
    assert find_layer_list(nn.Linear(4, 4)) is None
    assert find_layer_list(Net()) is not None and find_layer_list(Net())[0] == "blocks"
    tr = tilefit.trace(lambda: nn.Linear(6, 3), torch.empty(4, 6, device="meta"),
                       loss_fn=_loss,
                       recipe=Recipe(precision="fp32",
                                     parallel=Parallelism(world_size=2, strategy="fsdp2")),
                       gpu="cpu")
    assert any("Linear" in w and "only the root" in w for w in tr.warnings)


def test_compat_fake_process_group() -> None:
    assert not process_group_initialized()
    with fake_process_group(4):
        import torch.distributed as dist

        assert dist.get_world_size() == 4 and dist.get_rank() == 0
        assert process_group_size(dist.group.WORLD) == 4
        assert process_group_size(torch.zeros(1)) is None
    assert not process_group_initialized()
    t = torch.zeros(2)
    assert local_tensor(t) is t
    seen: list[int] = []
    with storage_resizes(lambda st, n: seen.append(n)):
        t.untyped_storage().resize_(0)
    assert seen == [0]


def test_cli_unknown_strategy_and_world_size(tmp_path: Path) -> None:
    runner = CliRunner()
    bad = runner.invoke(app, ["estimate", "gpt2", "--gpus", "2", "--strategy", "zero4"])
    assert bad.exit_code == 2 and "--strategy fsdp2" in bad.output
    nodes = runner.invoke(app, ["estimate", "gpt2", "--gpus", "12", "--gpu", "h100"])
    assert nodes.exit_code == 2 and "--gpus 16" in nodes.output


def test_cli_estimate_with_gpus(tmp_path: Path) -> None:
    config = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512,
              "n_positions": 64, "architectures": ["GPT2LMHeadModel"]}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    r = CliRunner().invoke(app, ["estimate", str(path), "--seq", "32", "--batch", "2",
                                 "--gpus", "2", "--gpu", "h100", "--json", "--no-ops"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output[r.output.index("{"):])
    assert data["parallel"]["strategy"] == "fsdp2" and data["parallel"]["world_size"] == 2


def test_torchrun_two_ranks_on_the_cpu_match_the_trace() -> None:
    """The real DDP step under torchrun (2 ranks, gloo): each rank's MemTracker peak and the
    collectives it issues (the bucket rebuild's broadcasts, one all-reduce per rebuilt
    bucket) equal the trace's (benchmarks/bench_multigpu_cpu.py; ~9 s). DDP, not FSDP2:
    gloo's worker thread sometimes frees an FSDP2 buffer late, which the benchmark's
    repeated launches absorb and one launch would not."""
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_multigpu_cpu.py"
    spec = importlib.util.spec_from_file_location("bench_multigpu_cpu", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    line, ok = bench.compare("mlp", "ddp", "fp32", 2)
    assert ok, line


def test_fsdp2_names_a_parameter_it_cannot_shard() -> None:
    # fully_shard splits dim 0 of every parameter: a learnable scalar (a temperature) cannot be
    # sharded; the error names it and its module, and offers DDP
    import torch
    from torch import nn

    import tilefit
    from tilefit.errors import TilefitError

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj, self.scale = nn.Linear(8, 8), nn.Parameter(torch.tensor(1.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x) * self.scale

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Block(), Block()])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.layers:
                x = block(x)
            return x

    with pytest.raises(TilefitError) as err:
        tilefit.estimate(Net, torch.randn(4, 8), loss_fn=lambda m, b: m(b).sum(),
                         recipe=Recipe(precision="fp32",
                                       parallel=Parallelism(world_size=2, strategy="fsdp2")),
                         gpu="h100")
    text = str(err.value)
    assert "layers.0.scale (module layers.0)" in text \
        and "Parallelism(strategy='ddp')" in text
    ddp = tilefit.estimate(Net, torch.randn(4, 8), loss_fn=lambda m, b: m(b).sum(),
                           recipe=Recipe(precision="fp32",
                                         parallel=Parallelism(world_size=2, strategy="ddp")),
                           gpu="h100")
    assert ddp.parallel is not None and ddp.parallel.strategy == "ddp"
