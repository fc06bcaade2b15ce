"""The estimator's predicted largest batch, as tune's first probe.

The step is traced on fake tensors (no real run, nothing allocated on the device) at two
batch sizes; its peak is affine in the batch (the activations and temporaries grow with it,
parameters, gradients and optimizer state do not), so two traces give the batch at which the
peak reaches the budget. On a GPU the peak is what the caching allocator would reserve: the
tensors plus the fragmentation of the trace replayed through its model. tune still confirms
it with a real trial and brackets from there.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tilefit.compat.fake import storage_key
from tilefit.errors import TilefitError
from tilefit.tuning.search import DEFAULT_START

if TYPE_CHECKING:
    from tilefit.recipe import Recipe

PROBE_BATCHES = (1, 2)
# the allocator replay's limit when only its fragmentation is wanted: never reached
UNLIMITED_BYTES = 2**62
MAX_REFINE_TRACES = 3


def _optimizer_factory(optimizer: Any) -> Callable[[Any], torch.optim.Optimizer]:
    if isinstance(optimizer, torch.optim.Optimizer):
        cls = type(optimizer)
        accepted = inspect.signature(cls.__init__).parameters
        # defaults can hold entries the constructor does not take (AdamW's
        # decoupled_weight_decay): keep what it accepts
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        return lambda params: cls(params, **defaults)
    return optimizer


@dataclass(frozen=True)
class Prediction:
    """The estimator's predicted largest batch (tune's first probe), or None with the reason
    it could not be predicted (tune reports it among its result's notes)."""

    max_batch: int | None
    skipped: str | None = None  # why there is no prediction


def skipped_note(why: str, cap: int | None) -> str:
    """What tune's notes say when the prediction is skipped: why, and where the search began."""
    start = DEFAULT_START if cap is None else min(DEFAULT_START, cap)
    return (f"the estimator's prediction of the largest batch was skipped: {why}; the search "
            f"began at batch {start} instead")


def predict_max_batch(model: nn.Module, make_batch: Callable[[int], Any], *,
                      loss_fn: Any, optimizer: Any, recipe: Recipe, device: torch.device,
                      budget_bytes: int | None, cap: int | None,
                      routing: str = "balanced") -> Prediction:
    """The largest batch whose predicted peak fits ``budget_bytes``; none, with the reason,
    when there is no budget or the step cannot be traced (tune then searches from its
    default start)."""
    if budget_bytes is None:
        return Prediction(None, skipped_note(
            "there is no memory budget to predict against (the CPU without a memory limit)", cap))
    from tilefit.estimator import cublas_workspace_bytes
    from tilefit.hardware import get_device
    from tilefit.tracing import trace

    recipe = _traced_recipe(optimizer, recipe, routing)
    target: Any = "cpu"
    extra = 0
    if device.type == "cuda":
        target = get_device("auto")
        extra = cublas_workspace_bytes(target)  # counted by the caching allocator too
    def pieces_at(b: int) -> tuple[int, int]:
        tr = trace(model, make_batch(b), recipe=recipe, gpu=target, loss_fn=loss_fn)
        fb, _, opt = tr.phase_peaks(rounded=device.type == "cuda")
        held = extra + (fragmentation_bytes(tr) if device.type == "cuda" else 0)
        return fb + held, opt + held

    # Each piece (forward/backward peak, optimizer-step peak) is affine in b at large b, but
    # at small b a fixed-size temporary can hold the piece's peak; so extrapolate from the
    # last two traces, trace at the prediction, and repeat (a secant search on fake tensors).
    try:
        points = [(b, pieces_at(b)) for b in PROBE_BATCHES]
        guess = _solve(points[-2], points[-1], budget_bytes)
        for _ in range(MAX_REFINE_TRACES):
            if guess is None:  # no piece grows with the batch
                guess = cap
            if guess is None or guess == points[-1][0]:
                break
            if cap is not None:
                guess = min(guess, cap)
            here = pieces_at(guess)
            points.append((guess, here))
            if guess == cap and max(here) <= budget_bytes:
                break  # the largest allowed batch fits
            nxt = _solve(points[-2], points[-1], budget_bytes)
            if nxt is None or abs(nxt - guess) <= max(1, 0.02 * guess):
                guess = guess if nxt is None else nxt
                break
            guess = nxt
    except TilefitError as exc:
        return Prediction(None, skipped_note(
            f"the step could not be traced on fake tensors: {_first_line(exc)}", cap))
    if guess is None:  # the loop sets a guess of None to the cap: there is none
        return Prediction(None, skipped_note(
            "the traced step's peak does not grow with the batch and there is no largest batch "
            "to stop at", cap))
    return Prediction(max(1, min(guess, cap) if cap is not None else guess))


def fragmentation_bytes(tr: Any) -> int:
    """What the CUDA caching allocator would reserve beyond the traced step's allocated peak
    (its replay under this process's PYTORCH_CUDA_ALLOC_CONF, tilefit.estimator.reserved),
    so that the first probe is the batch whose reserved memory, not only its tensors, meets
    the budget."""
    from tilefit.estimator.reserved import allocator_config_of, reserved_memory

    held = reserved_memory(tr, UNLIMITED_BYTES, allocator_config_of(tr))
    return max(0, held.fragmentation_bytes)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _solve(lo: tuple[int, tuple[int, int]], hi: tuple[int, tuple[int, int]],
           budget_bytes: int) -> int | None:
    """The largest b whose pieces, each on the line through two traces, fit the budget."""
    (b1, p1), (b2, p2) = lo, hi
    best = math.inf
    for y1, y2 in zip(p1, p2, strict=True):
        slope = (y2 - y1) / (b2 - b1)
        fixed = y1 - slope * b1
        if slope > 0:
            best = min(best, (budget_bytes - fixed) / slope)
        elif fixed > budget_bytes:
            return 1
    return None if best == math.inf else max(1, math.floor(best))


@dataclass(frozen=True)
class PersistentState:
    """What a training step keeps on the device whatever the batch: the floor of every trial.

    Parameters and buffers are measured on the model (each storage once); gradients are
    computed, one per trainable parameter of its size; the optimizer state is measured on the
    user's optimizer when it already holds state for every trainable parameter, else read off
    a fake-tensor trace of one step at batch 1 (None when the step cannot be traced)."""

    parameters_bytes: int  # parameters and buffers
    gradients_bytes: int
    optimizer_state_bytes: int | None
    optimizer_source: str  # "measured", "traced" or "unknown"

    @property
    def total_bytes(self) -> int:
        return self.parameters_bytes + self.gradients_bytes + (self.optimizer_state_bytes or 0)


def _unique_bytes(tensors: Iterable[Any]) -> int:
    sizes: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and not t.is_meta:
            storage = t.untyped_storage()
            sizes[storage_key(storage)] = int(storage.nbytes())
    return sum(sizes.values())


def _traced_recipe(optimizer: Any, recipe: Recipe, routing: str = "balanced") -> Recipe:
    """The step as tune runs it, for the tracer: tune's recipe (its loop) with the user's
    optimizer, a mixture of experts under ``routing``."""
    import dataclasses

    return dataclasses.replace(recipe, optimizer=_optimizer_factory(optimizer),
                               routing=routing)


def _measured_optimizer_state(optimizer: Any, trainable: list[nn.Parameter]) -> int | None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        return None
    if any(p not in optimizer.state or not optimizer.state[p] for p in trainable):
        return None  # the state is made by the first step: not there yet
    return _unique_bytes(v for s in optimizer.state.values() for v in s.values())


def _traced_optimizer_state(model: nn.Module, make_batch: Callable[[int], Any], *,
                            loss_fn: Any, optimizer: Any, recipe: Recipe,
                            device: torch.device) -> int | None:
    from tilefit.hardware import get_device
    from tilefit.tracing import trace

    try:
        target: Any = get_device("auto") if device.type == "cuda" else "cpu"
        tr = trace(model, make_batch(1), recipe=_traced_recipe(optimizer, recipe),
                   gpu=target, loss_fn=loss_fn)
    except TilefitError:
        return None
    timeline = tr.live_bytes_timeline(rounded=False,
                                      keep=lambda s: s.category == "optimizer_state")
    return max(timeline)


def persistent_state(model: nn.Module, make_batch: Callable[[int], Any], *, loss_fn: Any,
                     optimizer: Any, recipe: Recipe, device: torch.device) -> PersistentState:
    """The model's persistent state: parameters, buffers, gradients and optimizer state."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    params = _unique_bytes([*model.parameters(), *model.buffers()])
    grads = sum(p.numel() * p.element_size() for p in trainable)
    measured = _measured_optimizer_state(optimizer, trainable)
    if measured is not None:
        return PersistentState(params, grads, measured, "measured")
    traced = _traced_optimizer_state(model, make_batch, loss_fn=loss_fn, optimizer=optimizer,
                                     recipe=recipe, device=device)
    return PersistentState(params, grads, traced, "unknown" if traced is None else "traced")
