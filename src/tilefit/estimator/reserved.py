"""The memory the GPU really holds: a trace's storages replayed through PyTorch's CUDA
caching allocator (tilefit.estimator.allocator), against the line where it runs out of
memory, so that "fits" is decided as a real run decides it (docs/references.md, section 31).

The line is what the allocator may reserve: the device's memory less what a PyTorch process
holds outside it (the CUDA context and cuBLAS's workspace, tilefit.estimator.overhead_bytes).
On a failed cudaMalloc the allocator releases its cached segments and retries before it
raises; the replay does the same, so a step whose reserved peak would pass the line can still
fit when releasing whole cached segments makes room."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tilefit.alloc_conf import AllocatorConfig, alloc_conf_from_env, parse_alloc_conf
from tilefit.estimator.allocator_replay import events_of, replay
from tilefit.tracing.records import Trace

__all__ = ["ReservedMemory", "allocator_config_of", "reserved_memory"]


@dataclass(frozen=True)
class ReservedMemory:
    """What the caching allocator holds over the traced step (two steps: the first creates
    the optimizer state), on one GPU."""

    alloc_conf: str  # the PYTORCH_CUDA_ALLOC_CONF the replay ran under ("": PyTorch's defaults)
    limit_bytes: int  # what the allocator may reserve: device memory less context, workspace
    peak_reserved_bytes: int  # torch.cuda.max_memory_reserved
    allocated_at_peak_bytes: int  # the blocks in use when reserved first reached its peak
    peak_allocated_bytes: int  # torch.cuda.max_memory_allocated (whole blocks)
    segments: int  # segments held at the reserved peak
    segments_created: int  # cudaMalloc calls over the step
    fits: bool  # no allocation failed, after the allocator's own release and retry
    released_bytes: int  # what those releases gave back
    failed_request_bytes: int | None = None  # the request that raised OutOfMemoryError
    failed_where: str | None = None  # its phase and module
    notes: tuple[str, ...] = ()
    # memory_stats()['num_alloc_retries']: cudaMallocs tried again after the allocator
    # released its whole cache (each release synchronizes the device). Over the two traced
    # steps; and in the steady state: a third step replayed after them (the second step's
    # allocations repeated from the state the trace left; allocator_replay.repeated_step),
    # or the traced second step's where the trace is not periodic
    alloc_retries: int = 0
    steady_alloc_retries: int = 0

    @property
    def fits_by_releasing(self) -> bool:
        """The step fits, but only because the allocator releases its cache in every
        step of the steady state."""
        return self.fits and self.steady_alloc_retries > 0

    @property
    def fragmentation_bytes(self) -> int:
        """What the allocator holds beyond the most the tensors ever need (reserved peak less
        allocated peak): cached blocks too small or in the wrong place for the requests that
        came later, split remainders. Reserved minus allocated at the reserved peak itself
        (``allocated_at_peak_bytes``) overstates it: the allocator usually creates its last
        segment long before the tensors peak, and serves the peak from its cache."""
        return self.peak_reserved_bytes - self.peak_allocated_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"alloc_conf": self.alloc_conf, "limit_bytes": self.limit_bytes,
                "peak_reserved_bytes": self.peak_reserved_bytes,
                "allocated_at_peak_bytes": self.allocated_at_peak_bytes,
                "peak_allocated_bytes": self.peak_allocated_bytes,
                "fragmentation_bytes": self.fragmentation_bytes, "segments": self.segments,
                "segments_created": self.segments_created, "fits": self.fits,
                "released_bytes": self.released_bytes,
                "failed_request_bytes": self.failed_request_bytes,
                "failed_where": self.failed_where,
                "alloc_retries": self.alloc_retries,
                "steady_alloc_retries": self.steady_alloc_retries,
                "notes": list(self.notes)}


def allocator_config_of(tr: Trace, environ: Mapping[str, str] | None = None
                        ) -> AllocatorConfig:
    """The allocator settings of the traced step: its recipe's ``alloc_conf`` when it has
    one, else PYTORCH_CUDA_ALLOC_CONF from the environment of the estimate (as PyTorch reads
    it when the process starts)."""
    if tr.alloc_conf is not None:
        return parse_alloc_conf(tr.alloc_conf)
    return alloc_conf_from_env(os.environ if environ is None else environ)


def reserved_memory(tr: Trace, limit_bytes: int, config: AllocatorConfig
                    ) -> ReservedMemory:
    """The step's storages replayed through the caching allocator under ``config``, against
    ``limit_bytes``."""
    # after any release, even the first step's only: do releases recur in a step that
    # starts from what the traced steps left? (a third step, fed after them)
    steady_at = next((i for i, op in enumerate(tr.ops) if op.step >= 1), None)
    rep = replay(events_of(tr), config, limit_bytes, steady_at=steady_at)
    retries = steady_retries(steady_at, rep.retry_at) if rep.next_step_retries is None \
        else rep.next_step_retries
    notes = list(config.notes)
    if rep.fits and retries:
        notes.append(retry_note(retries))
    if tr.world_size > 1:
        notes.append("one rank's tensors and the engine's buffers replayed on one stream; "
                     "NCCL's own buffers and the collectives' streams are not modelled")
    if tr.compiled and tr.compile_mode == "reduce-overhead":
        notes.append("CUDA graphs' private memory pool is not replayed (the allocated peak "
                     "counts it)")
    failed_bytes = failed_where = None
    if rep.failed is not None:
        failed_bytes = rep.failed.nbytes
        storage = next((s for s in tr.storages if s.uid == rep.failed.uid), None)
        if storage is not None:
            failed_where = f"{storage.phase}, {storage.module or 'outside modules'}"
    return ReservedMemory(
        alloc_conf=config.text, limit_bytes=limit_bytes,
        peak_reserved_bytes=rep.peak_reserved_bytes,
        allocated_at_peak_bytes=rep.allocated_at_peak_bytes,
        peak_allocated_bytes=rep.peak_allocated_bytes, segments=rep.n_segments,
        segments_created=rep.segments_created, fits=rep.fits,
        released_bytes=rep.released_bytes, failed_request_bytes=failed_bytes,
        failed_where=failed_where, notes=tuple(notes), alloc_retries=len(rep.retry_at),
        steady_alloc_retries=retries)


def steady_retries(steady_at: int | None, retry_at: tuple[int, ...]) -> int:
    """The retries made at the traced steady-state step's ops (those from trace index
    ``steady_at`` on: the second step, with accumulation its micro-batches 0 and 1); a
    one-step trace's (``steady_at`` None) all."""
    if steady_at is None:
        return len(retry_at)
    return sum(1 for at in retry_at if at >= steady_at)


def retry_note(retries: int) -> str:
    """What a step that fits only by releasing the allocator's cache costs, in words."""
    times = "once" if retries == 1 else f"{retries} times"
    return (f"fits only because the caching allocator releases its whole cache and retries "
            f"(torch.cuda.memory_stats()['num_alloc_retries']), {times} in every step of the "
            "steady state: each release synchronizes the GPU and returns its cached segments, "
            "which are cudaMalloc'ed again, a cost the step time leaves out and that "
            "torchtitan warns of (docs/references.md, section 42); a smaller micro-batch, "
            "activation checkpointing or expandable_segments:True avoid it")
