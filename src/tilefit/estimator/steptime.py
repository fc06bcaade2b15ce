"""The step's time from its costed ops: device time alone on the CPU, where the host runs
every op itself; host and device timelines on a GPU (tilefit.estimator.timeline)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tilefit.compat.moe import EXPERT_LOOP_OPS
from tilefit.estimator.compiled_cost import compiled_launches
from tilefit.estimator.cudagraphs import replay_starts
from tilefit.estimator.multitensor import kernel_launches
from tilefit.estimator.result import OpCost
from tilefit.estimator.timeline import Block, Item, Timeline, simulate
from tilefit.hardware.device import Device
from tilefit.hardware.host import HostModel
from tilefit.tracing.records import OpRecord, reads_expert_offsets
from tilefit.vocab import MICRO_PHASES

# Ops after which the host waits for the device: a value read on the host (.item(),
# bool(tensor)), as GradScaler's step does with found_inf and Adafactor with its norms; and
# a mixture of experts' per-expert matmuls after their offsets are read
# (records.reads_expert_offsets).
SYNC_OPS = frozenset({"aten._local_scalar_dense.default", "aten.is_nonzero.default",
                      "aten.item.default", "aten.equal.default"})


def host_time_s(op: OpRecord, host: HostModel, device: Device) -> float:
    """What issuing the op costs the host: the issuer's per-op cost, and its kernel
    launches (none for a view or an op that runs on the host; a multi-tensor op launches
    one kernel per chunk list: tilefit.estimator.multitensor). An op of a compiled graph
    costs its launches alone (tilefit.estimator.compiled_cost)."""
    launches = 0 if op.kind == "view" else kernel_launches(op, device)
    if op.op in EXPERT_LOOP_OPS:  # Python issues each of its kernels, compiled or not
        return launches * (host.issue_s(op.phase) + host.launch_s)
    if op.compiled:  # a compiled graph issues its kernels with no per-op Python work
        return compiled_launches(op, launches) * host.launch_s
    return host.issue_s(op.phase) + launches * host.launch_s


def issue_time_s(costs: Iterable[OpCost], device: Device, *, graphs: bool = False) -> float:
    """The host's time to issue these ops, repeats included; ``graphs``: the compiled graphs
    replayed as CUDA graphs (one replay per graph, _host_times)."""
    costs = list(costs)
    return sum(host_s * c.repeats
               for c, host_s in zip(costs, _host_times(costs, device, graphs), strict=True))


def _host_times(costs: Sequence[OpCost], device: Device, graphs: bool) -> list[float]:
    """Each op's host issue time; ``graphs``: the compiled graphs are replayed as CUDA graphs,
    one replay per graph in place of their ops' launches (tilefit.estimator.cudagraphs)."""
    host = device.host
    if not graphs:
        return [host_time_s(c.record, host, device) for c in costs]
    starts = replay_starts([c.record for c in costs])
    return [(host.graph_replay_s if start else 0.0) if c.record.compiled
            else host_time_s(c.record, host, device) for c, start in zip(costs, starts,
                                                                         strict=True)]


def _blocks(costs: Sequence[OpCost], device: Device, param_tensors: int,
            graphs: bool = False) -> list[Block]:
    """Consecutive ops with the same repeat count form a block (a micro-batch that runs
    accumulation - 1 times is one block); the optimizer's per-tensor Python work opens the
    optimizer step."""
    host = device.host
    blocks: list[Block] = []
    items: list[Item] = []
    repeats = None
    opened_optimizer = False
    for c, host_s in zip(costs, _host_times(costs, device, graphs), strict=True):
        if c.repeats != repeats and items:
            blocks.append(Block(tuple(items), repeats or 1))
            items = []
        repeats = c.repeats
        if c.record.phase not in MICRO_PHASES and not opened_optimizer:
            opened_optimizer = True
            items.append(Item(param_tensors * host.optimizer_tensor_s, 0.0))
        sync = (c.record.op in SYNC_OPS or reads_expert_offsets(c.record)
                or c.record.then_synchronized) and not c.record.on_host
        items.append(Item(host_s, c.time_s, sync))
    if items:
        blocks.append(Block(tuple(items), repeats or 1))
    return blocks


def step_timeline(costs: Sequence[OpCost], device: Device, param_tensors: int, *,
                  graphs: bool = False) -> Timeline:
    """The step's timelines. On the CPU the host runs each op itself: its per-op overhead is
    already the device's per-call cost (calibrated), so the step is the sum of op times.
    ``graphs``: the compiled graphs are replayed as CUDA graphs (mode="reduce-overhead")."""
    if device.kind != "cuda":
        total = sum(c.time_s * c.repeats for c in costs)
        return Timeline(step_time_s=total, host_s=total, device_s=total, device_idle_s=0.0)
    return simulate(_blocks(costs, device, param_tensors, graphs))
