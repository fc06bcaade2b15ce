"""A trace's storages replayed through PyTorch's caching allocator
(tilefit.estimator.allocator): the memory the GPU holds (reserved segments) beside what the
tensors use, and whether the step stays under a memory line once the allocator has released
its cache and retried (docs/references.md, section 31)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from tilefit.alloc_conf import AllocatorConfig
from tilefit.estimator.allocator import Allocator, Block, SegmentInfo
from tilefit.tracing.records import Trace

__all__ = ["AllocEvent", "AllocatorReplay", "events_of", "repeated_step", "replay"]


@dataclass(frozen=True)
class AllocEvent:
    """One request to the allocator: storage ``uid`` allocated or freed at trace event
    ``at`` (-1: before the trace), on ``stream``."""

    kind: Literal["alloc", "free"]
    uid: int
    nbytes: int
    at: int
    stream: int = 0


def events_of(trace: Trace) -> list[AllocEvent]:
    """The allocations and frees of ``trace``'s storages in the order the step made them.

    The storages alive before the trace (alloc_at -1: parameters, buffers, the batch) come
    first, in uid order (the order the tracer registered them). Then, at each event index k:
    first the frees of older storages with free_at == k, then the allocations of op k, then
    the frees of storages op k made and that died at once. The recorder
    (tilefit.tracing.recorder) gives a storage alloc_at = the index of the op that returned
    it (outputs are tracked before the event counter moves on) and free_at = the counter
    when its finalizer ran: a storage dropped between op k-1 and op k has free_at == k and
    was freed before op k allocated anything. Frees at one index go in uid order (Python's
    garbage collector fixes the real one). A zero-byte storage (a value a compiled graph
    keeps in registers) allocates nothing: PyTorch's allocator is not called for 0 bytes.

    Every event is on the default stream: records.StorageRecord carries no stream (the
    collectives' streams of a data-parallel trace are not recorded)."""
    keyed: list[tuple[tuple[int, int, int], AllocEvent]] = []
    for s in trace.storages:
        if s.nbytes <= 0:
            continue
        keyed.append(((s.alloc_at, 1, s.uid), AllocEvent("alloc", s.uid, s.nbytes, s.alloc_at)))
        if s.free_at is not None:
            order = 0 if s.free_at > s.alloc_at else 2
            keyed.append(((s.free_at, order, s.uid),
                          AllocEvent("free", s.uid, s.nbytes, s.free_at)))
    keyed.sort(key=lambda pair: pair[0])
    return [event for _, event in keyed]


@dataclass(frozen=True)
class AllocatorReplay:
    """What the caching allocator did over a replay.

    ``peak_reserved_bytes``: torch.cuda.max_memory_reserved, the segments' bytes at their
    most; ``allocated_at_peak_bytes``: the blocks in use when reserved first reached it (the
    rest of the peak is cache and fragmentation); ``peak_allocated_bytes``:
    torch.cuda.max_memory_allocated, which counts each block's size (512-byte multiples, or
    a whole cached large block the request did not split). ``segments``: those held at the
    reserved peak. ``failed``: the allocation that raised OutOfMemoryError against
    ``limit_bytes`` even after the allocator released its cache and retried (None: the step
    fits); the figures then cover the events before it. ``released_bytes``: what those
    releases gave back over the replay; ``retried_allocations``: the allocations that
    succeeded only after one; ``retry_at``: the trace index (``AllocEvent.at``) of each
    cudaMalloc tried again after release_cached_blocks, which PyTorch counts in
    ``memory_stats()['num_alloc_retries']``."""

    config: AllocatorConfig
    limit_bytes: int | None
    peak_reserved_bytes: int
    allocated_at_peak_bytes: int
    peak_allocated_bytes: int
    n_segments: int  # segments held at the reserved peak
    segments_created: int  # cudaMalloc calls (expandable segments: segments created)
    final_reserved_bytes: int
    failed: AllocEvent | None = None
    released_bytes: int = 0
    retried_allocations: int = 0
    retry_at: tuple[int, ...] = ()
    # the retries of a third step fed after the trace (replay's steady_at); None where not
    # asked, not needed (no retry, or out of memory) or the trace is not periodic
    next_step_retries: int | None = None
    # what ``segments`` is computed from, when asked: the final segments where the cache was
    # never released (reserved never shrank), else the events replayed again to the peak
    final_segments: tuple[SegmentInfo, ...] | None = field(default=None, repr=False,
                                                           compare=False)
    events: tuple[AllocEvent, ...] = field(default=(), repr=False, compare=False)
    peak_at: int = field(default=-1, repr=False, compare=False)

    @property
    def fits(self) -> bool:
        return self.failed is None

    @functools.cached_property
    def segments(self) -> tuple[SegmentInfo, ...]:
        """The segments held at the reserved peak (computed when first asked: a second
        replay where the allocator released its cache on the way)."""
        if self.final_segments is not None:
            return self.final_segments
        at_peak = Allocator(self.config, self.limit_bytes)
        if self.peak_at >= 0:
            _run(list(self.events[:self.peak_at + 1]), at_peak)
        return at_peak.segment_infos()

    @property
    def segment_sizes(self) -> tuple[int, ...]:
        return tuple(s.size for s in self.segments)

    @property
    def fragmentation_bytes(self) -> int:
        """Reserved but not allocated at the reserved peak."""
        return self.peak_reserved_bytes - self.allocated_at_peak_bytes


@dataclass
class _Marks:
    peak_reserved: int = 0
    allocated_at_peak: int = 0
    peak_at: int = -1  # the position in the events where reserved first reached its peak
    peak_allocated: int = 0
    segments_at_peak: int = 0
    failed: AllocEvent | None = None
    retry_at: list[int] = field(default_factory=list)  # AllocEvent.at of each retry


def _run(events: list[AllocEvent], alloc: Allocator,
         live: dict[int, Block] | None = None) -> _Marks:
    """Feed ``events`` to ``alloc`` until one fails; the peaks on the way. ``live``: the
    blocks of the storages alive before (filled as it goes)."""
    marks = _Marks()
    live = {} if live is None else live
    malloc, free, pop = alloc.malloc, alloc.free, live.pop  # the loop's hot calls, bound once
    for i, ev in enumerate(events):
        if ev.kind == "free":
            block = pop(ev.uid, None)
            if block is not None:
                free(block)
            continue
        if ev.nbytes <= 0:  # PyTorch does not call the allocator for 0 bytes
            continue
        retries = alloc.retries
        new = malloc(ev.nbytes, ev.stream, ev.uid)
        if alloc.retries != retries:
            marks.retry_at.append(ev.at)
        if new is None:
            marks.failed = ev
            break
        live[ev.uid] = new
        if alloc.allocated > marks.peak_allocated:
            marks.peak_allocated = alloc.allocated
        if alloc.reserved > marks.peak_reserved:
            marks.peak_reserved, marks.allocated_at_peak = alloc.reserved, alloc.allocated
            marks.peak_at, marks.segments_at_peak = i, alloc.live_segments
    return marks


def replay(events: Iterable[AllocEvent], config: AllocatorConfig | None = None,
           limit_bytes: int | None = None, steady_at: int | None = None) -> AllocatorReplay:
    """Replay ``events`` (events_of(trace)) through a fresh caching allocator under
    ``config`` (PyTorch's defaults if None). ``limit_bytes``: the most the allocator can
    reserve (the device's memory less what is not PyTorch's: the CUDA context, other
    processes), None for no line. ``steady_at`` (the trace index where the steady-state
    step begins): where the replay fits after releasing the cache, the steady step is fed
    once more to the allocator as the trace left it (``repeated_step``) and its retries
    counted (``next_step_retries``); the other figures stay those of ``events``."""
    config = config or AllocatorConfig()
    events = list(events)
    alloc = Allocator(config, limit_bytes)
    live: dict[int, Block] = {}
    marks = _run(events, alloc, live)
    # without a release reserved never shrinks: the segments at the end are those at the peak
    final = None if alloc.released else alloc.segment_infos()
    out = AllocatorReplay(
        config=config, limit_bytes=limit_bytes, peak_reserved_bytes=marks.peak_reserved,
        allocated_at_peak_bytes=marks.allocated_at_peak,
        peak_allocated_bytes=marks.peak_allocated, n_segments=marks.segments_at_peak,
        segments_created=alloc.segments_created, final_reserved_bytes=alloc.reserved,
        failed=marks.failed, released_bytes=alloc.released,
        retried_allocations=alloc.retried, retry_at=tuple(marks.retry_at),
        final_segments=final,
        events=tuple(events) if final is None else (), peak_at=marks.peak_at)
    if steady_at is None or not marks.retry_at or marks.failed is not None:
        return out
    third = repeated_step(events, steady_at)
    if third is None:
        return out
    before = alloc.retries  # the figures above are read: the allocator may go on
    _run(third, alloc, live)
    return dataclasses.replace(out, next_step_retries=alloc.retries - before)


def repeated_step(events: list[AllocEvent], steady_at: int) -> list[AllocEvent] | None:
    """The steady-state step's events (from the first allocation at trace index
    ``steady_at``) once more, as a third step after ``events``: its allocations under new
    uids, its frees of its own storages likewise, and each free of a storage the previous
    step handed over (allocated before, freed in the steady step: the last step's
    gradients, its loss) turned into the free of the storage of the same size the steady
    step hands over (allocated in it, alive at the end), k-th to k-th in allocation order.
    None where the two steps hand over different sizes: the trace is not periodic."""
    # the frees at steady_at itself come before its op allocates: the previous step's end
    start = next((i for i, e in enumerate(events) if e.at > steady_at or
                  (e.at == steady_at and e.kind == "alloc")), len(events))
    steady = events[start:]
    freed = {e.uid for e in events if e.kind == "free"}
    born = {e.uid for e in steady if e.kind == "alloc"}
    order = {e.uid: i for i, e in enumerate(events) if e.kind == "alloc"}
    handed_in = sorted((e for e in steady if e.kind == "free" and e.uid not in born),
                       key=lambda e: order.get(e.uid, -1))
    handed_out = [e for e in steady if e.kind == "alloc" and e.uid not in freed]
    if sorted(e.nbytes for e in handed_in) != sorted(e.nbytes for e in handed_out):
        return None
    mates: dict[int, list[int]] = {}
    for o in reversed(handed_out):
        mates.setdefault(o.nbytes, []).append(o.uid)
    pairs = {e.uid: mates[e.nbytes].pop() for e in handed_in}
    offset = 1 + max((e.uid for e in events), default=0)
    return [AllocEvent(e.kind, e.uid + offset if e.uid in born else pairs.get(e.uid, e.uid),
                       e.nbytes, e.at, e.stream) for e in steady]
