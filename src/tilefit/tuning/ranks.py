"""tune under ``torchrun``: the ranks agree on every decision, so the search is the same on all.

Each rank runs the same trials in the same order; after each one, every rank takes part in
one all-reduce of its outcome (docs/references.md, section 24, item 1):

- fits: MAX of a failure code (0 fits, 1 out of memory or over the budget, 2 another error),
  so a batch that does not fit on one rank does not fit for the job;
- times: MAX of each timed repeat, since a data-parallel step is as slow as its slowest
  rank (the gradient all-reduce waits for it);
- the first probe: the smallest rank's prediction;
- what a fitting trial says of memory (the search extrapolates it to the next probe): the
  rank with the least room, each figure as its distance to that rank's budget (MAX), put
  against the smallest budget (``tightest``).

The all-reduce runs after the trial on every rank, also the rank that ran out of memory,
so no rank waits for a collective another rank never issues. Fit trials run the user's
module *unwrapped* (``local_module``): DDP's gradient all-reduce is issued by hooks armed
only by ``DistributedDataParallel.forward``, so a forward through the inner module launches
no collective, and a rank that runs out of memory half-way through cannot leave the others
waiting inside backward. Throughput trials run the wrapped model (its all-reduce is part of
the step's time) only at batches every rank's fit trial has proved to fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tilefit.errors import TilefitError
from tilefit.tuning.search import FitProbe
from tilefit.vocab import PHASES

FITS, DOES_NOT_FIT, FAILED = 0, 1, 2
NO_PROBE = 2**62  # stands for "no prediction" in the MIN all-reduce of first probes


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job: rank 0 of 1 outside ``torch.distributed``."""

    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def _reduce(self, values: list[float], op: Any, dtype: torch.dtype) -> list[float]:
        import torch.distributed as dist

        t = torch.tensor(values, dtype=dtype, device=_collective_device())
        dist.all_reduce(t, op=op)
        return t.tolist()

    def agree(self, code: int, times_s: list[float]) -> tuple[int, list[float]]:
        """The worst outcome over the ranks (FITS < DOES_NOT_FIT < FAILED) and each time,
        the slowest rank's: one all-reduce (MAX) of ``[code, *times_s]``."""
        if not self.distributed:
            return code, times_s
        import torch.distributed as dist

        worst = self._reduce([float(code), *times_s], dist.ReduceOp.MAX, torch.float64)
        return int(worst[0]), worst[1:]

    def tightest(self, probe: FitProbe) -> FitProbe:
        """A fitting trial's memory figures as the rank with the least room sees them, the
        same on every rank: each figure minus its rank's budget, the MAX over ranks, plus
        the smallest budget. A figure unknown on any rank is unknown."""
        if not self.distributed:
            return probe
        if not probe.fits:
            return FitProbe(False)  # the search extrapolates from fitting trials only
        import torch.distributed as dist

        budget = probe.budget_bytes
        phases = probe.phase_peaks or {}
        figures = [probe.peak_bytes, probe.baseline_bytes, *(phases.get(k) for k in PHASES)]
        rel = [math.inf if budget is None or v is None else float(v - budget) for v in figures]
        worst = self._reduce([math.inf if budget is None else float(-budget), *rel],
                             dist.ReduceOp.MAX, torch.float64)
        if math.isinf(worst[0]) or math.isinf(worst[1]):
            return FitProbe(True)
        least = int(-worst[0])
        known = [None if math.isinf(v) else least + int(v) for v in worst[1:]]
        peak, baseline, per_phase = known[0], known[1], known[2:]
        phase_peaks = {k: v for k, v in zip(PHASES, per_phase, strict=True) if v is not None}
        return FitProbe(True, peak_bytes=peak, budget_bytes=least, baseline_bytes=baseline,
                        phase_peaks=phase_peaks or None)

    def smallest_probe(self, probe: int | None) -> int | None:
        """The smallest rank's first probe (None where no rank has one)."""
        if not self.distributed:
            return probe
        import torch.distributed as dist

        value = NO_PROBE if probe is None else probe
        agreed = int(self._reduce([value], dist.ReduceOp.MIN, torch.int64)[0])
        return None if agreed == NO_PROBE else agreed


def current_ranks() -> Ranks:
    """The job this process belongs to: ``torch.distributed``'s, when initialised."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return Ranks(dist.get_rank(), dist.get_world_size())
    return Ranks()


def _collective_device() -> torch.device:
    """Where the backend takes tensors: NCCL's on the rank's GPU, gloo's on the CPU."""
    import torch.distributed as dist

    if "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def local_module(model: nn.Module, ranks: Ranks) -> nn.Module:
    """The module a fit trial runs: a DDP model's inner module (no collective in its step).
    Sharded engines cannot run a step without their collectives: an error says so."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return model.module
    if ranks.distributed and _is_sharded(model):
        raise TilefitError(
            "tune under torchrun cannot run trials of a sharded model (FSDP): its forward "
            "all-gathers parameters, so a rank that runs out of memory would leave the "
            "others waiting",
            expected="a model wrapped in DistributedDataParallel, or not wrapped",
            given=type(model).__name__,
            fix="tune the unwrapped model (one rank, or every rank before fully_shard), or "
            "predict the sharded step with `tilefit estimate MODEL --gpus N --strategy fsdp2`")
    return model


def _is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return any(isinstance(m, FSDPModule | FullyShardedDataParallel) for m in model.modules())


def rank_share(global_batch: int | None, ranks: Ranks) -> int | None:
    """One rank's share of the global batch (micro-batch x accumulation on each rank)."""
    if global_batch is None or not ranks.distributed:
        return global_batch
    if global_batch % ranks.world_size:
        raise TilefitError(
            "the global batch must split evenly over the ranks",
            expected=f"a multiple of the world size, {ranks.world_size}",
            given=f"global_batch={global_batch}",
            fix="pass TuneSearch(global_batch="
            f"{ranks.world_size * max(1, global_batch // ranks.world_size)})")
    return global_batch // ranks.world_size
