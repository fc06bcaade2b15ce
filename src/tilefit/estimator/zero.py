"""DeepSpeed ZeRO stages 1-3 on N GPUs, modelled: per-GPU memory and the step's collectives.

DeepSpeed's engine does not run on fake tensors (its initialisation moves the module with
``module.to(device)``, which cannot swap fake parameters), so ZeRO is not traced: its
documented partitioning and buffers are put on top of the one-GPU trace
(docs/references.md, section 24, item 2). Pure arithmetic, no torch.

Per GPU, Psi trainable parameters, w bytes per weight (2 for 16-bit weights), N GPUs,
K = 4 (fp32 master weights) + 4 (fp32 gradients) + the optimizer's own state per parameter
(8 for Adam: 16 in all, DeepSpeed's figure):

    stage  parameters  gradients  optimizer (+ master, fp32 grads)  gathered
    1      w Psi       w Psi      K Psi / N                          0
    2      w Psi       w Psi / N  K Psi / N                          0
    3      w Psi / N   (in K)     K Psi / N                          2 w L

L is the largest layer's parameter count (its parameters and gradients gathered whole).
With w = 2 and K = 16 stage 2 is DeepSpeed's ``estimate_zero2_model_states_mem_needs``
(2 Psi + 18 Psi / N) and stage 3 its ``estimate_zero3_model_states_mem_needs``
(4 L + 18 Psi / N). ``offload``: the optimizer partition (master weights, fp32 gradients,
state) lives in CPU memory, as the same functions count it with ``cpu_offload``.
Buffers beyond the model states, from DeepSpeed's source and defaults: the contiguous
gradient bucket of ``reduce_bucket_size`` elements (two with ``overlap_comm`` at stages 1
and 2), and at stage 3 the parameters prefetched ahead (``stage3_prefetch_bucket_size``,
within ``stage3_max_live_parameters``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import Any

from tilefit.errors import TilefitError
from tilefit.recipe import DEEPSPEED_DEFAULTS, ZeroConfig
from tilefit.vocab import ZERO_STRATEGIES

MASTER_BYTES = 4  # fp32 master copy of each parameter in the partition
FP32_GRAD_BYTES = 4  # fp32 gradient partition the optimizer steps on
LOAD_BYTES = 4  # DeepSpeed's CPU estimate: each process holds the fp32 model while loading
CPU_BUFFER_FACTOR = 1.5  # DeepSpeed's additional_buffer_factor default for CPU memory


# DeepSpeed's bucket sizes are part of the recipe (tilefit.recipe.Parallelism.zero)


@dataclass(frozen=True)
class ZeroInputs:
    """What the one-GPU trace says of the model."""

    params: int  # trainable parameters, Psi
    weight_bytes: int  # bytes per weight: 2 for 16-bit weights, 4 for fp32
    optimizer_bytes_per_param: float  # the optimizer's own state (AdamW: 8)
    largest_layer_params: int  # L
    # the parameter tensors' sizes (elements) in the order DeepSpeed flattens them
    # (model.parameters()); () when unknown
    param_sizes: tuple[int, ...] = ()

    @property
    def second_largest_params(self) -> int:
        """L2: the largest parameter tensor after L (0 when unknown)."""
        ranked = sorted(self.param_sizes, reverse=True)
        return ranked[1] if len(ranked) > 1 else 0

    def overlap_params(self, world_size: int) -> int:
        """The elements of the whole parameters that reach into a rank's flat partition,
        the most over ranks: stage 1-2's ``grads_in_partition`` holds each of them whole
        (stage_1_and_2.py, copy_grads_in_partition: ``total_size`` sums the numel of every
        parameter in ``params_in_partition``). Unknown sizes: the partition plus L."""
        part = math.ceil(self.params / world_size)
        if not self.param_sizes:
            return min(self.params, part + self.largest_layer_params)
        return _overlap(self.param_sizes, part)

    @property
    def partition_bytes_per_param(self) -> float:
        """K: what the optimizer partition holds per parameter."""
        return MASTER_BYTES + FP32_GRAD_BYTES + self.optimizer_bytes_per_param


@dataclass(frozen=True)
class ZeroMemory:
    """One GPU's memory under ZeRO, by part; ``host_bytes``: DeepSpeed's CPU estimate per
    node (its 1.5 buffer factor included)."""

    stage: int
    world_size: int
    offload: bool
    parameters_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int  # master weights, fp32 gradients and optimizer state
    gathered_bytes: int  # stage 3: the largest layer's parameters and gradients, whole
    buffer_bytes: int  # gradient bucket(s), stage 3's prefetched parameters
    host_bytes: int

    @property
    def model_states_bytes(self) -> int:
        """What DeepSpeed's estimate_zero*_model_states_mem_needs counts per GPU."""
        return (self.parameters_bytes + self.gradients_bytes + self.optimizer_state_bytes
                + self.gathered_bytes)

    @property
    def total_bytes(self) -> int:
        return self.model_states_bytes + self.buffer_bytes

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "model_states_bytes": self.model_states_bytes}


@functools.lru_cache(maxsize=64)
def _overlap(sizes: tuple[int, ...], part: int) -> int:
    """The most elements of whole parameters reaching into one partition of ``part``
    elements, the parameters laid end to end in order."""
    totals: dict[int, int] = {}
    start = 0
    for size in sizes:
        if size:
            for rank in range(start // part, (start + size - 1) // part + 1):
                totals[rank] = totals.get(rank, 0) + size
        start += size
    return max(totals.values(), default=0)


def zero_stage(strategy: str) -> int:
    """1, 2 or 3 for "zero1", "zero2", "zero3"."""
    key = str(strategy).strip().lower()
    if key not in ZERO_STRATEGIES:
        raise TilefitError(f"unknown ZeRO stage {strategy!r}",
                           expected=", ".join(ZERO_STRATEGIES), given=repr(strategy),
                           fix="pass Parallelism(strategy='zero2')")
    return ZERO_STRATEGIES.index(key) + 1


def zero_memory(inp: ZeroInputs, stage: int, world_size: int, *, offload: bool = False,
                config: ZeroConfig = DEEPSPEED_DEFAULTS, gpus_per_node: int = 8) -> ZeroMemory:
    """One GPU's model states and buffers at ``stage`` over ``world_size`` GPUs."""
    w, psi, n = inp.weight_bytes, inp.params, world_size
    per_gpu = psi / n
    params = w * psi if stage < 3 else w * per_gpu
    grads = {1: w * psi, 2: 0.0 if offload else w * per_gpu, 3: 0.0}[stage]
    optimizer = 0.0 if offload else inp.partition_bytes_per_param * per_gpu
    gathered = 2 * w * inp.largest_layer_params if stage == 3 else 0
    return ZeroMemory(
        stage=stage, world_size=n, offload=offload, parameters_bytes=int(params),
        gradients_bytes=int(grads), optimizer_state_bytes=int(optimizer),
        gathered_bytes=gathered, buffer_bytes=_buffer_bytes(inp, stage, config),
        host_bytes=_host_bytes(inp, stage, n, offload, min(n, gpus_per_node)))


def _buffer_bytes(inp: ZeroInputs, stage: int, config: ZeroConfig) -> int:
    """A summary (ZeroMemory.buffer_bytes; the peak takes ``zero_points``' figures): the
    contiguous gradient bucket, allocated whole (``torch.empty(reduce_bucket_size)`` in
    stage_1_and_2.py and stage3.py), doubled by overlap_comm at stages 1 and 2; at stage
    2 the largest layer's gradient, which autograd makes whole before DeepSpeed's hook
    copies it into the bucket (docs/references.md, section 24, item 4); at stage 3 the
    parameters prefetched beyond the gathered layer."""
    buckets = 2 if stage < 3 and config.overlaps(stage) else 1
    total = buckets * config.reduce_bucket_size * inp.weight_bytes
    if stage == 2:
        total += inp.largest_layer_params * inp.weight_bytes
    if stage == 3:
        room = min(inp.params, config.stage3_max_live_parameters) - inp.largest_layer_params
        total += min(config.stage3_prefetch_bucket_size, max(room, 0)) * inp.weight_bytes
    return int(total)


def zero_points(inp: ZeroInputs, stage: int, world_size: int, *, offload: bool = False,
                config: ZeroConfig = DEEPSPEED_DEFAULTS, grads_made: int | None = None
                ) -> tuple[dict[str, int], dict[str, int]]:
    """One rank's model states and DeepSpeed buffers, by category, (in forward/backward,
    at the step), as DeepSpeed 0.19.8 allocates them (measured on its engine:
    docs/references.md, section 24, item 4). ``grads_made``: the bytes of gradient that
    backward has made so far on one GPU (the trace's, at the same point; None: all of
    them). P = Psi / N, w bytes per weight, B the reduce bucket, L and L2 the two largest
    parameter tensors.

    Forward/backward. Stages 1-2 have no fp32 gradient partition yet; the first gradient
    hook allocates the bucket (``process_gradients``, ``setup_buckets``), and the rank's
    gradients are copied into ``grads_in_partition`` (w bytes for every parameter reaching
    into the partition, whole): at stage 1 once backward is over (``reduce_gradients``), at
    stage 2 from its first bucket reduction on (the second gradient's hook, backward
    having made the last parameter's first). Stage 1 keeps every 16-bit gradient; stage 2
    the one autograd has just made (L) and one waiting un-copied in the bucket (L2 when it
    exceeds B: ``extra_large_param_to_reduce``). Stage 3: its partition and persistent bucket; in
    forward it gathers each module's parameters and keeps those used again within
    ``stage3_max_reuse_distance`` elements (its backward comes within twice the parameters
    after it), so at the forward/backward turn the last R/2 elements are gathered; backward
    releases each module once its gradient is made (that gradient, up to L, in flight);
    beyond the kept ones, prefetch gathers whole parameters (at least L2).

    Stage 3 keeps its gradient partition in the weights' dtype (w P in place of K's fp32
    4 P; DeepSpeed's default gradient-accumulation dtype).

    Step. The 16-bit gradients and stages 1-2's bucket are gone; the fp32 gradient
    partition is made (in K); stage 3 flattens its gradient partition into an fp32 copy
    (``_prepare_fp32_grad_for_sub_group``) and keeps its bucket; nothing is gathered.
    """
    mem = zero_memory(inp, stage, world_size, offload=offload, config=config)
    made = inp.weight_bytes * inp.params if grads_made is None else grads_made
    if stage < 3:
        return _stage12_points(inp, stage, world_size, mem, made, offload, config)
    return _stage3_points(inp, world_size, mem, made, offload, config)


def _stage12_points(inp: ZeroInputs, stage: int, world_size: int, mem: ZeroMemory, made: int,
                    offload: bool, config: ZeroConfig
                    ) -> tuple[dict[str, int], dict[str, int]]:
    """zero_points at stages 1 and 2 (``made``: the gradient bytes backward has made)."""
    w, b = inp.weight_bytes, config.reduce_bucket_size
    part = math.ceil(inp.params / world_size)
    big, second = inp.largest_layer_params, inp.second_largest_params
    optimizer = mem.optimizer_state_bytes
    buckets = 2 if config.overlaps(stage) else 1
    if offload:
        in_partition = optimizer_bwd = 0
    else:
        in_partition = w * inp.overlap_params(world_size)
        optimizer_bwd = optimizer - FP32_GRAD_BYTES * part
    waiting = w * (big + (second if second > b else 0))
    grads = made if stage == 1 else min(made, waiting)
    # stage 1 copies into grads_in_partition after backward (reduce_gradients); stage 2
    # at its first bucket reduction, when the second gradient arrives
    first = inp.param_sizes[-1] if inp.param_sizes else big
    copied = made >= w * inp.params if stage == 1 else made > w * first
    backward = {"parameters": mem.parameters_bytes, "gradients": grads,
                "optimizer_state": optimizer_bwd + (in_partition if copied else 0),
                "communication": buckets * b * w if made else 0}
    step = {"parameters": mem.parameters_bytes, "gradients": 0,
            "optimizer_state": optimizer, "communication": 0}
    return backward, step


def _stage3_points(inp: ZeroInputs, world_size: int, mem: ZeroMemory, made: int,
                   offload: bool, config: ZeroConfig) -> tuple[dict[str, int], dict[str, int]]:
    """zero_points at stage 3 (``made``: the gradient bytes backward has made)."""
    w, b = inp.weight_bytes, config.reduce_bucket_size
    part = math.ceil(inp.params / world_size)
    big, second = inp.largest_layer_params, inp.second_largest_params
    optimizer = mem.optimizer_state_bytes
    kept = min(inp.params, config.stage3_max_reuse_distance // 2)
    room = max(min(inp.params, config.stage3_max_live_parameters) - kept, 0)
    prefetch = min(max(config.stage3_prefetch_bucket_size, second), room)
    in_flight = min(made, w * big)
    gathered = max(w * kept - max(made - w * big, 0), w * big)
    # the gradient partition is kept in the gradient-accumulation dtype, by default the
    # weights' (stage3.py:784-791): w P, not the fp32 gradients K counts
    if not offload:
        optimizer += (w - FP32_GRAD_BYTES) * part
    backward = {"parameters": mem.parameters_bytes, "gradients": 0,
                "optimizer_state": optimizer,
                "communication": gathered + in_flight + w * (b + prefetch)}
    step = {"parameters": mem.parameters_bytes, "gradients": 0,
            "optimizer_state": optimizer + (0 if offload else FP32_GRAD_BYTES * part),
            "communication": w * b}
    return backward, step


def _host_bytes(inp: ZeroInputs, stage: int, world_size: int, offload: bool,
                gpus_per_node: int) -> int:
    """DeepSpeed's CPU estimate per node (estimate_zero2/zero3_model_states_mem_needs, with
    zero_init and the parameters kept on the GPU at stage 3), K for its 16."""
    psi, k = inp.params, inp.partition_bytes_per_param
    nodes = math.ceil(world_size / gpus_per_node)
    if stage < 3:
        per_param = max(LOAD_BYTES * world_size, k) if offload else LOAD_BYTES * gpus_per_node
        return int(psi * per_param * CPU_BUFFER_FACTOR)
    if offload:
        return int(psi * k / nodes * CPU_BUFFER_FACTOR)
    return int(inp.largest_layer_params * LOAD_BYTES * gpus_per_node * CPU_BUFFER_FACTOR)


@dataclass(frozen=True)
class ZeroCollective:
    """Collectives of one kind in one phase of the optimizer step: ``count`` calls of
    ``nbytes`` each (NCCL's size: the whole buffer), ``repeats`` times per step."""

    phase: str
    name: str  # a collectives.BUS_FACTOR name
    nbytes: int
    count: int
    repeats: int = 1


def zero_collectives(inp: ZeroInputs, stage: int, accumulation_steps: int,
                     config: ZeroConfig = DEEPSPEED_DEFAULTS) -> tuple[ZeroCollective, ...]:
    """The step's collectives (ZeRO paper, section 7): stages 1-2 reduce-scatter the
    gradients in buckets (stage 1 once per step, stage 2 after every micro-batch) and
    all-gather the updated parameters after the optimizer step; stage 3 all-gathers the
    parameters in forward and again in backward and reduce-scatters the gradients, every
    micro-batch."""
    grads = inp.weight_bytes * inp.params
    reduce = _pieces(inp.params, config.reduce_bucket_size)
    a = accumulation_steps
    if stage < 3:
        gather = _pieces(inp.params, config.allgather_bucket_size)
        return (ZeroCollective("backward", "reduce_scatter", grads // reduce, reduce,
                               1 if stage == 1 else a),
                ZeroCollective("optimizer", "all_gather", grads // gather, gather))
    gather = _pieces(inp.params, config.stage3_prefetch_bucket_size)
    return (ZeroCollective("forward", "all_gather", grads // gather, gather, a),
            ZeroCollective("backward", "all_gather", grads // gather, gather, a),
            ZeroCollective("backward", "reduce_scatter", grads // reduce, reduce, a))


def _pieces(elements: int, bucket: int) -> int:
    return max(1, math.ceil(elements / max(bucket, 1)))
