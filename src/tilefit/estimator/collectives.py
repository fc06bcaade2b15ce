"""The cost of collectives, and how much of it the step sees.

Time of one collective (NCCL's ring algorithm, nccl-tests' bus bandwidth definition,
docs/references.md, section 20), for S bytes (NCCL's size of the operation) over n ranks
whose links carry busBW each way:

    all_reduce                    latency + 2 (n - 1) / n x S / busBW
    all_gather, reduce_scatter    latency + (n - 1) / n x S / busBW      (S: the whole buffer)
    all_to_all                    latency + (n - 1) / n x S / busBW
    broadcast, reduce             latency + S / busBW

busBW is the GPU's link (NVLink, or PCIe without it) times the share NCCL reaches; across
nodes the network per GPU bounds it. On the CPU (gloo through shared memory) the memory
bandwidth stands in.

Overlap (a simple model): collectives run on their own stream beside the compute. Within a
phase, communication hides behind that phase's compute, except what cannot: in the forward
the first collective (FSDP2's first all-gather has nothing before it; later blocks' are
prefetched behind the previous block), in the backward the last one (DDP's last bucket and
FSDP2's last reduce-scatter start after the last gradient). Elsewhere (clipping's norm, the
optimizer step) communication is exposed. Per phase:

    exposed = min(comm, max(comm - compute, unhidden))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from tilefit.errors import TilefitError
from tilefit.hardware.device import Device

if TYPE_CHECKING:  # result imports cost, which imports this module
    from tilefit.estimator.result import OpCost

# nccl-tests' correction factors from algorithm to bus bandwidth (PERFORMANCE.md)
BUS_FACTOR: dict[str, tuple[int, int]] = {  # name -> (a, b): factor = a (n - 1) / (b n)
    "all_reduce": (2, 1), "all_gather": (1, 1), "reduce_scatter": (1, 1),
    "all_to_all": (1, 1)}
ROOTED = frozenset({"broadcast", "reduce"})  # factor 1: all data leaves or enters the root
# A small collective's time: tilefit's assumption of 15 us within a node and twice that
# across nodes (docs/references.md, section 20, item 7: not a measured figure).
LATENCY_S = 15e-6
INTER_NODE_LATENCY_S = 30e-6
ENGINE_COPY_PREFIX = "fsdp."  # FSDP2's copy-in / copy-out kernels


def bus_factor(name: str, n: int) -> float:
    """The share of S each rank's link carries: 2(n-1)/n for all-reduce, (n-1)/n for
    all-gather and reduce-scatter, 1 for broadcast; 0 on one rank or for a barrier."""
    if n <= 1:
        return 0.0
    if name in ROOTED:
        return 1.0
    a, b = BUS_FACTOR.get(name, (0, 1))
    return a * (n - 1) / (b * n)


def bus_bandwidth_bytes_per_s(device: Device, n: int) -> float:
    """NCCL's achieved bus bandwidth on ``n`` GPUs of ``device``."""
    if device.link_bytes_per_s <= 0:  # the CPU: shared memory
        return device.bandwidth_bytes_per_s * device.bandwidth_efficiency
    link = device.link_bytes_per_s
    if n > device.gpus_per_node and device.network_bytes_per_s > 0:
        link = min(link, device.network_bytes_per_s)
    return link * device.link_efficiency


def collective_time_s(name: str, nbytes: int, n: int, device: Device) -> float:
    """One collective's time: its latency plus its bytes at the bus bandwidth."""
    if n <= 1:
        return 0.0
    latency = INTER_NODE_LATENCY_S if n > device.gpus_per_node else LATENCY_S
    return latency + bus_factor(name, n) * nbytes / bus_bandwidth_bytes_per_s(device, n)


def link_description(device: Device, world_size: int) -> str:
    """The interconnect the collectives of ``world_size`` GPUs cross: the link within a node,
    and the network between nodes when they span several."""
    link = device.link_name or "memory"
    if device.kind != "cuda" or world_size <= device.gpus_per_node:
        return link
    nodes = world_size // device.gpus_per_node
    return (f"{link} within nodes of {device.gpus_per_node}, "
            f"{device.network_bytes_per_s * 8 / 1e9:g} Gb/s per GPU between {nodes} nodes")


def check_world_size(device: Device, world_size: int) -> None:
    """Several nodes take whole nodes, and a network figure; else an error offering the
    nearest world sizes that work."""
    per_node = device.gpus_per_node
    if device.kind != "cuda" or world_size <= per_node:
        return
    if device.network_bytes_per_s <= 0:
        raise TilefitError(
            f"{world_size} GPUs span several nodes of {per_node}, and tilefit has no network "
            f"figure for {device.display_name}",
            expected=f"at most {per_node} GPUs (one node) on this GPU",
            given=str(world_size),
            fix=f"pass Parallelism(world_size={per_node}), or name the network between nodes "
            "(tilefit.hardware.networks: on_nodes(..., network=get_network(spec='ib-ndr')))")
    if world_size % per_node:
        low, high = world_size // per_node * per_node, -(-world_size // per_node) * per_node
        raise TilefitError(
            f"{world_size} GPUs do not fill whole nodes of {per_node} GPUs",
            expected=f"a multiple of {per_node} above one node",
            given=str(world_size),
            fix=f"pass Parallelism(world_size={low}) or Parallelism(world_size={high})")


@dataclass(frozen=True)
class Communication:
    """The step's communication: all collectives in sequence, and what the step sees."""

    time_s: float
    exposed_s: float
    by_phase_s: dict[str, float] = field(default_factory=dict)
    exposed_by_phase_s: dict[str, float] = field(default_factory=dict)


def _unhidden_s(phase: str, comm: Sequence[float], total: float) -> float:
    if phase == "forward":
        return comm[0]
    if phase == "backward":
        return comm[-1]
    return total


def exposed_s(phase: str, comm: Sequence[float], compute_s: float) -> float:
    """What the phase's compute does not hide of its collectives ``comm`` (in order)."""
    total = sum(comm)
    return min(total, max(total - compute_s, _unhidden_s(phase, comm, total)))


def communication(costs: Sequence[OpCost]) -> Communication:
    """Collective time per phase and how much of it the compute does not hide."""
    comm: dict[str, list[float]] = {}
    compute: dict[str, float] = {}
    for c in costs:
        phase = c.record.phase
        if c.record.kind == "collective":
            comm.setdefault(phase, []).append(c.time_s * c.repeats)
        else:
            compute[phase] = compute.get(phase, 0.0) + c.time_s * c.repeats
    by_phase = {p: sum(v) for p, v in comm.items()}
    exposed = {p: exposed_s(p, comm[p], compute.get(p, 0.0)) for p in by_phase}
    return Communication(sum(by_phase.values()), sum(exposed.values()), by_phase, exposed)


def without_communication(costs: Sequence[OpCost]) -> list[OpCost]:
    """The costs with collectives taking no compute-stream time (they run on their own)."""
    return [replace(c, time_s=0.0) if c.record.kind == "collective" else c for c in costs]


@dataclass(frozen=True)
class ParallelSummary:
    """A data-parallel step seen from one rank, and the whole job."""

    strategy: str
    world_size: int
    link: str  # the interconnect the collectives are costed on
    bus_bandwidth_bytes_per_s: float
    communication_time_s: float  # every collective of the step, in sequence
    exposed_communication_s: float  # what the compute does not hide (in step_time_s)
    communication_by_phase_s: dict[str, float]
    one_gpu_step_time_s: float  # the same micro-batch on one GPU (see scaling_efficiency)
    step_time_s: float
    samples_per_step: int  # one rank's
    tokens_per_step: int | None
    # DeepSpeed ZeRO: memory and communication modelled, not traced (estimator/zero.py);
    # details: the model's per-GPU parts and collectives
    modelled: bool = False
    details: dict[str, Any] = field(default_factory=dict)
    # the exposed communication by phase, where the engine's collectives are not all in the
    # micro-batch phases (ZeRO-1/2 gather the parameters after the optimizer step); empty:
    # all of it in forward/backward
    exposed_by_phase_s: dict[str, float] = field(default_factory=dict)

    @property
    def scaling_efficiency(self) -> float:
        """Per-GPU throughput against one GPU running the same micro-batch: one GPU's step
        is this rank's compute without the engine's collectives and FSDP2's copies, with
        the optimizer step over the whole model (approximate: no second trace)."""
        return self.one_gpu_step_time_s / self.step_time_s if self.step_time_s > 0 else 0.0

    @property
    def tokens_per_s_per_gpu(self) -> float | None:
        if not self.tokens_per_step or self.step_time_s <= 0:
            return None
        return self.tokens_per_step / self.step_time_s

    @property
    def tokens_per_s_total(self) -> float | None:
        per_gpu = self.tokens_per_s_per_gpu
        return None if per_gpu is None else per_gpu * self.world_size

    @property
    def samples_per_s_total(self) -> float:
        if self.step_time_s <= 0:
            return 0.0
        return self.samples_per_step * self.world_size / self.step_time_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy, "world_size": self.world_size, "link": self.link,
            "bus_bandwidth_bytes_per_s": self.bus_bandwidth_bytes_per_s,
            "communication_time_s": self.communication_time_s,
            "exposed_communication_s": self.exposed_communication_s,
            "communication_by_phase_s": dict(self.communication_by_phase_s),
            "one_gpu_step_time_s": self.one_gpu_step_time_s,
            "scaling_efficiency": self.scaling_efficiency,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "tokens_per_s_total": self.tokens_per_s_total,
            "samples_per_s_total": self.samples_per_s_total,
            "modelled": self.modelled,
            **({"details": dict(self.details)} if self.details else {}),
        }


def one_gpu_step_time_s(costs: Sequence[OpCost], step_time_s: float, exposed_s: float,
                        strategy: str, world_size: int) -> float:
    """The step on one GPU, approximately: without exposed communication and FSDP2's
    copies; FSDP2's sharded optimizer phases times the world size."""
    engine = sum(c.time_s * c.repeats for c in costs
                 if c.record.op.startswith(ENGINE_COPY_PREFIX))
    one = step_time_s - exposed_s - engine
    if strategy == "fsdp2":
        sharded = sum(c.time_s * c.repeats for c in costs
                      if c.record.phase in ("optimizer", "clip_grad", "zero_grad"))
        one += (world_size - 1) * sharded
    return max(one, 0.0)
