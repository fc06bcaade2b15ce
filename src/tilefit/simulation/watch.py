"""The user's training loop as the simulation sees it: which phase each op is in, where the
optimizer steps fall, and the stop after the last one.

Everything is read from the script's own calls, through torch's public hooks where torch has
them (``register_optimizer_step_pre_hook`` / ``_post_hook``, the global module forward
pre-hook) and by wrapping the calls that have none (``torch.autograd.backward`` and ``grad``,
``clip_grad_norm_`` / ``clip_grad_value_``, GradScaler's ``unscale_`` / ``step`` /
``update``, ``zero_grad``) for the simulation's life.

A step ends when the optimizer that stepped first steps again (with two optimizers, a GAN's,
each iteration's steps fall in one cycle); after ``steps`` of them the script is stopped with
``StopSimulation``, a BaseException the script's ``except Exception`` does not catch."""

from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from tilefit.compat.bitsandbytes import logical_numel, quant_state_tensors
from tilefit.compat.simulated_cuda import patched
from tilefit.tracing.optimizers import optimizer_state_tensors
from tilefit.tracing.recorder import Recorder
from tilefit.tracing.step import samples_and_tokens
from tilefit.vocab import REDUCE_OVERHEAD

# torch.nn.utils' gradient clipping, whole (the first two) or in its two parts
CLIPPING = ("clip_grad_norm_", "clip_grad_value_", "get_total_norm", "clip_grads_with_norm_")


class StopSimulation(BaseException):
    """Raised from the script's ``steps``-th optimizer step: the simulation has its steps."""


@dataclasses.dataclass
class OptimizerSeen:
    """One optimizer the script stepped: its class and the hyperparameters that cost."""

    name: str
    steps: int = 0
    fused: bool | None = None
    foreach: bool | None = None
    param_tensors: int = 0


@dataclasses.dataclass
class LoopFacts:
    """What the script's loop did, as seen (the report's 'found in the script')."""

    optimizers: list[OptimizerSeen] = dataclasses.field(default_factory=list)
    backward_calls: list[int] = dataclasses.field(default_factory=list)  # per step
    clipping: set[str] = dataclasses.field(default_factory=set)
    grad_scaler: bool = False
    zero_grad_to_none: set[bool] = dataclasses.field(default_factory=set)
    models: list[str] = dataclasses.field(default_factory=list)  # root modules' classes
    compiled: bool = False  # the code called torch.compile
    compiled_modules: int = 0  # modules it compiled: predicted as Inductor runs them
    compile_options: set[str] = dataclasses.field(default_factory=set)  # not the defaults
    compile_mode: str = "default"  # "reduce-overhead": its graphs replayed as CUDA graphs
    tf32: bool = False  # the code let fp32 matmuls run as TF32
    max_grad_norm: float | None = None  # the norm it clipped to (clip_grad_norm_'s max_norm)
    # wall-clock seconds on this machine from each step's end to the next step's first
    # forward (data loading, logging, the loop's own Python), under the simulation
    between_steps_s: list[float] = dataclasses.field(default_factory=list)


def _as_simulated(keyword: str, value: Any) -> bool:
    """Whether a torch.compile keyword asks for what the simulation predicts: Inductor's
    default mode, one graph (fullgraph either way: breaks are not predicted), static or
    automatic shapes."""
    return (keyword == "mode" and value in (None, "default")) or (
        keyword == "backend" and value == "inductor") or keyword == "fullgraph" or (
        keyword == "dynamic" and value in (None, False))


def _call_batch(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A forward call's inputs as tracing.step.samples_and_tokens reads a batch: its keyword
    arguments where they hold input_ids (model(**batch)), else all of them."""
    return kwargs if isinstance(kwargs.get("input_ids"), torch.Tensor) else (args, kwargs)


class StepWatch:
    """Sets the recorder's phase from the script's calls and marks the step boundaries."""

    def __init__(self, recorder: Recorder, steps: int) -> None:
        self.recorder = recorder
        self.steps = steps
        self.facts = LoopFacts()
        self.boundaries: list[int] = []  # event index after each step's end
        self._phases: list[str] = []
        self._first: Any = None  # the optimizer that stepped first: its steps end a step
        self._seen: weakref.WeakKeyDictionary[Any, OptimizerSeen] = weakref.WeakKeyDictionary()
        self._backwards = 0
        self._roots: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._first_root: nn.Module | None = None
        self._handles: list[Any] = []  # the hooks on the top modules, removed at the end
        self._stepping = False  # inside an optimizer's step (a closure may run the forward)
        self._backwards_at_step = 0
        # the main model's micro-batch: (samples, tokens), read from its inputs as it is
        # called (the tensors themselves are not kept: that would hold the script's memory)
        self.batch_size: tuple[int, int | None] | None = None
        self.params: list[torch.Tensor] = []  # every optimizer's, as of its last step
        self.param_count = 0  # the elements of the top modules' parameters
        self.every_param: list[torch.Tensor] = []  # the top modules' and optimizers'
        self._step_ended_at: float | None = None  # perf_counter at the last step's end
        # torch.compile(module) under the simulation (simulation.compiled), set by the session
        self.compile_module: Callable[[nn.Module], nn.Module] | None = None

    # ---- phases -------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._phases.append(self.recorder.phase)
        self.recorder.enter_phase(name)  # type: ignore[arg-type]
        try:
            yield
        finally:
            self.recorder.enter_phase(self._phases.pop())  # type: ignore[arg-type]

    def _wrapped(self, fn: Callable[..., Any], name: str,
                 after: Callable[[], None] | None = None) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            with self.phase(name):
                out = fn(*args, **kwargs)
            if after is not None:
                after()
            return out
        return call

    def _backward_done(self) -> None:
        if self.recorder.phase in ("backward", "recompute"):
            return  # a backward inside a backward (double backward): one pass
        self._backwards += 1
        self.recorder.begin_micro(self._backwards)
        if self._stepping:  # a closure's backward (Lightning's): the optimizer's work follows
            self.recorder.enter_phase("optimizer")

    def _in_closure(self) -> bool:
        """An optimizer step whose closure runs the forward (Lightning's automatic
        optimization, LBFGS): no backward of this step has run yet."""
        return self._stepping and self._backwards_at_step == self._backwards

    # ---- hooks --------------------------------------------------------------------------
    def _forward_pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self.recorder.phase in ("backward", "recompute") or (
                self.recorder.phase == "optimizer" and not self._in_closure()):
            return
        if self.recorder.tracker.current == "" and module not in self._roots:
            # a top module (this hook runs before the tracker's): its calls' arguments
            # from the next on (the global hook has no keyword arguments)
            self._roots.add(module)
            if next(module.parameters(), None) is not None:  # a model, not a loss module
                self._first_root = self._first_root or module
                inner = getattr(module, "_orig_mod", module)  # torch.compile's wrapper's
                self.facts.models.append(type(inner).__name__)
            self.batch_size = self.batch_size or samples_and_tokens(_call_batch(args, {}))
            self._handles.append(module.register_forward_pre_hook(self._inputs,
                                                                  with_kwargs=True))
        if self.recorder.phase not in ("forward", "scaler", "clip_grad"):
            self.recorder.enter_phase("forward")
        if self._step_ended_at is not None:  # the next step's first forward
            self.facts.between_steps_s.append(time.perf_counter() - self._step_ended_at)
            self._step_ended_at = None

    def _inputs(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                ) -> None:
        if self.recorder.phase not in ("backward", "recompute") and module is self._main():
            self.batch_size = samples_and_tokens(_call_batch(args, kwargs))

    def _main(self) -> nn.Module | None:
        """The first top module the code called (the model; a teacher or discriminator
        comes later)."""
        return next(iter(self._roots), None) if len(self._roots) == 1 else self._first_root

    def _step_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        seen = self._seen.get(optimizer)
        if seen is None:
            defaults = getattr(optimizer, "defaults", {})
            seen = OptimizerSeen(type(optimizer).__name__, fused=defaults.get("fused"),
                                 foreach=defaults.get("foreach"))
            self._seen[optimizer] = seen
            self.facts.optimizers.append(seen)
            self._first = self._first or weakref.ref(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        seen.param_tensors = len(params)
        self._count_params(params)
        self.recorder.label(params, "parameters")
        self.recorder.label([p.grad for p in params if p.grad is not None], "gradients")
        self._phases.append(self.recorder.phase)
        self.recorder.enter_phase("optimizer")
        self._stepping, self._backwards_at_step = True, self._backwards

    def _count_params(self, stepped: list[torch.Tensor]) -> None:
        known = {id(p) for p in self.params}
        self.params += [p for p in stepped if id(p) not in known]
        every = {id(p): p for m in list(self._roots) for p in m.parameters()}
        every.update({id(p): p for p in self.params})
        self.param_count = sum(logical_numel(p) for p in every.values())
        self.every_param = list(every.values())
        # a frozen model's too (a teacher, a reference model): no optimizer steps them
        self.recorder.label(list(every.values()), "parameters")
        self.recorder.label([b for m in list(self._roots) for b in m.buffers()], "parameters")
        self.recorder.label([t for m in list(self._roots) for t in quant_state_tensors(m)],
                            "parameters")  # a quantized base's absmax and codes

    def _step_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._stepping = False
        self.recorder.label(optimizer_state_tensors(optimizer), "optimizer_state")
        before = self._phases.pop() if self._phases else "forward"
        # what follows the step until the next is the next micro-batch's (its data, its
        # copies to the GPU) unless the step ran inside GradScaler.step
        self.recorder.enter_phase(before if before == "scaler" else "forward")
        self._seen[optimizer].steps += 1
        if self._first is None or self._first() is not optimizer:
            return
        self.boundaries.append(self.recorder.events)
        self._step_ended_at = time.perf_counter()
        self.facts.backward_calls.append(self._backwards)
        self._backwards = 0
        self.recorder.begin_micro(0)
        if len(self.boundaries) >= self.steps:
            raise StopSimulation

    def _zero_grad(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def zero_grad(obj: Any, set_to_none: bool = True) -> Any:
            self.facts.zero_grad_to_none.add(bool(set_to_none))
            with self.phase("zero_grad"):
                return fn(obj, set_to_none)
        return zero_grad

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """The hooks and wrappers, for the block."""
        from torch.nn.modules.module import register_module_forward_pre_hook
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        autograd = {"backward": self._wrapped(torch.autograd.backward, "backward",
                                              self._backward_done),
                    "grad": self._wrapped(torch.autograd.grad, "backward")}
        # accelerate (the HF Trainer's) clips with get_total_norm and clip_grads_with_norm_
        utils = {n: self._clip(getattr(nn.utils, n), n) for n in CLIPPING
                 if hasattr(nn.utils, n)}
        scaler = torch.amp.GradScaler
        scaling = {"unscale_": self._wrapped(scaler.unscale_, "scaler"),
                   "step": self._scaler_step(scaler.step),
                   "update": self._wrapped(scaler.update, "scaler")}
        handles = [register_module_forward_pre_hook(self._forward_pre),  # type: ignore[arg-type]
                   register_optimizer_step_pre_hook(self._step_pre),
                   register_optimizer_step_post_hook(self._step_post)]
        with contextlib.ExitStack() as stack:
            stack.enter_context(patched(torch.autograd, autograd))
            stack.enter_context(patched(nn.utils, utils))
            stack.enter_context(patched(nn.utils.clip_grad, utils))
            stack.enter_context(patched(scaler, scaling))
            stack.enter_context(patched(torch.optim.Optimizer, {
                "zero_grad": self._zero_grad(torch.optim.Optimizer.zero_grad)}))
            stack.enter_context(patched(nn.Module, {
                "zero_grad": self._zero_grad(nn.Module.zero_grad)}))
            stack.enter_context(patched(torch, {"compile": self._compile(torch.compile)}))
            try:
                yield
            finally:
                for h in handles + self._handles:
                    h.remove()

    def _compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def compile_(*args: Any, **kwargs: Any) -> Any:
            self.facts.compiled = True
            if args and isinstance(args[0], nn.Module) and self.compile_module is not None:
                self.facts.compiled_modules += 1
                if kwargs.get("mode") == REDUCE_OVERHEAD:  # CUDA graphs: the estimator's
                    self.facts.compile_mode = REDUCE_OVERHEAD
                    kwargs = {k: v for k, v in kwargs.items() if k != "mode"}
                self.facts.compile_options.update(
                    f"{k}={v!r}" for k, v in kwargs.items() if not _as_simulated(k, v))
                return self.compile_module(args[0])  # its graphs as Inductor runs them
            return fn(*args, **kwargs)
        return compile_

    def _clip(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        def clip(*args: Any, **kwargs: Any) -> Any:
            self.facts.clipping.add(name)
            norm = kwargs.get("max_norm", args[1] if len(args) > 1 else None)
            if name in ("clip_grad_norm_", "clip_grads_with_norm_") and isinstance(
                    norm, (int, float)) and not isinstance(norm, bool):
                self.facts.max_grad_norm = float(norm)
            if self.recorder.phase == "clip_grad":  # clip_grad_norm_'s own parts
                return fn(*args, **kwargs)
            with self.phase("clip_grad"):
                return fn(*args, **kwargs)
        return clip

    def _scaler_step(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def step(scaler: Any, *args: Any, **kwargs: Any) -> Any:
            self.facts.grad_scaler = True
            with self.phase("scaler"):
                return fn(scaler, *args, **kwargs)
        return step
