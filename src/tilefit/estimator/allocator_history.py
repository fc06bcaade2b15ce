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
from typing import Any

from tilefit.estimator.allocator_replay import AllocEvent

__all__ = ["events_of_history"]


def events_of_history(entries: Iterable[Mapping[str, Any]]) -> list[AllocEvent]:
    """The allocations and frees of a recorded device trace, in its order.

    ``alloc`` is an allocation of a new block (uid: its position in the trace) of the
    recorded size; ``free_completed`` frees the block live at that address (the moment it
    can be reused: a block still owed to another stream is not, between its
    ``free_requested`` and its ``free_completed``). A free of a block allocated before the
    recording began is left out (its segment was reserved before: the caller counts it
    apart). Streams are numbered by first appearance (0: the first seen). The segment events
    are the allocator's answer, which the replay computes itself, and are not fed back."""
    out: list[AllocEvent] = []
    live: dict[int, AllocEvent] = {}
    streams: dict[int, int] = {}
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
        if born is not None:
            out.append(AllocEvent("free", born.uid, born.nbytes, at, born.stream))
    return out
