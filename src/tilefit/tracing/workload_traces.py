"""Tracing a named model: a catalog name, config.json or factory, built by tilefit at the
recipe's batch size (tilefit.models.Workload), LoRA adapters and the fused loss included.

``shared_traces()`` scopes one call of audit or plan: inside it each distinct (workload,
recipe, device) is traced once and its Trace (frozen) handed to every later asker (a plan's
one-GPU and multi-GPU sweeps share their 16-bit points; an audit's way forward runs a plan).
Nothing outlives the scope. ``prefetch`` starts a step the scope will ask for on another core
(tracing.background), for trace_workload to collect."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Hashable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from tilefit.errors import TilefitError
from tilefit.recipe import Recipe
from tilefit.tracing.background import Background, background_slots
from tilefit.tracing.records import Trace
from tilefit.tracing.step import resolve_target, trace_module

if TYPE_CHECKING:
    from tilefit.hardware import Device
    from tilefit.models import Workload


@dataclass(frozen=True)
class _Prefetched:
    """A step traced in a forked child, with others (prefetch): its place in their list."""

    child: Background
    index: int

    def trace(self) -> Trace | None:
        traces = self.child.result()
        return None if traces is None else traces[self.index]


@dataclass(frozen=True)
class _Queued:
    """A step to prefetch as soon as a core is free, before any later prefetch."""

    work: Workload
    recipe: Recipe


_Shared = dict[Hashable, "Trace | _Prefetched | _Queued"]
# the traces of the innermost shared_traces() scope, by (workload, recipe, device), the
# steps prefetched into forked children and those queued for the next free core
_SHARED: ContextVar[_Shared | None] = ContextVar("tilefit_shared_traces", default=None)


@contextlib.contextmanager
def shared_traces() -> Iterator[None]:
    """Within: trace_workload traces each (workload, recipe, device) once. A scope inside
    another shares the outer one's traces; they are dropped when the outermost ends."""
    if _SHARED.get() is not None:
        yield
        return
    shared: _Shared = {}
    token = _SHARED.set(shared)
    try:
        yield
    finally:
        _SHARED.reset(token)
        for found in shared.values():
            if isinstance(found, _Prefetched):
                found.child.cancel()


def trace_workload(workload: str | Workload, recipe: Recipe, gpu: str | Device) -> Trace:
    """One training step of ``workload`` under ``recipe`` (its batch size, its adapters and
    loss) on ``gpu``; inside ``shared_traces()``, the scope's trace of the same step if it
    has one."""
    work, recipe, key = _step_key(workload, recipe, gpu)
    shared = _SHARED.get()
    if shared is None or key is None:
        return _trace_workload(work, recipe, gpu)
    found = shared.get(key)
    if isinstance(found, _Queued):  # asked for before a core was free: traced here
        del shared[key]
        found = None
    if isinstance(found, _Prefetched):  # its trace, or in-process if the child failed
        found = found.trace()
    _start_queued(shared, gpu)  # on the core just freed, or beside the trace below
    if found is None:
        found = _trace_workload(work, recipe, gpu)
    shared[key] = found
    return found


def prefetch(steps: Sequence[tuple[str | Workload, Recipe]], gpu: str | Device, *,
             queue: bool = False) -> bool:
    """Inside ``shared_traces()``: start tracing these (workload, recipe) steps, in order, in
    one forked child where a core is free, for later trace_workload calls to collect.
    Whether it started (never outside a scope, for steps already there, or with no free
    core). ``queue``: with no free core now, start them on the next one that frees (before
    any later prefetch; a long trace the caller collects last)."""
    shared = _SHARED.get()
    if shared is None:
        return False
    _start_queued(shared, gpu)
    keyed = [_step_key(w, r, gpu) for w, r in steps]
    keyed = [s for s in keyed if s[2] is not None and s[2] not in shared]
    if not keyed:
        return False
    if _free_slot(shared):
        _start(shared, keyed, gpu)
        return True
    if queue:
        for w, r, key in keyed:
            shared[key] = _Queued(w, r)
    return False


def _free_slot(shared: _Shared) -> bool:
    children = {v.child for v in shared.values() if isinstance(v, _Prefetched)}
    return sum(c.running for c in children) < background_slots()


def _start(shared: _Shared, keyed: Sequence[tuple[Workload, Recipe, Hashable | None]],
           gpu: str | Device) -> None:
    child = Background(functools.partial(_trace_steps, tuple((w, r) for w, r, _ in keyed),
                                         gpu))
    for i, (_, _, key) in enumerate(keyed):
        shared[key] = _Prefetched(child, i)


def _start_queued(shared: _Shared, gpu: str | Device) -> None:
    """The queued steps, started in one child where a core is free now."""
    queued = [(v.work, v.recipe, k) for k, v in shared.items() if isinstance(v, _Queued)]
    if queued and _free_slot(shared):
        _start(shared, queued, gpu)


def _trace_steps(steps: tuple[tuple[Workload, Recipe], ...], gpu: str | Device
                 ) -> tuple[Trace, ...]:
    return tuple(_trace_workload(w, r, gpu) for w, r in steps)


def _step_key(workload: str | Workload, recipe: Recipe, gpu: str | Device
              ) -> tuple[Workload, Recipe, Hashable | None]:
    """The workload, the recipe on the device, and the step's key in a shared_traces()
    scope (None for an unhashable part: a user's optimizer factory object)."""
    from tilefit.models import load_workload

    work = load_workload(workload) if isinstance(workload, str) else workload
    device = resolve_target(gpu)[1]
    recipe = recipe.on(device)
    try:
        key: Hashable | None = (work, recipe, device)
        hash(key)
    except TypeError:
        key = None
    return work, recipe, key


def _trace_workload(work: Workload, recipe: Recipe, gpu: str | Device) -> Trace:
    """trace_workload's step, traced (``recipe`` already on the device)."""
    build_attention = recipe.attention  # auto: transformers' choice for the architecture
    if work.is_factory and recipe.attention != "auto":
        raise TilefitError(
            f"Recipe(attention={recipe.attention!r}) applies to Hugging Face models",
            expected="auto for a plain nn.Module factory (its own code chooses)",
            given=recipe.attention, fix="pass Recipe(attention='auto')")
    model: Any = functools.partial(work.build, build_attention)
    if recipe.quantize is not None:  # QLoRA: bitsandbytes' layers under peft's adapters
        from tilefit.models.quantize import build_quantized_model, check_target

        check_lora(work)
        check_target(recipe, resolve_target(gpu)[0].kind == "cuda")
        model = build_quantized_model(work, build_attention, recipe)
    elif recipe.lora is not None:  # peft's LoRA, built on the meta device (models.lora says why)
        from tilefit.models.lora import build_lora_model, lora_base_dtype

        check_lora(work)
        model = build_lora_model(work, build_attention, lora_base_dtype(recipe), recipe.lora)
    if recipe.use_cache is not None:
        model = _with_use_cache(model, recipe.use_cache)
    # the workload's model already has its attention implementation built in
    tr = trace_module(model, work.make_batch(recipe.batch_size, device="meta"),
                      replace(recipe, attention="auto"), gpu,
                      loss_fn=work.loss_for(recipe.fused_ce))
    if recipe.quantize is None:
        return tr
    from tilefit.models.quantize import quantize_notes

    return replace(tr, warnings=tr.warnings + quantize_notes(recipe))


def _with_use_cache(model: Any, use_cache: bool) -> Any:
    """The model (or its factory's) with every Hugging Face config's ``use_cache`` set, as
    the training loop sets it (the HF Trainer: False); the model is tilefit's own build."""
    def set_cache(m: Any) -> Any:
        for sub in m.modules():
            config = getattr(sub, "config", None)
            if config is not None and hasattr(config, "use_cache"):
                config.use_cache = use_cache
        return m

    if callable(model) and not hasattr(model, "modules"):
        return lambda: set_cache(model())
    return set_cache(model)


def check_lora(workload: Workload) -> None:
    """LoRA wraps a Hugging Face model's linear layers; a plain nn.Module factory is an
    error."""
    if workload.is_factory:
        raise TilefitError(
            "LoRA (peft) applies to Hugging Face models",
            expected="a catalog model or a config.json", given=workload.name,
            fix="pass Recipe(lora=None), or wrap the model with peft.get_peft_model in your "
            "own factory")
