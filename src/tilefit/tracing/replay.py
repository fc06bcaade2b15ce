"""Recording a stretch of the step again instead of running it: the steady step's forward and
backward from the first step's, and a second micro-batch's from the first's.

Both are the same ops on tensors of the same shapes, so running them again through fake
tensors (most of a trace's time) would record the same rows. What differs is written out
here: storages the copy leaves alive get the free time their originals' role gives them, and
a second micro-batch accumulates its gradients where the first created them. The equality
with running them is tested op by op and byte by byte (tests/test_tracing.py)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from tilefit.tracing.records import OpRecord

if TYPE_CHECKING:
    from tilefit.tracing.recorder import StepMarks

__all__ = ["Replays"]

# autograd's AccumulateGrad adds a later micro-batch's gradient into the one it kept
# (torch/csrc/autograd/functions/accumulate_grad.h, case 2.3: variable_grad += new_grad)
_ACCUMULATE = torch.ops.aten.add_.Tensor


class Replays:
    """The recorder's replays (mixed into tracing.recorder.Recorder, whose state they copy)."""

    ops: list[OpRecord]
    category: dict[int, str]
    _events: int
    _next_uid: int
    _recording: bool
    _nbytes: dict[int, int]
    _alloc_at: dict[int, int]
    _free_at: dict[int, int]
    _alloc_phase: dict[int, str]
    _alloc_module: dict[int, str]
    _detached: dict[int, int | None]  # event -> storage uid of each detach in a backward

    def _record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any,
                module: str, phase: str) -> None:
        raise NotImplementedError  # the recorder's

    def uid(self, t: torch.Tensor) -> int | None:
        raise NotImplementedError  # the recorder's

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Ops run but are not recorded and their tensors are not tracked."""
        self._recording = False
        try:
            yield
        finally:
            self._recording = True

    def _copy_storage(self, uid: int, offset: int) -> int:
        """A new storage like ``uid``, allocated ``offset`` events later; its free time is
        the caller's to set."""
        new = self._next_uid
        self._next_uid += 1
        self._nbytes[new] = self._nbytes[uid]
        self._alloc_at[new] = self._alloc_at[uid] + offset
        self._alloc_phase[new] = self._alloc_phase[uid]
        self._alloc_module[new] = self._alloc_module[uid]
        if uid in self.category:
            self.category[new] = self.category[uid]
        return new

    def _allocated_in(self, start: int, end: int) -> list[int]:
        return [u for u, a in self._alloc_at.items() if start <= a < end]

    def _outliving(self, start: int, end: int) -> list[int]:
        """The storages made in events [start, end) and still alive at ``end``."""
        return [u for u in self._allocated_in(start, end)
                if (freed := self._free_at.get(u)) is None or freed > end]

    def can_replay(self, start: int, end: int) -> bool:
        """Whether a step's forward and backward, events [start, end), can be replayed: the
        only storages they leave alive are gradients (the first call of a model that keeps
        a tensor it made, a cache, would be counted twice: such a step is run again)."""
        return all(self.category.get(u) == "gradients" for u in self._outliving(start, end))

    def replay(self, start: int, end: int, step: int) -> list[tuple[int, int | None]]:
        """Record events [start, end) again, now: the same ops, and copies of the storages
        they allocated with the same lifetimes. Returns (new uid, original free_at) of the
        copies still alive at ``end``; ``settle`` gives them a free time."""
        offset = self._events - start
        self.ops.extend(dataclasses.replace(op, step=step) for op in self.ops[start:end])
        pending: list[tuple[int, int | None]] = []
        for uid in self._allocated_in(start, end):
            new = self._copy_storage(uid, offset)
            freed = self._free_at.get(uid)
            if freed is not None and freed <= end:
                self._free_at[new] = freed + offset
            else:
                pending.append((new, freed))
        self._events += end - start
        return pending

    def settle(self, pending: list[tuple[int, int | None]], *, first: StepMarks,
               steady: StepMarks) -> None:
        """Free the replayed storages that outlived the backward where their originals were
        freed: during the optimizer step (same offset into it) or at zero_grad."""
        for uid, freed in pending:
            if freed is None:
                continue
            if freed < first.zero_grad:
                self._free_at[uid] = min(steady.optimizer + (freed - first.optimizer),
                                         steady.zero_grad)
            else:
                self._free_at[uid] = min(steady.zero_grad + (freed - first.zero_grad),
                                         steady.end)

    def _accumulations(self, start: int, end: int, grads: Sequence[torch.Tensor]
                       ) -> dict[int, tuple[int, torch.Tensor]] | None:
        """AccumulateGrad's detach events in [start, end) (the first micro-batch took each
        new gradient as ``.grad``, case 1.1), each with the storage and the gradient it
        kept; None when the
        micro-batch cannot be replayed: a storage it made outlives it and is no gradient
        (a cache made on the first call), or a gradient was copied (case 1.5) rather than
        kept, which a later micro-batch does not do."""
        kept = {u: g for g in grads if (u := self.uid(g)) is not None}
        if any(uid not in kept for uid in self._outliving(start, end)):
            return None
        made = {u for u in kept if start <= self._alloc_at[u] < end}
        events = {at: (uid, kept[uid]) for at, uid in self._detached.items()
                  if start <= at < end and uid in made}
        if len(events) != len(made) or len({uid for uid, _ in events.values()}) != len(made):
            return None  # each new gradient detached once, where AccumulateGrad took it
        return events

    def replay_micro(self, start: int, micro: int, grads: Sequence[torch.Tensor]) -> bool:
        """Record the micro-batch that began at event ``start`` (and ends now) again as
        micro-batch ``micro``: its ops, except that each gradient the first one created is
        now added into ``.grad`` (one add_ in the detach's place, its new gradient freed
        after it); False, recording nothing, when it cannot be replayed (``_accumulations``).
        """
        end = self._events
        accumulated = self._accumulations(start, end, grads)
        if accumulated is None:
            return False
        offset = end - start
        added = {uid: at for at, (uid, _) in accumulated.items()}
        for uid in self._allocated_in(start, end):
            new = self._copy_storage(uid, offset)
            if uid in added:  # the new gradient: added into .grad, then dropped
                self.category.pop(new, None)
                self._free_at[new] = added[uid] + offset + 1
            else:
                self._free_at[new] = self._free_at[uid] + offset
        for at in range(start, end):
            if at not in accumulated:
                self.ops.append(dataclasses.replace(self.ops[at], micro=micro))
                self._events += 1
                continue
            grad, op = accumulated[at][1], self.ops[at]
            with self.paused():
                new_grad = torch.empty_like(grad)
            self._record(_ACCUMULATE, (grad, new_grad), {}, grad, op.module, op.phase)
        return True
