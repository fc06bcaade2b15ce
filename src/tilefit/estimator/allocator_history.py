"""A real caching allocator's recorded history as replay events.

``torch.cuda.memory._record_memory_history`` makes PyTorch's allocator log every request it
serves (tilefit.compat.cuda_memory reads it back): ``alloc`` (a block handed out, at its
address, with its size), ``free_requested`` (the program dropped it), ``free_completed`` (the
block is back in its pool, once the streams that used it are done with it), and the
allocator's own ``segment_alloc`` / ``segment_free`` (cudaMalloc, cudaFree). Fed through
tilefit's model of the allocator (tilefit.estimator.allocator_replay.replay), the requests
alone check the model on exactly the stream the real allocator saw, apart from the tracer:
the replay's reserved peak against the real ``max_memory_reserved`` measures the allocator
model's own error (benchmarks/gpu_memory_check.py; docs/references.md, section 45).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tilefit.alloc_conf import parse_alloc_conf
from tilefit.errors import TilefitError
from tilefit.estimator.allocator_replay import AllocEvent, replay

__all__ = ["SnapshotReplay", "events_of_history", "replay_snapshot"]


def events_of_history(entries: Iterable[Mapping[str, Any]]) -> list[AllocEvent]:
    """The allocations and frees of a recorded device trace, in its order.

    ``alloc`` is an allocation of a new block (uid: its position in the trace) of the
    recorded size; ``free_completed`` frees the block live at that address (the moment it
    can be reused: a block still owed to another stream is not, between its
    ``free_requested`` and its ``free_completed``). A free of a block allocated before the
    recording began is left out (its segment was reserved before: the caller counts it
    apart). Streams are numbered by first appearance (0: the first seen). The segment events
    are the allocator's answer, which the replay computes itself, and are not fed back."""
    return _converted(entries)[0]


def _converted(entries: Iterable[Mapping[str, Any]]) -> tuple[list[AllocEvent], int]:
    """events_of_history's events, and how many frees it left out."""
    out: list[AllocEvent] = []
    live: dict[int, AllocEvent] = {}
    streams: dict[int, int] = {}
    early = 0
    for at, e in enumerate(entries):
        action = e.get("action")
        if action not in ("alloc", "free_completed"):
            continue
        stream = streams.setdefault(int(e.get("stream", 0)), len(streams))
        addr = int(e["addr"])
        if action == "alloc":
            event = AllocEvent("alloc", at, int(e["size"]), at, stream)
            live[addr] = event
            out.append(event)
            continue
        born = live.pop(addr, None)
        if born is None:
            early += 1
        else:
            out.append(AllocEvent("free", born.uid, born.nbytes, at, born.stream))
    return out, early


@dataclass(frozen=True)
class SnapshotReplay:
    """A PyTorch memory snapshot's recorded requests replayed through tilefit's allocator
    model: as recorded (PyTorch's default settings) and under ``alloc_conf``."""

    device: int
    requests: int  # allocations recorded
    frees_before_trace: int  # frees of blocks allocated before the trace begins
    recorded_reserved_bytes: int  # the snapshot's segments on the device when it was taken
    replayed_reserved_bytes: int  # the model's reserved peak under recorded_conf
    recorded_conf: str  # the settings the run used ("": PyTorch's defaults)
    alloc_conf: str
    whatif_reserved_bytes: int  # the model's reserved peak under alloc_conf
    whatif_segments: int  # segments at that peak
    # with a line (limit_bytes: what the allocator may hold on another GPU), under alloc_conf:
    # whether the requests fit, the allocations retried after releasing the cache, and the
    # allocation (its position among the requests, its bytes) that ran out of memory
    limit_bytes: int | None = None
    fits: bool | None = None
    alloc_retries: int = 0
    failed_request: int | None = None
    failed_bytes: int | None = None

    @property
    def complete(self) -> bool:
        """The trace starts from an allocator holding nothing it later frees."""
        return self.frees_before_trace == 0

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {**asdict(self), "complete": self.complete}


def replay_snapshot(snapshot: Mapping[str, Any], alloc_conf: str = "", device: int = 0, *,
                    recorded_conf: str = "", limit_bytes: int | None = None
                    ) -> SnapshotReplay:
    """``snapshot`` (torch.cuda.memory._snapshot()'s dict, or a pickle of it written by
    _dump_snapshot, loaded) replayed: its device trace's requests through the allocator
    model under the settings the run used (``recorded_conf``, default PyTorch's) and under
    ``alloc_conf`` (both PYTORCH_CUDA_ALLOC_CONF's text); with ``limit_bytes`` (what the
    allocator may hold on another GPU: its memory less the CUDA context) the second replay
    runs against that line, releasing its cache and retrying as PyTorch does.
    A snapshot taken without history recording has no trace: a TilefitError says how."""
    traces = snapshot.get("device_traces") or []
    entries = list(traces[device]) if device < len(traces) else []
    events, early = _converted(entries)
    allocs = [e.uid for e in events if e.kind == "alloc"]
    if not allocs:
        raise TilefitError(
            f"the snapshot has no recorded allocations on device {device}",
            expected="a snapshot taken after torch.cuda.memory._record_memory_history() "
            "(the allocator records its requests only while that is on)",
            given=f"{len(entries)} trace entries on device {device}",
            fix="call torch.cuda.memory._record_memory_history(max_entries=1_000_000) before "
            "the steps, then torch.cuda.memory._dump_snapshot('snapshot.pickle')")
    config = parse_alloc_conf(alloc_conf)
    recorded = replay(events, parse_alloc_conf(recorded_conf))
    whatif = replay(events, config)
    line = None if limit_bytes is None else replay(events, config, limit_bytes)
    failed = None if line is None else line.failed
    return SnapshotReplay(
        device=device, requests=len(allocs), frees_before_trace=early,
        recorded_reserved_bytes=sum(int(s.get("total_size", 0))
                                    for s in snapshot.get("segments", [])
                                    if int(s.get("device", 0)) == device),
        replayed_reserved_bytes=recorded.peak_reserved_bytes, recorded_conf=recorded_conf,
        alloc_conf=alloc_conf, whatif_reserved_bytes=whatif.peak_reserved_bytes,
        whatif_segments=whatif.n_segments, limit_bytes=limit_bytes,
        fits=None if line is None else line.fits,
        alloc_retries=0 if line is None else line.retried_allocations,
        failed_request=None if failed is None else allocs.index(failed.uid) + 1,
        failed_bytes=None if failed is None else failed.nbytes)
