"""Several simulated GPUs: ``tilefit run --gpus N`` gives the script torchrun's environment as
rank 0 of N, and ``torch.distributed.init_process_group`` (whatever backend it names: "nccl"
on a GPU) the fake process group PyTorch tests with, whose collectives are dispatched (so
recorded, then costed as the estimate costs them) but move no data. DistributedDataParallel
is built as the tracer builds it on fake tensors (tilefit.tracing.distributed): without its
initial parameter check and broadcast, which read values, its buckets all-reduced by one
collective each."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from tilefit.compat.distributed import enable_dtensor, fake_process_group
from tilefit.compat.fake import unset_fake_temporarily
from tilefit.compat.simulated_cuda import patched
from tilefit.simulation.devices import names_gpu
from tilefit.simulation.values import SimulationRecorder
from tilefit.tracing.distributed import ddp_on_fake_tensors


def torchrun_environment(world_size: int) -> dict[str, str]:
    """What torchrun sets for rank 0 of ``world_size`` processes on one node."""
    return {"RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500"}


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _device_mesh_on_real_ranks() -> Iterator[None]:
    """init_device_mesh builds its mesh of ranks outside the fake mode (it reads the ranks'
    values: a fake tensor has none), as the tracer's FSDP2 build does
    (tilefit.tracing.distributed); a "cuda" mesh is built on the CPU, as the tracer's is: its
    tensors are CPU fakes, and FSDP2 places parameters on the mesh's device."""
    from torch.distributed import device_mesh

    build = device_mesh.init_device_mesh

    def init_device_mesh(device_type: str, *args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return build("cpu" if names_gpu(device_type) else device_type, *args, **kwargs)

    import torch.distributed as dist

    with patched(device_mesh, {"init_device_mesh": init_device_mesh}), \
            patched(dist, {"init_device_mesh": init_device_mesh}):
        yield


@contextlib.contextmanager
def _fsdp2_seen(used: list[str]) -> Iterator[None]:
    """FSDP2's fully_shard runs as written (its mesh on the CPU: _device_mesh_on_real_ranks;
    its buffers on the GPU: simulation.devices); ``used`` gets "fsdp2", so the step is
    costed as FSDP2's, its collectives on their own stream."""
    import importlib

    owners = []
    for name in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "fully_shard"):
            owners.append(module)
    if not owners:
        yield
        return
    real = owners[0].fully_shard

    def fully_shard(*args: Any, **kwargs: Any) -> Any:
        if "fsdp2" not in used:
            used.append("fsdp2")
        return real(*args, **kwargs)

    with contextlib.ExitStack() as stack:
        for module in owners:
            stack.enter_context(patched(module, {"fully_shard": fully_shard}))
        yield


@contextlib.contextmanager
def simulated_ranks(world_size: int, recorder: SimulationRecorder, used: list[str]
                    ) -> Iterator[None]:
    """Rank 0 of ``world_size`` for the block; ``used`` collects the engines the code built
    ("ddp", "fsdp2")."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    build = DistributedDataParallel.__init__

    def ddp_init(ddp: Any, module: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["init_sync"] = False  # its parameter check and broadcast read values
        with recorder.engine_buffers():
            build(ddp, module, *args, **kwargs)
        ddp_on_fake_tensors(ddp, recorder, recorder.engine_buffers)
        used.append("ddp")

    enable_dtensor()
    with _device_mesh_on_real_ranks(), _fsdp2_seen(used), \
            _environment(torchrun_environment(world_size)), fake_process_group(world_size), \
            patched(dist, {"init_process_group": lambda *a, **k: None,
                           "destroy_process_group": lambda *a, **k: None}), \
            patched(DistributedDataParallel, {"__init__": ddp_init}):
        yield
