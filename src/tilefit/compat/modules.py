"""Which module is running, module paths on FX graph nodes, a module's parameter and buffer
slots.

ModTracker (torch.distributed._tools.mod_tracker, private) and ModuleTracker
(torch.utils.module_tracker, public since 2.4) for module names; autograd's sequence numbers
(torch._C._autograd._get_sequence_nr, Node._sequence_nr, torch._C._current_autograd_node,
private) for the module a backward op belongs to; FX's node-meta propagation
(torch.fx.traceback.current_meta, public but not backward compatible); nn.Module's
``_parameters`` and ``_buffers`` dicts.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from tilefit.compat import probes

__all__ = ["ModulePath", "acyclic_mod_tracker", "buffer_slots", "node_module", "parameter_slots",
           "record_module_paths"]


def parameter_slots(module: nn.Module) -> dict[str, Any]:
    """The module's own parameter slots, name -> Parameter or None (``Module._parameters``):
    writing one replaces the parameter without ``Module._apply``'s tensor swap."""
    return module._parameters  # type: ignore[return-value]


def buffer_slots(module: nn.Module) -> dict[str, Any]:
    """The module's own buffer slots, name -> tensor or None (``Module._buffers``)."""
    return module._buffers  # type: ignore[return-value]


class ModulePath:
    """Which module's code is running: in the forward (and a checkpointed forward recomputed
    in the backward), the innermost module whose forward runs; in the backward, the module
    whose forward created the autograd node the engine runs.

    The backward is attributed by autograd's sequence numbers (each node takes the next
    number of its thread's counter when the forward creates it; the profiler links forward
    and backward ops the same way): the forward marks the number at which each module starts
    and ends, and a backward op belongs to the module running when its node's number was
    taken. Not by ModTracker's backward hooks: those leave a module "running" until the
    gradient of its input is complete, so q/k/v projections that share their input overlap
    through each other's backward, and a module whose output is its input (nn.Identity,
    nn.Dropout(p=0)) stays "running" for the rest of the backward. ModTracker
    (torch.distributed._tools.mod_tracker, what MemTracker uses, with its input hook made
    acyclic by ``acyclic_mod_tracker`` so that it keeps no tensors alive) still names the
    modules. A reentrant checkpoint's nested backward, run on another
    thread than the forward (a CUDA machine's device thread), runs nodes whose numbers come
    from that thread's counter: they are attributed to no module.
    """

    def __init__(self) -> None:
        self.recompute_depth = 0
        self.last_entered = ""  # the last module whose forward started (for error messages)
        self._stack: list[str] = []  # the modules whose forward runs, innermost last
        self._marks: list[int] = []  # sequence numbers where the running module changed
        self._marked: list[str] = []  # the module running from that number on ("" none)
        self._thread: int | None = None  # the thread whose counter the marks read
        self._param_module: WeakIdKeyDictionary = WeakIdKeyDictionary()  # leaf -> owner
        self._strays: weakref.WeakSet[Any] = weakref.WeakSet()  # see _stray
        try:
            self._tracker: Any = acyclic_mod_tracker()
        except ImportError:  # pragma: no cover - builds without torch.distributed
            from torch.utils.module_tracker import ModuleTracker

            self._tracker = ModuleTracker()
        self._handles: list[Any] = []

    def _name(self, mod: Any) -> str:
        known = getattr(self._tracker, "get_known_fqn", None)
        if known is None:
            probes.went_blind("torch", "module paths (ModTracker.get_known_fqn): ops are "
                              "attributed to module classes, not paths")
        return (known(mod) if known is not None else None) or type(mod).__name__

    def _stray(self, mod: Any, name: str) -> bool:
        """A module called inside another's forward that is no submodule of the model (its
        name is its class's alone): its code is the caller's. transformers' kernel wrappers
        are such modules with the ``kernels`` package installed (one private instance per
        layer, called through a context variable, never registered)."""
        if mod in self._strays:
            return True
        if self._stack and "." not in name and name == type(mod).__name__:
            self._strays.add(mod)
            return True
        return False

    def _pre_fw(self, mod: Any, inputs: Any) -> None:
        if self._stray(mod, self._name(mod)):
            return
        self.last_entered = self._name(mod)
        if self.is_bw:
            self.recompute_depth += 1
        self._stack.append(self.last_entered)
        self._mark()

    def _post_fw(self, mod: Any, inputs: Any, outputs: Any) -> None:
        if mod in self._strays:
            return
        if self.is_bw and self.recompute_depth > 0:
            self.recompute_depth -= 1
        name = self._name(mod)
        for p in mod.parameters(recurse=False):  # FSDP2's unsharded ones, before it reshards
            self._param_module[p] = name
        if self._stack and self._stack[-1] == name:
            self._stack.pop()
        elif name in self._stack:  # an exception unwound inner modules without their hooks
            del self._stack[self._stack.index(name):]
        self._mark()

    def _mark(self) -> None:
        """From the counter's next number on, the top of the stack runs."""
        thread = threading.get_ident()
        if self._thread is None and not self.is_bw:
            self._thread = thread
        if thread != self._thread:  # another thread's counter: its numbers do not compare
            return
        seq = torch._C._autograd._get_sequence_nr()
        top = self._stack[-1] if self._stack else ""
        if self._marks and self._marks[-1] == seq:
            self._marked[-1] = top
        else:
            self._marks.append(seq)
            self._marked.append(top)

    def _creator(self, node: Any) -> str:
        """The module whose forward created ``node``; a parameter's gradient accumulator
        (no sequence number of its own), the module that owns the parameter."""
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            return self._param_module.get(variable, "")
        i = bisect.bisect_right(self._marks, node._sequence_nr()) - 1
        return self._marked[i] if i >= 0 else ""

    @property
    def current(self) -> str:
        """The module (its ModTracker name) whose code runs now; "" outside every module."""
        if self.is_bw and not self.recomputing:
            node = torch._C._current_autograd_node()
            # None: the engine's callbacks after the last node (FSDP2's, DDP's)
            return "" if node is None else self._creator(node)
        return self._stack[-1] if self._stack else ""

    @property
    def is_bw(self) -> bool:
        # inside autograd's engine (the graph task id is -1 outside backward)
        return torch._C._current_graph_task_id() != -1

    @property
    def recomputing(self) -> bool:
        return self.recompute_depth > 0

    def __enter__(self) -> ModulePath:
        from torch.nn.modules.module import (
            register_module_forward_hook,
            register_module_forward_pre_hook,
        )

        self._tracker.__enter__()
        # global module hooks (public API), registered after the tracker's so that its names
        # are known: they count forwards that run inside backward (checkpoint recompute)
        self._handles = [register_module_forward_pre_hook(self._pre_fw),
                         register_module_forward_hook(self._post_fw, always_call=True)]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._tracker.__exit__(*exc)


def acyclic_mod_tracker() -> Any:
    """A ModTracker whose hook on a module's one input that requires grad holds no autograd
    node. ModTracker registers it with register_multi_grad_hook(mode="all"), whose closure
    holds the inputs' grad_fns while the hook sits on those same nodes: a reference cycle.
    A graph that the backward never runs (DoRA's weight norm: peft's lora_B(lora_A(eye))
    before .detach(), freed by reference count in a real step) then lives, with the
    tensors it saved, until Python's cycle collector runs, which the trace pauses
    (tilefit.tracing.gc_pause): two weight-sized tensors per DoRA layer held to the end.
    With one such input "all" and "any" fire alike (once per backward, when its node runs),
    and "any" holds no node; several inputs keep ModTracker's "all"."""
    from torch.autograd.graph import register_multi_grad_hook
    from torch.distributed._tools.mod_tracker import ModTracker
    from torch.utils._pytree import tree_flatten

    class AcyclicModTracker(ModTracker):  # type: ignore[misc]
        def _fw_pre_hook(self, mod: Any, input: Any) -> None:
            # ModTracker._fw_pre_hook (torch 2.13) but for the mode of the grad hook
            if torch._dynamo.eval_frame._is_in_optimized_module():
                return
            name = self._get_mod_name(mod)
            w_mod = weakref.ref(mod)
            self._get_append_fn(w_mod, name, False)()
            if self._user_pre_fw_hook is not None:
                self._user_pre_fw_hook(mod, input)
            args, _ = tree_flatten(input)
            tensors = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
            if self.is_bw:
                return
            pop = self._get_pop_fn(w_mod, name, True)
            if tensors:
                register_multi_grad_hook(tensors, pop,
                                         mode="any" if len(tensors) == 1 else "all")
            else:
                self._post_bw_callbacks_to_enqueue.append(pop)

        def _get_append_fn(self, w_mod: Any, name: str, is_bw: bool) -> Any:
            append = super()._get_append_fn(w_mod, name, is_bw)

            def fn(*args: Any) -> Any:
                if name not in self.parents or not _stray_name(w_mod(), name):
                    return append(*args)
                with _no_nesting_warning():
                    return append(*args)

            return fn

    return AcyclicModTracker()


def _stray_name(mod: Any, name: str) -> bool:
    """ModTracker named ``mod`` by its class alone: a module that is no submodule of the
    model (ModulePath._stray), or the root."""
    return mod is not None and "." not in name and name == type(mod).__name__


@contextlib.contextmanager
def _no_nesting_warning() -> Iterator[None]:
    """ModTracker warns "The module hierarchy tracking maybe be messed up" when a module
    starts under a running module of its name (torch 2.13), and replaces
    ``warnings.formatwarning`` for the whole process as it does. Two modules that no path
    names, of one class, share the name: transformers' kernel wrappers with the ``kernels``
    package (kernels 0.19's ``Func``: the global wrapper's forward calls the layer's private
    copy; Mamba's and Mixtral's layers). Its count of running modules handles them and
    ModulePath treats them as their caller's code, so the warning asks the user to report a
    bug that is not there: silenced, and the process's formatwarning kept."""
    import warnings

    formatwarning = warnings.formatwarning
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The module hierarchy tracking",
                                    category=UserWarning)
            yield
    finally:
        warnings.formatwarning = formatwarning


@contextlib.contextmanager
def record_module_paths(root: torch.nn.Module) -> Iterator[None]:
    """While AOTAutograd traces ``root``'s forward, tag each graph node with the module
    that made it (``nn_module_stack`` in its meta, as Dynamo's graphs carry; AOTAutograd
    copies it to the backward nodes as ``fwd_nn_module_stack``). Uses FX's node-meta
    propagation (torch.fx.traceback.current_meta), public but not backward compatible."""
    import torch.fx.traceback as fx_traceback
    from torch.nn.modules.module import (
        register_module_forward_hook,
        register_module_forward_pre_hook,
    )

    names = {id(m): name for name, m in root.named_modules() if name}
    stack: list[Any] = []

    def pre(mod: Any, args: Any) -> None:
        meta = fx_traceback.current_meta
        stack.append(meta.get("nn_module_stack"))
        name = names.get(id(mod))
        if name is not None:
            meta["nn_module_stack"] = {name: (name, type(mod))}

    def post(mod: Any, args: Any, out: Any) -> None:
        if stack:
            previous = stack.pop()
            if previous is None:
                fx_traceback.current_meta.pop("nn_module_stack", None)
            else:
                fx_traceback.current_meta["nn_module_stack"] = previous

    handles = [register_module_forward_pre_hook(pre),
               register_module_forward_hook(post, always_call=True)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def node_module(node: Any) -> str:
    """The module path a graph node was tagged with (record_module_paths), "" if none."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path if isinstance(path, str) else ""
