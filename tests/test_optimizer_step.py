"""The optimizer step as torch.optim runs it: multi_tensor_apply's launches, the bytes each
AdamW implementation moves, the step counters that stay on the host, and the fused-optimizer
finding (docs/references.md, section 16)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tilefit.estimator import estimate_trace
from tilefit.estimator.multitensor import kernel_launches, multi_tensor_launches
from tilefit.estimator.steptime import SYNC_OPS
from tilefit.hardware import get_device
from tilefit.recipe import Recipe
from tilefit.tracing import trace

# ---- multi_tensor_apply's loop, counted by hand ---------------------------------------------


def test_one_launch_while_the_argument_block_has_room() -> None:
    # 10 tensors of 1000 elements: 10 chunks, 10 tensors, far below any limit
    assert multi_tensor_launches([1000] * 10, 2, large_arg=False) == 1


def test_a_launch_each_time_the_tensor_list_fills() -> None:
    # depth 1, 4 KB argument: 110 tensors per launch; 250 one-chunk tensors -> 110 + 110 + 30
    assert multi_tensor_launches([10] * 250, 1, large_arg=False) == 3
    # depth 4 (fused AdamW): 36 tensors per launch; 100 tensors -> 36 + 36 + 28
    assert multi_tensor_launches([10] * 100, 4, large_arg=False) == 3
    # the 32 KB argument: 7x the tensors (252 at depth 4): one launch
    assert multi_tensor_launches([10] * 100, 4, large_arg=True) == 1


def test_a_launch_each_time_the_blocks_fill_and_the_tensor_carries_over() -> None:
    # one tensor of 1000 chunks, 320 blocks per launch: 320 + 320 + 320 + 40 -> 4 launches
    assert multi_tensor_launches([1000 * 65536], 2, large_arg=False) == 4
    # 2240 blocks per launch with the large argument: 1000 chunks -> 1 launch
    assert multi_tensor_launches([1000 * 65536], 2, large_arg=True) == 1
    # empty tensors are skipped; an all-empty list launches nothing
    assert multi_tensor_launches([0, 0], 1) == 0


def test_scalar_lists_hold_fewer_tensors_at_depth_one() -> None:
    assert multi_tensor_launches([10] * 100, 1, large_arg=False) == 1  # 110 per launch
    assert multi_tensor_launches([10] * 100, 1, large_arg=False, scalar_list=True) == 2  # 96


# ---- the traced AdamW step ---------------------------------------------------------------------

SIZES = ((256, 128), (256,), (64, 256), (64,))  # the 4 parameter tensors of _Net


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(128, 256)
        self.b = nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def _optimizer_ops(optimizer: object, device: str):  # type: ignore[no-untyped-def]
    dev = get_device(device)
    tr = trace(_Net, torch.randn(8, 128), loss_fn=lambda m, x: m(x).sum(),
               recipe=Recipe(precision="fp32", optimizer=optimizer), gpu=dev)
    est = estimate_trace(tr, dev)
    return [c for c in est.ops if c.record.phase == "optimizer"], dev


N_PARAMS = sum(torch.Size(s).numel() for s in SIZES)


@pytest.mark.parametrize(("optimizer", "bytes_per_param"), [
    # foreach: weight decay mul_ (r+w 8), lerp_ (r2 w1 12), mul_ (8), addcmul_ (grad read once:
    # r2 w1 12), sqrt (r1 w1 8), div_ (8), add_ (8), addcdiv_ (r3 w1 16) = 80
    ("adamw", 80),
    # fused: reads param, grad, exp_avg, exp_avg_sq; writes param, exp_avg, exp_avg_sq = 28
    ("adamw-fused", 28),
])
def test_bytes_per_parameter_of_each_adamw(optimizer: str, bytes_per_param: int) -> None:
    ops, _ = _optimizer_ops(optimizer, "a100-80gb")
    on_device = sum(c.record.bytes for c in ops if not c.record.on_host)
    step_counters = 4 * 4 if optimizer == "adamw-fused" else 0  # fused: +1 on the GPU, r+w
    assert on_device == pytest.approx(bytes_per_param * N_PARAMS + step_counters, abs=64)


def test_step_counters_stay_on_the_host_for_foreach_adamw() -> None:
    ops, dev = _optimizer_ops("adamw", "a100-80gb")
    reads = [c for c in ops if c.record.op in SYNC_OPS]
    # bias corrections read each parameter's step counter twice (_get_value)
    assert len(reads) == 2 * len(SIZES)
    assert all(c.record.on_host and c.time_s == 0 for c in reads)
    assert all(kernel_launches(c.record, dev) == 0 for c in reads)
    increments = [c for c in ops if c.record.op.startswith("aten._foreach_add_.Tensor")]
    assert increments and all(c.record.on_host for c in increments)


def test_fused_adamw_is_one_kernel_and_reads_nothing_on_the_host() -> None:
    ops, dev = _optimizer_ops("adamw-fused", "a100-80gb")
    names = [c.record.op for c in ops]
    assert names.count("aten._fused_adamw_.default") == 1
    assert not any(c.record.on_host for c in ops)
    assert not any(n in SYNC_OPS for n in names)
    fused = next(c for c in ops if c.record.op == "aten._fused_adamw_.default")
    assert fused.record.multi_tensor == (4, tuple(torch.Size(s).numel() for s in SIZES))
    assert kernel_launches(fused.record, dev) == 1


def test_cpu_foreach_calls_a_kernel_per_tensor() -> None:
    ops, dev = _optimizer_ops(lambda ps: torch.optim.AdamW(ps, foreach=True), "cpu")
    lerp = next(c for c in ops if c.record.op.startswith("aten._foreach_lerp_"))
    assert kernel_launches(lerp.record, dev) == len(SIZES)
    assert not any(c.record.on_host for c in ops)  # one memory: nothing is "on the host"


# ---- the training loop's loss check ----------------------------------------------------------

def test_the_trainers_loss_check_is_one_wait_per_micro_batch() -> None:
    # HF Trainer, logging_nan_inf_filter=True: torch.isnan(loss) or torch.isinf(loss) after each
    # micro-batch's backward: two reads on the host; with 3 micro-batches, 3 times each
    dev = get_device("a100-80gb")
    tr = trace(_Net, torch.randn(8, 128), loss_fn=lambda m, x: m(x).sum(),
               recipe=Recipe(precision="fp32", optimizer="adamw", accumulation_steps=3,
                             loss_sync=True),
               gpu=dev)
    est = estimate_trace(tr, dev)
    reads = [c for c in est.ops if c.record.phase == "loss_check" and c.record.op in SYNC_OPS]
    assert len(reads) == 2 * 2  # two traced micro-batches stand for three
    assert sum(c.repeats for c in reads) == 2 * 3
    assert not any(c.record.on_host for c in reads)  # the loss is on the GPU: real waits
    plain = estimate_trace(trace(_Net, torch.randn(8, 128), loss_fn=lambda m, x: m(x).sum(),
                                 recipe=Recipe(precision="fp32", optimizer="adamw",
                                               accumulation_steps=3),
                                 gpu=dev), dev)
    assert est.step_time_s >= plain.step_time_s  # a wait never makes the step shorter
