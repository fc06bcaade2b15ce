"""Rank 0 of a data-parallel step: the model wrapped in the real engine (DDP or FSDP2) under
PyTorch's fake process group, so the trace records the engine's own collectives and buffers.

- DDP: ``torch.nn.parallel.DistributedDataParallel`` with its gradient buckets (default
  ``bucket_cap_mb``, ``gradient_as_bucket_view=False``), built while the recorder runs so its
  buckets are tracked. DDP rebuilds its buckets in the second step's forward, so a DDP trace
  runs both steps in full (no replay of the first). The fake group's work objects carry no
  result, which DDP's built-in all-reduce hook needs, so an equivalent hook is registered:
  one all-reduce of each bucket (the built-in hook's division by the world size is fused
  into the bucket copy; the values do not matter on fake tensors).
- FSDP2: ``fully_shard`` on each block of the model's layer list, then on the root (the
  recipe of PyTorch's FSDP2 tutorial and torchtitan): parameters resharded after forward,
  the next block's all-gather prefetched. Under mixed precision (an autocast dtype) with
  ``MixedPrecisionPolicy(param_dtype=<that dtype>, reduce_dtype=float32)`` as torchtitan
  runs it: 16-bit all-gathers and compute weights, gradients reduce-scattered in fp32
  (docs/references.md, section 23); autocast stays on around it, as accelerate runs it,
  and casts nothing the policy already cast. Otherwise no policy (all-gathers in the parameters'
  dtype). A factory's model is built on the meta device and materialised with ``to_empty``
  inside the fake mode. The fake group's reduce-scatter allocates nothing, as NCCL's; for a
  CPU target, whose backend is gloo, the trace adds gloo's clone of the whole input
  (``gloo_reduce_scatter``; docs/references.md, section 23, item 8).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tilefit.compat.distributed import (
    distributed_available,
    enable_dtensor,
    fake_process_group,
    process_group_initialized,
    rebuild_ddp_buckets_on_fake_tensors,
    reduce_scatter_single_name,
)
from tilefit.compat.fake import FakeTensorMode
from tilefit.errors import TilefitError
from tilefit.tracing.recorder import Recorder
from tilefit.vocab import DEFAULT_STRATEGY, STRATEGIES, ZERO_STRATEGIES

__all__ = ["Parallel", "find_layer_list", "fsdp2_policy", "parallel_spec", "process_group",
           "root_name", "wrap_model"]


@dataclass(frozen=True)
class Parallel:
    """A data-parallel setup: the engine and the number of ranks (one GPU each). The
    planner also names DeepSpeed ZeRO stages here (vocab.ZERO_STRATEGIES, with ``offload``
    of the optimizer to the CPU): those are modelled on the one-GPU trace
    (tilefit.estimator.zero_step), never wrapped or traced by this module."""

    strategy: str  # a vocab.STRATEGIES name, or a ZERO_STRATEGIES one (planner only)
    world_size: int
    offload: bool = False  # ZeRO-Offload: the optimizer on the CPU (ZeRO only)

    @property
    def modelled(self) -> bool:
        """DeepSpeed ZeRO: modelled on the one-GPU trace, not traced under the engine."""
        return self.strategy in ZERO_STRATEGIES


def parallel_spec(world_size: int = 1, strategy: str | None = None) -> Parallel | None:
    """The setup for ``world_size`` ranks, None for one GPU without a strategy (today's
    single-device trace). Without a strategy, several GPUs run ``DEFAULT_STRATEGY``."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise TilefitError("the world size must be a whole number of GPUs >= 1",
                           expected="1, 2, 4, 8, ...", given=repr(world_size),
                           fix="pass Parallelism(world_size=...) with the number of GPUs")
    if strategy is None:
        return None if world_size == 1 else Parallel(DEFAULT_STRATEGY, world_size)
    key = str(strategy).strip().lower()
    if key in ZERO_STRATEGIES:
        raise TilefitError(f"DeepSpeed {key} is modelled, not traced",
                           expected="a traced engine: " + ", ".join(STRATEGIES),
                           given=repr(strategy),
                           fix=f"estimate it (tilefit.estimate(..., recipe=Recipe(parallel="
                           f"Parallelism(strategy={key!r})))): it is modelled on the one-GPU "
                           "trace")
    if key not in STRATEGIES:
        raise TilefitError(f"unknown data-parallel strategy {strategy!r}",
                           expected="one of " + ", ".join(STRATEGIES) + " (traced) or "
                           + ", ".join(ZERO_STRATEGIES) + " (DeepSpeed ZeRO, modelled)",
                           given=repr(strategy),
                           fix="pass Parallelism(strategy='fsdp2') (sharded), "
                           "Parallelism(strategy='ddp') (replicated) or "
                           "Parallelism(strategy='zero2') (DeepSpeed ZeRO-2)")
    if not distributed_available():
        raise TilefitError("this torch build has no torch.distributed",
                           expected="a torch build with distributed support (Linux wheels)",
                           given="torch.distributed.is_available() is False",
                           fix="trace on one GPU (Parallelism(world_size=1))")
    return Parallel(key, world_size)


@contextlib.contextmanager
def process_group(parallel: Parallel | None, gloo: bool = False) -> Iterator[Any]:
    """The fake process group of ``parallel`` (and FSDP2's device mesh, yielded), or
    nothing for a single-device trace; ``gloo``: its reduce-scatter as gloo runs it (a CPU
    target), else as NCCL does."""
    if parallel is None:
        yield None
        return
    if process_group_initialized():
        raise TilefitError("a torch.distributed process group is already initialised",
                           expected="tilefit's multi-GPU trace to run outside torchrun's group",
                           given="torch.distributed.is_initialized() is True",
                           fix="call tilefit.estimate(world_size=...) before "
                           "init_process_group, or in a separate process")
    enable_dtensor()
    with fake_process_group(parallel.world_size), \
            gloo_reduce_scatter() if gloo else contextlib.nullcontext():
        mesh = None
        if parallel.strategy == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh

            # outside the fake mode: the mesh holds a real tensor of ranks
            mesh = init_device_mesh("cpu", (parallel.world_size,))
        yield mesh


@contextlib.contextmanager
def gloo_reduce_scatter() -> Iterator[None]:
    """torch.distributed.reduce_scatter_single (reduce_scatter_tensor before torch 2.13) as
    ProcessGroupGloo runs it: a clone of the whole input alive through the collective, this
    rank's chunk copied out of it (NCCL works on the input and output as given). FSDP2's
    reduce-scatter input is a block's unsharded gradients in the reduce dtype, so on a CPU
    the clone sets the backward's peak under mixed precision
    (docs/references.md, section 23, item 8)."""
    import torch.distributed as dist

    name = reduce_scatter_single_name()
    plain = getattr(dist, name)

    def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, *args: Any,
                              **kwargs: Any) -> Any:
        clone = input.clone()
        work = plain(output, input, *args, **kwargs)
        output.copy_(clone.chunk(dist.get_world_size(kwargs.get("group")))[0])
        del clone
        return work

    setattr(dist, name, reduce_scatter_single)
    try:
        yield
    finally:
        setattr(dist, name, plain)


def find_layer_list(model: nn.Module) -> tuple[str, list[nn.Module]] | None:
    """The model's list of repeated blocks (HF ``model.layers``, ``transformer.h``, ...):
    the ModuleList or Sequential of two or more children of one class, with parameters,
    holding the most parameters. None when there is none."""
    best: tuple[int, str, list[nn.Module]] | None = None
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList | nn.Sequential):
            continue
        children = list(mod.children())
        if len(children) < 2 or len({type(c) for c in children}) != 1:
            continue
        numel = sum(p.numel() for p in mod.parameters())
        if numel and (best is None or numel > best[0]):
            best = (numel, name, children)
    return None if best is None else (best[1], best[2])


def root_name(model: nn.Module) -> str:
    """The root of the module paths the recorder reports: DDP's wrapped module, so paths
    read as on one GPU; the model itself otherwise (FSDP2 keeps the module tree)."""
    name = type(model).__name__
    return f"{name}.module" if hasattr(model, "module") and hasattr(model, "reducer") else name


def wrap_model(model: nn.Module, parallel: Parallel, mesh: Any, mode: FakeTensorMode,
               recorder: Recorder, param_dtype: torch.dtype | None = None
               ) -> tuple[nn.Module, tuple[str, ...]]:
    """``model`` in the engine of ``parallel``, its parameters fake; and notes for the
    trace's warnings. ``param_dtype``: mixed precision's autocast dtype, FSDP2's policy."""
    if parallel.strategy == "ddp":
        return _wrap_ddp(model, mode, recorder), ()
    return _wrap_fsdp2(model, mesh, mode, param_dtype)


def fsdp2_policy(param_dtype: torch.dtype | None) -> Any:
    """FSDP2's MixedPrecisionPolicy for a mixed-precision recipe (torchtitan's: the compute
    dtype for parameters, fp32 for the gradient reduction); the default policy (none)
    without one."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if param_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def _wrap_fsdp2(model: nn.Module, mesh: Any, mode: FakeTensorMode,
                param_dtype: torch.dtype | None) -> tuple[nn.Module, tuple[str, ...]]:
    from torch.distributed.fsdp import fully_shard

    notes: list[str] = []
    _check_shardable(model)
    found = find_layer_list(model)
    if found is None:
        notes.append(f"FSDP2 found no list of repeated blocks in {type(model).__name__}: only "
                     "the root was wrapped (one all-gather of every parameter per forward "
                     "and backward)")
    else:
        for block in found[1]:
            fully_shard(block, mesh=mesh, mp_policy=fsdp2_policy(param_dtype))
    fully_shard(model, mesh=mesh, mp_policy=fsdp2_policy(param_dtype))
    if any(p.is_meta for p in model.parameters()):
        with mode:
            model.to_empty(device="cpu")
    return model, tuple(notes)


def _check_shardable(model: nn.Module) -> None:
    """FSDP2 shards every parameter on its first dimension: a 0-d parameter cannot be sharded
    (fully_shard refuses it deep inside); name it and its module instead."""
    scalars = [name for name, p in model.named_parameters() if p.dim() == 0]
    if scalars:
        module = scalars[0].rpartition(".")[0] or "(the root module)"
        raise TilefitError(
            f"FSDP2 cannot shard the 0-d parameter {scalars[0]} (module {module})"
            + (f" and {len(scalars) - 1} more" if len(scalars) > 1 else ""),
            expected="parameters with at least one dimension (fully_shard splits dim 0)",
            given=", ".join(scalars[:4]),
            fix="make it a 1-element tensor (nn.Parameter(torch.ones(1))), or use "
            "Parallelism(strategy='ddp'), which does not shard")


def _wrap_ddp(model: nn.Module, mode: FakeTensorMode, recorder: Recorder) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    with mode, recorder, recorder.allocations_as("communication"):
        # init_sync=False: the construction's parameter check and broadcast read values
        ddp = DistributedDataParallel(model, init_sync=False)
    ddp_on_fake_tensors(ddp, recorder)
    return ddp


def ddp_on_fake_tensors(ddp: nn.Module, recorder: Recorder,
                        around: Callable[[], Any] | None = None) -> None:
    """A DDP built on fake tensors (with ``init_sync=False``) made to run there: its buckets
    all-reduced by one collective each, and rebuilt as the recorder's "communication"
    (``around()``: the context the rebuild runs in; default that category)."""
    ddp.register_comm_hook(None, _all_reduce_bucket)  # type: ignore[operator]
    rebuild_ddp_buckets_on_fake_tensors(
        ddp, around or (lambda: recorder.allocations_as("communication")))


def _all_reduce_bucket(state: Any, bucket: Any) -> Any:
    """DDP's communication hook: one all-reduce of the bucket, its future resolving to the
    bucket (the fake group's own future resolves to None)."""
    import torch.distributed as dist

    buffer = bucket.buffer()
    work = dist.all_reduce(buffer, async_op=True)
    return work.get_future().then(lambda _: buffer)


# DDP checks a hook's annotations against its own classes; these module's are strings
_all_reduce_bucket.__annotations__ = {}
