"""`tilefit tune` launched by ``torchrun``: join the job, wrap the model in DDP, print on rank 0.

torchrun sets ``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK`` in each process's environment
(PyTorch's torchrun documentation, docs/references.md, section 24, item 1); with more than one
process the command joins the job (NCCL on GPUs, gloo on the CPU), trains each rank's model
as DistributedDataParallel does and leaves the job when done.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Job:
    """This process's part in a torchrun job (rank 0 of 1 when not launched by torchrun)."""

    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def wrap(self, module: Any, device: Any) -> Any:
        """The module as each rank trains it: DDP over the job, or as it is alone."""
        if self.world_size == 1:
            return module
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=ids)


def world_size_from_env() -> int:
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


@contextlib.contextmanager
def torchrun_job(gpu: str) -> Iterator[Job]:
    """Join the job torchrun launched this process into (the CPU's gloo when ``gpu`` is cpu
    or there is no GPU, else NCCL on the local rank's GPU) and leave it on exit."""
    if world_size_from_env() == 1:
        yield Job()
        return
    import torch
    import torch.distributed as dist

    on_gpu = gpu.strip().lower() != "cpu" and torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    joined = not dist.is_initialized()
    if joined:
        dist.init_process_group("nccl" if on_gpu else "gloo")
    try:
        yield Job(dist.get_rank(), dist.get_world_size())
    except BaseException:
        if joined:  # no barrier: the other ranks may never reach it
            dist.destroy_process_group()
        raise
    if joined:
        dist.barrier()  # no rank tears the group down while another is in a collective
        dist.destroy_process_group()
