"""Two timelines: the host issues each op, the device runs it.

Eager PyTorch issues every op from the host (Python, the dispatcher, a kernel launch) and the
GPU runs the kernels in issue order on one stream. The device never starts an op before the
host has issued it, and the host runs ahead until something makes it wait for the device
(``.item()``, a non-finite check, a copy to the CPU). So

    issued_i   = issued_{i-1} + host_i                 (then, at a sync: max(issued_i, done_i))
    done_i     = max(done_{i-1}, issued_i) + device_i

and a step takes max(issued_last, done_last). When kernels are short (small batches, small
layers, the optimizer's many small tensors) the device waits for the host: the step is
host-bound. Pure arithmetic, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Item:
    """One op (or a run of ops that repeats): its host issue time and device time."""

    host_s: float
    device_s: float
    sync: bool = False  # the host waits for the device after issuing it (.item(), ...)


@dataclass(frozen=True)
class Block:
    """Consecutive items that run ``repeats`` times in a row (a micro-batch under
    accumulation)."""

    items: tuple[Item, ...]
    repeats: int = 1


@dataclass(frozen=True)
class Timeline:
    step_time_s: float  # until both the host and the device are done
    host_s: float  # total host issue time (waits excluded)
    device_s: float  # total device busy time
    device_idle_s: float  # step time the device spends waiting for the host

    @property
    def host_bound_fraction(self) -> float:
        """Share of the step the device waits for the host: 0 when the GPU never starves."""
        return self.device_idle_s / self.step_time_s if self.step_time_s > 0 else 0.0


@dataclass(frozen=True)
class _State:
    issued_s: float = 0.0  # when the host has issued everything so far
    done_s: float = 0.0  # when the device finishes everything issued so far


def _run(state: _State, items: Iterable[Item]) -> _State:
    issued, done = state.issued_s, state.done_s
    for it in items:
        issued += it.host_s
        done = max(done, issued) + it.device_s
        if it.sync:
            issued = max(issued, done)
    return _State(issued, done)


# A block's timeline is max-plus linear in its start state, so after a short transient each
# repetition shifts both clocks by the same amount: run a few, extrapolate the rest.
_EXACT_REPEATS = 3


def _run_block(state: _State, block: Block) -> _State:
    exact = min(block.repeats, _EXACT_REPEATS)
    prev = state
    for _ in range(exact):
        prev, state = state, _run(state, block.items)
    left = block.repeats - exact
    if left <= 0:
        return state
    d_issued, d_done = state.issued_s - prev.issued_s, state.done_s - prev.done_s
    return _State(state.issued_s + left * d_issued, state.done_s + left * d_done)


def simulate(blocks: Iterable[Block]) -> Timeline:
    """The step's two timelines, block after block."""
    state = _State()
    host = device = 0.0
    for block in blocks:
        state = _run_block(state, block)
        host += block.repeats * sum(it.host_s for it in block.items)
        device += block.repeats * sum(it.device_s for it in block.items)
    step = max(state.issued_s, state.done_s)
    return Timeline(step_time_s=step, host_s=host, device_s=device,
                    device_idle_s=max(0.0, step - device))
